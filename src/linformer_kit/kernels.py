"""Softmax attention kernels: `F.scaled_dot_product_attention` or explicit GEMMs + softmax
(+ dropout), whichever a measured rule says is cheaper for the call.

Why two kernels. On CPU, SDPA's flash kernel never builds the N x M weights, but with
dropout it falls back to its math path, which draws the mask with `bernoulli_` and runs
the weights through several separate tensors: attention becomes 2-3x slower. The explicit
kernel drops the weights by 16 random bits each (`dropout_bits`: SplitMix64 outputs by
position, one 64-bit word for four weights) and comes in two implementations of the same
mask:

- compiled (`_fused_attention`, `csrc/attention.cpp` via `native.cpu_ops`; CPU, fp32 /
  fp64 / bf16, eager or torch.compile): flash attention's plan with the dropout inside. One
  parallel loop over blocks of query rows, each block's scores, softmax, mask and output
  GEMM done in the thread's cache; for backward it saves, with dropout, the weights
  where they fit in cache (`_KEEP_WEIGHTS`), else only a logsumexp per row, from which
  backward makes them again (one more GEMM: no N x M tensor allocated), the mask always
  again from its seed;
- PyTorch ops (`_ExplicitAttention`): where the compiled one cannot run (no compiler,
  `LINFORMER_KIT_NATIVE=0`, a GPU, fp16); one autograd node that builds the
  weights once, in blocks of query rows on CPU, folds the softmax scale and the dropout
  rescaling into the GEMMs' alpha, saves the weights and the bits, and works in place in
  backward.

The rule (`kernel_rule.choose_kernel`) comes from the tables `benchmarks/kernels.py` makes
(SDPA vs explicit, fwd+bwd and forward only, over n, k and head_dim, on CPU and on a GPU);
it is never a per-call timing. `kernel_rule.use_kernel` pins one kernel over a block. On a
GPU in training SDPA runs with its queries cut into chunks (`cut_sdpa.sdpa`, as many as
`kernel_rule.choose_splits` says), so that its backward fills the SMs.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

from .cut_sdpa import sdpa
from .dropout import (
    drop,
    dropout_bits,
    dropout_seed,
    native_ops,
    rescaling,
    threshold,
)
from .kernel_rule import (
    autocast_casts,
    autocast_on,
    check_kernel,
    choose_kernel,
    choose_reduction_splits,
    choose_splits,
    compute_dtype,
    pinned_kernel,
)
from .native import rows_in_place, transformed
from .python_side import SDPA_DOUBLE_BACKWARD, first_order_only

# Blocks of the PyTorch-ops kernel (`block_rows`): 64 (GEMMs stay efficient) to 512 query
# rows, at most 2^22 weights. Measured (fp32, 2 threads, M 256, head_dim 64, fwd+bwd):
# 256-512 rows beat one N x M block by 1.2-1.6x from n 4096; with dropout 0.1 (B 1, 4 heads,
# AVX2) 64 / 128 / 256 / 512 rows took 20.1 / 16.1 / 14.7 / 14.8 ms at n 1024, 396 / 261 /
# 253 / 226 at 16384: per-block op overheads outweigh the cache.
_BLOCK_WEIGHTS = 1 << 22
_BLOCK_ROWS = (64, 512)
# Query rows per block (one task of its parallel loop) of the compiled kernel. Measured
# (fp32, B 1, 4 heads, M 256, head_dim 64, fwd+bwd, dropout 0.1, 2 threads): 64 / 128 /
# 256 / 512 rows took 4.32 / 4.13 / 4.08 / 4.42 ms at n 1024, 69.5 / 63.7 / 62.4 / 68.0
# at 16384 (AVX-512 Xeon); on a Zen 4 EPYC 128 / 256 / 512 rows 23.2 / 23.1 / 23.6 ms at
# 4096, 87.1 / 87.7 / 88.5 at 16384 (the kernel alone): flat, so no per-CPU size.
_FUSED_ROWS = 256
# Weights (B x H x N x M) up to which the compiled kernel, training with dropout, keeps its
# forward's weights for backward (`keep_weights`, 4 bytes each) instead of making them
# again there (one GEMM of its seven, and an exp pass): while they stay in the last-level
# cache. Measured on a Zen 3 EPYC (AVX2, 32 MiB of L3, 2 threads; 4 heads, M 256, head_dim
# 64), the kernel alone, recompute / keep: 1.15-1.17x at 2^20-2^22 weights with dropout 0.1,
# but 0.93-0.95x at 2^23; the attention layer 1.05-1.08x, a 6-layer encoder 1.04-1.08x at
# n 1024-4096 (`benchmarks/kernels/zen3-avx2/keep-weights/`, docs/performance.md). Only
# with dropout: without, SDPA (which the rule mostly takes then) saves one logsumexp a row,
# which the encoder layer's memory matches; with dropout its math path keeps N x N.
_KEEP_WEIGHTS = 1 << 22


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
    batch = a.shape[:-2]  # (not -1: a reshape of no elements cannot infer it)
    a3, b3 = (t.reshape(batch.numel(), *t.shape[-2:]) for t in (a, b))
    # beta = 0: the (expanded, never read) input only gives the output its shape.
    zero = a3.new_zeros(1, 1, 1).expand(a3.shape[0], a3.shape[1], b3.shape[2])
    out = torch.baddbmm(zero, a3, b3, beta=0.0, alpha=alpha)
    return out.view(*batch, a.shape[-2], b.shape[-1])


def _bmm_rows(a: Tensor, b: Tensor, alpha: float, splits: int) -> Tensor:
    """alpha * a^T b, a sum over the rows (dimension -2) of a and b, in `splits` chunks of
    rows whose products run as more batch entries of one GEMM and are summed after
    (`kernel_rule.choose_reduction_splits`)."""
    if splits == 1:
        return _bmm(a.transpose(-1, -2), b, alpha)
    a, b = (t.unflatten(-2, (splits, -1)) for t in (a, b))
    return _bmm(a.transpose(-1, -2), b, alpha).sum(-3)


def _accumulate(total: Tensor | None, part: Tensor, like: Tensor) -> Tensor:
    """total + part, over part's leading rows (a causal block sees the first keys only); the
    first part is the total where it covers all of `like`'s rows."""
    if total is None and part.shape == like.shape:
        return part
    if total is None:
        total = torch.zeros_like(like)
    total[..., : part.shape[-2], :] += part
    return total


