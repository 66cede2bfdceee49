"""The table behind the feed-forward kernel's `all_rows` rule (`csrc/feedforward.cpp`): how
backward sums the weight gradients over the rows.

Per width (hidden = 4 x dim, GELU) and row count, one fwd+bwd of the compiled kernel with
each thread summing its blocks into its own dim x hidden copies (`thread sums`), with A and
dH kept for every row and two GEMMs over all rows (`all rows`), with the rule's choice, and
of PyTorch's three modules, timed interleaved (medians). The copies cost 2 x threads x dim
x hidden however few the rows; the kept rows 2 x rows x hidden. Writes OUT/table.json
and OUT/table.png (all rows over thread sums against rows / (threads x dim)).

    PYTHONPATH=src python benchmarks/kernels_feedforward_sums.py
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from kernels_fused import compiled_ops, write_table
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter
from tqdm.auto import tqdm

from linformer_kit.bench.timing import time_interleaved
from linformer_kit.training.compare import machine

OUT = Path(__file__).parent / "kernels" / "feedforward" / "sums"
SUMS = {"thread sums": 0, "all rows": 1, "rule": -1}  # the op's `weight_sums`


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The widths, row counts, threads and output folder of a run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", default="256,512,768,1024", help="comma-separated widths")
    parser.add_argument("--rows", default="512,1024,2048,4096", help="comma-separated")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=11, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=OUT, help="writes table.json, table.png")
    args = parser.parse_args(argv)
    args.dim = [int(part) for part in args.dim.split(",")]
    args.rows = [int(part) for part in args.rows.split(",")]
    return args


def steps(ops: object, dim: int, rows: int) -> dict[str, Callable[[], None]]:
    """One fwd+bwd per way of summing, and the modules' own, on the same weights."""
    torch.manual_seed(0)
    up, down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
    weights = [w.detach() for w in (up.weight, up.bias, down.weight, down.bias)]
    x, grad = torch.randn(rows, dim), torch.randn(rows, dim)

    def kernel(weight_sums: int) -> Callable[[], None]:
        def step() -> None:
            _, hidden = ops.feedforward_forward(x, *weights, 0, True)
            ops.feedforward_backward(
                grad, x, weights[0], weights[2], hidden, 0, [True, True], weight_sums
            )

        return step

    def modules() -> None:
        inputs = x.detach().requires_grad_()
        out = down(torch.nn.functional.gelu(up(inputs)))
        torch.autograd.grad(out, [inputs, *up.parameters(), *down.parameters()], grad)

    return {name: kernel(code) for name, code in SUMS.items()} | {"modules": modules}


def plot(rows: list[dict], path: Path) -> None:
    """All rows over thread sums against rows / (threads x dim), one line per width."""
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for dim in sorted({row["dim"] for row in rows}):
        own = [row for row in rows if row["dim"] == dim]
        ratios = [row["rows_per_thread_width"] for row in own]
        times = [row["all_rows_over_thread_sums"] for row in own]
        ax.plot(ratios, times, "o-", label=f"dim {dim}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axvline(2.0, color="grey", lw=0.8, ls="--")
    ax.set(xscale="log", xlabel="rows / (threads x dim)", ylabel="all rows / thread sums (time)")
    ticks = sorted({row["rows_per_thread_width"] for row in rows})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=7)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_title("feed-forward fwd+bwd, weight gradients (< 1: all rows faster)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    """Times every width x row count and writes the table."""
    args = parse_args(argv)
    ops = compiled_ops(args.threads)
    before, rows = machine(), []
    shapes = [(dim, count) for dim in args.dim for count in args.rows]
    for dim, count in tqdm(shapes, desc="shapes", unit="shape"):
        times = time_interleaved(
            steps(ops, dim, count), warmup=1, repeats=args.repeats, device="cpu"
        )
        ms = {name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()}
        rows.append({
            "dim": dim, "rows": count, "threads": args.threads,
            "rows_per_thread_width": round(count / (args.threads * dim), 3),
            "median_ms": ms,
            "all_rows_over_thread_sums": round(ms["all rows"] / ms["thread sums"], 3),
            "rule_over_modules": round(ms["rule"] / ms["modules"], 3),
        })  # fmt: skip
        tqdm.write(f"dim {dim} rows {count}: {ms}")
    fields = {"rows": rows}
    write_table(args.out, "kernels_feedforward_sums.py", argv, before, fields,
                lambda path: plot(rows, path))  # fmt: skip


if __name__ == "__main__":
    main()
