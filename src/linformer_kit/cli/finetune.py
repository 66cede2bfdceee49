"""`linformer finetune`: sequence classification from a pretrained checkpoint, with accuracy
and F1 on the validation set after every epoch (or every --eval-every steps)."""

from __future__ import annotations

import argparse
import logging

from tqdm.contrib.logging import logging_redirect_tqdm

from ..training.distributed import is_main_process
from ..training.finetune import finetune
from ..training.finetune_settings import (
    TRAIN_DEFAULTS,
    FinetuneSettings,
    finetune_train_settings,
)
from ..training.settings import TrainSettings
from .common import format_table, print_checkpoints, run_summary
from .overrides import add_override_arguments, collect_overrides, exit_on_user_error

# Set from the finetune section (--epochs, --max-steps, --eval-every), or unused by it.
DERIVED = ("max_steps", "eval_every", "save_every")
UNUSED = ("objective", "mlm_probability", "eval_batches")


@exit_on_user_error
def run(args: argparse.Namespace) -> None:
    """`linformer finetune`: fine-tunes a classifier, prints its validation and run."""
    main_process = is_main_process()
    logging.basicConfig(level=logging.INFO if main_process else logging.WARNING)
    overrides = collect_overrides(args)
    settings = FinetuneSettings(**overrides.get("finetune", {}))
    train = finetune_train_settings(**overrides.get("train", {}))
    with logging_redirect_tqdm():  # warnings between progress bars, not inside them
        result = finetune(settings, train)
    if main_process:
        validations = [
            {k: r[k] for k in ("step", "val_loss", "accuracy", "f1")}
            for r in result.records
            if r["split"] == "val"
        ]
        print(format_table(validations))
        print(format_table([run_summary(result)]))
        print_checkpoints(result)


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `finetune` subcommand."""
    parser = commands.add_parser(
        "finetune", help="fine-tune a pretrained checkpoint for sequence classification"
    )
    add_override_arguments(parser, FinetuneSettings, "finetune")
    add_override_arguments(
        parser, TrainSettings, "train", exclude=DERIVED + UNUSED, defaults=TRAIN_DEFAULTS
    )
    parser.set_defaults(func=run)
