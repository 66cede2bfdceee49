"""Sequence-classification fine-tuning from a pretrained checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import torch

from .. import hub
from ..data.classification import ClassificationData, load_classification
from ..data.tokenizer import TextTokenizer, load_tokenizer
from ..models import CAUSAL_CLS, LinformerForSequenceClassification
from ..projection import SequenceProjection
from .batches import ClassificationBatches, ClassificationEvaluator, RowSchedule
from .checkpoint import Checkpoint, check_run_dir, latest_checkpoint
from .distributed import distributed_job
from .finetune_settings import DEFAULT_TRUNCATION, FinetuneRunConfig, FinetuneSettings
from .loop import Trainer, TrainResult
from .probe import init_head_from_probe
from .resume import DATA_ORDER, check_resume_keeps, same_file
from .settings import TrainSettings, use_threads
from .task_distill import (
    DistillationObjective,
    check_teacher,
    check_teacher_labels,
    teacher_logits,
)

logger = logging.getLogger(__name__)


def _sequence_length(settings: FinetuneSettings, model_len: int) -> int:
    """The truncation length; a longer one than the model accepts is an error, not a clamp,
    because the positions and the sequence projection are sized to the model's."""
    if settings.max_seq_len > model_len:
        raise ValueError(
            f"--max-seq-len {settings.max_seq_len} is longer than the model's max_seq_len "
            f"{model_len} ({settings.init}); pass at most {model_len}"
        )
    return settings.max_seq_len or model_len


# What a fine-tuning --resume keeps: the texts as read (files, fields, length cut; the
# truncation rule is the model's config, `check_same_model`'s) and the order they come in.
RESUME_KEEPS = {
    "finetune": ("data", "eval", "text_field", "label_field", "max_seq_len"),
    "train": DATA_ORDER,
}


def _check_same_inputs(
    checkpoint: Checkpoint | None, run: FinetuneRunConfig, model_len: int
) -> None:
    """Checks that a resumed fine-tuning goes on as it started (`RESUME_KEEPS`, against
    `checkpoint`'s run_config.json); a run without a checkpoint (None) passes.

    Raises:
        ValueError: naming each flag that differs, with the run's value.
    """

    def same(name: str, now: Any, was: Any) -> bool | None:
        if name == "max_seq_len":  # 0: the model's
            return (now or model_len) == (was or model_len)
        return same_file(now, was) if name in ("data", "eval") else now == was

    def shown(name: str, value: Any) -> str:
        default = name == "max_seq_len" and not value
        return f"0 = the model's {model_len}" if default else repr(value)

    path = checkpoint and checkpoint.path
    continues = f"the fine-tuning of {path} on its texts, read and ordered as it started"
    check_resume_keeps(checkpoint, run, RESUME_KEEPS, continues, same, shown)


def _sized(
    settings: FinetuneSettings, train: TrainSettings, examples: int, ranks: int
) -> TrainSettings:
    """`train` with max_steps, eval_every and save_every from the epochs or the step flags.

    The rows run as one stream over the shuffled epochs (a step's batch can span two), so
    `--epochs E` is ceil(E x examples / rows a step) steps: rounding each epoch up instead
    added up (3 epochs of 10 examples at 16 a step ran 4.8 passes)."""
    per_step = train.batch_size * train.grad_accum_steps * ranks
    epoch_steps = math.ceil(examples / per_step)
    max_steps = settings.max_steps or math.ceil(settings.epochs * examples / per_step)
    every = settings.eval_every or epoch_steps  # the last step validates and saves anyway
    logger.info(
        "fine-tuning for %d steps (%.3g passes over the %d examples, %d a step), validating "
        "every %d steps",
        max_steps,
        max_steps * per_step / examples,
        examples,
        per_step,
        every,
    )
    return dataclasses.replace(train, max_steps=max_steps, eval_every=every, save_every=every)


def _head_labels(meta: dict[str, Any], num_labels: int) -> int:
    """The classes of `--init`'s head when it is a classifier that `--num-labels` (0: any)
    does not resize, else 0."""
    if meta["architecture"] != LinformerForSequenceClassification.__name__:
        return 0
    saved = meta["model_kwargs"].get("num_labels", 0)
    return saved if num_labels in (0, saved) else 0


