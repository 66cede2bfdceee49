"""`linformer demo`: a few training steps of Linformer vs exact attention on random tokens."""

from __future__ import annotations

import argparse

import torch

from .. import __version__
from ..bench.compare import StepComparison, compare_training_steps
from .common import add_dataclass_arguments, dataclass_from_args, format_table


def run(args: argparse.Namespace) -> None:
    settings = dataclass_from_args(StepComparison, args)
    print(
        f"linformer-kit {__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"masked-LM training on random tokens: batch {settings.batch_size} x "
        f"{settings.seq_len} tokens, {settings.steps} timed steps"
    )
    rows = compare_training_steps(settings)
    print(format_table(rows))
    speedup = rows[1]["sec_per_step"] / rows[0]["sec_per_step"]
    print(f"Linformer is {speedup:.2f}x the speed of exact attention per training step")


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `demo` subcommand."""
    parser = commands.add_parser(
        "demo", help="train Linformer and exact attention for a few steps and compare speed"
    )
    add_dataclass_arguments(parser, StepComparison)
    parser.set_defaults(func=run)
