"""Which attention kernel a call runs: the measured rule (`choose_kernel`), the dtype it
computes in under autocast (`compute_dtype`), and `use_kernel` to pin one over a block.
Into how many chunks a GPU call is cut (`choose_splits`, `choose_reduction_splits`,
`use_reduction_splits`) is `cut_rule`'s, exported here too.

The kernels themselves are in `kernels`; the tables the rule is read from are made by
`benchmarks/kernels.py` (CPU: `benchmarks/kernels/table.json`, `bf16/table.json`; CUDA:
`benchmarks/kernels/cuda/`), never timed per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from . import native, precision
from .cut_rule import choose_reduction_splits, choose_splits, use_reduction_splits

__all__ = [
    "KERNELS", "autocast_casts", "autocast_on", "check_kernel", "checkpointed", "choose_kernel",
    "choose_reduction_splits", "choose_splits", "compute_dtype", "pinned_kernel", "use_kernel",
    "use_reduction_splits",
]  # fmt: skip

KERNELS = ("sdpa", "explicit")
# The kernel `use_kernel` pins for the calls that leave it to the rule (None: the rule).
_pinned: str | None = None


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
    global _pinned
    check_kernel(kernel)
    before, _pinned = _pinned, kernel
    try:
        yield
    finally:
        _pinned = before


def checkpointed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` under activation checkpointing (non-reentrant), its
    recomputation in backward under the kernel pin (`use_kernel`) and switch
    (`native.kernels_off`) of the forward, as checkpoint does for autocast: a backward
    after the block ended ran the other kernel and failed ("a different number of tensors
    was saved during the original forward and recomputation")."""
    pin, off = _pinned, native.switched_off()
    # Under torch.compile the pin is read at trace time and the recomputation is traced with
    # it (and dynamo takes no nested context_fn); with nothing pinned there is nothing to redo.
    if torch.compiler.is_compiling() or (pin is None and not off):
        return checkpoint(function, *args, use_reentrant=False, **kwargs)

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:  # entered in backward, around the recomputation
        with use_kernel(pin), native.kernels_off() if off else contextlib.nullcontext():
            yield

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), recompute()

    return checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def check_kernel(kernel: str | None) -> None:
    """Raises a ValueError unless `kernel` is one of `KERNELS` or None."""
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)} or None; got {kernel!r}")


def pinned_kernel() -> str | None:
    """The kernel an enclosing `use_kernel` pinned, or None (the rule decides)."""
    return _pinned


