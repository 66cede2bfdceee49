"""The tables behind `kernel_rule.choose_splits` and `choose_reduction_splits`: SDPA's
training step with its queries cut into chunks (`kernels.sdpa`), against one call and
against the explicit kernel, whose backward's key and value gradients are cut too.

One attention call (H = 4, head_dim 64) at each dtype x batch x n x k, fwd+bwd with and
without attention dropout 0.1: SDPA uncut and cut into 2, 4, ... `--max-splits` chunks
(of at least 64 queries), and the explicit kernel with its backward's sums over the
queries cut as the rule says and into 1, 4, 16 and 64 chunks (`--reduction-splits`), all
timed interleaved per shape (medians). A GPU's SDPA backward has one thread block per
(batch, head, block of keys), and cuBLAS gives the explicit kernel's dK = dS^T Q and
dV = P^T dO few blocks too: with Linformer's few keys, chunks of queries as more batch
entries fill its SMs. Writes OUT/table.json and OUT/table.png (the best cut's speed-up
over one call).

    PYTHONPATH=src python benchmarks/kernels_split.py --device cuda
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from kernels import make_step  # benchmarks/kernels.py: the call as `attend` makes it
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from linformer_kit.bench.timing import time_interleaved
from linformer_kit.kernel_rule import choose_reduction_splits, use_reduction_splits
from linformer_kit.training.compare import machine

MODES = ("train dropout 0.1", "train")
OUT = Path(__file__).parent / "kernels" / "cuda" / "split"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The device, shapes and output folder of a run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma-separated")
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--n", default="1024,4096,16384,65536", help="comma-separated n")
    parser.add_argument("--k", default="64,256,1024", help="comma-separated k")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--max-splits", type=int, default=64, help="most chunks tried")
    parser.add_argument(
        "--reduction-splits", default="1,4,16,64", help="the explicit kernel's cuts tried"
    )
    parser.add_argument("--min-seconds", type=float, default=0.3, help="timing per shape")
    parser.add_argument("--out", type=Path, default=OUT, help="writes table.json, table.png")
    args = parser.parse_args(argv)
    for name in ("batch", "n", "k", "reduction_splits"):
        setattr(args, name, [int(part) for part in getattr(args, name).split(",")])
    args.dtype = args.dtype.split(",")
    return args


def time_shape(
    shape: tuple[int, int, int, int], mode: str, args: argparse.Namespace, dtype: str
) -> dict:
    """One row: ms per call of each cut and of the explicit kernel, the best cut."""
    n = shape[1]
    counts = [2**i for i in range(int(math.log2(args.max_splits)) + 1) if n // 2**i >= 64]
    like = (args.device, getattr(torch, dtype))
    steps = {f"sdpa/{s}": make_step(shape, mode, "sdpa", *like, splits=s) for s in counts}
    steps["explicit"] = make_step(shape, mode, "explicit", *like)
    batch, n, k, head_dim = shape
    rule = choose_reduction_splits(
        device=torch.device(args.device), dtype=like[1], rows=n, groups=4 * batch, keys=k,
        head_dim=head_dim,
    )  # fmt: skip
    cuts = [s for s in args.reduction_splits if n % s == 0]
    for s in cuts:
        steps[f"explicit/{s}"] = pinned(make_step(shape, mode, "explicit", *like), s)
    for step in steps.values():
        step()
    times = time_interleaved(
        steps, warmup=1, repeats=5, device=args.device, min_seconds=args.min_seconds
    )
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    best = min(counts, key=lambda s: ms[f"sdpa/{s}"])
    return {
        "mode": mode, "dtype": dtype, "batch": batch, "n": n, "k": k, "head_dim": shape[3],
        "sdpa_ms": {s: float(f"{ms[f'sdpa/{s}']:.4g}") for s in counts},
        "explicit_ms": float(f"{ms['explicit']:.4g}"),
        "explicit_splits": rule,
        "explicit_cut_ms": {s: float(f"{ms[f'explicit/{s}']:.4g}") for s in cuts},
        "best_splits": best,
        "best_speedup": round(ms["sdpa/1"] / ms[f"sdpa/{best}"], 3),
        "best_vs_explicit": round(ms["explicit"] / ms[f"sdpa/{best}"], 3),
    }  # fmt: skip


def pinned(step: Callable[[], None], splits: int) -> Callable[[], None]:
    """The step with the explicit kernel's backward cut into `splits` chunks."""

    def run() -> None:
        with use_reduction_splits(splits):
            step()

    return run


def plot(rows: list[dict], path: Path) -> None:
    """The best cut's speed-up over one SDPA call (and the cut) per (dtype, batch, mode)."""
    panels = sorted({(r["dtype"], r["batch"], r["mode"]) for r in rows})
    seq_lens, proj_dims = sorted({r["n"] for r in rows}), sorted({r["k"] for r in rows})
    fig = Figure(figsize=(4.2 * 2, 3.2 * math.ceil(len(panels) / 2)))
    axes = fig.subplots(math.ceil(len(panels) / 2), 2, squeeze=False).ravel()
    for axis, (dtype, batch, mode) in zip(axes, panels):
        cells = {
            (r["k"], r["n"]): r
            for r in rows
            if (r["dtype"], r["batch"], r["mode"]) == (dtype, batch, mode)
        }
        values = [
            [cells[(k, n)]["best_speedup"] if (k, n) in cells else math.nan for n in seq_lens]
            for k in proj_dims
        ]
        axis.imshow(values, cmap="RdYlGn", vmin=0.5, vmax=2.5, aspect="auto")
        for (i, k), (j, n) in itertools.product(enumerate(proj_dims), enumerate(seq_lens)):
            if (k, n) in cells:
                cell = cells[(k, n)]
                axis.text(
                    j,
                    i,
                    f"{cell['best_speedup']:.2f}\n/{cell['best_splits']}",
                    ha="center",
                    va="center",
                    fontsize=7,
                )
        axis.set_xticks(range(len(seq_lens)), [str(n) for n in seq_lens], fontsize=7)
        axis.set_yticks(range(len(proj_dims)), [f"k={k}" for k in proj_dims], fontsize=7)
        axis.set(title=f"{dtype}, B={batch}, {mode}:\nuncut / best cut (/chunks)", xlabel="n")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    """Times every shape, writes the table after each and the plot at the end."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else argv
    command = "PYTHONPATH=src python benchmarks/kernels_split.py " + " ".join(given)
    before, rows = machine(), []
    grid = list(itertools.product(args.dtype, args.batch, args.n, args.k, MODES))
    for dtype, batch, n, k, mode in tqdm(grid, desc="shapes"):
        torch.manual_seed(0)
        rows.append(time_shape((batch, n, k, args.head_dim), mode, args, dtype))
        tqdm.write(json.dumps(rows[-1]))
        result = {"command": command, "machine": before, "device": args.device, "rows": rows}
        (args.out / "table.json").write_text(json.dumps(result, indent=1) + "\n")
        if args.device == "cuda":
            torch.cuda.empty_cache()
    plot(rows, args.out / "table.png")


if __name__ == "__main__":
    main()
