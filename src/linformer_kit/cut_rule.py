"""Into how many chunks a GPU attention call in training is cut: SDPA's queries
(`choose_splits`, `cut_sdpa.sdpa`) and the explicit kernel's backward sums over the queries
(`choose_reduction_splits`, `kernels._bmm_rows`), each from the H200 tables in its
docstring, and `use_reduction_splits` to pin the second over a block. `kernel_rule`, which
picks the kernel, exports them beside `choose_kernel`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# The explicit kernel's backward products on a GPU (`choose_reduction_splits`): cut from
# this many queries, into chunks of at least `_REDUCTION_MIN_ROWS` rows.
_REDUCTION_MIN_QUERIES, _REDUCTION_MIN_ROWS = 16384, 256
# The chunks `use_reduction_splits` pins for the explicit kernel's backward (None: the rule).
_pinned_reduction_splits: int | None = None


def choose_splits(
    *,
    device: torch.device,
    dtype: torch.dtype,
    backward: bool,
    causal: bool,
    queries: int,
    keys: int,
    groups: int,
) -> int:
    """Into how many chunks of queries an SDPA call is cut (`cut_sdpa.sdpa`): 1 but on a GPU
    in training, where SDPA's backward has one thread block per (batch, head, block of
    64 keys), each looping over all N queries, and Linformer's few keys leave most SMs idle.

    `benchmarks/kernels/cuda/split/table.json` (`benchmarks/kernels_split.py`, H200, torch
    2.11, fp32 and bf16, B 1 and 8, H 4, head_dim 64, n 1024-65536, k 64 / 256 / 1024,
    fwd+bwd with and without dropout; 1, 2, 4, ... 64 chunks of at least 64 queries):

    - fp32 (the mem-efficient kernel): from n = 4096 cutting won up to 20x (B 1, n 65536,
      k 64); n 1024 was best uncut but in one cell (B 1, k 1024, dropout: 1.07x at 8
      chunks). The rule: as many chunks (a power of 2, at most 64,
      each of at least 64 queries) as keep B x H x chunks x ceil(M / 64) <= 512, about four
      blocks per SM: 0.91-1.00x the best cut measured at every shape (geometric mean 0.985),
      never slower than one call; e.g. B 1, k 256, n 16384: 32 chunks, 0.71 ms against 4.45
      uncut (and 2.15 on the explicit kernel). Re-timed in the eighth GPU call, same
      shapes (`cuda/split-run8/`): 0.95-1.00x the best cut (geometric mean 0.985), never
      slower than one call;
    - bf16 (flash): cutting costs its copies and launches (B 1, n 4096, k 256 without
      dropout: 0.34 ms uncut, 0.47 in 8 chunks). The best cut of one call gains
      1.09-1.43x at n 16384, B 1 (1.00-1.30x at B 8) and 2.0-3.3x at n 65536 (1.0-1.5x
      at B 8), but the layers lose it below n = 65536, so the cut (by the same bound)
      starts there. Inside the layers, whose steps at B 1 are bound by launches on the
      host (`benchmarks/kernels/cuda/split-layers/`, `kernels_split_layers.py`: ours, kv,
      k 256, attention and encoder layer, fwd+bwd), the cut from n = 8192 the rule made
      before took 1.06-1.11x the uncut step at B 1, n 8192-32768 in all six cells (bursts
      of 10 steps: 1.02-1.24x) and 1.13x / 1.01x at B 8, n 8192 (4 chunks); with dropout
      0.1 (`split-layers/dropout/`) 32 chunks took 1.09-1.13x at B 1, n 8192-16384,
      0.98-1.00x at 32768 and 1.01-1.04x at B 8, n 16384; at B 1, n 65536
      (`split-layers/threshold/`) 0.84x (bursts: 1.08x attention, 0.94x layer): the cut
      pays there. Re-timed (`cuda/split-run8/`), the calls the rule cuts (n 65536) ran
      1.12-4.14x faster than uncut, 0.98-1.00x the best cut but one (0.74x: B 1, k 256
      without dropout, 32 chunks against the best 64);
    - CPU (`benchmarks/kernels/split-cpu/`, the same script with `--device cpu`, fp32,
      2 threads, B 1, n 1024 / 4096, k 64 / 256; Intel Xeon): the best cut was 0.85-0.97x
      one call at n 1024 and with dropout (which runs the explicit kernel anyway), and
      1.04x / 1.14x in training without dropout at n 4096 (two cells of one run, not
      checked in the layers, where the call is about a sixth of the time): uncut;
    - fp16 (the same kernels as bf16, not measured), fp64 (SDPA's math path, whose work
      does not depend on the cut) and more than 1024 keys (not measured; exact attention,
      whose N keys already give the backward N / 64 blocks per head) stay uncut.

    Args:
        device: where the call runs.
        dtype: the dtype the call computes in (`compute_dtype`).
        backward: whether a backward pass will follow.
        causal: exact causal attention (never cut: its mask is aligned to the whole N).
        queries, keys: N and M.
        groups: B x H.

    Returns:
        A power of 2 dividing `queries`.
    """
    if device.type != "cuda" or not backward or causal:
        return 1
    if dtype not in (torch.float32, torch.bfloat16) or keys > 1024:
        return 1
    if queries < (4096 if dtype == torch.float32 else 65536):
        return 1
    return _cut(queries, fewest=64, blocks=groups * -(-keys // 64))


@contextlib.contextmanager
def use_reduction_splits(splits: int | None) -> Iterator[None]:
    """Cuts the explicit kernel's key and value gradients (`choose_reduction_splits`) into
    `splits` chunks of query rows inside, wherever it runs one block (process-wide, for the
    block; where `splits` does not divide N, into the largest power of 2 that does): 1 runs
    each as one batched GEMM.

    Args:
        splits: a power of 2; None follows the rule.

    Raises:
        ValueError: for anything but None or a positive power of 2.
    """
    global _pinned_reduction_splits
    if splits is not None and (splits < 1 or splits & (splits - 1)):
        raise ValueError(f"splits must be a positive power of 2 or None; got {splits}")
    before, _pinned_reduction_splits = _pinned_reduction_splits, splits
    try:
        yield
    finally:
        _pinned_reduction_splits = before


def choose_reduction_splits(
    *, device: torch.device, dtype: torch.dtype, rows: int, groups: int, keys: int, head_dim: int
) -> int:
    """Into how many chunks of query rows the explicit kernel's backward cuts the two
    products that sum over them, dK = dS^T Q and dV = P^T dO (`kernels._ExplicitAttention`,
    one block of rows: on a GPU and under torch.compile): each chunk's product is a batch
    entry of one batched GEMM, and the chunks' products are summed after.

    Each product's output is only M x D per (batch, head), its reduction N long: at B 1,
    H 4, k 256, head_dim 64, cuBLAS's fp32 GEMM covers the 16 output tiles of 64 x 64 with
    few thread blocks, each looping over all N rows, on an H200's 132 SMs (the two products
    took 0.31 ms of the explicit kernel's 1.17 ms of GPU time in an encoder layer's training
    step at n 4096, fp32, `benchmarks/kernels/cuda/profile/profile-b1-run9.json`;
    lucidrains' two the same 0.29). The cut is as many chunks (a power of 2, at most 64, of
    at least `_REDUCTION_MIN_ROWS` rows) as keep chunks x output tiles <= 512, about four
    tiles per SM, as `choose_splits` cuts SDPA's queries.

    `benchmarks/kernels/cuda/split-run10/` and `split-run10-mid/` (`kernels_split.py`, H200,
    torch 2.11, B 1 and 8, H 4, head_dim 64, n 1024-65536, k 64 / 256 / 1024, fwd+bwd with
    and without dropout 0.1; the explicit kernel uncut, cut by this rule and into 4, 16 and
    64 chunks, interleaved):

    - fp32 from n 16384 (36 shapes): the rule's cut took 0.24-1.06x the uncut call's time
      (geometric mean 0.74; B 1, n 65536, k 64 without dropout: 1.22 ms against 5.16; B 8,
      n 16384, k 64: 1.49 against 2.38), and the best cut measured 0.83-1.00x the rule's
      (geometric mean 0.97). The kernel took 0.91 ms of GPU time a step cut into 16 at
      n 4096 (`profile/profile-b1-run10.json`), its two products gone from the top kernels;
    - fp32 below n 16384 (n 1024-8192, 36 shapes) the call, bound by issuing kernels at
      these sizes, ran faster uncut at most shapes (the cut's one more launch and its
      copies): the same cut at n 1024 and 4096 took 0.90-1.20x the uncut time (geometric
      mean 1.05), and the best cut was at most 10 % faster anywhere (B 8, n 1024, k 64,
      dropout): uncut;
    - bf16 (48 shapes): no cut was 5 % faster than one call anywhere (best cuts 0.96-1.14x
      its time; cuBLAS's bf16 GEMMs split their own reductions): uncut. fp16 and fp64 (not
      measured) stay uncut too, as does the CPU, whose compiled kernel has its own plan.

    It leaves the eager CUDA rule (`choose_kernel`) on SDPA: SDPA cut as `choose_splits`
    cuts it was faster than the explicit kernel cut as this rule cuts it at 111 of the 120
    shapes, and at most 5 % slower at the other 9 (1.00-1.05x, all fp32 training without
    dropout, n >= 16384, k 256 and 1024), not worth the N x M weights the explicit kernel
    keeps for backward (2 GiB at B 8, n 65536, k 256; SDPA keeps a logsumexp a row).

    Args:
        device: where the call runs.
        dtype: the dtype the products compute in.
        rows: N, the query rows summed over.
        groups: B x H, the products' batch.
        keys, head_dim: M and D, each product's output M x D (in tiles of 64 x 64).

    Returns:
        A power of 2 dividing `rows` (the pinned count where `use_reduction_splits` pins one,
        lowered until it does).
    """
    pinned = _pinned_reduction_splits
    if pinned is not None:
        return _cut(rows, fewest=1, blocks=1, most=pinned, bound=pinned)
    if device.type != "cuda" or dtype != torch.float32 or rows < _REDUCTION_MIN_QUERIES:
        return 1
    tiles = groups * -(-keys // 64) * -(-head_dim // 64)  # each product's, of 64 x 64
    return _cut(rows, fewest=_REDUCTION_MIN_ROWS, blocks=tiles)


def _cut(rows: int, *, fewest: int, blocks: int, most: int = 64, bound: int = 512) -> int:
    """The most chunks, a power of 2 up to `most`, that divide `rows` into chunks of at
    least `fewest` rows and keep chunks x `blocks` (thread blocks or tiles a chunk) within
    `bound`: about four a streaming multiprocessor on an H200's 132."""
    splits = 1
    # (divisibility in the loop, not math.gcd after it: dynamo traces this with N symbolic)
    while (
        splits < most
        and rows % (2 * splits) == 0
        and rows // (2 * splits) >= fewest
        and blocks * 2 * splits <= bound
    ):
        splits *= 2
    return splits
