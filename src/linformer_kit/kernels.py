"""Softmax attention kernels: `F.scaled_dot_product_attention` or explicit GEMMs + softmax
(+ dropout), whichever a measured rule says is cheaper for the call.

Why two kernels. On CPU, SDPA's flash kernel never builds the N x M weights, but with
dropout it falls back to its math path, which draws the mask with `bernoulli_` and runs
the weights through several separate tensors: attention becomes 2-3x slower. The explicit
kernel here is one autograd node that builds the weights once, draws its dropout mask from
16 random bits per weight (one 32-bit draw gives two), folds the softmax scale and the
dropout rescaling into the GEMMs' alpha, and works in place in backward.

The rule (`choose_kernel`) comes from `benchmarks/kernels/table.json`, made by
`benchmarks/kernels.py` (SDPA vs explicit, fwd+bwd and forward only, over n, k and
head_dim); it is never a per-call timing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

KERNELS = ("sdpa", "explicit")
# Dropout probabilities are rounded to a multiple of 2^-16 (|error| <= 7.6e-6): the mask
# compares 16 uniform random bits with a threshold. The rescaling uses the rounded value,
# so the expectation of the output is exactly the undropped one.
_LEVELS = 1 << 16


def choose_kernel(*, device: torch.device, dtype: torch.dtype, dropout: bool) -> str:
    """The cheaper kernel for a call, by the measured rule.

    `benchmarks/kernels/table.json` (CPU, fp32, one thread, B = 1, H = 4; n 1024-16384,
    k 64-1024, head_dim 32-128, fwd+bwd with and without dropout, forward only):

    - dropout on: explicit beats SDPA's math fallback at all 27 shapes (SDPA time /
      explicit time 1.10-1.95, geometric mean 1.53), so CPU attention with dropout goes
      explicit (fp32 measured; fp64 takes the same path);
    - dropout off: SDPA's flash kernel, which never writes the N x M weights to memory,
      wins on the geometric mean (0.78 in training, 0.60 in inference; explicit ahead by
      more than 5 % at only 3 training shapes and 1 inference shape, none a region).

    Exact causal attention (`benchmarks/kernels/causal/`, n 1024-4096, head_dim 64) agrees:
    explicit 1.40-1.54x faster with dropout, SDPA 1.5-4.4x faster without.

    n, k and head_dim did not change the winner in any region of that table, so the CPU
    rule does not read them. On a GPU, and for bf16 / fp16 or under autocast (not measured
    for the explicit kernel yet), SDPA is kept.

    Args:
        device: where the call runs.
        dtype: the dtype of q, k and v.
        dropout: whether attention dropout is on (dropout_p > 0).

    Returns:
        "sdpa" or "explicit".
    """
    measured = device.type == "cpu" and dtype in (torch.float32, torch.float64)
    if measured and dropout and not torch.is_autocast_enabled("cpu"):
        return "explicit"
    return "sdpa"


def masked_scores(q: Tensor, k: Tensor, attn_mask: Tensor | None, scale: float) -> Tensor:
    """Q K^T * scale with the disallowed keys at -inf: (..., N, D), (..., M, D) -> (..., N, M).

    Args:
        q: (..., N, D).
        k: (..., M, D), the same leading dimensions as q.
        attn_mask: optional bool, broadcastable to (..., N, M), True where attention is allowed.
        scale: softmax scale.
    """
    scores = _bmm(q, k.transpose(-1, -2), scale)  # (..., N, M)
    if attn_mask is not None:
        scores.masked_fill_(~attn_mask, float("-inf"))
    return scores


def _bmm(a: Tensor, b: Tensor, alpha: float) -> Tensor:
    """alpha * a @ b over equal leading dimensions, as one batched GEMM (the scale costs no
    extra pass over the product)."""
    batch = a.shape[:-2]
    a3, b3 = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
    # beta = 0: the (expanded, never read) input only gives the output its shape.
    zero = a3.new_zeros(1, 1, 1).expand(a3.shape[0], a3.shape[1], b3.shape[2])
    out = torch.baddbmm(zero, a3, b3, beta=0.0, alpha=alpha)
    return out.view(*batch, a.shape[-2], b.shape[-1])


def dropout_weights(weights: Tensor, dropout_p: float) -> tuple[Tensor, float]:
    """The weights with a random fraction `dropout_p` set to 0, and the rescaling
    1 / (1 - p) of the rounded p (left to the next GEMM's alpha).

    Each weight compares 16 uniform random bits with a threshold, so one 32-bit draw of
    torch's default generator serves two weights (`torch.manual_seed` makes it repeatable).
    The comparison writes float 0/1 straight into the output, multiplied in place by the
    weights: a bool mask would cost a conversion pass, and `masked_fill` is slower still.

    Returns:
        (dropped weights, factor for the kept ones; 0 if none is kept).
    """
    dropped = round(dropout_p * _LEVELS)
    width = weights.shape[-1]
    shape = (*weights.shape[:-1], (width + 1) // 2)
    # Out of place (randint, not random_): torch.compile traces it without a graph break.
    pairs = torch.randint(-(2**31), 2**31, shape, dtype=torch.int32, device=weights.device)
    bits = pairs.view(torch.int16)[..., :width]  # uniform int16
    kept = torch.ge(bits, dropped - _LEVELS // 2, out=torch.empty_like(weights))  # 1 - p
    factor = 0.0 if dropped == _LEVELS else _LEVELS / (_LEVELS - dropped)
    return kept.mul_(weights), factor


class _ExplicitAttention(torch.autograd.Function):
    """softmax(Q K^T * scale) with dropout, times V; saves the weights, not the scores."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p, scale):  # noqa: ANN001, ANN205
        weights = torch.softmax(masked_scores(q, k, attn_mask, scale), -1)  # (..., N, M)
        dropped, factor = weights, 1.0
        if dropout_p > 0.0:
            dropped, factor = dropout_weights(weights, dropout_p)
        ctx.save_for_backward(q, k, v, weights, dropped)
        ctx.factor, ctx.scale, ctx.dropout = factor, scale, dropout_p > 0.0
        return _bmm(dropped, v, factor)  # (..., N, Dv)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v, weights, dropped = ctx.saved_tensors
        grad_v = _bmm(dropped.transpose(-1, -2), grad, ctx.factor)  # (..., M, Dv)
        grad_dropped = _bmm(grad, v.transpose(-1, -2), ctx.factor)  # (..., N, M)
        if ctx.dropout:
            # With dropped = weights * kept: d scores = dropped * g - weights * sum(dropped * g),
            # no mask needed; three in-place passes.
            product = grad_dropped.mul_(dropped)
            row_sums = product.sum(-1, keepdim=True)  # (..., N, 1)
            grad_scores = product.addcmul_(weights, row_sums, value=-1.0)
        else:
            # weights * (g - sum(g * weights)) in one fused pass: softmax's own backward.
            grad_scores = torch._softmax_backward_data(grad_dropped, weights, -1, weights.dtype)
        grad_q = _bmm(grad_scores, k, ctx.scale)
        grad_k = _bmm(grad_scores.transpose(-1, -2), q, ctx.scale)
        return grad_q, grad_k, grad_v, None, None, None


def dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    kernel: str | None = None,
    is_causal: bool = False,
) -> Tensor:
    """softmax(Q K^T * scale) V with dropout on the weights, through the kernel
    `choose_kernel` picks (or `kernel`, if given).

    The contract of `F.scaled_dot_product_attention` with a bool mask; for the explicit
    kernel every row must have at least one allowed key (`functional.attendable` sees to it).

    Args:
        q: (..., N, D).
        k, v: (..., M, D) and (..., M, Dv), the same leading dimensions as q.
        attn_mask: optional bool, broadcastable to (..., N, M), True where allowed.
        dropout_p: dropout on the attention weights, in [0, 1).
        scale: softmax scale; default 1 / sqrt(D).
        kernel: "sdpa" or "explicit" to override the rule; None to follow it.
        is_causal: query i sees keys 0..i only, aligned top-left as SDPA's flag (with
            N > M the last queries see all M keys); attn_mask must be None.

    Returns:
        (..., N, Dv).

    Raises:
        ValueError: for an unknown kernel, or a mask given with is_causal.
    """
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal=True builds its own mask; got an attn_mask as well")
    if kernel is None:
        kernel = choose_kernel(device=q.device, dtype=q.dtype, dropout=dropout_p > 0.0)
    if kernel == "explicit":
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if is_causal:
            attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
            attn_mask.tril_()
        return _ExplicitAttention.apply(q, k, v, attn_mask, dropout_p, scale)
    if kernel == "sdpa":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )
    raise ValueError(f"kernel must be one of {', '.join(KERNELS)} or None; got {kernel!r}")
