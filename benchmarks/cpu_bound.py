"""How close to the CPU's fp32 matmul ceiling can ours' layer get? Its products at their own rates.

`linformer bench` reads a layer's model FLOPs against a square matmul it times (the probe,
about 0.1 s a call): issue 17 asks the attention layer for 85 % of it from n = 4096. A
layer's products are not that square: the linear maps' inner dimension is the width (256),
the attention kernel's GEMMs have head_dim (64) or k (256) inside, and the weight gradients
sum over all n rows into a 256 x 256 output. This runs the layer once (forward + backward,
the rule's kernels, as the bench builds it) recording every product op with its inputs
(the compiled kernels' `linformer_kit::matmul`, the attention and feed-forward kernels'
forward and backward, SDPA's CPU kernel's, ATen's `mm` / `addmm` / `bmm` / `baddbmm`), then
times each op alone on those inputs, interleaved with the probe and the whole step:

    bound = model FLOPs / (sum of the products' own times) / probe's FLOP/s

the fraction the layer would reach if nothing but its products took time, each at the rate
it runs alone (inputs warm in cache: an upper bound). `measured` is the step's fraction in
the same rounds; the rest of the step is the ops between the products (bias adds and sums,
the head split and merge, gradient accumulation). Writes OUT/bound.json and OUT/bound.png.

    PYTHONPATH=src python benchmarks/cpu_bound.py
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
from matplotlib.figure import Figure
from roofline import COMPUTE_OPS, op_name  # benchmarks/roofline.py
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm.auto import tqdm

from linformer_kit.bench.flops import Shape
from linformer_kit.bench.timing import (
    matmul_step,
    module_step,
    size_ceiling_matmul,
    time_interleaved,
)
from linformer_kit.bench.variants import SCOPES, Variant, build_variant, variant_flops
from linformer_kit.training.compare import machine
from linformer_kit.training.settings import keep_freed_memory

OUT = Path(__file__).parent / "kernels" / "cpu-bound"
COMMAND = "PYTHONPATH=src python benchmarks/cpu_bound.py"
# The ops that multiply matrices, by the name between namespace and overload: ATen's
# (`roofline.COMPUTE_OPS`), SDPA's CPU kernel where the rule takes it, and the compiled
# kernels (with what they fuse: the softmax and dropout, the feed-forward's GELU).
PRODUCTS = COMPUTE_OPS | {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "matmul", "matmul_add_", "attention_forward", "attention_backward", "feedforward_forward",
    "feedforward_backward",
}  # fmt: skip


class ProductRecorder(TorchDispatchMode):
    """Records every product op that runs, with copies of its arguments to call it again."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if op_name(str(func)) in PRODUCTS:
            copy = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
            self.calls.append(
                (func, tuple(map(copy, args)), {k: copy(v) for k, v in kwargs.items()})
            )
        return func(*args, **kwargs)


def describe(args: tuple) -> str:
    """The shapes of an op's tensor arguments, e.g. [1, 4096, 256] x [1, 256, 256]."""
    return " x ".join(str(list(a.shape)) for a in args if isinstance(a, torch.Tensor))


def products(step: Callable[[], None]) -> list[tuple[str, Callable[[], None]]]:
    """Each product op one call of `step` runs: (name and shapes, a call of it alone)."""
    recorder = ProductRecorder()
    with recorder:
        step()
    return [
        (f"{op_name(str(func))} {describe(args)}", lambda f=func, a=args, k=kwargs: f(*a, **k))
        for func, args, kwargs in recorder.calls
    ]


def bound_at(seq_len: int, args: argparse.Namespace, probe: Callable[[], None], flop: int) -> dict:
    """One row: the step, its products alone, the probe; fractions of the probe's rate."""
    shape = Shape(
        batch_size=args.batch, seq_len=seq_len, dim=args.dim, num_heads=args.num_heads,
        proj_dim=args.proj_dim, ffn_dim=4 * args.dim,
    )  # fmt: skip
    variant = Variant(name=f"linformer {args.sharing}", kind="ours", sharing=args.sharing)
    torch.manual_seed(0)
    module = build_variant(variant, shape, args.scope)
    x = torch.randn(args.batch, seq_len, args.dim, requires_grad=True)
    module.train()
    step = module_step(module, x, backward=True)
    step()
    ops = products(step)
    steps = {
        "step": step,
        "probe": probe,
        **{f"{i} {name}": call for i, (name, call) in enumerate(ops)},
    }
    times = time_interleaved(steps, warmup=1, repeats=args.repeats, device="cpu")
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    flops = variant_flops(variant, shape, args.scope, backward=True)
    probe_flop_s = flop / (ms["probe"] / 1e3)
    alone_ms = sum(ms[name] for name in steps if name not in ("step", "probe"))
    return {
        "n": seq_len,
        "step_ms": sig(ms["step"]),
        "products_alone_ms": sig(alone_ms),
        "probe_gflop_per_s": sig(probe_flop_s / 1e9),
        "model_gflop": flops / 1e9,
        "measured": sig(flops / (ms["step"] / 1e3) / probe_flop_s),
        "bound": sig(flops / (alone_ms / 1e3) / probe_flop_s),
        "products": [
            {"op": name.split(" ", 1)[1], "ms": sig(ms[name])}
            for name in steps
            if name not in ("step", "probe")
        ],
    }


def sig(value: float) -> float:
    """value to 4 significant digits, for the JSON."""
    return float(f"{value:.4g}")


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Measured fraction and the products' bound against n."""
    fig = Figure(figsize=(5.5, 3.6))
    axis = fig.subplots()
    seq_lens = [r["n"] for r in rows]
    axis.plot(seq_lens, [r["bound"] for r in rows], "o-", label="bound: products alone")
    axis.plot(seq_lens, [r["measured"] for r in rows], "s-", label="measured step")
    axis.axhline(0.85, color="gray", linestyle=":", label="issue 17's target")
    axis.set(xscale="log", xlabel="n", ylabel="fraction of the probe's FLOP/s", title=title)
    axis.set_ylim(0, 1.05)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    """Times the step, its products and the probe at each n; writes bound.json and .png."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", default="4096,8192,16384", help="comma-separated lengths")
    parser.add_argument("--scope", choices=SCOPES, default="attention")
    parser.add_argument("--sharing", default="kv")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--proj-dim", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds per n")
    parser.add_argument("--out", type=Path, default=OUT, help="writes bound.json, bound.png")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as `linformer bench` times
    size, _ = size_ceiling_matmul("float32", "cpu")
    probe = matmul_step(size, "float32", "cpu")
    given = sys.argv[1:] if argv is None else argv
    result: dict[str, Any] = {
        "command": " ".join([COMMAND, *given]),
        "machine": machine(),
        "probe_size": size,
        "scope": args.scope,
        "sharing": args.sharing,
        "rows": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for seq_len in tqdm([int(n) for n in args.n.split(",")], desc="n"):
        result["rows"].append(bound_at(seq_len, args, probe, 2 * size**3))
        row = result["rows"][-1]
        tqdm.write(f"n {seq_len}: measured {row['measured']:.3f}, bound {row['bound']:.3f}")
        (args.out / "bound.json").write_text(json.dumps(result, indent=1) + "\n")
    layer = {"attention": "attention layer", "layer": "encoder layer"}[args.scope]
    title = f"{layer} ({args.sharing}), fwd+bwd, {args.threads} threads"
    plot(result["rows"], args.out / "bound.png", title)


if __name__ == "__main__":
    main()
