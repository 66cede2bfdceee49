"""`linformer demo`: the main job. Pretrain Linformer and an exact Transformer of identical
size and budget on the Python standard library, as masked and as causal LMs, then compare."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from .. import __version__
from ..training.compare import (
    OBJECTIVE_NAMES,
    PLOT_NAME,
    RESULT_NAME,
    ComparisonSettings,
    run_comparison,
)
from .common import add_dataclass_arguments, dataclass_from_args, format_table
from .overrides import exit_on_user_error


@exit_on_user_error
def run(args: argparse.Namespace) -> None:
    """`linformer demo`: trains both models, prints and writes their comparison."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = dataclass_from_args(ComparisonSettings, args)
    threads = settings.threads or torch.get_num_threads()
    print(f"linformer-kit {__version__}, torch {torch.__version__}, {threads} threads")
    objectives = " and ".join(OBJECTIVE_NAMES[o] for o in settings.objective_list)
    print(
        f"{objectives} pretraining on {settings.data}: {settings.steps} steps of "
        f"{settings.batch_size} x {settings.seq_len} tokens per model, same data, order and seed"
    )
    comparison = run_comparison(settings)
    print(format_table([{k: v for k, v in r.items() if k != "run"} for r in comparison["rows"]]))
    for objective, pair in comparison["pairs"].items():
        print(
            f"{OBJECTIVE_NAMES[objective]}: Linformer / Transformer validation perplexity "
            f"{pair['ppl_ratio']:.3f}; Linformer is {pair['speedup_per_step']:.2f}x the speed "
            "per training step"
        )
    output = Path(settings.output_dir)
    print(f"wrote {output / RESULT_NAME}, {output / PLOT_NAME} and every run's checkpoints")
    if settings.publish_dir:
        print(f"copied the table and plot to {settings.publish_dir}")


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `demo` subcommand."""
    parser = commands.add_parser(
        "demo",
        help="pretrain Linformer and an exact Transformer (masked and causal LMs) on the stdlib "
        "and compare them",
    )
    add_dataclass_arguments(parser, ComparisonSettings)
    parser.set_defaults(func=run)