def _training_data(
    settings: FinetuneSettings,
    tokenizer: TextTokenizer,
    max_len: int,
    fields: dict[str, str],
    head_names: dict[str, int] | None,
) -> ClassificationData:
    """The training file, its class names numbered as `--init`'s classifier numbers them
    (`head_names`, its label2id) when they are among that classifier's (its head's outputs
    keep their meaning), else in sorted order."""
    if head_names:
        try:
            return load_classification(
                settings.data, tokenizer, max_seq_len=max_len, label2id=head_names, **fields
            )
        except ValueError:  # other names, or ids: a task of its own (a bad file fails below)
            pass
    return load_classification(settings.data, tokenizer, max_seq_len=max_len, **fields)


def _keeps_head(meta: dict[str, Any], num_labels: int, names_match: bool) -> bool:
    """Whether `--init` is a classifier of `num_labels` classes, whose trained head is kept
    (e.g. the exact model fine-tuned at full length, then converted to a Linformer). A
    classifier of another number of classes, or whose class names are not the data's
    (`names_match`), gives its backbone only: a new head starts."""
    if meta["architecture"] != LinformerForSequenceClassification.__name__:
        return False
    if not names_match:
        logger.info("--init's classes are not the data's: its backbone is kept, with a new head")
        return False
    saved = meta["model_kwargs"].get("num_labels")
    if saved != num_labels:
        logger.info(
            "--init is a classifier of %s classes and the data has %d: its backbone is kept, "
            "with a new head",
            saved,
            num_labels,
        )
    return saved == num_labels


def _pooling(
    meta: dict[str, Any], settings: FinetuneSettings, keep_head: bool, resumed: Checkpoint | None
) -> str:
    """The head's pooling: a resumed run's (`check_same_model` names another), a kept head's
    own (its weights learned from those features; a `--pooling` other than that is
    refused), else `--pooling` or mean."""
    if resumed is not None:  # an earlier version kept a head with mean pooling: goes on so
        return settings.pooling or hub.read_config(resumed.path)["model_kwargs"]["pooling"]
    own = meta["model_kwargs"].get("pooling", "mean") if keep_head else None
    if own and settings.pooling not in ("", own):
        raise ValueError(
            f"--pooling {settings.pooling}: the head kept from {settings.init} was trained on "
            f"{own}-pooled features; drop --pooling"
        )
    return own or settings.pooling or "mean"


def freeze_projections(model: torch.nn.Module) -> int:
    """Stops the gradient of every sequence projection's parameters (the optimizer then
    leaves them out).

    Returns:
        The number of parameters frozen.
    """
    frozen = {  # a set: a projection shared by several layers counts once
        p
        for module in model.modules()
        if isinstance(module, SequenceProjection)
        for p in module.parameters()
    }
    for parameter in frozen:
        parameter.requires_grad_(False)
    count = sum(p.numel() for p in frozen)
    logger.info("sequence projections frozen: %d parameters", count)
    return count


