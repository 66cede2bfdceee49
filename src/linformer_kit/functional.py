"""Pure functions: sequence projections, Linformer attention and exact attention.

Paper eq. 7: head = softmax(Q (E K)^T / sqrt(d)) F V, with E, F of shape k x n. Here a
projection weight is stored transposed, (max_seq_len, proj_dim), so that a sequence of any
length n <= max_seq_len uses its first n rows. Keys and values at padded positions are
zeroed before the projection, so padding never changes outputs at real positions.

Internally tensors are sequence-major, (B, N, G, C): that is how a Linear layer's output
lies in memory, so reshapes are views and the shared projection is one GEMM per batch row.
The public attention functions take (B, H, N, D) like `F.scaled_dot_product_attention`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .input_checks import (
    check_heads,
    check_key_padding_mask,
    check_projections,
    check_qkv,
    check_seq_len,
)
from .kernels import dot_product_attention, masked_scores
from .linear_backend import matmul


def real_first(key_padding_mask: Tensor) -> Tensor:
    """(B, N) indices that put each row's real tokens first, in order, then its padding (a
    stable sort): gathered by them, any padding (left, inside) becomes right padding."""
    return torch.argsort((~key_padding_mask).to(torch.uint8), dim=1, stable=True)


def gather_positions(x: Tensor, order: Tensor, dim: int = 1) -> Tensor:
    """`x` (batch first) with its positions along `dim` in `order` (B, N) (`real_first`, or
    `order.argsort(1)` to put them back)."""
    shape = [order.shape[0]] + [1] * (x.dim() - 1)
    shape[dim] = order.shape[1]
    return x.gather(dim, order.view(shape).expand_as(x))


def real_tokens_first(
    key_padding_mask: Tensor, *tensors: Tensor, dim: int = 1
) -> tuple[Tensor, ...]:
    """`tensors` (batch first, positions along `dim`) and then the mask, each row's real
    tokens gathered first, in order (`real_first`): any padding becomes right padding, so
    row j of a projection's E and F projects the j-th real token."""
    order = real_first(key_padding_mask)
    gathered = (gather_positions(t, order, dim) for t in tensors)
    return (*gathered, key_padding_mask.gather(1, order))


