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
  GEMM done in the thread's cache; only a logsumexp per row is saved, and backward makes
  the weights and the mask again (one more GEMM, no N x M tensor ever allocated);
- PyTorch ops (`_ExplicitAttention`): where the compiled one cannot run (no compiler,
  `LINFORMER_KIT_NATIVE=0`, a GPU, fp16); one autograd node that builds the
  weights once, in blocks of query rows on CPU, folds the softmax scale and the dropout
  rescaling into the GEMMs' alpha, saves the weights and the bits, and works in place in
  backward.

The rule (`choose_kernel`) comes from `benchmarks/kernels/table.json` and
`benchmarks/kernels/bf16/table.json`, made by `benchmarks/kernels.py` (SDPA vs explicit,
fwd+bwd and forward only, over n, k and head_dim); it is never a per-call timing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .dropout import (
    drop,
    dropout_bits,
    dropout_seed,
    native_ops,
    rescaling,
    threshold,
)

KERNELS = ("sdpa", "explicit")
# Blocks of the explicit kernel (`block_rows`): rows of queries per block between 64 (GEMMs
# stay efficient) and 512, at most 2^22 weights (16 MiB in fp32). Measured on CPU (fp32,
# 2 threads, M = 256, head_dim 64, fwd+bwd): 256-512 rows beat one N x M block by 1.2-1.6x
# from n = 4096 (B = 1, 4 heads) and at B = 8; 1024 rows and more lose part of it. Fewer
# rows lose too, though a block then fits in L2: with dropout 0.1 (B = 1, 4 heads, AVX2),
# 64 / 128 / 256 / 512 rows took 20.1 / 16.1 / 14.7 / 14.8 ms at n = 1024 and 396 / 261 /
# 253 / 226 ms at n = 16384: per-block op overheads outweigh the cache.
_BLOCK_WEIGHTS = 1 << 22
_BLOCK_ROWS = (64, 512)
# Query rows per block of the compiled kernel (`_fused_attention`), one block per task of
# its parallel loop. Measured (fp32, B = 1, 4 heads, M = 256, head_dim 64, fwd+bwd with
# dropout 0.1, 2 threads, AVX-512 Xeon, best of 3 interleaved rounds): 64 / 128 / 256 /
# 512 rows took 4.32 / 4.13 / 4.08 / 4.42 ms at n = 1024, 17.3 / 16.4 / 16.6 / 17.0 ms at
# 4096 and 69.5 / 63.7 / 62.4 / 68.0 ms at 16384.
_FUSED_ROWS = 256
# The kernel `use_kernel` sets for the calls that leave it to the rule (None: the rule).
_forced: str | None = None


@contextlib.contextmanager
def use_kernel(kernel: str | None) -> Iterator[None]:
    """Runs the attention calls inside on `kernel` instead of the rule's choice, as
    `torch.nn.attention.sdpa_kernel` pins SDPA's backend: for a model's layers, which call
    `dot_product_attention` without a `kernel` (a call that names one keeps it). Like
    `sdpa_kernel` it sets process-wide state for the duration of the block.

    Args:
        kernel: "sdpa" or "explicit"; None follows the rule (`choose_kernel`).

    Raises:
        ValueError: for an unknown kernel.
    """
    global _forced
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)} or None; got {kernel!r}")
    before, _forced = _forced, kernel
    try:
        yield
    finally:
        _forced = before


