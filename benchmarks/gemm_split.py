"""The table behind `split_reduction` (`csrc/blas.h`): a float product on oneDNN's
micro-kernel with its reduction split between the threads, against its output tiled.

Products: per output (m x n), reduction k and layout of A (transposed, as a weight gradient
X^T dY reads it, or not), `matmul` with the split allowed and with it switched off
(`split_reduction(False)`), in alternating order, the caches flushed before each call (as
the layers' operands come: from memory, not from the last call); medians. Where the rule
does not split (A as is, k under 8x the longer side) both ways run the same code: those
rows show the measurement's noise. Layers: one
attention layer and one encoder layer (kv, dim 256, 4 heads, k 256, fwd+bwd, as `linformer
bench` builds them) at each `--n`, both ways, timed interleaved. Writes OUT/table.json and
OUT/table.png (the split's speedup against k / max(m, n)).

    PYTHONPATH=src python benchmarks/gemm_split.py
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from kernels_fused import compiled_ops, write_table
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from linformer_kit.bench.flops import Shape
from linformer_kit.bench.timing import module_step, time_interleaved
from linformer_kit.bench.variants import Variant, build_variant
from linformer_kit.linear_backend import use_linear_backend
from linformer_kit.training import keep_freed_memory
from linformer_kit.training.compare import machine

OUT = Path(__file__).parent / "kernels" / "amd-epyc" / "gemm-split"
WAYS = ("split", "tiles")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Outputs, reductions, sequence lengths, threads, repeats and output folder of a run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outputs", default="64x256,256x256,256x1024,512x512", help="m x n")
    parser.add_argument("--k", default="512,1024,2048,4096,16384", help="comma-separated")
    parser.add_argument("--n", default="2048,4096,16384", help="layers' lengths ('' for none)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=15, help="calls per way and product")
    parser.add_argument("--min-seconds", type=float, default=15.0, help="per layer and n")
    parser.add_argument("--out", type=Path, default=OUT, help="writes table.json, table.png")
    args = parser.parse_args(argv)
    args.outputs = [tuple(map(int, part.split("x"))) for part in args.outputs.split(",")]
    args.k = [int(part) for part in args.k.split(",")]
    args.n = [int(part) for part in args.n.split(",") if part]
    return args


def splitting(ops: object, allowed: bool, step: Callable[[], None]) -> Callable[[], None]:
    """The step with the split allowed or not (restored to allowed after it)."""

    def run() -> None:
        ops.split_reduction(allowed)
        try:
            step()
        finally:
            ops.split_reduction(True)

    return run


def time_product(ops: object, m: int, n: int, k: int, trans_a: bool, repeats: int) -> dict:
    """Median ms of (m x k) @ (k x n) both ways, the caches flushed before every call."""
    a = torch.randn(1, k, m).mT if trans_a else torch.randn(1, m, k)
    b, flush = torch.randn(1, k, n), torch.empty(16 << 20)
    steps = {way: splitting(ops, way == "split", lambda: ops.matmul(a, b)) for way in WAYS}
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for call in range(repeats + 1):
        for way in WAYS if call % 2 else WAYS[::-1]:
            flush.fill_(float(call))
            begin = time.perf_counter()
            steps[way]()
            if call:  # (the first call of each: warm-up)
                times[way].append(time.perf_counter() - begin)
    return {way: round(statistics.median(t) * 1e3, 4) for way, t in times.items()}


def layer_steps(ops: object, n: int) -> dict[str, Callable[[], None]]:
    """Each scope's fwd+bwd step at length n, both ways."""
    shape = Shape(batch_size=1, seq_len=n, dim=256, num_heads=4, proj_dim=min(256, n), ffn_dim=1024)
    steps = {}
    for scope in ("attention", "layer"):
        torch.manual_seed(0)
        module = build_variant(Variant(name="kv", kind="ours", sharing="kv"), shape, scope)
        x = torch.randn(1, n, 256, requires_grad=True)
        step = module_step(module.train(), x, backward=True)
        for way in WAYS:
            steps[f"{scope}, {way}"] = splitting(ops, way == "split", step)
    return steps


def plot(rows: list[dict], path: Path) -> None:
    """The split's speedup against k / max(m, n), one line per output and layout of A."""
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for (m, n, trans_a), own in itertools.groupby(rows, lambda r: (r["m"], r["n"], r["trans_a"])):
        own = list(own)
        ratios = [row["k"] / max(m, n) for row in own]
        ax.plot(ratios, [row["split_speedup"] for row in own], "o-" if trans_a else "x:",
                label=f"{m} x {n}, A {'transposed' if trans_a else 'as is'}")  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axvline(8.0, color="grey", lw=0.8, ls="--")
    ax.set(xscale="log", xlabel="k / max(m, n)", ylabel="tiles' time / split's (> 1: split faster)")
    ax.set_title("float product on oneDNN's micro-kernel, caches flushed", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    """Times the products and the layers both ways and writes the table."""
    args = parse_args(argv)
    ops = compiled_ops(args.threads)
    keep_freed_memory()
    before, products, layers = machine(), [], []
    with use_linear_backend("onednn"):  # (the split is the micro-kernel's)
        shapes = list(itertools.product(args.outputs, [True, False], args.k))
        for (m, n), trans_a, k in tqdm(shapes, desc="products", unit="product"):
            ms = time_product(ops, m, n, k, trans_a, args.repeats)
            speedup = round(ms["tiles"] / ms["split"], 3)
            products.append({"m": m, "n": n, "k": k, "trans_a": trans_a, "median_ms": ms,
                             "split_speedup": speedup})  # fmt: skip
            tqdm.write(f"({m}, {n}, {k}) A {'T' if trans_a else 'N'}: {ms} -> {speedup}x")
        for n in args.n:
            times = time_interleaved(layer_steps(ops, n), warmup=1, repeats=5, device="cpu",
                                     min_seconds=args.min_seconds)  # fmt: skip
            ms = {name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()}
            speedup = {scope: round(ms[f"{scope}, tiles"] / ms[f"{scope}, split"], 3)
                       for scope in ("attention", "layer")}  # fmt: skip
            layers.append({"n": n, "median_ms": ms, "split_speedup": speedup})
            print(f"n {n}: {ms} -> {speedup}")
    fields = {"threads": args.threads, "products": products, "layers": layers}
    write_table(args.out, "gemm_split.py", argv, before, fields, lambda path: plot(products, path))


if __name__ == "__main__":
    main()
