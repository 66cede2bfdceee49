"""`linformer seq2seq train|evaluate`: an encoder-decoder Linformer on (source, target) pairs:
stdlib function bodies -> their docstring summaries, or the synthetic copy / reverse tasks.

    linformer seq2seq train --task docstrings --proj-dim 128 --output-dir runs/doc
    linformer seq2seq train --task docstrings --proj-dim none --output-dir runs/doc-exact
    linformer seq2seq evaluate runs/doc/best --split test
    linformer generate runs/doc/best --prompt "def add(a, b): return a + b"
"""

from __future__ import annotations

import argparse
import logging

from tqdm.contrib.logging import logging_redirect_tqdm

from ..data.seq2seq import Seq2SeqDataSettings
from ..training.distributed import is_main_process
from ..training.seq2seq import (
    SPLITS,
    Seq2SeqModelSettings,
    Seq2SeqRunConfig,
    evaluate_seq2seq,
    train_seq2seq,
)
from ..training.settings import TrainSettings
from .common import format_table, merged_run_config, print_checkpoints, run_summary
from .overrides import add_override_arguments, exit_on_user_error

NOT_SEQ2SEQ = ("objective", "mlm_probability")  # pretraining's, meaningless here


def build_run_config(args: argparse.Namespace) -> Seq2SeqRunConfig:
    """Defaults, then `--config FILE` (a run_config.json or a run directory), then flags."""
    run, given = merged_run_config(Seq2SeqRunConfig, args)
    run.data.check_flags(given.get("data", {}))
    return run


@exit_on_user_error
def run_train(args: argparse.Namespace) -> None:
    """`linformer seq2seq train`: trains an encoder-decoder, prints its run."""
    main_process = is_main_process()
    logging.basicConfig(level=logging.INFO if main_process else logging.WARNING)
    config = build_run_config(args)
    with logging_redirect_tqdm():
        result = train_seq2seq(config)
    if main_process:
        print(format_table([{**run_summary(result), **result.final}]))
        print_checkpoints(result)


@exit_on_user_error
def run_evaluate(args: argparse.Namespace) -> None:
    """`linformer seq2seq evaluate`: prints a checkpoint's metrics on a split."""
    logging.basicConfig(level=logging.INFO)
    metrics = evaluate_seq2seq(
        args.checkpoint,
        split=args.split,
        batch_size=args.batch_size,
        max_examples=args.max_examples,
        device=args.device,
        threads=args.threads,
    )
    print(format_table([{"split": args.split, **metrics}]))


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `seq2seq` subcommand and its `train` and `evaluate` actions."""
    parser = commands.add_parser(
        "seq2seq",
        help="encoder-decoder Linformer: train / evaluate on stdlib docstrings or copy/reverse",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(
        dest="action", required=True, help="train: a model; evaluate: a checkpoint"
    )
    train = actions.add_parser("train", help="train (or --resume) an encoder-decoder")
    train.add_argument(
        "--config",
        default=None,
        help="a run_config.json (or run directory) to start from (default: none)",
    )
    add_override_arguments(train, Seq2SeqDataSettings, "data")
    add_override_arguments(train, Seq2SeqModelSettings, "model")
    add_override_arguments(
        train, TrainSettings, "train", exclude=NOT_SEQ2SEQ, defaults={"output_dir": "runs/seq2seq"}
    )
    train.set_defaults(func=run_train)
    evaluate = actions.add_parser(
        "evaluate", help="loss, token accuracy, ROUGE-L and exact match of a checkpoint"
    )
    evaluate.add_argument("checkpoint", help="a checkpoint directory (e.g. runs/seq2seq/best)")
    evaluate.add_argument(
        "--split", choices=SPLITS, default="test", help="held-out split (default: test)"
    )
    evaluate.add_argument(
        "--batch-size", type=int, default=16, help="pairs per batch (default: 16)"
    )
    evaluate.add_argument(
        "--max-examples", type=int, default=0, help="score the first N pairs (0 = all) (default: 0)"
    )
    evaluate.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    evaluate.add_argument("--threads", type=int, default=0, help="CPU threads (0 = default)")
    evaluate.set_defaults(func=run_evaluate)
