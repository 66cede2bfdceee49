"""`linformer lra TASK`: Long Range Arena, generated offline. Trains Linformer and the exact
Transformer of the same size on one task and prints their accuracy beside LRA's."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tqdm.contrib.logging import logging_redirect_tqdm

from ..data.lra import TASKS
from ..training.lra import run_lra
from ..training.lra_report import COLUMNS, counted, summary_rows
from ..training.lra_settings import LRASettings
from .common import add_dataclass_arguments, dataclass_from_args, format_table
from .overrides import exit_on_user_error


@exit_on_user_error
def run(args: argparse.Namespace) -> None:
    """`linformer lra TASK`: trains both models on the task, prints the table."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = dataclass_from_args(LRASettings, args)
    recipe = settings.recipe(args.task)
    print(
        f"LRA {args.task} at scale {settings.scale}: width {recipe.dim}, "
        f"{counted(recipe.depth, 'layer')}, {counted(recipe.num_heads, 'head')}, "
        f"{counted(recipe.steps, 'step')} of {counted(recipe.batch_size, 'sequence')}"
    )
    with logging_redirect_tqdm():  # log lines between progress bars, not inside them
        report = run_lra(args.task, settings)
    rows = [  # a figure not measured (no exact model: no step-time ratio) is a dash (v != v: nan)
        {COLUMNS[k]: "-" if v != v else v for k, v in row.items()} for row in summary_rows(report)
    ]
    print(format_table(rows))
    output = Path(settings.output_dir)
    print(
        f"wrote {output / f'{args.task}.json'}, {output / f'{args.task}.png'} and "
        f"{output / 'summary.md'} (every task in {output})"
    )


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `lra` subcommand."""
    parser = commands.add_parser(
        "lra",
        help="Long Range Arena (generated offline): Linformer vs exact Transformer on one task",
    )
    parser.add_argument("task", choices=TASKS, help="listops, text or pathfinder")
    add_dataclass_arguments(parser, LRASettings)
    parser.set_defaults(func=run)