def choose_kernel(
    *,
    device: torch.device,
    dtype: torch.dtype,
    dropout: bool,
    backward: bool,
    queries: int,
    keys: int,
    groups: int,
    compiled: Callable[[], bool],
) -> str:
    """The cheaper kernel for a call, by the measured rule.

    float32 / float64: `benchmarks/kernels/table.json` (CPU, fp32, one thread, B = 1, H = 4;
    n 1024-16384, k 64-1024, head_dim 32-128, fwd+bwd with and without dropout, forward
    only; the explicit kernel compiled, on an AVX-512 Xeon):

    - dropout on: explicit beats SDPA's math fallback at all 27 shapes (SDPA time /
      explicit time 1.67-5.33, geometric mean 2.70), so CPU attention with dropout goes
      explicit (fp32 measured; fp64 takes the same path);
    - dropout off: a tie. Geometric mean 1.03 in training (explicit ahead by more than 5 %
      at 10 shapes, 8 of them at k = 64, by up to 1.26x; SDPA ahead at 5, by up to 1.16x)
      and 0.97 in inference (SDPA ahead by more than 5 % at 12 shapes). The explicit kernel
      is chosen only where its geometric mean wins by more than 5 % (a second run of the
      table, `compiled-attention/table/`, gave 1.03 and 0.97 again), so SDPA (torch's own
      kernel, nothing to build) keeps these cases; k = 64 in training alone would favour
      explicit (1.05-1.26x), a corner of a non-default config not worth a rule.

    Exact causal attention (`benchmarks/kernels/compiled-attention/causal/`, n 1024-4096,
    head_dim 64) agrees: explicit 4.6-7.0x faster with dropout (its blocks skip the keys no
    query of theirs sees), 0.96-1.13x without.

    bfloat16 (also float32 under bf16 autocast, `compute_dtype`):
    `benchmarks/kernels/bf16/table.json`, the same 27 shapes on the same Xeon (AMX), the
    compiled kernel's GEMMs in bf16:

    - dropout on: explicit 3.12-7.40x faster at all 27 shapes (geometric mean 4.26);
    - training without dropout: explicit 1.26-2.03x faster at the 18 shapes with k <= 256,
      a tie at k = 1024 (0.90-1.10x), so explicit up to k = 256 (and SDPA beyond: exact
      attention, k = n, lost 30 % through the explicit kernel at n = 1024 in a bench run),
      and only where the compiled kernel runs: the PyTorch-ops one (no compiler) is no
      faster than SDPA (8.5-9.8 against 8.5-9.1 ms, n 1024, k 256, head_dim 64, 1 thread)
      and, its softmax in bf16, less accurate (relative error 0.0051 against 0.0037);
    - inference: SDPA's flash kernel faster at all 27 (explicit 0.41-0.69x).

    With AVX2 only (`bf16/avx2-emulated/`, n 1024, k 64-1024, head_dim 64; AVX-512 and AMX
    switched off in torch, MKL and oneDNN, the kernels built for haswell) explicit is
    1.82-2.02x faster with dropout, 3.5-6.2x in training without (SDPA's bf16 backward is
    emulated there), 0.85-0.94x in inference. The rule follows the AMX machine, where bf16
    is worth using (`precision` warns against it elsewhere): at k = 1024 in training without
    dropout it keeps SDPA, which is 5.7x slower with AVX2 only.

    n and head_dim did not change the winner anywhere on CPU, and k only bf16 training
    without dropout.

    CUDA: `benchmarks/kernels/cuda/table.json` and `table-mid/table.json` (H200, torch
    2.11, fp32 and bf16, B 1 and 8, H = 4, n 1024-65536, k 64 / 256 / 1024, head_dim 64; the
    explicit kernel by PyTorch ops, one block). A call of a few ms costs kernel launches
    more than arithmetic: the explicit kernel's (1.1-1.5 ms fwd+bwd against SDPA's 0.5)
    lose below n = 8192. SDPA's fp32 backward runs a block per 64 keys of each (batch,
    head), each over all n queries: with B x H x M small it keeps few of the 132 SMs busy
    and its time grows with n, while the explicit kernel's GEMMs use them all.

    - inference: SDPA everywhere (explicit 0.26-0.85x);
    - fp32 training: explicit from n = 8192 where B H M <= 8192 (4096 with dropout):
      1.17-2.56x without dropout, 1.01-2.35x with; above that SDPA (without dropout
      0.97-1.03x at B H M = 32768; with dropout 0.60-0.83x at 8192 and more); at n = 4096
      SDPA (explicit 0.89-1.10x without dropout, 0.59-0.79x with). The layers agree
      (`cuda/pinned-explicit/`, `cuda/bench-b1`, `bench-b8`: ours on each kernel);
    - bf16 training without dropout: explicit only from n = 65536 where B H M <= 1024
      (1.37-1.43x; 0.93x at 2048, 0.72-0.96x at n = 32768);
    - bf16 with dropout: SDPA (explicit ahead at one shape only: B 1, k 64, n 65536, 1.19x).

    fp16 and fp64 (not measured for the explicit kernel), and other devices, keep SDPA.

    Args:
        device: where the call runs.
        dtype: the dtype the call computes in (`compute_dtype`).
        dropout: whether attention dropout is on (dropout_p > 0).
        backward: whether a backward pass will follow (grad enabled, an input needing it).
        queries: the number of queries (N).
        keys: the number of keys each query attends to (M).
        groups: the number of (N, M) attention matrices: the product of the leading
            dimensions (B x H).
        compiled: returns whether the compiled explicit kernel runs here; called only where
            the rule depends on it (its first call builds the kernels).

    Returns:
        "sdpa" or "explicit".
    """
    if device.type == "cuda":
        if not backward:
            return "sdpa"
        if dtype == torch.float32:
            up_to = 4096 if dropout else 8192
            return "explicit" if queries >= 8192 and groups * keys <= up_to else "sdpa"
        if dtype == torch.bfloat16 and not dropout:
            return "explicit" if queries >= 65536 and groups * keys <= 1024 else "sdpa"
        return "sdpa"
    if device.type != "cpu":
        return "sdpa"
    if dtype in (torch.float32, torch.float64):
        return "explicit" if dropout else "sdpa"
    if dtype == torch.bfloat16:
        return "explicit" if dropout or (backward and keys <= 256 and compiled()) else "sdpa"
    return "sdpa"


