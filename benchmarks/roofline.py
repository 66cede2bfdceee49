"""How close to the matmul ceiling can the GPU's eager op sequence get? Bytes against FLOPs.

`linformer bench` reads each layer's model FLOPs against the matmul rate it measured (the
issue's "50 % of the bf16 ceiling" is such a fraction). The GEMMs are only part of a step:
norms, activations, residual adds, autocast's casts and gradient sums each read and write
whole activations. This counts those bytes for ours (the GPU's op sequence: `F.linear`,
SDPA uncut, PyTorch's GELU, LayerNorm and dropout; traced on fake CPU tensors, so any size
costs no memory and no time) and bounds the fraction any implementation of that sequence
can reach: the GEMMs (and SDPA) at the measured ceiling, every other op at the memory's
bandwidth, one after the other (unfused ops do not overlap):

    bound = (FLOPs / ceiling) / (FLOPs / ceiling + other bytes / bandwidth)

An op's bytes are its tensor inputs and outputs, each read or written once from memory
(views are free): right where activations outgrow the caches, as at the bench's long n.
With `--bench PATH` (a `bench.json` of a GPU run) the ceiling and FLOPs of each n come from
it, and the measured fraction is put beside the bound. Writes OUT/roofline.json.

    PYTHONPATH=src python benchmarks/roofline.py \\
        --bench benchmarks/kernels/cuda/bench-b8-run6/bench.json --batch 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from linformer_kit.bench.flops import Shape
from linformer_kit.bench.variants import SCOPES, Variant, build_variant, variant_flops
from linformer_kit.kernel_rule import use_kernel
from linformer_kit.linear_backend import use_linear_backend
from linformer_kit.native import kernels_off

OUT = Path(__file__).parent / "kernels" / "roofline"
COMMAND = "PYTHONPATH=src python benchmarks/roofline.py"
H200_BANDWIDTH_GBS = 4800.0  # HBM3e, NVIDIA's figure
# Ops bounded by their arithmetic, not their bytes: dense products and fused attention.
COMPUTE_OPS = {"mm", "addmm", "bmm", "baddbmm"}
# Ops that move no data (views, allocations), by the name between namespace and overload;
# and the `prim` namespace (metadata queries of fake tensors).
FREE_OPS = {
    "view", "_unsafe_view", "_reshape_alias", "reshape", "transpose", "t", "permute",
    "detach", "alias", "expand", "unsqueeze", "squeeze", "slice", "select", "as_strided",
    "split", "split_with_sizes", "unbind", "empty", "empty_like", "empty_strided",
    "new_empty", "new_empty_strided", "lift_fresh",
}  # fmt: skip


def op_name(name: str) -> str:
    """An op's name without namespace and overload: `aten.addmm.default` -> `addmm`."""
    return name.split(".")[1]


def is_compute(name: str) -> bool:
    """Whether the op (`aten.mm.default`) is a product or fused attention."""
    return op_name(name) in COMPUTE_OPS or "scaled_dot_product" in op_name(name)


def tensor_bytes(values: Any) -> int:
    """Bytes of every tensor in `values` (tensors, and lists or tuples of them)."""
    if isinstance(values, torch.Tensor):
        return values.numel() * values.element_size()
    if isinstance(values, (list, tuple)):
        return sum(tensor_bytes(v) for v in values)
    return 0


class ByteCounter(TorchDispatchMode):
    """Each op's calls and bytes read and written (inputs and outputs), views free."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if not name.startswith("prim.") and op_name(name) not in FREE_OPS:
            entry = self.ops[name]
            entry[0] += 1
            entry[1] += tensor_bytes(list(args)) + tensor_bytes(list((kwargs or {}).values()))
            entry[1] += tensor_bytes(out)
        return out


def count_bytes(run: Callable[[], None]) -> dict[str, list[int]]:
    """The ops `run` dispatches, as {name: [calls, bytes]}."""
    with ByteCounter() as counter:
        run()
    return dict(counter.ops)


def layer_step_bytes(scope: str, shape: Shape, dtype: str, sharing: str) -> dict[str, list[int]]:
    """The ops of one forward + backward of ours (the GPU's op sequence) on fake tensors."""
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if dtype == "bfloat16"
        else contextlib.nullcontext()
    )
    # our CPU kernels off: the PyTorch ops a GPU runs
    with kernels_off(), FakeTensorMode(), use_linear_backend("blas"), use_kernel("sdpa"):
        module = build_variant(Variant(name=sharing, kind="ours", sharing=sharing), shape, scope)
        module.train()
        x = torch.randn(shape.batch_size, shape.seq_len, shape.dim, requires_grad=True)
        grad = torch.randn(shape.batch_size, shape.seq_len, shape.dim)

        def step() -> None:
            with autocast:
                out = module(x)
            (out[0] if isinstance(out, tuple) else out).backward(grad)

        return count_bytes(step)


