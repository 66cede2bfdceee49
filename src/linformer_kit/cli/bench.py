"""`linformer bench`: time and memory of Linformer, exact attention and the published
Linformer packages, one attention layer and one encoder layer, across sequence lengths."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from .. import __version__
from ..bench.summary import peer_ratios
from ..bench.sweep import EMULATED, RESULT_NAME, TABLE_NAME, BenchSettings, run_bench
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
    summary = result["summary"]
    ratios = peer_ratios(summary)
    if ratios:
        lengths = sorted({n for points in ratios.values() for n, _ in points})
        entries = {
            key: {n: summary[key[0]][key[1]][key[2]][n] for n, _ in points}
            for key, points in ratios.items()
        }
        table = [
            {"scope": scope, "dtype": dtype, "variant": label}
            | {f"n={n}": "-" for n in lengths}  # (not measured at that n)
            | {f"n={n}": _ratio_cell(entry) for n, entry in by_n.items()}
            for (scope, dtype, label), by_n in entries.items()
        ]
        print("the faster peer's median time over ours (above 1: ours faster):")
        print(format_table(table))
        by_round = "speedup_vs_faster_peer_quartiles"
        if any(by_round in entry for by_n in entries.values() for entry in by_n.values()):
            print("(in brackets: the quartiles of the same ratio round by round)")
    out = Path(settings.out)
    names = (RESULT_NAME, TABLE_NAME, "scaling.png", "grid.png", "peers.png")
    print("wrote " + ", ".join(str(out / name) for name in names if (out / name).exists()))


def _ratio_cell(entry: dict) -> str:
    """`summarise`'s speed-up over the faster peer at one n, with the quartiles of its
    round-by-round ratios where there were enough rounds: "1.39x (1.33-1.45)"."""
    cell = f"{entry['speedup_vs_faster_peer']:.2f}x"
    quartiles = entry.get("speedup_vs_faster_peer_quartiles")
    return f"{cell} ({quartiles[0]:.2f}-{quartiles[1]:.2f})" if quartiles else cell


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `bench` subcommand."""
    parser = commands.add_parser(
        "bench", help="time and memory of Linformer vs exact attention (and the peers)"
    )
    add_dataclass_arguments(parser, BenchSettings)
    parser.set_defaults(func=run)
