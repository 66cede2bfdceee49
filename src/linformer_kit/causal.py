"""Causal attention: causal Linformer (blocks of exactly attended positions plus the
projected summaries of every completed block) and exact causal attention, (B, H, N, D) like
`F.scaled_dot_product_attention`. The module `attention.LinformerSelfAttention(causal=True)`
and the generation state (`attention.CausalState`) build on these functions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_positive
from .functional import real_first
from .input_checks import check_key_padding_mask, check_projections, check_qkv, check_seq_len
from .kernels import dot_product_attention


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

    An einsum over (B, H, M, S, D) copied its output back and made the prefix sums'
    product broadcast over B x H; with this layout the causal Linformer attention layer
    (fwd+bwd, dim 256, 4 heads, k 256, 2 threads) got 1.10x faster at B 8, n 1024.
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


SCAN_CHUNK = 64  # blocks per chunk of the prefix sums (`_exclusive_sums`)


def _exclusive_sums(products: Tensor, scale: Tensor) -> Tensor:
    """sums[:, m] = scale[m] * (products[:, 0] + ... + products[:, m - 1]) of a (G, M, F)
    tensor, in O(M) work.

    Up to SCAN_CHUNK blocks: one (M, M) strictly lower-triangular matrix product with the
    scales folded in (2.7x faster than cumsum along the block axis, fwd + bwd, CPU). Past
    it, that product within chunks of SCAN_CHUNK blocks, plus the sums of the chunks before
    each (the same, one level up), scaled as they are added: one (M, M) product was M^2
    work (an N x N matrix at block_size 1).
    """
    groups, blocks, width = products.shape
    if blocks <= SCAN_CHUNK:
        earlier = torch.ones(blocks, blocks, dtype=products.dtype, device=products.device)
        return torch.bmm((earlier.tril(-1) * scale[:, None]).expand(groups, -1, -1), products)
    chunks = math.ceil(blocks / SCAN_CHUNK)
    pad = chunks * SCAN_CHUNK - blocks
    padded = (F.pad(products, (0, 0, 0, pad)) if pad else products).view(
        groups, chunks, SCAN_CHUNK, width
    )
    before = _exclusive_sums(padded.sum(2), torch.ones_like(scale[:chunks]))  # (G, chunks, F)
    scales = F.pad(scale, (0, pad)).view(chunks, SCAN_CHUNK, 1)
    earlier = torch.ones(SCAN_CHUNK, SCAN_CHUNK, dtype=products.dtype, device=products.device)
    sums = torch.matmul(earlier.tril(-1) * scales, padded)  # (G, chunks, SCAN_CHUNK, F)
    return sums.addcmul_(scales, before[:, :, None]).flatten(1, 2)[:, :blocks]


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
    prefix_len = torch.arange(blocks, device=x.device) * block_size
    sums = _exclusive_sums(products.flatten(2), summary_scale(prefix_len).to(x.dtype))
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
    q, k, v = (  # (B, H, M, S, D); F.pad copies even with nothing to pad
        (F.pad(t, (0, 0, 0, pad)) if pad else t).view(batch, heads, blocks, block_size, width)
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
        every_row_attends=True,  # the diagonal
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
            None for exact causal attention. Pass `proj_k` alone for key-value sharing.
        block_size: positions per block, >= 1 (ignored by exact attention).
        key_padding_mask: optional bool (B, N), True at real tokens.
        dropout_p: dropout on the attention weights (pass 0.0 in eval mode).
        scale: softmax scale; default 1 / sqrt(D).

    Returns:
        (B, H, N, D).

    Raises:
        ValueError: for inputs not (B, H, N, D), queries, keys and values of other shapes, if
            N exceeds max_seq_len, the mask has the wrong shape or dtype, the projections give
            different k or a per-head one other heads, proj_v comes without proj_k, or
            block_size < 1.
    """
    check_qkv(q, k, v)
    batch, _, seq_len, _ = q.shape
    if k.shape[2] != seq_len:  # SDPA aligned the causal mask top-left without a word
        raise ValueError(
            f"causal attention takes as many queries as keys: got {seq_len} and {k.shape[2]}"
        )
    check_key_padding_mask(key_padding_mask, batch, seq_len)
    if proj_k is None and proj_v is not None:
        raise ValueError("proj_v needs proj_k: pass both, proj_k alone (shared), or neither")
    if proj_k is not None:
        check_positive("block_size", block_size)
        block_size = min(block_size, seq_len)  # one block either way (10**12 was allocated)
        proj_v = proj_k if proj_v is None else proj_v
        check_projections(proj_k, proj_v, num_heads=q.shape[1])
        check_seq_len(seq_len, min(proj_k.shape[-2], proj_v.shape[-2]))
    index = None
    if key_padding_mask is not None:
        index = real_first(key_padding_mask)[:, None, :, None].expand(q.shape)  # (B, H, N, D)
        padded = ~key_padding_mask[:, None, :, None]  # (B, 1, N, 1)
        k, v = k.masked_fill(padded, 0), v.masked_fill(padded, 0)  # 0 * nan would be nan
        q, k, v = q.gather(2, index), k.gather(2, index), v.gather(2, index)
    if proj_k is None:
        out = dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, is_causal=True)
    else:
        out = _block_causal_attention(q, k, v, proj_k, proj_v, block_size, dropout_p, scale)
    if index is None:
        return out
    # Gathered to the end, padded queries saw every real token: zero them, so nothing leaks.
    return torch.zeros_like(out).scatter(2, index, out).masked_fill(padded, 0)