def choose_kernel(
    *,
    device: torch.device,
    dtype: torch.dtype,
    dropout: bool,
    backward: bool,
    causal: bool,
    queries: int,
    keys: int,
    groups: int,
    compiled: Callable[[], bool],
) -> str:
    """The cheaper kernel for a call, by the measured rule.

    float32 / float64: `benchmarks/kernels/table.json` (CPU, fp32, one thread, B = 1, H = 4;
    n 1024-16384, k 64-1024, head_dim 32-128, fwd+bwd with and without dropout, forward
    only; the explicit kernel compiled with 512-bit vectors, on an AVX-512 Xeon):

    - dropout on: explicit beats SDPA's math fallback at all 27 shapes (SDPA time /
      explicit time 1.72-5.48, geometric mean 2.83), so CPU attention with dropout goes
      explicit (fp32 measured; fp64 takes the same path);
    - training without dropout: the table favours explicit at k <= 256 (1.04-1.40x at all
      18 shapes; geometric mean 1.21 at k = 64, 1.11 at k = 256; 0.96 at k = 1024), but the
      layers do not (`linformer bench --kernel explicit,sdpa`, 2 threads, n 1024 / 4096 /
      16384, `benchmarks/kernels/vector512/`: SDPA time / explicit time at k = 256 0.93 /
      1.00 / 1.04 for the attention layer, 1.01 / 1.00 / 1.00 for the encoder layer; at
      k = 64, `vector512/k64/`, 0.91 / 0.99 / 1.03 and 0.98 / 1.01 / 1.02; the call is about
      a sixth of the encoder layer's time), so SDPA (torch's own kernel, nothing to build)
      keeps it, as on a GPU in bf16. Before the kernel's softmax was vectorised at 512 bits
      the table itself was a tie (1.03 over all 27 shapes, `compiled-attention/table/`);
    - inference: a tie (1.05 / 1.01 / 0.97 at k = 64 / 256 / 1024): SDPA. The explicit
      kernel is taken only where it wins a k's geometric mean by more than 5 % and the
      layers agree.

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
      and was less accurate (relative error 0.0051 against 0.0037, its scores in bf16
      then; float32 since);
    - inference: SDPA's flash kernel faster at all 27 (explicit 0.41-0.69x).

    With AVX2 only (`bf16/avx2-emulated/`, n 1024, k 64-1024, head_dim 64; AVX-512 and AMX
    switched off in torch, MKL and oneDNN, the kernels built for haswell) explicit is
    1.82-2.02x faster with dropout, 3.5-6.2x in training without (SDPA's bf16 backward is
    emulated there), 0.85-0.94x in inference. The rule follows the AMX machine, where bf16
    is worth using (`precision` warns against it elsewhere): at k = 1024 in training without
    dropout it keeps SDPA, which is 5.7x slower with AVX2 only.

    On an AMD CPU with AVX-512 BF16 and no AMX (`benchmarks/kernels/amd-epyc/table/`, the
    same 27 shapes in fp32 and bf16, AMD EPYC), where MKL runs its generic AVX2 code
    (`precision.mkl_without_avx512`), the explicit kernel's float32 GEMMs are oneDNN's
    brgemm micro-kernel (`native.kernel_gemm`), and its bf16 ones run AVX-512 BF16's dot
    products (`csrc/bf16_gemm.h`; first measured widened to fp32 for the fp32 one), while
    SDPA's flash kernel calls MKL. fp32: explicit 1.65-2.28x faster in training
    without dropout (geometric means 1.96 / 2.14 / 2.07 at k = 64 / 256 / 1024),
    1.18-2.20x in inference (1.84 / 2.07 / 2.02), 2.38-8.46x with dropout; exact causal
    attention (`amd-epyc/table-causal/`, n 1024 and 4096, head_dim 64) 2.12-2.24x without
    dropout. Few queries lose there (`amd-epyc/table-queries/`, k 64 and 256, head_dim 64,
    without dropout): explicit 0.27-0.48x at 1 query (the kernel lays K^T out per call),
    0.58-0.74x at 16, 1.10-1.32x at 64, 1.61-1.83x at 256. So fp32 without dropout goes
    explicit from 64 queries wherever the kernels' GEMMs are oneDNN's (and the kernel is
    compiled: the PyTorch-ops one runs torch's own GEMMs). Before, on MKL's `sgemm_`, it
    was a tie without dropout (training 0.94-1.17x, inference 0.72-1.10x,
    `amd-epyc/table-mkl/`). bf16 (`amd-epyc/table-bf16-dot/`, on the dot products): explicit
    1.72-3.26x in training without dropout (geometric means 2.81 / 2.39 / 2.03), 2.07-3.46x
    in inference, 3.67-9.35x with dropout (widened: 1.30-2.33x, 1.65-2.13x, 2.29-7.46x);
    exact causal 1.95-3.06x (`amd-epyc/table-causal-bf16-dot/`; widened 1.30-1.96x); on
    MKL's bf16 GEMM it had lost without dropout (training 0.65-1.29x, inference 0.98-1.12x,
    `amd-epyc/table-bf16-mkl/`). Below 64 queries the bf16
    rows are mixed (`amd-epyc/table-queries-bf16-dot/`: explicit 0.75-2.11x in training,
    SDPA's bf16 backward being slow; 0.81-1.32x in inference, 0.81-0.98x at 16 queries), so
    bf16 goes explicit at any query count in training and from 64 in inference. A Zen 5
    EPYC (`zen5/table/`, the same 162 cells) agrees at every one: fp32 1.83-2.49x in training
    without dropout, 1.63-2.40x in inference; bf16 1.88-2.99x and 2.09-3.55x.

    On a non-Intel CPU without AVX-512 (AVX2 only) the kernels' GEMMs are MKL's, as on
    Intel CPUs: so SDPA without dropout in float32. Emulated on the AMD EPYC (torch, MKL and
    oneDNN held to AVX2, the kernels built for haswell), the attention kernel's GEMMs on
    oneDNN's AVX2 code had run the attention layer 1.04-1.07x faster at n 1024
    (`avx2-emulated/attention-onednn/ab/`), and such CPUs took that routing; on a real one
    (AMD EPYC Zen 3) every GEMM on MKL, SDPA taken without dropout, ran it 1.04 / 1.01 /
    1.03x as fast as that routing at n 1024 / 4096 / 16384 (`zen3-avx2/gemm-ab/`), and the
    attention kernel alone tied in float32 and ran faster on MKL's bf16 GEMM than widened
    onto oneDNN (`zen3-avx2/gemm-rate*/`): that routing is gone.

    n and head_dim did not change the winner anywhere on CPU, and k only training without
    dropout on Intel (in the rule, only bf16's).

    CUDA (H200, torch 2.11, fp32 without TF32, bf16; read as holding for any CUDA GPU until
    another is measured): SDPA, its queries cut into chunks in training (`choose_splits`),
    but under torch.compile in fp32 training with dropout at 4096 <= n < 8192 with
    B H M <= 1024.

    - Eager: SDPA cut as `choose_splits` says beat the explicit kernel at every shape of
      `cuda/split/table.json` (fp32 and bf16, B 1 and 8, n 1024-65536, k 64 / 256 / 1024,
      fwd+bwd with and without dropout): explicit 1.01-8.6x slower, or a tie (0.98x, B 8,
      n >= 16384, k 1024, fp32 without dropout). The layers agree (`cuda/bench-b1-split`,
      `bench-b8-split`, k 256, ours on the rule's kernel and pinned to explicit): the rule
      0.97-1.95x explicit's speed, the two cells below 1 (0.97x, 0.98x) B 1 and 8 at n 4096
      in the fp32 attention layer. Re-timed settled (ninth call, `cuda/table-run9/`, the
      same shapes and n 8192 / 32768, SDPA as the rule runs it): explicit 0.11-1.04x, its
      only wins 1.02-1.04x (B 8, k 1024, n >= 16384, fp32 training without dropout).
      Before the cut (`cuda/table.json`, `table-mid/`: uncut SDPA against explicit) the
      explicit kernel won fp32 training from n = 8192 at small B H M, 1.17-2.56x, because
      SDPA's backward, one thread block per 64 keys of each (batch, head), left most of the
      132 SMs idle. Inference: SDPA everywhere (explicit
      0.25-0.85x, uncut and cut alike: the forward is never cut). Exact causal
      (`cuda/table-causal/`, explicit 0.05-0.71x) and fp16 (`cuda/table-fp16/`, explicit
      0.11-0.92x but at n 65536 with B H M <= 1024, 1.23-1.44x in training, uncut) keep
      SDPA too.
    - Under torch.compile (`cuda/compiled-split/`: a 2-layer encoder, k 256, H 4, dropout
      0.1, compiled on each kernel, fp32 training; Inductor fuses the explicit kernel's
      softmax, mask and dropout bits): explicit 1.14x faster at B 1, n 4096 (3.5 against
      4.0 ms); SDPA cut 1.35x faster at B 1, n 8192 (4.8 against 6.5 ms) and 1.37x at
      n 16384 (5.7 against 7.8 ms), a tie at B 8
      (n 4096 10.5 against 10.6 ms, n 16384 37.9 against 37.7), where SDPA's lower memory
      decides (5274 against 7647 MiB peak at n 16384). The explicit band rests on that
      one cell; the B 8, n 4096 pair's two runs came from two calls (explicit's before
      the cut, which does not touch it). Without dropout, where Inductor has no mask to
      fuse, compiled SDPA cut does less GPU work there (`cuda/profile/profile-b1-run9.json`,
      one encoder layer, B 1, n 4096, fp32 training: its kernels 0.81 against 1.06 ms a
      step in kv sharing, 0.87 against 1.13 in headwise) and its step was no slower (2.68
      against 2.88 ms, 2.71 against 3.02, at a size bound by the host, where two timings of
      one kernel differed by 8 %), so the band takes dropout. Not measured compiled: k
      other than 256, B H M between 1024 and 8192. Compiled inference and bf16 stay on
      SDPA (`cuda/compiled/`: inference 0.63-0.95x on explicit; bf16 at B 1, n 16384,
      4.2 ms explicit against 4.1 on uncut SDPA). The explicit kernel's dropout bits add
      the seed before the 64-bit product (`dropout.dropout_bits`): the first form failed to
      compile there (torch 2.11, `cuda/compile-16384/`). Under CUDA graphs
      (`mode="reduce-overhead"`, which a trace cannot see) the band loses instead: the same
      2-layer pair took 2.6 ms explicit against 2.3 on SDPA cut, and one encoder layer at
      B 1, n 4096 1.54 against 1.29 (`cuda/bench-b1-compiled-dropout-run10/`), replays
      that leave only the GPU's work, where the explicit kernel's is the larger. The band
      follows Inductor without graphs, the mode's default; under graphs pin SDPA
      (`use_kernel("sdpa")`).

    CUDA fp64 (not measured) keeps SDPA, as do other devices.

    Args:
        device: where the call runs.
        dtype: the dtype the call computes in (`compute_dtype`).
        dropout: whether attention dropout is on (dropout_p > 0).
        backward: whether a backward pass will follow (grad enabled, an input needing it).
        causal: whether the call is exact causal attention (`is_causal`).
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
        compiled_fp32 = torch.compiler.is_compiling() and dtype == torch.float32
        if compiled_fp32 and backward and dropout and not causal and 4096 <= queries < 8192:
            return "explicit" if groups * keys <= 1024 else "sdpa"
        return "sdpa"
    if device.type != "cpu":
        return "sdpa"
    if dtype not in (torch.float32, torch.float64, torch.bfloat16):
        return "sdpa"
    if dropout:
        return "explicit"
    # fp32 and bf16 on oneDNN's micro-kernel, from 64 queries but bf16 training (asked again
    # once compiled() has built the kernels: they report what they took)
    fewest = 1 if dtype == torch.bfloat16 and backward else 64
    onednn = dtype != torch.float64 and queries >= fewest and native.kernel_gemm() == "onednn"
    if onednn and compiled() and native.kernel_gemm() == "onednn":
        return "explicit"
    if dtype == torch.bfloat16:
        mkl_fast = not precision.mkl_without_avx512()  # the explicit kernel's GEMMs are MKL's
        return "explicit" if backward and keys <= 256 and mkl_fast and compiled() else "sdpa"
    return "sdpa"


def compute_dtype(q: Tensor) -> torch.dtype:
    """The dtype an attention call with queries q computes in: autocast's where autocast is
    on for q's device and would cast q (floating, not float64: as it casts SDPA's inputs),
    else q's own."""
    if autocast_casts(q):
        return torch.get_autocast_dtype(q.device.type)
    return q.dtype


def autocast_casts(t: Tensor) -> bool:
    """Whether autocast, on for t's device, casts t to its dtype (it leaves float64 alone)."""
    return t.is_floating_point() and t.dtype != torch.float64 and autocast_on(t.device.type)


def autocast_on(device: str) -> bool:
    """Whether autocast is on for a device type (False for those it has none for: meta).
    CPU and CUDA are known to have it: torch.compile (2.11) cannot trace the availability
    check and broke the graph there, in every attention call."""
    known = device in ("cpu", "cuda")
    return (known or torch.amp.is_autocast_available(device)) and torch.is_autocast_enabled(device)
