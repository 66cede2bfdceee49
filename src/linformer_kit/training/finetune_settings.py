"""What a fine-tuning run reads and how long it trains (`FinetuneSettings`), its recipe's
defaults and the run_config.json it saves."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checks import check_choice, check_finite_positive, check_non_negative, check_positive
from ..config import TRUNCATIONS, LinformerConfig
from ..files import save_json
from ..models import POOLINGS
from .settings import TrainSettings

HEAD_INITS = ("probe", "random")
# Measured on Pang & Lee (500 reviews, exact MiniLM at 512): head+tail 0.836, head 0.720
# test accuracy (README); Sun et al. 2019 found it best on long reviews too.
DEFAULT_TRUNCATION = "head+tail"
PROJECTION_MODES = ("train", "freeze")
# Fine-tuning's own recipe where it differs from pretraining's: a pretrained backbone takes
# BERT's fine-tuning learning rate (Devlin et al.: 2e-5 to 5e-5), not a from-scratch one;
# max_steps is sized from the epochs.
TRAIN_DEFAULTS: dict[str, Any] = {
    "output_dir": "runs/finetune",
    "lr": 5e-5,
    "warmup_steps": 10,
    "batch_size": 16,
    "max_steps": 1,
}


@dataclass(kw_only=True)
class FinetuneSettings:
    """What to fine-tune on and for how long; the optimisation recipe is a TrainSettings."""

    init: str = field(
        default="", metadata={"help": "pretrained checkpoint directory", "required": True}
    )
    data: str = field(
        default="", metadata={"help": "training JSONL or CSV (text + label)", "required": True}
    )
    eval: str = field(
        default="", metadata={"help": "validation JSONL or CSV (text + label)", "required": True}
    )
    epochs: int = field(default=3, metadata={"help": "passes over the training set"})
    max_steps: int = field(
        default=0, metadata={"help": "optimiser steps; overrides --epochs (0 = use --epochs)"}
    )
    eval_every: int = field(
        default=0, metadata={"help": "validate and checkpoint every N steps (0 = every epoch)"}
    )
    num_labels: int = field(default=0, metadata={"help": "classes (0 = max label + 1)"})
    pooling: str = field(
        default="",
        metadata={
            "help": "mean (over real tokens; a masked-LM or sentence-embedding backbone never "
            "trained its first token for classification), cls (the first real token; not on "
            "a causal LM) or last (the last real token) (default: a kept head's own, else "
            "mean)"
        },
    )
    head_init: str = field(
        default="probe",
        metadata={
            "help": "how a new head starts: probe (the output layer fitted on the frozen "
            "backbone's features first, LP-FT) or random; a classifier --init with as many "
            "classes keeps its own head"
        },
    )
    projections: str = field(
        default="freeze",
        metadata={
            "help": "freeze or train the pretrained sequence projections (E, F); frozen "
            "measured 1.6-2 points better on Pang & Lee, with faster steps (README)"
        },
    )
    text_field: str = field(
        default="text", metadata={"help": "JSONL field or CSV column of the text"}
    )
    label_field: str = field(
        default="label", metadata={"help": "JSONL field or CSV column of the label"}
    )
    max_seq_len: int = field(
        default=0, metadata={"help": "truncate texts to N tokens (0 = the model's max_seq_len)"}
    )
    truncation: str = field(
        default="",
        metadata={
            "help": "what a longer text keeps: head, tail or head+tail (a quarter from the "
            "start, the rest from the end); saved with the model for evaluate (default: the "
            f"model's if it was fine-tuned with one, else {DEFAULT_TRUNCATION})"
        },
    )
    teacher: str = field(
        default="",
        metadata={
            "help": "a fine-tuned classifier (e.g. the exact model at full length) whose "
            "predictions on --data the model also learns (knowledge distillation)"
        },
    )
    distill_weight: float = field(
        default=0.5,
        metadata={"help": "with --teacher: share of the teacher's term in the loss, in [0, 1]"},
    )
    temperature: float = field(
        default=2.0, metadata={"help": "with --teacher: softmax temperature of both, > 0"}
    )

    def __post_init__(self) -> None:
        check_positive("epochs", self.epochs)
        for name in ("max_steps", "eval_every", "num_labels", "max_seq_len"):
            check_non_negative(name, getattr(self, name))
        if self.num_labels == 1:
            raise ValueError("num_labels must be at least 2 (or 0: max label + 1), got 1")
        check_choice("head_init", self.head_init, HEAD_INITS)
        check_choice("projections", self.projections, PROJECTION_MODES)
        if self.truncation:
            check_choice("truncation", self.truncation, TRUNCATIONS)
        if self.pooling:
            check_choice("pooling", self.pooling, POOLINGS)
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"distill_weight must be in [0, 1], got {self.distill_weight!r}")
        check_finite_positive("temperature", self.temperature)
        given = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(self)
                 if f.name in ("distill_weight", "temperature")
                 and getattr(self, f.name) != f.default]  # fmt: skip
        if given and not self.teacher:  # they were ignored without a word
            raise ValueError(f"{' and '.join(given)} apply with --teacher only")


@dataclass(kw_only=True)
class FinetuneRunConfig:
    """A fine-tuning run's backbone, recipe (as sized) and data; saved as run_config.json."""

    model: LinformerConfig
    train: TrainSettings
    finetune: FinetuneSettings

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return {
            "model": self.model.to_dict(),
            "train": dataclasses.asdict(self.train),
            "finetune": dataclasses.asdict(self.finetune),
        }

    def save(self, path: Path) -> None:
        """Writes the JSON form to `path`."""
        save_json(self.to_dict(), path)


def finetune_train_settings(**overrides: Any) -> TrainSettings:
    """Fine-tuning's TrainSettings: TRAIN_DEFAULTS, then `overrides`."""
    return TrainSettings(**{**TRAIN_DEFAULTS, **overrides})
