"""FLOP counts of every benchmarked variant, from stated formulas (matmuls only).

A multiply-add is 2 FLOPs. With B batch, n sequence length, d = dim, k = proj_dim and
f = the feed-forward width, one forward pass needs:

| part                                   | FLOPs          |
|----------------------------------------|----------------|
| q / k / v / out linear layer (each)    | 2 B n d^2      |
| exact attention, Q K^T and P V         | 4 B n^2 d      |
| Linformer attention, Q (EK)^T and P FV | 4 B n k d      |
| one sequence projection E X            | 2 B n k d      |
| k / v layer on k projected rows (each) | 2 B k d^2      |
| feed-forward (two layers)              | 4 B n d f      |

Forward + backward counts 3x the forward: each matmul's backward computes the gradients of
both of its operands (the input of a layer inside a network needs its gradient too). Work a
kernel repeats (SDPA's backward recomputes Q K^T) is not counted: these are model FLOPs,
the useful work, so GFLOP/s and the fraction of the matmul ceiling compare like for like.
Softmax, norms, biases and activations are left out (O(n k) or O(n d), well under 1%).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The sizes every variant of one configuration shares."""

    batch_size: int  # sequences per call
    seq_len: int  # n
    dim: int  # model width d
    num_heads: int  # attention heads
    proj_dim: int | None  # k; None for exact attention
    ffn_dim: int  # feed-forward width f


def exact_attention_flops(shape: Shape) -> int:
    """Forward FLOPs of exact attention: four linear layers and the n x n attention."""
    b, n, d = shape.batch_size, shape.seq_len, shape.dim
    return 4 * 2 * b * n * d * d + 4 * b * n * n * d


def linformer_attention_flops(shape: Shape, *, input_first: bool, shared_kv: bool) -> int:
    """Forward FLOPs of Linformer attention in the given order.

    Args:
        shape: the configuration (proj_dim must be set).
        input_first: project the input sequence (n -> k) before the key/value layers,
            E (X W) = (E X) W, possible when the projection is shared across heads.
        shared_kv: E = F, so an input-first order projects the input once.

    Returns:
        The forward FLOPs.
    """
    b, n, d, k = shape.batch_size, shape.seq_len, shape.dim, shape.proj_dim
    if k is None:
        raise ValueError("linformer_attention_flops needs a proj_dim")
    q_out = 2 * 2 * b * n * d * d
    attention = 4 * b * n * k * d
    if input_first:
        projections = (1 if shared_kv else 2) * 2 * b * n * k * d
        kv_layers = 2 * 2 * b * k * d * d
    else:
        projections = 2 * 2 * b * n * k * d
        kv_layers = 2 * 2 * b * n * d * d
    return q_out + attention + projections + kv_layers


def feed_forward_flops(shape: Shape) -> int:
    """Forward FLOPs of the feed-forward block."""
    return 4 * shape.batch_size * shape.seq_len * shape.dim * shape.ffn_dim


def total_flops(attention_forward: int, shape: Shape, *, layer: bool, backward: bool) -> int:
    """FLOPs of one timed call: attention (+ feed-forward for a layer), x3 with backward."""
    forward = attention_forward + (feed_forward_flops(shape) if layer else 0)
    return forward * (3 if backward else 1)


def matmul_flops(size: int) -> int:
    """FLOPs of one (size x size) @ (size x size) matmul: the ceiling measurement."""
    return 2 * size**3
