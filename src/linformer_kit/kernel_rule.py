"""Which attention kernel a call runs: the measured rule (`choose_kernel`), the dtype it
computes in under autocast (`compute_dtype`), and `use_kernel` to pin one over a block.

The kernels themselves are in `kernels`; the tables the rule is read from are made by
`benchmarks/kernels.py` (CPU: `benchmarks/kernels/table.json`, `bf16/table.json`; CUDA:
`benchmarks/kernels/cuda/`), never timed per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

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
      and, its softmax in bf16, less accurate (relative error 0.0051 against 0.0037);
    - inference: SDPA's flash kernel faster at all 27 (explicit 0.41-0.69x).

    With AVX2 only (`bf16/avx2-emulated/`, n 1024, k 64-1024, head_dim 64; AVX-512 and AMX
    switched off in torch, MKL and oneDNN, the kernels built for haswell) explicit is
    1.82-2.02x faster with dropout, 3.5-6.2x in training without (SDPA's bf16 backward is
    emulated there), 0.85-0.94x in inference. The rule follows the AMX machine, where bf16
    is worth using (`precision` warns against it elsewhere): at k = 1024 in training without
    dropout it keeps SDPA, which is 5.7x slower with AVX2 only.

    n and head_dim did not change the winner anywhere on CPU, and k only training without
    dropout (in the rule, only bf16's).

    CUDA: `benchmarks/kernels/cuda/table.json` and `table-mid/table.json` (H200, torch
    2.11, fp32 without TF32 and bf16, B 1 and 8, H = 4, n 1024-65536, k 64 / 256 / 1024,
    head_dim 64; the explicit kernel by PyTorch ops, one block; read as holding for any
    CUDA GPU until another is measured). A call of a few ms costs kernel launches more than
    arithmetic: the explicit kernel's (1.1-1.5 ms fwd+bwd against SDPA's 0.5) lose below
    n = 8192. SDPA's fp32 backward runs a block per 64 keys of each (batch, head), each
    over all n queries: with B x H x M small it keeps few of the 132 SMs busy and its time
    grows with n, while the explicit kernel's GEMMs use them all.

    - inference: SDPA everywhere (explicit 0.25-0.85x);
    - fp32 training: explicit from n = 8192 where B H M <= 8192 (4096 with dropout):
      1.17-2.56x without dropout, 1.01-2.35x with; above that SDPA (without dropout
      0.97-1.03x at B H M = 32768; with dropout 0.60-0.83x at 8192 and more); at n = 4096
      SDPA (explicit 0.89-1.10x without dropout, 0.59-0.79x with). The layers agree
      (`cuda/pinned-explicit/`, `cuda/bench-b1`, `bench-b8`: ours on each kernel). The
      price is memory: the explicit kernel keeps the N x M weights for backward, so from
      n = 8192 the attention layer's peak was 1.9-2.2x (B 1) and 2.5-2.6x (B 8) that on
      SDPA, the encoder layer's 1.16-1.19x; `use_kernel("sdpa")` keeps the low-memory path;
    - bf16: SDPA. The explicit kernel was faster in the table only at n = 65536 with
      B H M <= 1024 (1.37-1.43x without dropout; 1.19x with, at k 64), but not in the
      layers (0.93x / 1.04x at n 65536, `cuda/bench-b1`), and its bf16 softmax was the less
      accurate one on CPU;
    - exact causal attention (`cuda/table-causal/`, fp32 and bf16, B 1 and 8, n 1024-8192):
      SDPA, explicit 0.05-0.71x;
    - fp16 (`cuda/table-fp16/`, n 4096-65536): SDPA. As in bf16, explicit won only in
      training at n = 65536 with B H M <= 1024 (1.23-1.44x), lost everywhere else
      (0.11-0.92x);
    - under torch.compile (`cuda/compiled/`: a 2-layer encoder, k 256, H 4, compiled on
      each kernel; Inductor fuses the explicit kernel's softmax, mask and dropout bits),
      fp32 training: explicit from n = 4096 where B H M <= 8192, with or without dropout.
      It won at all six measured shapes (B 1 and 8, n 4096-65536): 1.51-1.94x at
      n >= 16384, B 1, where the eager rule takes it too, and 1.06-1.13x where the eager
      rule keeps SDPA (n 4096; B 8 with dropout), at 1.46x the compiled step's peak
      memory on SDPA (B 8, n 16384, `cuda/compiled/memory/`). Not measured compiled: B 8
      at n 4096 with dropout (eager explicit 0.59-0.79x there), n 8192, k other than 256.
      Inference and bf16 stay with SDPA (compiled inference 0.63-0.95x on explicit; bf16
      as eager: in the one compiled bf16 pair, `cuda/compiled/bf16/`, the explicit run had
      18 graph breaks, since fixed, so it does not count). The bits add the seed before the
      64-bit product (`dropout.dropout_bits`): the first form failed to compile there
      (torch 2.11, `cuda/compile-16384/`).

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
        if not backward or causal or dtype != torch.float32:
            return "sdpa"
        if torch.compiler.is_compiling():
            return "explicit" if queries >= 4096 and groups * keys <= 8192 else "sdpa"
        up_to = 4096 if dropout else 8192
        return "explicit" if queries >= 8192 and groups * keys <= up_to else "sdpa"
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
