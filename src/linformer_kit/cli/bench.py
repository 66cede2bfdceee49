"""`linformer bench`: time and memory of Linformer, exact attention and the published
Linformer packages, one attention layer and one encoder layer, across sequence lengths."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from .. import __version__
from ..bench.settings import BenchSettings
from ..bench.summary import peer_ratios
from ..bench.sweep import EMULATED, PLOT_NAMES, RESULT_NAME, TABLE_NAME, run_bench
from .common import add_dataclass_arguments, dataclass_from_args, format_table
from .overrides import exit_on_user_error

COLUMNS = (
    "scope",
    "dtype",
    "variant",
    "n",
    "k",
    "median_ms",
    "gflop_per_s",
    "ceiling_fraction",
    "ceiling_fraction_best",
    "peak_mem_mb",
    "speedup_vs_sdpa",
    "reason",
)


@exit_on_user_error
def run(args: argparse.Namespace) -> None:
    """`linformer bench`: runs the efficiency sweep, prints its table, writes JSON and plots."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = dataclass_from_args(BenchSettings, args)
    print(
        f"linformer-kit {__version__}, torch {torch.__version__}, {settings.device}, "
        f"{settings.threads or torch.get_num_threads()} threads, {settings.mode}, {settings.dtype}"
    )
    result = run_bench(settings)
    print(format_table([{c: row.get(c) for c in COLUMNS} for row in result["rows"]]))
    ceilings = ", ".join(
        f"n={n}: " + " / ".join(f"{v:.0f}" for v in c.values())
        for n, c in result["ceiling_gflop_per_s"].items()
    )
    dtypes = " / ".join(result["ceiling_matmul_size"])
    print(f"matmul ceiling {dtypes} GFLOP/s per timing run: {ceilings}")
    emulated = [row for row in result["rows"] if row["status"] == EMULATED]
    if emulated:
        print(f"bfloat16 rows marked {EMULATED!r} are {emulated[0]['reason']}")
    ratios = peer_ratios(result["summary"])
    if ratios:
        lengths = sorted({n for points in ratios.values() for n, _, _ in points})
        table = [
            {"scope": scope, "dtype": dtype, "variant": label}
            | {f"n={n}": "-" for n in lengths}  # (not measured at that n)
            | {f"n={n}": _ratio_cell(ratio, quartiles) for n, ratio, quartiles in points}
            for (scope, dtype, label), points in ratios.items()
        ]
        print("the faster peer's median time over ours (above 1: ours faster):")
        print(format_table(table))
        if any(quartiles for points in ratios.values() for _, _, quartiles in points):
            print("(in brackets: the quartiles of the same ratio round by round)")
    out = Path(settings.out)
    names = (RESULT_NAME, TABLE_NAME, *PLOT_NAMES)
    print("wrote " + ", ".join(str(out / name) for name in names if (out / name).exists()))


def _ratio_cell(ratio: float, quartiles: list[float] | None) -> str:
    """A speed-up over the faster peer, with the quartiles of its round-by-round ratios
    where the run had enough rounds: "1.39x (1.33-1.45)"."""
    cell = f"{ratio:.2f}x"
    return f"{cell} ({quartiles[0]:.2f}-{quartiles[1]:.2f})" if quartiles else cell


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `bench` subcommand."""
    parser = commands.add_parser(
        "bench", help="time and memory of Linformer vs exact attention (and the peers)"
    )
    add_dataclass_arguments(parser, BenchSettings)
    parser.set_defaults(func=run)