def finetune(settings: FinetuneSettings, train: TrainSettings) -> TrainResult:
    """Fine-tunes a classifier initialised from `settings.init` (backbone kept, new head).

    `train.max_steps`, `eval_every` and `save_every` come from `settings`: by default
    validation and a checkpoint after every epoch.

    Raises:
        ValueError / FileNotFoundError: for a missing checkpoint or malformed data files.
    """
    for name in ("init", "data", "eval"):
        if not getattr(settings, name):
            raise ValueError(f"finetune needs --{name}")
    check_run_dir(train.output_dir, resume=train.resume)  # before the model and data load
    use_threads(train.threads)  # the probe's and the teacher's passes too, not training alone
    teacher = check_teacher(settings.teacher) if settings.teacher else None
    meta = hub.read_encoder_config(
        settings.init, "fine-tune a masked or causal LM (or a classifier) for classification"
    )
    config = meta["config"]
    if settings.pooling == "cls" and config.causal:  # before the data loads
        raise ValueError(f"--pooling cls: {CAUSAL_CLS}")
    for name in ("data", "eval"):  # a missing --eval was named, without its flag, after --data
        if not Path(getattr(settings, name)).exists():  # was read and the teacher checked
            raise FileNotFoundError(f"--{name} {getattr(settings, name)}: no such file")
    tokenizer = load_tokenizer(settings.init, model_vocab_size=config.vocab_size)
    max_len = _sequence_length(settings, config.max_seq_len)
    # a folder with checkpoints is resumed (its head loaded) or refused by the Trainer
    last = latest_checkpoint(Path(train.output_dir))
    if train.resume:
        run = FinetuneRunConfig(model=config, train=train, finetune=settings)
        _check_same_inputs(last, run, config.max_seq_len)
    fields = {"text_field": settings.text_field, "label_field": settings.label_field}
    fields["truncation"] = settings.truncation or config.truncation or DEFAULT_TRUNCATION
    head_labels = _head_labels(meta, settings.num_labels)
    head_names = (config.label2id or None) if head_labels else None
    train_data = _training_data(settings, tokenizer, max_len, fields, head_names)
    named_as_head = head_names is not None and train_data.label2id == head_names
    num_labels = settings.num_labels or (
        head_labels if named_as_head else max(train_data.labels) + 1
    )
    keep_head = _keeps_head(meta, num_labels, names_match=named_as_head or not head_names)
    # One class in the data is refused where the classes come from it (a new head without
    # --num-labels; one class of id 1 made max + 1 = 2), not for a kept head's classes.
    classes_from_data = not settings.num_labels and not keep_head
    if num_labels < 2 or (classes_from_data and len(set(train_data.labels)) < 2):
        label = next(iter(train_data.label2id)) if train_data.label2id else train_data.labels[0]
        raise ValueError(
            f"{settings.data} has one class only (every label is {label!r}); a classifier "
            f"needs two or more: check --data, or give --num-labels"
        )
    train_data.check_labels(num_labels)
    if teacher is not None:  # before the student loads and the probe reads the data
        labels = (num_labels, train_data.label2id, train_data.source)
        check_teacher_labels(settings.teacher, teacher, *labels)
    eval_data = load_classification(
        settings.eval,
        tokenizer,
        max_seq_len=max_len,
        num_labels=num_labels,
        label2id=train_data.label2id or {},
        **fields,
    )
    for data in (train_data, eval_data):
        logger.info(data.describe_truncation(max_len))
    with distributed_job(train.device) as dist:
        train = _sized(settings, train, len(train_data), dist.world_size)
        torch.manual_seed(train.seed)
        model = LinformerForSequenceClassification.from_pretrained(
            settings.init,
            num_labels=num_labels,
            pooling=_pooling(meta, settings, keep_head, last if train.resume else None),
            config_overrides=train_data.label_config() | {"truncation": fields["truncation"]},
            keep_head=keep_head,
        ).to(dist.device)
        if settings.projections == "freeze":
            freeze_projections(model)
        fresh = last is None
        if keep_head:
            logger.info("the classification head of %s is kept", settings.init)
        elif settings.head_init == "probe" and fresh:
            init_head_from_probe(model, train_data, tokenizer.pad_id, train.batch_size, dist.device)
        schedule = RowSchedule.for_run(len(train_data), train, dist.world_size)
        soft, objective = None, None
        if settings.teacher:
            soft = teacher_logits(
                settings.teacher,
                train_data,
                num_labels=num_labels,
                text_field=settings.text_field,
                label_field=settings.label_field,
                batch_size=train.batch_size,
                device=dist.device,
            )
            objective = DistillationObjective(settings.distill_weight, settings.temperature)
        result = Trainer(
            model=model,
            batches=ClassificationBatches(train_data, tokenizer.pad_id, schedule, soft),
            evaluator=ClassificationEvaluator(
                eval_data, tokenizer.pad_id, train.batch_size, num_labels, verbose=dist.is_main
            ),
            settings=train,
            dist=dist,
            run_config=FinetuneRunConfig(model=config, train=train, finetune=settings),
            tokenizer=tokenizer,
            loss_fn=objective,
            checkpoint=last,
        ).fit()  # the trainer (and its DDP wrapper) gone before the group is destroyed
        return result
