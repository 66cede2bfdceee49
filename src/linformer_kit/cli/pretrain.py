"""`linformer pretrain`: masked-LM pretraining on your text (files, directories, JSONL, stdlib);
`--objective clm` trains a causal LM instead (for `linformer generate`).

Multi-process: `torchrun --nproc_per_node N --no-python linformer pretrain ...`.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from tqdm.contrib.logging import logging_redirect_tqdm

from ..config import FINETUNE_FIELDS, LinformerConfig
from ..data.pipeline import DataSettings
from ..training.distributed import is_main_process
from ..training.pretrain import pretrain
from ..training.settings import RunConfig, TrainSettings
from .common import format_table, merged_run_config, print_checkpoints, run_summary
from .overrides import add_override_arguments, exit_on_user_error

FROM_TOKENIZER = ("vocab_size", "pad_token_id")  # model fields the tokenizer decides
FROM_OBJECTIVE = ("causal",)  # set by --objective, so the two cannot disagree


def build_run_config(args: argparse.Namespace) -> RunConfig:
    """Defaults, then `--config FILE` (a run_config.json or a run directory), then flags."""
    config, given = merged_run_config(RunConfig, args)
    _check_objective_flags(given, config.train.objective)
    return config


def _check_objective_flags(overrides: dict[str, dict[str, Any]], objective: str) -> None:
    """A flag of the other objective is an error: it would do nothing."""
    if objective != "clm" and "block_size" in overrides.get("model", {}):
        raise ValueError(
            "--block-size applies to --objective clm only (a masked LM attends to the whole "
            "sequence at once)"
        )
    if objective == "clm" and "mlm_probability" in overrides.get("train", {}):
        raise ValueError(
            "--mlm-probability applies to --objective mlm only (a causal LM masks nothing)"
        )


@exit_on_user_error
def run(args: argparse.Namespace) -> None:
    """`linformer pretrain`: trains a masked or causal LM, prints its run."""
    main_process = is_main_process()
    logging.basicConfig(level=logging.INFO if main_process else logging.WARNING)
    config = build_run_config(args)
    with logging_redirect_tqdm():  # warnings between progress bars, not inside them
        result = pretrain(config)
    if main_process:
        print(format_table([{**run_summary(result), **result.final}]))
        print_checkpoints(result)


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `pretrain` subcommand."""
    parser = commands.add_parser(
        "pretrain",
        help="masked- or causal-LM pretraining on text files, directories, JSONL or the stdlib",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        default=None,
        help="a run_config.json (or run directory) to start from (default: none)",
    )
    add_override_arguments(parser, DataSettings, "data")
    add_override_arguments(parser, TrainSettings, "train")
    add_override_arguments(
        parser, LinformerConfig, "model", exclude=FROM_TOKENIZER + FINETUNE_FIELDS + FROM_OBJECTIVE
    )
    parser.set_defaults(func=run)