def bound(
    ops: dict[str, list[int]], gflop: float, ceiling_gflops: float, bandwidth_gbs: float
) -> dict[str, Any]:
    """The counted bytes and the ceiling fraction the op sequence can reach at most."""
    compute_bytes = sum(b for name, (_, b) in ops.items() if is_compute(name))
    other_bytes = sum(b for _, b in ops.values()) - compute_bytes
    compute_ms = gflop / ceiling_gflops * 1e3
    memory_ms = other_bytes / 1e9 / bandwidth_gbs * 1e3
    return {
        "gflop": gflop,
        "compute_gb": compute_bytes / 1e9,
        "other_gb": other_bytes / 1e9,
        "compute_ms_at_ceiling": compute_ms,
        "other_ms_at_bandwidth": memory_ms,
        "bound_fraction": compute_ms / (compute_ms + memory_ms),
        "top_ops": [
            {"name": n, "calls": c, "gb": b / 1e9}
            for n, (c, b) in sorted(ops.items(), key=lambda item: -item[1][1])[:12]
        ],
    }


def main(argv: list[str] | None = None) -> None:
    """Counts, bounds, prints and writes roofline.json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", type=Path, help="a GPU bench.json: ceilings, FLOPs, times")
    parser.add_argument("--scope", choices=SCOPES, default="layer")
    parser.add_argument("--sharing", default="kv")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n", default="16384,32768,65536", help="comma-separated")
    parser.add_argument("--dim", type=int, default=256, help="model width (4 heads)")
    parser.add_argument("--k", type=int, default=256, help="projected length")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--ceiling-gflops", type=float, help="without --bench: the matmul rate")
    parser.add_argument("--bandwidth-gbs", type=float, default=H200_BANDWIDTH_GBS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if (args.bench is None) == (args.ceiling_gflops is None):
        parser.error("give --bench or --ceiling-gflops (exactly one)")
    bench = json.loads(args.bench.read_text()) if args.bench else None
    rows = []
    for n in [int(v) for v in args.n.split(",")]:
        shape = Shape(
            batch_size=args.batch,
            seq_len=n,
            dim=args.dim,
            num_heads=4,
            proj_dim=args.k,
            ffn_dim=4 * args.dim,
        )
        if bench:
            ceiling = bench["ceiling_gflop_per_s"][str(n)][args.dtype]
            measured = next(
                r for r in bench["rows"]
                if r["scope"] == args.scope and r["dtype"] == args.dtype and r["n"] == n
                and r["variant"] == f"linformer {args.sharing}"
            )  # fmt: skip
            gflop = measured["gflop"]
        else:
            ceiling, measured = args.ceiling_gflops, None
            variant = Variant(name=args.sharing, kind="ours", sharing=args.sharing)
            gflop = variant_flops(variant, shape, args.scope, backward=True) / 1e9
        ops = layer_step_bytes(args.scope, shape, args.dtype, args.sharing)
        row = {"n": n, "batch": args.batch, "ceiling_gflops": ceiling}
        row |= bound(ops, gflop, ceiling, args.bandwidth_gbs)
        if measured:
            row |= {"measured_ms": measured["median_ms"],
                    "measured_fraction": measured["ceiling_fraction"]}  # fmt: skip
        rows.append(row)
        print(
            f"n {n}: {row['gflop']:.0f} GFLOP, {row['other_gb']:.2f} GB outside the GEMMs "
            f"({row['compute_gb']:.2f} in them): {row['compute_ms_at_ceiling']:.2f} ms at the "
            f"ceiling + {row['other_ms_at_bandwidth']:.2f} at {args.bandwidth_gbs:.0f} GB/s, "
            f"bound {row['bound_fraction']:.0%}"
            + (f", measured {row['measured_fraction']:.0%}" if measured else ""),
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join([COMMAND, *(sys.argv[1:] if argv is None else argv)]),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "model": "each op reads its inputs and writes its outputs once; GEMMs and SDPA at the "
        "ceiling, the rest at the bandwidth, not overlapped",
        "rows": rows,
    }
    (args.out / "roofline.json").write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out / "roofline.json")


if __name__ == "__main__":
    main()