def block_rows(groups: int, keys: int) -> int:
    """Query rows per block of the explicit kernel: at most `_BLOCK_WEIGHTS` weights per
    block over the `groups` (batch x heads) matrices, within `_BLOCK_ROWS`.

    Args:
        groups: number of (N, M) weight matrices (the product of the leading dimensions).
        keys: M.
    """
    low, high = _BLOCK_ROWS
    return max(low, min(high, _BLOCK_WEIGHTS // max(1, groups * keys)))


def _blocks(seq_len: int, rows: int | None, keys: int, causal: bool) -> list[tuple[slice, int]]:
    """(query rows, number of keys they see) of each block: all M keys, or under a causal
    mask only the first min(M, end of the block), which the block's last query sees (no
    query of the block sees a later key, so those scores are never computed).
    `rows=None`: one block of every row and key, whatever N (no shape-dependent loop for
    torch.compile to specialise on); N = 0 is one block of no rows."""
    if rows is None:
        return [(slice(None), keys)]
    return [
        (slice(start, start + rows), min(keys, seq_len, start + rows) if causal else keys)
        for start in range(0, max(seq_len, 1), rows)  # N = 0: one empty block
    ]


def _block_mask(
    attn_mask: Tensor | None, causal: bool, block: slice, queries: Tensor, keys: int
) -> Tensor | None:
    """The mask of one block's (rows, keys) weights, True where allowed: the block's rows
    of `attn_mask` (broadcastable to (..., N, M)), or the causal one (query i sees keys
    0..i); `queries` are the block's, (..., rows, D)."""
    if causal:
        allowed = queries.new_ones((queries.shape[-2], keys), dtype=torch.bool)
        return allowed.tril_(block.start or 0)
    if attn_mask is None or attn_mask.dim() < 2 or attn_mask.shape[-2] == 1:
        return attn_mask
    return attn_mask[..., block, :]


class _ExplicitAttention(torch.autograd.Function):
    """softmax(Q K^T * scale) with dropout, times V, by PyTorch ops, block of query rows by
    block; saves the weights (and the dropout bits), not the scores.

    On CPU each block's weights are made, dropped and consumed while they are hot in
    cache, and a block's temporaries (scores, dropped weights, gradients) reuse the memory
    of the previous block's instead of mapping fresh pages for N x M tensors (`block_rows`);
    the weights kept for backward are N x M in all. On a GPU, where each block costs
    kernel launches, and under torch.compile (a loop over N / rows blocks would compile a
    graph for every N) there is one block. With all the
    keys a block sees in one block the softmax needs no running maximum: blocks of rows are
    independent. Under a causal mask a block computes only the keys its queries can see
    (`_blocks`): half the work at N = M. In one block, dK and dV sum over all N rows: they
    are cut into chunks of rows where `choose_reduction_splits` says (`_bmm_rows`).
    """

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p, scale, causal):  # noqa: ANN001, ANN205
        rows = None
        if q.device.type == "cpu" and not torch.compiler.is_compiling():
            rows = block_rows(q.shape[:-2].numel(), k.shape[-2])
        outs, weights, bits = [], [], []
        seed = dropout_seed(q.device) if dropout_p > 0.0 else None
        layout = (q.shape[-2], (k.shape[-2] + 3) // 4)
        # bf16 / fp16 scores and softmax in float32, as SDPA and the compiled kernel make
        # them (rounded first, the weights' error grew with the logits: 0.10 at std 36)
        wide = torch.promote_types(q.dtype, torch.float32)
        for block, keys in _blocks(q.shape[-2], rows, k.shape[-2], causal):
            queries = q[..., block, :]
            mask = _block_mask(attn_mask, causal, block, queries, keys)
            scores = masked_scores(queries.to(wide), k[..., :keys, :].to(wide), mask, scale)
            weights.append(torch.softmax(scores, -1).to(q.dtype))
            kept = weights[-1]  # (..., rows, keys)
            if dropout_p > 0.0:
                bits.append(dropout_bits(kept, seed, block.start or 0, *layout))
                kept = drop(kept, bits[-1], dropout_p)
            outs.append(_bmm(kept, v[..., :keys, :], rescaling(dropout_p)))
        # The dropped weights are made again in backward from the saved bits (half their size).
        ctx.save_for_backward(q, k, v, *weights, *bits)
        ctx.scale, ctx.rows, ctx.causal, ctx.dropout_p = scale, rows, causal, dropout_p
        return torch.cat(outs, -2) if len(outs) > 1 else outs[0]  # (..., N, Dv)

    @staticmethod
    @first_order_only("the explicit attention kernel", SDPA_DOUBLE_BACKWARD)
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v, *saved = ctx.saved_tensors
        blocks = _blocks(q.shape[-2], ctx.rows, k.shape[-2], ctx.causal)
        weights, bits = saved[: len(blocks)], saved[len(blocks) :]
        factor = rescaling(ctx.dropout_p)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        splits = 1
        if ctx.rows is None:  # one block: dK and dV sum over all N rows (`_bmm_rows`)
            *lead, seq_len, head_dim = q.shape
            splits = choose_reduction_splits(
                device=q.device, dtype=q.dtype, rows=seq_len, groups=math.prod(lead),
                keys=k.shape[-2], head_dim=head_dim,
            )  # fmt: skip
        grad_q, grad_k, grad_v = [], None, None
        for i, (block, keys) in enumerate(blocks):
            g, kept = grad[..., block, :], weights[i]
            grad_scores = None
            if bits:
                kept = drop(weights[i], bits[i], ctx.dropout_p)
            if need_q or need_k:
                grad_kept = _bmm(g, v[..., :keys, :].transpose(-1, -2), factor)  # (.., rows, keys)
                if bits:
                    # With kept = weights * mask: d scores = kept * g - weights * sum(kept * g),
                    # no mask needed; three in-place passes.
                    product = grad_kept.mul_(kept)
                    row_sums = product.sum(-1, keepdim=True)  # (..., rows, 1)
                    grad_scores = product.addcmul_(weights[i], row_sums, value=-1.0)
                else:
                    # weights * (g - sum(g * weights)) in one fused pass: softmax's own backward.
                    grad_scores = torch._softmax_backward_data(grad_kept, kept, -1, kept.dtype)
            if need_v:
                grad_v = _accumulate(grad_v, _bmm_rows(kept, g, factor, splits), v)
            if need_q:
                grad_q.append(_bmm(grad_scores, k[..., :keys, :], ctx.scale))
            if need_k:
                part = _bmm_rows(grad_scores, q[..., block, :], ctx.scale, splits)
                grad_k = _accumulate(grad_k, part, k)
        grad_q = (torch.cat(grad_q, -2) if len(grad_q) > 1 else grad_q[0]) if need_q else None
        return grad_q, grad_k, grad_v, None, None, None, None


def _fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    scale: float,
    causal: bool,
    ops: object,
) -> Tensor:
    """The explicit kernel on CPU, compiled (`csrc/attention.cpp`; its autograd kernel:
    `csrc/autograd.cpp`; its fake kernel for torch.compile: `native`): one parallel loop
    over blocks of `_FUSED_ROWS` query rows per (batch, head), each block's scores,
    weights, dropout mask and gradients made and used in the thread's cache, the output
    written straight into the (B, N, H, Dv) memory the head merge reads. Saves q, k, v, the
    mask, and for backward, with dropout, the weights themselves up to `_KEEP_WEIGHTS` of
    them (while they fit in cache), else one logsumexp per row, from which backward makes
    them again with one more GEMM, as flash attention does; the dropout mask always from
    its seed.

    Inputs of any leading dimensions are seen as (B, H, ..): views wherever the layout
    allows (unit stride in the last dimension and rows at least a row apart, which the BLAS
    calls need: a row expanded over a dimension has row stride 0, and a BLAS reading it as
    a matrix walks past it); the mask is broadcast to (B, H, N, M) as a view, read row by
    row, any row stride.
    """
    *lead, seq_len, _ = q.shape
    keys, groups = k.shape[-2], math.prod(lead)

    def four_d(t: Tensor, *, matrix: bool = True) -> Tensor:
        t = t if t.dim() == 4 else t.reshape(groups, 1, *t.shape[-2:])
        return t if rows_in_place(t, matrix=matrix) else t.contiguous()

    mask = None
    if attn_mask is not None:
        mask = four_d(attn_mask.expand(*lead, seq_len, keys), matrix=False)
    seed = dropout_seed(q.device) if dropout_p > 0.0 else q.new_zeros((), dtype=torch.int64)
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    keep = backward and dropout_p > 0.0 and groups * seq_len * keys <= _KEEP_WEIGHTS
    args = (causal, scale, seed, threshold(dropout_p), rescaling(dropout_p), _FUSED_ROWS, keep)
    out, _ = ops.attention_forward(four_d(q), four_d(k), four_d(v), mask, *args)
    return out if q.dim() == 4 else out.reshape(*lead, seq_len, v.shape[-1])


def dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    kernel: str | None = None,
    is_causal: bool = False,
    *,
    every_row_attends: bool = False,
) -> Tensor:
    """softmax(Q K^T * scale) V with dropout on the weights, through the kernel
    `choose_kernel` picks (or `kernel`, if given).

    The contract of `F.scaled_dot_product_attention` with a bool mask (leading dimensions
    broadcast; a row with no allowed key gives 0).
    Inside a torch.func transform always SDPA, whatever the rule or a pin says.
    SDPA runs with its queries cut into as many chunks as `choose_splits` says (more than
    one on a GPU in training only; `sdpa(..., splits=1)` is always one call).

    Args:
        q: (..., N, D).
        k, v: (..., M, D) and (..., M, Dv), leading dimensions broadcastable with q's.
        attn_mask: optional bool, broadcastable to (..., N, M), True where allowed.
        dropout_p: dropout on the attention weights, in [0, 1).
        scale: softmax scale; default 1 / sqrt(D).
        kernel: "sdpa" or "explicit" to override the rule; None to follow it (or the
            kernel of an enclosing `use_kernel`).
        is_causal: query i sees keys 0..i only, aligned top-left as SDPA's flag (with
            N > M the last queries see all M keys); attn_mask must be None.
        every_row_attends: the caller's mask gives every query a key (`functional.attendable`,
            a causal block's diagonal): the explicit kernels skip looking for rows without.

    Returns:
        (..., N, Dv).

    Raises:
        ValueError: for an unknown kernel, a mask that is not bool or is given with
            is_causal, dropout_p outside [0, 1), or keys and values of different lengths.
    """
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal=True builds its own mask; got an attn_mask as well")
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise ValueError(
            f"attn_mask must be bool (True where attention is allowed), got {attn_mask.dtype}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if attn_mask is not None and attn_mask.dim() < 2:  # (M,): SDPA's IndexError, not explicit's
        attn_mask = attn_mask.reshape(1, -1)
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"keys and values must be as many: got k of shape {tuple(k.shape)} and v of "
            f"shape {tuple(v.shape)} (dimension -2: {k.shape[-2]} against {v.shape[-2]})"
        )
    check_kernel(kernel)
    if transformed(q, k, v, attn_mask):
        # torch.func (grad, vmap, functional_call): neither explicit kernel (autograd
        # Functions, C++ or Python) runs inside a transform; SDPA has its rules.
        return sdpa(q, k, v, attn_mask, dropout_p, scale, is_causal)
    dtype = compute_dtype(q)
    call = {
        "device": q.device,
        "dtype": dtype,
        "backward": torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
        "causal": is_causal,
        "queries": q.shape[-2],
        "keys": k.shape[-2],
        "groups": math.prod(q.shape[:-2]),
    }
    kernel = kernel or pinned_kernel()
    if kernel is None:
        kernel = choose_kernel(
            **call, dropout=dropout_p > 0.0, compiled=lambda: native_ops(q, dtype) is not None
        )
    if kernel == "explicit":
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])  # as SDPA's
        q, k, v = (t.expand(*lead, *t.shape[-2:]) for t in (q, k, v))
        empty = None
        if attn_mask is not None and not every_row_attends:  # such a row: 0, as SDPA's (not NaN)
            empty = ~attn_mask.any(-1, keepdim=True)  # (..., N or 1, 1)
            if torch.compiler.is_compiling() or empty.any():
                attn_mask = attn_mask | empty  # (a copy of an expanded mask: only if needed)
            else:
                empty = None
        # Under autocast as SDPA is: its inputs cast as autocast casts them (float64 and
        # mismatched dtypes are left to raise), the kernel's own ops not cast again.
        device = q.device.type
        q, k, v = (t.to(dtype) if autocast_casts(t) else t for t in (q, k, v))
        off = torch.autocast(device, enabled=False) if autocast_on(device) else None
        # `is not None`: torch 2.11's dynamo cannot take the truth of an autocast object
        # (a graph break per call, "attempted to jump with AutocastModeVariable()").
        with off if off is not None else contextlib.nullcontext():
            ops = native_ops(q)
            if ops is not None:
                out = _fused_attention(q, k, v, attn_mask, dropout_p, scale, is_causal, ops)
            else:
                out = _ExplicitAttention.apply(q, k, v, attn_mask, dropout_p, scale, is_causal)
        return out if empty is None else out.masked_fill(empty, 0)
    return sdpa(q, k, v, attn_mask, dropout_p, scale, is_causal, choose_splits(**call))
