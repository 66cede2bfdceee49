"""`linformer evaluate CKPT --data ...`: masked-LM (or, for a causal LM, next-token)
perplexity on text, or a classifier's accuracy and F1 on labelled JSONL."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..training.compare import machine
from ..training.evaluate import EvaluateSettings, evaluate_checkpoint
from .common import check_report_path, format_table, write_report
from .overrides import add_override_arguments, collect_overrides, exit_on_user_error


@exit_on_user_error
def run(args: argparse.Namespace) -> None:
    """`linformer evaluate`: prints (and with `--out` writes) a checkpoint's metrics."""
    logging.basicConfig(level=logging.INFO)
    settings = EvaluateSettings(**collect_overrides(args).get("evaluate", {}))
    if args.out:
        out = Path(args.out).resolve()
        if out in [Path(spec).resolve() for spec in settings.data] or (
            Path(args.checkpoint).resolve() in out.parents
        ):  # the metrics were written over the data file without a word
            raise ValueError(f"--out {args.out} is an input (--data, or in the checkpoint)")
        check_report_path(args.out)
    metrics = evaluate_checkpoint(args.checkpoint, settings)
    print(format_table([{"data": name, **values} for name, values in metrics.items()]))
    if args.out:
        report = {"checkpoint": args.checkpoint, "metrics": metrics, "machine": machine()}
        print(f"wrote {write_report(report, args.out)}")


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `evaluate` subcommand."""
    parser = commands.add_parser("evaluate", help="evaluate a checkpoint on text or labelled data")
    parser.add_argument("checkpoint", help="a checkpoint directory (e.g. runs/x/best)")
    parser.add_argument(
        "--out",
        default=None,
        help="also write the metrics (and the machine) as JSON here (default: none)",
    )
    add_override_arguments(parser, EvaluateSettings, "evaluate")
    parser.set_defaults(func=run)