def compute_dtype(q: Tensor) -> torch.dtype:
    """The dtype an attention call with queries q computes in: autocast's where autocast is
    on for q's device and would cast q (floating, not float64: as it casts SDPA's inputs),
    else q's own."""
    if _autocast_casts(q):
        return torch.get_autocast_dtype(q.device.type)
    return q.dtype


def _autocast_casts(t: Tensor) -> bool:
    """Whether autocast, on for t's device, casts t to its dtype (it leaves float64 alone)."""
    return t.is_floating_point() and t.dtype != torch.float64 and _autocast_on(t.device.type)


def _autocast_on(device: str) -> bool:
    """Whether autocast is on for a device type (False for those it has none for: meta).
    CPU and CUDA are known to have it: torch.compile (2.11) cannot trace the availability
    check and broke the graph there, in every attention call."""
    known = device in ("cpu", "cuda")
    return (known or torch.amp.is_autocast_available(device)) and torch.is_autocast_enabled(device)


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
    the weights kept for backward are N x M in all. On a GPU, where each
    block costs kernel launches, and under torch.compile there is one block. With all the
    keys a block sees in one block the softmax needs no running maximum: blocks of rows are
    independent. Under a causal mask a block computes only the keys its queries can see
    (`_blocks`): half the work at N = M.
    """

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p, scale, causal):  # noqa: ANN001, ANN205
        # One block on a GPU (each block costs kernel launches) and under torch.compile
        # (a loop over N / rows blocks would compile a graph for every N).
        rows = None
        if q.device.type == "cpu" and not torch.compiler.is_compiling():
            rows = block_rows(q.shape[:-2].numel(), k.shape[-2])
        outs, weights, bits = [], [], []
        seed = dropout_seed(q.device) if dropout_p > 0.0 else None
        layout = (q.shape[-2], (k.shape[-2] + 3) // 4)
        for block, keys in _blocks(q.shape[-2], rows, k.shape[-2], causal):
            queries = q[..., block, :]
            mask = _block_mask(attn_mask, causal, block, queries, keys)
            weights.append(torch.softmax(masked_scores(queries, k[..., :keys, :], mask, scale), -1))
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
    @once_differentiable  # the backward is not itself differentiable: say so, not a wrong answer
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v, *saved = ctx.saved_tensors
        blocks = _blocks(q.shape[-2], ctx.rows, k.shape[-2], ctx.causal)
        weights, bits = saved[: len(blocks)], saved[len(blocks) :]
        factor = rescaling(ctx.dropout_p)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        grad_q = []
        grad_k = torch.zeros_like(k) if need_k else None
        grad_v = torch.zeros_like(v) if need_v else None
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
                grad_v[..., :keys, :] += _bmm(kept.transpose(-1, -2), g, factor)
            if need_q:
                grad_q.append(_bmm(grad_scores, k[..., :keys, :], ctx.scale))
            if need_k:
                grad_k[..., :keys, :] += _bmm(
                    grad_scores.transpose(-1, -2), q[..., block, :], ctx.scale
                )
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
    mask and one logsumexp per row, never an N x M tensor: backward makes the weights again
    with one more GEMM (the mask from the seed), as flash attention does.

    Inputs of any leading dimensions are seen as (B, H, ..): views wherever the layout
    allows (unit stride in the last dimension, which the BLAS calls need); the mask is
    broadcast to (B, H, N, M) as a view.
    """
    *lead, seq_len, _ = q.shape
    keys, groups = k.shape[-2], math.prod(lead)

    def four_d(t: Tensor) -> Tensor:
        t = t if t.dim() == 4 else t.reshape(groups, 1, *t.shape[-2:])
        return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()

    mask = None
    if attn_mask is not None:
        mask = four_d(attn_mask.expand(*lead, seq_len, keys))
    seed = dropout_seed(q.device) if dropout_p > 0.0 else q.new_zeros((), dtype=torch.int64)
    args = (causal, scale, seed, threshold(dropout_p), rescaling(dropout_p), _FUSED_ROWS)
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
        kernel: "sdpa" or "explicit" to override the rule; None to follow it (or the
            kernel of an enclosing `use_kernel`).
        is_causal: query i sees keys 0..i only, aligned top-left as SDPA's flag (with
            N > M the last queries see all M keys); attn_mask must be None.

    Returns:
        (..., N, Dv).

    Raises:
        ValueError: for an unknown kernel, or a mask given with is_causal.
    """
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal=True builds its own mask; got an attn_mask as well")
    dtype = compute_dtype(q)
    kernel = kernel or _forced
    if kernel is None:
        kernel = choose_kernel(
            device=q.device,
            dtype=dtype,
            dropout=dropout_p > 0.0,
            backward=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
            queries=q.shape[-2],
            keys=k.shape[-2],
            groups=math.prod(q.shape[:-2]),
            compiled=lambda: native_ops(q, dtype) is not None,
        )
    if kernel == "explicit":
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        # Under autocast as SDPA is: its inputs cast as autocast casts them (float64 and
        # mismatched dtypes are left to raise), the kernel's own ops not cast again.
        device = q.device.type
        q, k, v = (t.to(dtype) if _autocast_casts(t) else t for t in (q, k, v))
        off = torch.autocast(device, enabled=False) if _autocast_on(device) else None
        with off or contextlib.nullcontext():
            ops = native_ops(q)
            if ops is not None:
                return _fused_attention(q, k, v, attn_mask, dropout_p, scale, is_causal, ops)
            return _ExplicitAttention.apply(q, k, v, attn_mask, dropout_p, scale, is_causal)
    if kernel == "sdpa":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )
    raise ValueError(f"kernel must be one of {', '.join(KERNELS)} or None; got {kernel!r}")
