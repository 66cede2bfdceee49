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

from .kernels import dot_product_attention, masked_scores


def check_seq_len(seq_len: int, max_seq_len: int) -> None:
    """Raises ValueError if a sequence is longer than the model accepts."""
    if seq_len > max_seq_len:
        raise ValueError(
            f"sequence length {seq_len} exceeds max_seq_len {max_seq_len}; inputs may have any "
            f"length from 1 to {max_seq_len}"
        )


def check_key_padding_mask(key_padding_mask: Tensor | None, batch: int, seq_len: int) -> None:
    """Raises ValueError unless the mask is a bool tensor of shape (batch, seq_len)."""
    if key_padding_mask is None:
        return
    if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (batch, seq_len):
        raise ValueError(
            f"key_padding_mask must be a bool tensor of shape (batch, seq_len) = "
            f"({batch}, {seq_len}) with True at real tokens; got dtype "
            f"{key_padding_mask.dtype} and shape {tuple(key_padding_mask.shape)}"
        )


def zero_padding(x: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """Zeroes the padded positions of a (B, N, G, C) tensor."""
    if key_padding_mask is None:
        return x
    return x * key_padding_mask[:, :, None, None].to(x.dtype)


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
        # One GEMM per batch row over all heads and features: (K, N) @ (B, N, G*C). Not
        # torch.matmul, which folds a 2-D @ 3-D product through transposed copies of x and
        # of the gradient: bmm over the expanded weight reads both in place (fwd+bwd at N
        # 1024, K 256, G*C 256, B 8, 2 threads: 10.8 against 14.7 ms); one row is one mm
        # (the expand's backward would add a copy: 2.1 against 1.5 ms; and indexing the row,
        # rows[0], a zero-filled gradient of x: a view's backward is a view).
        rows = x.reshape(batch, seq_len, -1)
        projection = weight.transpose(0, 1)  # (K, N)
        if batch == 1:
            out = (projection @ rows.squeeze(0)).unsqueeze(0)
        else:
            out = torch.bmm(projection.expand(batch, -1, -1), rows)
        return out.view(batch, -1, groups, width)  # (B, K, G, C)
    if weight.shape[0] != groups:
        raise ValueError(
            f"a per-head projection of shape {tuple(weight.shape)} needs {weight.shape[0]} "
            f"heads, got {groups}"
        )
    # (G, K, N) @ (G, N, B*C): one bmm over the groups, the batch folded into the columns.
    # torch.matmul's broadcast (G, K, N) @ (B, G, N, C) copied the weight B times and summed
    # B gradients (fwd+bwd at N 1024, K 256, G 4, C 64, 2 threads: 13.2 against 45.8 ms at
    # B 8, 2.6 against 4.1 ms at B 1).
    rows = x.permute(2, 1, 0, 3).reshape(groups, seq_len, batch * width)
    out = torch.bmm(weight.transpose(-1, -2), rows)  # (G, K, B*C)
    return out.view(groups, -1, batch, width).permute(2, 1, 0, 3)  # (B, K, G, C)


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
    x = x * real[:, :, None, None]
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
    (`kernels.choose_kernel`).

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
    return dot_product_attention(q, k, v, attn_mask, dropout_p, scale, kernel)


def attention_weights(
    q: Tensor, k: Tensor, kv_mask: Tensor | None = None, scale: float | None = None
) -> Tensor:
    """The context-mapping matrix softmax(Q K^T * scale) that `attend` applies, materialised.

    For analysis (the paper's Figure 1 spectrum, attention maps); the same scores as the
    explicit kernel's, before dropout.

    Args:
        q: (B, H, N, D).
        k: (B, H, M, D), already projected for Linformer (M = k) or not (M = N).
        kv_mask: optional bool (B, M), True at keys that may be attended to.
        scale: softmax scale; default 1 / sqrt(D).

    Returns:
        (B, H, N, M), rows summing to 1 (0 for a row with no key).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    attn_mask = None if kv_mask is None else attendable(kv_mask)[:, None, None, :]  # (B, 1, 1, M)
    return masked_scores(q, k, attn_mask, scale).softmax(-1)


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
        key_padding_mask: optional bool (B, N), True at real tokens; padded keys and values
            are zeroed before the projection.
        dropout_p: dropout on the attention weights, as in SDPA (pass 0.0 in eval mode).
        scale: softmax scale; default 1 / sqrt(D).

    Returns:
        (B, H, N, D).

    Raises:
        ValueError: if N exceeds max_seq_len or the mask has the wrong shape or dtype.
    """
    check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[2])
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
    """
    check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[2])
    k = zero_padding(k.transpose(1, 2), key_padding_mask).transpose(1, 2)
    v = zero_padding(v.transpose(1, 2), key_padding_mask).transpose(1, 2)
    return attend(q, k, v, key_padding_mask, dropout_p, scale)


def summary_scale(prefix_len: Tensor) -> Tensor:
    """The factor on a causal prefix summary E[:L]^T X[:L] as a function of L.

    1 / sqrt(L) keeps the summary rows' magnitude level as the prefix grows (a sum of L
    roughly independent terms grows as sqrt(L)). Measured by `benchmarks/causal_scaling.py`
    (README, "Causal language models"): unscaled trains worst; 1 / sqrt(L) beats 1 / L for
    the learned projection and trails it by at most 0.03 nats for the fixed random one.
    """
    return prefix_len.clamp(min=1).to(torch.float64).rsqrt()


def _block_products(x: Tensor, weight: Tensor, block_size: int) -> Tensor:
    """weight[m*bs:(m+1)*bs]^T x[m*bs:(m+1)*bs] for every block m of a (B, H, N, D) x, as one
    bmm over the blocks (per head: over heads x blocks) with the batch, heads and features
    in its columns: (G, M, K, C), G = 1 and C = B*H*D for a shared (N, K) weight, G = H and
    C = B*D for a per-head (H, N, K) one. `_blocks_view` turns it into (B, H, M, K, D).

    An einsum over (B, H, M, S, D) instead permuted its output back through a copy and
    broadcast the prefix sums' (M, M) matrix over B x H; this layout needs neither: the
    causal Linformer attention layer (dim 256, 4 heads, k 256, fwd+bwd, 2 threads, Intel
    Xeon, interleaved) got 1.10x faster at B 8, n 1024 (1.07x with per-head E), 1.04x at
    B 1, 1.08x at B 1, n 4096.
    """
    batch, heads, seq_len, width = x.shape
    blocks = seq_len // block_size
    x = x.view(batch, heads, blocks, block_size, width)
    if weight.dim() == 2:
        cols = x.permute(2, 3, 0, 1, 4).reshape(blocks, block_size, -1)  # (M, S, B*H*D)
        rows = weight.view(blocks, block_size, -1)  # (M, S, K)
        return torch.bmm(rows.transpose(1, 2), cols).unsqueeze(0)  # (1, M, K, B*H*D)
    cols = x.permute(1, 2, 3, 0, 4).reshape(heads * blocks, block_size, -1)  # (H*M, S, B*D)
    rows = weight.reshape(heads * blocks, block_size, -1)  # (H*M, S, K)
    out = torch.bmm(rows.transpose(1, 2), cols)  # (H*M, K, B*D)
    return out.view(heads, blocks, *out.shape[1:])


def _blocks_view(products: Tensor, batch: int, heads: int, width: int) -> Tensor:
    """(G, M, K, C) from `_block_products` as a (B, H, M, K, D) view."""
    groups, blocks, proj_dim, _ = products.shape
    if groups == 1:  # C = B*H*D
        return products.view(blocks, proj_dim, batch, heads, width).permute(2, 3, 0, 1, 4)
    return products.view(heads, blocks, proj_dim, batch, width).permute(3, 0, 1, 2, 4)


def block_projections(x: Tensor, weight: Tensor, block_size: int) -> Tensor:
    """Projects each block of `block_size` positions with its own rows of the projection.

    Args:
        x: (B, H, N, D), N a multiple of block_size.
        weight: (N, K) shared across heads, or (H, N, K); row j projects position j.

    Returns:
        (B, H, N / block_size, K, D): block m holds weight[m*bs:(m+1)*bs]^T x[m*bs:(m+1)*bs]
        (a strided view).
    """
    batch, heads, _, width = x.shape
    return _blocks_view(_block_products(x, weight, block_size), batch, heads, width)


def _prefix_summaries(x: Tensor, weight: Tensor, block_size: int) -> Tensor:
    """Exclusive cumulative sum of the block projections: block m gets the sum over the
    blocks before it, E[:m*bs]^T X[:m*bs], scaled by `summary_scale`.

    (B, H, M, S, D) -> (B, H, M, K, D), a strided view.
    """
    batch, heads, blocks, _, width = x.shape
    rows = blocks * block_size
    # Rows past max_seq_len only ever meet the zero padding of the last block.
    weight = F.pad(weight[..., :rows, :], (0, 0, 0, max(0, rows - weight.shape[-2])))
    products = _block_products(x.view(batch, heads, rows, width), weight, block_size)
    # The exclusive prefix sums and their scales as one (M, M) strictly lower-triangular
    # matrix product: 2.7x faster than cumsum along the block axis (fwd + bwd, CPU).
    prefix_len = torch.arange(blocks, device=x.device) * block_size
    earlier = torch.ones(blocks, blocks, dtype=x.dtype, device=x.device).tril(-1)  # (M, M)
    earlier = earlier * summary_scale(prefix_len).to(x.dtype)[:, None]
    groups = products.shape[0]
    sums = torch.bmm(earlier.expand(groups, -1, -1), products.flatten(2))  # (G, M, K*C)
    return _blocks_view(sums.view_as(products), batch, heads, width)


def _block_causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    proj_k: Tensor,
    proj_v: Tensor,
    block_size: int,
    dropout_p: float,
    scale: float | None,
) -> Tensor:
    """Each query attends causally to its own block's keys and to the k summary rows of
    all earlier blocks. (B, H, N, D) -> (B, H, N, D)."""
    batch, heads, seq_len, width = q.shape
    blocks = math.ceil(seq_len / block_size)
    pad = blocks * block_size - seq_len
    q, k, v = (
        F.pad(t, (0, 0, 0, pad)).view(batch, heads, blocks, block_size, width)  # (B, H, M, S, D)
        for t in (q, k, v)
    )
    keys = torch.cat([_prefix_summaries(k, proj_k, block_size), k], 3)  # (B, H, M, K + S, D)
    values = torch.cat([_prefix_summaries(v, proj_v, block_size), v], 3)
    summaries = keys.shape[3] - block_size
    has_prefix = (torch.arange(blocks, device=q.device) > 0)[:, None, None]  # (M, 1, 1)
    mask = torch.cat(
        [
            has_prefix.expand(blocks, block_size, summaries),
            torch.ones(block_size, block_size, dtype=torch.bool, device=q.device)
            .tril()
            .expand(blocks, block_size, block_size),
        ],
        -1,
    )  # (M, S, K + S): block 0 has no prefix, and own-block keys are seen up to the query
    out = dot_product_attention(
        q.flatten(0, 1),
        keys.flatten(0, 1),
        values.flatten(0, 1),
        mask[None],  # 4-D: CPU SDPA takes its flash kernel (a 3-D mask: math, 1.5x slower)
        dropout_p,
        scale,
    )  # (B * H, M, S, D)
    return out.reshape(batch, heads, blocks * block_size, width)[:, :, :seq_len]


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    proj_k: Tensor | None = None,
    proj_v: Tensor | None = None,
    *,
    block_size: int = 64,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> Tensor:
    """Causal attention: the output at position i depends on positions <= i only.

    With projections (causal Linformer) the sequence is cut into blocks of `block_size`: a
    query attends exactly to the keys of its own block up to itself, and to the k summary
    rows E[:L]^T K[:L], F[:L]^T V[:L] of the L positions of the completed blocks before it
    (the paper's projection restricted to what has been seen, scaled by `summary_scale`).
    Time O(N (block_size + k) D), memory O((N / block_size) k D). With `proj_k=None` it is
    exact causal softmax attention through the same steps, the projection skipped.

    Padding may be anywhere: real tokens are gathered to the front in order before attending
    and scattered back, so the real outputs never depend on where the padding is (left or
    right) and row j of E always projects the j-th real token. Padded keys and values are
    zeroed; the outputs at padded positions are 0.

    Args:
        q, k, v: (B, H, N, D) with N <= max_seq_len.
        proj_k, proj_v: (max_seq_len, K) shared across heads, or (H, max_seq_len, K); both
            None for exact causal attention.
        block_size: positions per block (ignored by exact attention).
        key_padding_mask: optional bool (B, N), True at real tokens.
        dropout_p: dropout on the attention weights (pass 0.0 in eval mode).
        scale: softmax scale; default 1 / sqrt(D).

    Returns:
        (B, H, N, D).

    Raises:
        ValueError: if N exceeds max_seq_len or the mask has the wrong shape or dtype.
    """
    batch, heads, seq_len, width = q.shape
    check_key_padding_mask(key_padding_mask, batch, seq_len)
    if proj_k is not None:
        check_seq_len(seq_len, proj_k.shape[-2])
    index = None
    if key_padding_mask is not None:
        order = torch.argsort((~key_padding_mask).to(torch.uint8), dim=1, stable=True)  # (B, N)
        index = order[:, None, :, None].expand(batch, heads, seq_len, width)  # (B, H, N, D)
        keep = key_padding_mask[:, None, :, None].to(k.dtype)  # (B, 1, N, 1)
        q, k, v = q.gather(2, index), (k * keep).gather(2, index), (v * keep).gather(2, index)
    if proj_k is None:
        out = dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, is_causal=True)
    else:
        out = _block_causal_attention(q, k, v, proj_k, proj_v, block_size, dropout_p, scale)
    if index is None:
        return out
    # Gathered to the end, padded queries saw every real token: zero them, so nothing leaks.
    return torch.zeros_like(out).scatter(2, index, out) * keep
