"""Masked- or causal-LM pretraining of a run config: data, tokenizer, model, trainer (one or N
processes)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from ..causal_lm import LinformerForCausalLM
from ..data.corpus import HF_PREFIX, STDLIB
from ..data.pipeline import DataSettings, PretrainingData, prepare_pretraining_data
from ..data.tokenizer import TOKENIZER_NAME, load_tokenizer
from ..masked_lm import LinformerForMaskedLM
from .batches import LMBatches, LMEvaluator, RowSchedule
from .checkpoint import CHECKPOINTS_DIR, check_run_dir
from .distributed import Distributed, setup_distributed, teardown_distributed
from .loop import Trainer, TrainResult
from .settings import RUN_CONFIG_NAME, RunConfig

logger = logging.getLogger(__name__)


def resumed_data_settings(run: RunConfig) -> DataSettings:
    """The data settings to prepare a run's data with: on `--resume` of a run with
    checkpoints, with the run's own tokenizer, since a BPE trained anew (on a corpus changed
    since, say) would give ids the checkpoint's embeddings never learned.

    Raises:
        ValueError: if `--tokenizer` names another tokenizer than the run's.
    """
    saved = sorted((Path(run.train.output_dir) / CHECKPOINTS_DIR).glob(f"step-*/{TOKENIZER_NAME}"))
    if not run.train.resume or not saved:
        return run.data
    own = saved[-1]
    if run.data.tokenizer:
        given = load_tokenizer(run.data.tokenizer).tokenizer.to_str()
        if given != load_tokenizer(own).tokenizer.to_str():
            raise ValueError(
                f"--tokenizer {run.data.tokenizer} is not the tokenizer of the run being "
                f"resumed ({own}): its ids would not match the checkpoint's embeddings; drop "
                f"--tokenizer to go on with the run's, or start a fresh run"
            )
    logger.info("resuming with the run's own tokenizer, %s", own)
    return dataclasses.replace(run.data, tokenizer=str(own))


# What a pretraining --resume keeps: the corpus, its split into train and validation, and
# the order its blocks come in (a changed split scored blocks the run had trained on).
RESUME_KEEPS = {
    "data": ("data", "glob", "text_field", "skip_bad_files", "max_documents", "val_fraction",
             "max_val_blocks"),
    "train": ("objective", "batch_size", "grad_accum_steps", "seed"),
}  # fmt: skip


def check_same_data(run: RunConfig) -> None:
    """Checks that a `--resume` goes on with the run's data, split and order
    (`RESUME_KEEPS`, against the run_config.json of its `last` checkpoint: read, not
    verified, which the trainer's resume does once); a fresh run, or a run without a
    checkpoint, passes.

    Raises:
        ValueError: naming each flag that differs, with the run's value.
    """
    last = Path(run.train.output_dir) / "last"
    if not run.train.resume or not (last / RUN_CONFIG_NAME).is_file():
        return
    try:
        started = json.loads((last / RUN_CONFIG_NAME).read_text())
    except json.JSONDecodeError:
        return  # a damaged checkpoint: the resume names it, or falls back to an intact one
    changed = []
    for section, names in RESUME_KEEPS.items():
        # as run_config.json holds it (a tuple is a list there)
        now = json.loads(json.dumps(dataclasses.asdict(getattr(run, section))))
        was = started.get(section, {})
        changed += [
            f"--{name.replace('_', '-')} {now[name]!r} (the run's: {was[name]!r})"
            for name in names
            if name in was and _comparable(name, now[name]) != _comparable(name, was[name])
        ]
    if changed:
        raise ValueError(
            f"--resume continues the pretraining of {last.resolve()} on its data, split and "
            f"order; these differ: {', '.join(changed)}. Give the run's values, or start over "
            f"in another --output-dir"
        )


def _comparable(name: str, value: Any) -> Any:
    """A setting as the data sees it: --data's files by their real paths from here
    (`corpus`, `./corpus/` and its absolute path are one corpus), the rest as given."""
    if name != "data":
        return value
    return [v if v == STDLIB or v.startswith(HF_PREFIX) else os.path.realpath(v) for v in value]


def prepare_data(run: RunConfig, dist: Distributed) -> PretrainingData:
    """Tokenizer and token cache: rank 0 builds them first, the other ranks then reuse them."""
    settings = resumed_data_settings(run)
    data = prepare_pretraining_data(settings, run.model.max_seq_len) if dist.is_main else None
    dist.barrier()
    return data or prepare_pretraining_data(settings, run.model.max_seq_len)


def build_trainer(run: RunConfig, data: PretrainingData, dist: Distributed) -> Trainer:
    """The masked or causal LM, per the objective (vocab_size and pad_token_id from the
    tokenizer; seeded so every rank starts from the same weights), its batches, evaluator and
    trainer."""
    causal = run.train.objective == "clm"
    model_config = run.model.replace(
        vocab_size=data.tokenizer.vocab_size, pad_token_id=data.tokenizer.pad_id, causal=causal
    )
    run = RunConfig(model=model_config, train=run.train, data=run.data)
    settings = run.train
    torch.manual_seed(settings.seed)
    model = (LinformerForCausalLM if causal else LinformerForMaskedLM)(model_config)
    schedule = RowSchedule.for_run(len(data.train), settings, dist.world_size)
    batches, val_batches = (
        LMBatches(blocks, data.tokenizer, schedule, settings.mlm_probability, causal=causal)
        for blocks in (data.train, data.val)
    )
    return Trainer(
        model=model,
        batches=batches,
        evaluator=LMEvaluator(
            val_batches, settings.batch_size, settings.eval_batches, verbose=dist.is_main
        ),
        settings=settings,
        dist=dist,
        run_config=run,
        tokenizer=data.tokenizer,
        loss_fn=batches.loss,
    )


def pretrain(run: RunConfig, data: PretrainingData | None = None) -> TrainResult:
    """Pretrains a masked or causal LM per `run` (under torchrun: one process of a DDP job).

    Args:
        run: model, training and data settings; the model's vocab_size and pad_token_id are
            taken from the tokenizer, and `causal` from the objective.
        data: prepared data, to share one corpus between several runs (else prepared here).

    Returns:
        The run's records, final validation metrics and throughput.
    """
    check_run_dir(run.train.output_dir, resume=run.train.resume)  # before the data's work
    check_same_data(run)
    dist = setup_distributed(run.train.device)
    try:
        result = build_trainer(run, data or prepare_data(run, dist), dist).fit()
        dist.barrier()  # gloo can abort a process whose peer already closed the group
        return result
    finally:
        teardown_distributed()
