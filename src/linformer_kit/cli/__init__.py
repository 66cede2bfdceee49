"""The `linformer` command: thin subcommands over library functions.

Each subcommand lives in its own module with a `register(commands)` function.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .. import __version__
from . import analysis, bench, convert, demo, distill, evaluate, finetune, generate, pretrain

SUBCOMMANDS = (demo, pretrain, finetune, evaluate, generate, convert, distill, analysis, bench)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="linformer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"linformer-kit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `linformer` command."""
    args = build_parser().parse_args(argv)
    args.func(args)