def zero_padding(x: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """Zeroes the padded positions of a (B, N, G, C) tensor. Filled, not multiplied by the
    mask: 0 * nan and 0 * inf are nan, and whatever padding holds must not reach real rows."""
    if key_padding_mask is None:
        return x
    return x.masked_fill(~key_padding_mask[:, :, None, None], 0)


def leading_rows(weight: Tensor, seq_len: int) -> Tensor:
    """The first `seq_len` rows of a (..., max_seq_len, K) projection (ValueError past
    max_seq_len); the weight itself at full length, as a slice's backward writes a
    zero-filled full-size copy."""
    check_seq_len(seq_len, weight.shape[-2])
    return weight[..., :seq_len, :] if seq_len < weight.shape[-2] else weight


def project_linear(x: Tensor, weight: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
    """Projects the sequence axis with a matrix: out = weight[:N]^T @ x (padding zeroed first).

    Args:
        x: (B, N, G, C), N <= max_seq_len.
        weight: (max_seq_len, K) shared by all G groups, or (G, max_seq_len, K), one per group.
        key_padding_mask: optional bool (B, N), True at real tokens.

    Returns:
        (B, K, G, C).

    Raises:
        ValueError: if N exceeds the weight's max_seq_len, or the group counts differ.
    """
    batch, seq_len, groups, width = x.shape
    weight = leading_rows(weight, seq_len)
    x = zero_padding(x, key_padding_mask)
    if weight.dim() == 2:
        # (K, N) @ (B, N, G*C) as one bmm over the expanded weight, not torch.matmul, which
        # folds it through transposed copies of x and of the gradient (fwd+bwd at N 1024,
        # K 256, G*C 256, B 8, 2 threads: 10.8 against 14.7 ms); one row as one mm on a view
        # (the expand's backward would add a copy: 1.5 against 2.1 ms).
        rows = x.reshape(batch, seq_len, groups * width)  # sizes given: batch may be 0
        projection = weight.transpose(0, 1)  # (K, N)
        if batch == 1:
            out = matmul(projection, rows.squeeze(0)).unsqueeze(0)
        else:
            out = matmul(projection.expand(batch, -1, -1), rows)
        return out.view(batch, weight.shape[-1], groups, width)  # (B, K, G, C)
    check_heads(weight, groups)
    # (G, B*C, N) @ (G, N, K): one bmm over the groups, the batch folded into the rows.
    # torch.matmul's broadcast (G, K, N) @ (B, G, N, C) copied the weight B times and summed
    # B gradients (fwd+bwd at N 1024, K 256, G 4, C 64, 2 threads: 13.2 against 45.8 ms at
    # B 8, 2.6 against 4.1 ms at B 1). (X^T E)^T rather than E^T X: bmm makes the gradient
    # of its first operand in that operand's own layout, so E^T's came as (G, K, N) and
    # was copied transposed into E's (G, N, K) gradient (bf16 autocast, N 8192: 13.5 ms a
    # call); here E is the second operand and its gradient X dY lands in E's layout.
    rows = x.permute(2, 1, 0, 3).reshape(groups, seq_len, batch * width)
    out = matmul(rows.transpose(-1, -2), weight)  # (G, B*C, K)
    return out.view(groups, batch, width, weight.shape[-1]).permute(1, 3, 0, 2)  # (B, K, G, C)


def project_blocks(
    x: Tensor,
    block_size: int,
    weight: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Projects the sequence axis by blocks of `block_size` positions (kernel = stride).

    With `weight=None` each block is the mean of its real positions (paper: "pooling"); with
    a kernel of shape (block_size,) or (G, block_size) it is a strided 1-D convolution
    (paper: "convolution"), rescaled by block_size / (real positions in the block), so a
    block that is partly padding or past the end behaves like a full one.

    Only the ceil(N / block_size) blocks that reach into the sequence are returned: the
    rest would be empty. Blocks holding no real token are flagged in the returned mask.

    Args:
        x: (B, N, G, C).
        block_size: positions per block.
        weight: None (mean pooling), or a convolution kernel (block_size,) or (G, block_size).
        key_padding_mask: optional bool (B, N), True at real tokens.

    Returns:
        (B, M, G, C) with M = ceil(N / block_size), and a bool (B, M) mask of non-empty
        blocks (None when no key_padding_mask was given: then every block is non-empty).
    """
    batch, seq_len, groups, width = x.shape
    num_blocks = math.ceil(seq_len / block_size)
    pad = num_blocks * block_size - seq_len
    if key_padding_mask is None:
        real = x.new_ones(batch, seq_len)
    else:
        real = key_padding_mask.to(x.dtype)
    x = zero_padding(x, key_padding_mask)
    x = F.pad(x, (0, 0, 0, 0, 0, pad)).view(batch, num_blocks, block_size, groups, width)
    counts = F.pad(real, (0, pad)).view(batch, num_blocks, block_size).sum(-1)  # (B, M)
    if weight is None:
        summed = x.sum(2)
        scale = 1.0 / counts.clamp(min=1)
    else:
        equation = "bmsgc,s->bmgc" if weight.dim() == 1 else "bmsgc,gs->bmgc"
        summed = torch.einsum(equation, x, weight.to(x.dtype))
        scale = block_size / counts.clamp(min=1)
    out = summed * scale[:, :, None, None]  # (B, M, G, C)
    return out, (counts > 0 if key_padding_mask is not None else None)


def attendable(kv_mask: Tensor) -> Tensor:
    """The keys each row may attend to: a row with no real key may attend to all its
    (zeroed) keys, so its output is 0 instead of NaN."""
    return kv_mask | ~kv_mask.any(-1, keepdim=True)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    kernel: str | None = None,
) -> Tensor:
    """Softmax attention, safe for empty rows, through the cheaper of SDPA and explicit GEMMs
    (`kernel_rule.choose_kernel`).

    Args:
        q: (B, H, N, D).
        k, v: (B, H, M, D); masked-out keys must already hold zero values.
        kv_mask: optional bool (B, M), True at keys that may be attended to.
        dropout_p: dropout on the attention weights (pass 0.0 in eval mode).
        scale: softmax scale; default 1 / sqrt(D).
        kernel: "sdpa" or "explicit" to override the rule; None to follow it.

    Returns:
        (B, H, N, D). A row with no key to attend to gives zeros, never NaN.
    """
    attn_mask = None if kv_mask is None else attendable(kv_mask)[:, None, None, :]  # (B, 1, 1, M)
    return dot_product_attention(
        q, k, v, attn_mask, dropout_p, scale, kernel, every_row_attends=True
    )


def attention_weights(
    q: Tensor,
    k: Tensor,
    kv_mask: Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
) -> Tensor:
    """The context-mapping matrix softmax(Q K^T * scale) that `attend` applies, materialised.

    For analysis (the paper's Figure 1 spectrum, attention maps); the same scores as the
    explicit kernel's, before dropout.

    Args:
        q: (B, H, N, D).
        k: (B, H, M, D), already projected for Linformer (M = k) or not (M = N).
        kv_mask: optional bool (B, M), True at keys that may be attended to.
        scale: softmax scale; default 1 / sqrt(D).
        causal: query i sees keys j <= i only (exact causal attention, M = N).

    Returns:
        (B, H, N, M), rows summing to 1 (0 for a row with no key).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    attn_mask = None if kv_mask is None else kv_mask[:, None, None, :]  # (B, 1, 1, M)
    if causal:
        allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        attn_mask = allowed if attn_mask is None else attn_mask & allowed  # (B | 1, 1, N, M)
    if attn_mask is None:
        return masked_scores(q, k, None, scale).softmax(-1)
    # a row with no key (a padded sequence; under causal also a left-padded query, whose keys
    # j <= i are all padding) is scored over every key, then zeroed: 0, not NaN
    weights = masked_scores(q, k, attendable(attn_mask), scale).softmax(-1)
    return weights.masked_fill(~attn_mask.any(-1, keepdim=True), 0.0)


def linformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    proj_k: Tensor,
    proj_v: Tensor,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> Tensor:
    """Linformer attention, softmax(Q (E K)^T / sqrt(d)) F V (paper eq. 7).

    Args:
        q, k, v: (B, H, N, D) with N <= max_seq_len.
        proj_k, proj_v: (max_seq_len, K) shared across heads, or (H, max_seq_len, K).
            Pass the same tensor twice for key-value sharing.
        key_padding_mask: optional bool (B, N), True at real tokens, anywhere: the real
            keys and values are projected as the first rows of E and F (`real_first`, as
            the modules do), the padded ones not at all, so padding never changes the output.
        dropout_p: dropout on the attention weights, as in SDPA (pass 0.0 in eval mode).
        scale: softmax scale; default 1 / sqrt(D).

    Returns:
        (B, H, N, D).

    Raises:
        ValueError: for inputs not (B, H, N, D) or keys and values of other shapes, if N
            exceeds max_seq_len, the mask has the wrong shape or dtype, or the projections
            give different k or a per-head one other heads.
    """
    check_qkv(q, k, v)
    check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[2])
    check_projections(proj_k, proj_v, num_heads=q.shape[1])
    if key_padding_mask is not None:  # E's row j projects the j-th real token (left padding)
        k, v, key_padding_mask = real_tokens_first(key_padding_mask, k, v, dim=2)
    k = project_linear(k.transpose(1, 2), proj_k, key_padding_mask).transpose(1, 2)
    v = project_linear(v.transpose(1, 2), proj_v, key_padding_mask).transpose(1, 2)
    return attend(q, k, v, None, dropout_p, scale)  # (B, H, N, D)


def exact_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> Tensor:
    """Exact softmax attention with the same masking rules: the Transformer baseline.

    Args:
        q, k, v: (B, H, N, D).
        key_padding_mask: optional bool (B, N), True at real tokens.
        dropout_p: dropout on the attention weights.
        scale: softmax scale; default 1 / sqrt(D).

    Returns:
        (B, H, N, D).

    Raises:
        ValueError: for inputs not (B, H, N, D), keys and values of other shapes, or a mask
            of the wrong shape or dtype.
    """
    check_qkv(q, k, v)
    check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[2])
    k = zero_padding(k.transpose(1, 2), key_padding_mask).transpose(1, 2)
    v = zero_padding(v.transpose(1, 2), key_padding_mask).transpose(1, 2)
    return attend(q, k, v, key_padding_mask, dropout_p, scale)
