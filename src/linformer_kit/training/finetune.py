"""Sequence-classification fine-tuning from a pretrained checkpoint."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .. import hub
from ..data.classification import load_classification
from ..data.tokenizer import load_tokenizer
from ..models import LinformerForSequenceClassification
from .batches import ClassificationBatches, ClassificationEvaluator, RowSchedule
from .distributed import setup_distributed, teardown_distributed
from .loop import Trainer, TrainResult
from .settings import TrainSettings


@dataclass(kw_only=True)
class FinetuneSettings:
    """What to fine-tune on; the optimisation recipe is a TrainSettings."""

    init: str = field(default="", metadata={"help": "pretrained checkpoint directory"})
    data: str = field(default="", metadata={"help": "training JSONL or CSV (text + label)"})
    eval: str = field(default="", metadata={"help": "validation JSONL or CSV (text + label)"})
    epochs: int = field(default=3, metadata={"help": "passes over the training set"})
    num_labels: int = field(default=0, metadata={"help": "classes (0 = max label + 1)"})
    pooling: str = field(default="cls", metadata={"help": "cls or mean"})
    text_field: str = field(default="text", metadata={"help": "JSONL text field"})
    label_field: str = field(default="label", metadata={"help": "JSONL label field"})
    max_seq_len: int = field(default=0, metadata={"help": "truncate texts (0 = the model's)"})


def finetune(settings: FinetuneSettings, train: TrainSettings) -> TrainResult:
    """Fine-tunes a classifier initialised from `settings.init` (backbone kept, new head).

    `train.max_steps`, `eval_every` and `save_every` are derived from the epochs: validation
    and a checkpoint after every epoch.

    Raises:
        ValueError / FileNotFoundError: for a missing checkpoint or malformed data files.
    """
    for name in ("init", "data", "eval"):
        if not getattr(settings, name):
            raise ValueError(f"finetune needs --{name}")
    tokenizer = load_tokenizer(settings.init)
    config = hub.read_config(settings.init)["config"]
    max_len = min(settings.max_seq_len or config.max_seq_len, config.max_seq_len)
    fields = {"text_field": settings.text_field, "label_field": settings.label_field}
    train_data = load_classification(settings.data, tokenizer, max_seq_len=max_len, **fields)
    num_labels = settings.num_labels or max(train_data.labels) + 1
    train_data.check_labels(num_labels)
    eval_data = load_classification(
        settings.eval,
        tokenizer,
        max_seq_len=max_len,
        num_labels=num_labels,
        label2id=train_data.label2id or {},
        **fields,
    )
    dist = setup_distributed(train.device)
    try:
        per_step = train.batch_size * train.grad_accum_steps * dist.world_size
        epoch_steps = math.ceil(len(train_data) / per_step)
        train = dataclasses.replace(
            train,
            max_steps=epoch_steps * settings.epochs,
            eval_every=epoch_steps,
            save_every=epoch_steps,
        )
        torch.manual_seed(train.seed)
        model = LinformerForSequenceClassification.from_pretrained(
            settings.init,
            num_labels=num_labels,
            pooling=settings.pooling,
            config_overrides=train_data.label_config(),
        )
        schedule = RowSchedule(
            len(train_data), train.batch_size, train.grad_accum_steps, dist.world_size, train.seed
        )
        trainer = Trainer(
            model=model,
            batches=ClassificationBatches(train_data, tokenizer.pad_id, schedule),
            evaluator=ClassificationEvaluator(
                eval_data, tokenizer.pad_id, train.batch_size, num_labels
            ),
            settings=train,
            dist=dist,
            tokenizer=tokenizer,
        )
        result = trainer.fit()
        dist.barrier()  # gloo can abort a process whose peer already closed the group
        return result
    finally:
        teardown_distributed()
