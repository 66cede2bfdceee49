"""The compiled attention kernel against its own GEMMs: how far below its GEMMs' rate it runs.

`linformer bench` reads the attention layer against a large square matmul (the probe). The
fused CPU attention kernel (`csrc/attention.cpp`) multiplies blocks instead: per block of
`--block-rows` query rows, products with head_dim (64) or the block's rows inside, each a
one-thread BLAS call in a parallel loop. This times, interleaved, at one thread and at
`--threads`: the kernel's forward and backward (training, `--dropout`, `--dtype`) on each
library its GEMMs can take (`native.set_kernel_gemm`: "blas", MKL in torch's wheel, and
"onednn", oneDNN's brgemm micro-kernel; in bfloat16 MKL's bf16 GEMM against the GEMMs off
MKL, `csrc/blas.h`), and at one thread `torch.mm` at the block's three shapes (scores
Q K^T, output P V, the keys' gradient Q^T dS) and the probe. It reports each one's GFLOP/s
per thread: the kernel's rate against its block products' own says what a faster loop
around the GEMMs could still gain, the products' rate against the probe's what only
faster GEMMs could. Writes OUT/rate.json.

    PYTHONPATH=src python benchmarks/kernel_gemm_rate.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from linformer_kit import native
from linformer_kit.bench.timing import matmul_step, size_ceiling_matmul, time_interleaved
from linformer_kit.dropout import rescaling, threshold
from linformer_kit.training.compare import machine

OUT = Path(__file__).parent / "kernels" / "gemm-rate"
COMMAND = "PYTHONPATH=src python benchmarks/kernel_gemm_rate.py"
LIBRARIES = ("blas", "onednn")


def kernel_steps(args: argparse.Namespace, ops: Any) -> dict[str, tuple[Callable, float]]:
    """The kernel's forward and backward on each library: name -> (call, FLOPs)."""
    b, h, n, m, d = args.batch, args.num_heads, args.n, args.proj_dim, args.head_dim
    dtype = getattr(torch, args.dtype)
    q, grad = (torch.randn(b, n, h, d, dtype=dtype).transpose(1, 2) for _ in range(2))  # views
    k, v = (torch.randn(b, m, h, d, dtype=dtype).transpose(1, 2) for _ in range(2))
    seed = torch.tensor(7, dtype=torch.int64)
    p = args.dropout
    common = (False, d**-0.5, seed, threshold(p), rescaling(p), args.block_rows)
    _, lse = ops.attention_forward(q, k, v, None, *common)
    product = 2 * b * h * n * m * d  # one of the kernel's GEMMs over all blocks

    def on(library: str, call: Callable[[], Any]) -> Callable[[], None]:
        def step() -> None:
            native.set_kernel_gemm(library)
            call()

        return step

    forward = lambda: ops.attention_forward(q, k, v, None, *common)  # noqa: E731
    backward = lambda: ops.attention_backward(  # noqa: E731
        grad, q, k, v, None, lse, *common, [True, True, True]
    )
    steps = {}
    for library in LIBRARIES:
        steps[f"kernel forward [{library}]"] = (on(library, forward), 2 * product)
        steps[f"kernel backward [{library}]"] = (on(library, backward), 5 * product)
    return steps


def block_steps(args: argparse.Namespace) -> dict[str, tuple[Callable, float]]:
    """`torch.mm` at one block's shapes (rows x keys x head_dim): name -> (call, FLOPs)."""
    rows, m, d, dtype = args.block_rows, args.proj_dim, args.head_dim, getattr(torch, args.dtype)
    q, kt, weights, v = (
        torch.randn(*size, dtype=dtype) for size in ((rows, d), (d, m), (rows, m), (m, d))
    )
    scores, out = torch.empty(rows, m, dtype=dtype), torch.empty(rows, d, dtype=dtype)
    sums = torch.zeros(d, m, dtype=dtype)
    flops = 2 * rows * m * d
    return {
        "mm Q K^T": (lambda: torch.mm(q, kt, out=scores), flops),
        "mm P V": (lambda: torch.mm(weights, v, out=out), flops),
        "mm Q^T dS": (lambda: sums.addmm_(q.t(), weights), flops),
    }


def rates(steps: dict[str, tuple[Callable, float]], threads: int, repeats: int) -> dict:
    """Median ms and GFLOP/s per thread of each step, timed interleaved at `threads`."""
    torch.set_num_threads(threads)
    times = time_interleaved(
        {name: call for name, (call, _) in steps.items()}, warmup=1, repeats=repeats, device="cpu"
    )
    out = {}
    for name, (_, flops) in steps.items():
        ms = statistics.median(times[name]) * 1e3
        out[name] = {
            "ms": float(f"{ms:.4g}"),
            "gflop_per_s_per_thread": float(f"{flops / ms / 1e6 / threads:.4g}"),
        }
    return out


def taken() -> dict[str, str]:
    """The library each setting of `LIBRARIES` gives here (a libtorch without oneDNN's float
    micro-kernel keeps the BLAS: both rows then time the same)."""
    out = {}
    for library in LIBRARIES:
        native.set_kernel_gemm(library)
        out[library] = native.kernel_gemm()
    return out


def main(argv: list[str] | None = None) -> None:
    """Times the kernel at one thread and `--threads`, its block GEMMs and the probe at one."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1024, help="query rows")
    parser.add_argument("--proj-dim", type=int, default=256, help="keys (k)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--block-rows", type=int, default=256, help="the kernel's, 256")
    parser.add_argument("--dropout", type=float, default=0.0, help="on the weights, training")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds")
    parser.add_argument("--out", type=Path, default=OUT, help="writes rate.json")
    args = parser.parse_args(argv)
    ops = native.cpu_ops()
    if ops is None:
        raise SystemExit("the CPU kernels are not built here (LINFORMER_KIT_NATIVE=0?)")
    before, threads = native.set_kernel_gemm(None), torch.get_num_threads()
    size, _ = size_ceiling_matmul("float32", "cpu")
    kernel = kernel_steps(args, ops)
    one_thread = {
        **kernel,
        **block_steps(args),
        "probe": (matmul_step(size, "float32", "cpu"), 2 * size**3),
    }
    try:
        result: dict[str, Any] = {
            "command": " ".join([COMMAND, *(sys.argv[1:] if argv is None else argv)]),
            "machine": machine(),
            "machine_library": native.kernel_gemm(),
            "libraries_taken": taken(),
            "probe_size": size,
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "threads_1": rates(one_thread, 1, args.repeats),
            f"threads_{args.threads}": rates(kernel, args.threads, args.repeats),
        }
    finally:
        native.set_kernel_gemm(before)
        torch.set_num_threads(threads)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rate.json").write_text(json.dumps(result, indent=1) + "\n")
    for key in ("threads_1", f"threads_{args.threads}"):
        for name, row in result[key].items():
            print(
                f"{key:10s} {name:28s} {row['ms']:9.4f} ms "
                f"{row['gflop_per_s_per_thread']:7.2f} GFLOP/s a thread"
            )


if __name__ == "__main__":
    main()
