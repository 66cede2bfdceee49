"""Masked- or causal-LM pretraining of a run config: data, tokenizer, model, trainer (one or N
processes)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..causal_lm import LinformerForCausalLM
from ..data.cache import token_digest
from ..data.corpus import HF_PREFIX, STDLIB
from ..data.pipeline import DataSettings, PretrainingData, prepare_pretraining_data
from ..data.tokenizer import TOKENIZER_NAME, load_tokenizer
from ..masked_lm import LinformerForMaskedLM
from .batches import LMBatches, LMEvaluator, RowSchedule
from .checkpoint import Checkpoint, check_run_dir, latest_checkpoint
from .distributed import Distributed, distributed_job
from .loop import Trainer, TrainResult
from .resume import DATA_ORDER, check_resume_keeps, same_file
from .settings import RunConfig

logger = logging.getLogger(__name__)


def resumed_data_settings(run: RunConfig, checkpoint: Checkpoint | None) -> DataSettings:
    """The data settings to prepare a run's data with: on `--resume` from `checkpoint` (the
    newest intact one, `latest_checkpoint`), with its tokenizer, since a BPE trained anew (on
    a corpus changed since, say) would give ids the checkpoint's embeddings never learned.

    Raises:
        ValueError: if `--tokenizer` names another tokenizer than the run's.
    """
    if checkpoint is None:
        return run.data
    own = checkpoint.path / TOKENIZER_NAME
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
# the order its blocks come in (a changed split scored blocks the run had trained on); the
# tokenizer's settings (the run's tokenizer goes on: a new --vocab-size was ignored silently).
RESUME_KEEPS = {
    "data": ("data", "glob", "text_field", "skip_bad_files", "max_documents", "val_fraction",
             "max_val_blocks", "vocab_size", "tokenizer_documents"),
    "train": ("objective", *DATA_ORDER),
}  # fmt: skip


def check_same_data(run: RunConfig, checkpoint: Checkpoint | None) -> None:
    """Checks that a `--resume` from `checkpoint` goes on with the run's data, tokenizer
    settings, split and order (`RESUME_KEEPS`); a fresh run (None) passes.

    Raises:
        ValueError: naming each flag that differs, with the run's value.
    """
    path = checkpoint and checkpoint.path
    continues = f"the pretraining of {path} on its data, tokenizer, split and order"
    check_resume_keeps(checkpoint, run, RESUME_KEEPS, continues, _same_setting)


def _same_setting(name: str, now: Any, was: Any) -> bool | None:
    """Whether a setting is the run's: --data's entries one by one (`stdlib` and `hf:` ones
    as written, files by their real paths, `same_file`), the rest as given."""
    if name != "data":
        return now == was
    if len(now) != len(was):
        return False
    named = lambda spec: spec == STDLIB or spec.startswith(HF_PREFIX)  # noqa: E731
    verdicts = [
        a == b if named(a) or named(b) else same_file(a, b) for a, b in zip(now, was, strict=True)
    ]
    return False if False in verdicts else None if None in verdicts else True


def prepare_data(
    run: RunConfig, dist: Distributed, checkpoint: Checkpoint | None = None
) -> PretrainingData:
    """Tokenizer and token cache (with the tokenizer of `checkpoint`, which a `--resume`
    goes on from): rank 0 builds them first, the other ranks then reuse them."""
    settings = resumed_data_settings(run, checkpoint)
    data = prepare_pretraining_data(settings, run.model.max_seq_len) if dist.is_main else None
    dist.barrier()
    return data or prepare_pretraining_data(settings, run.model.max_seq_len)


def build_trainer(
    run: RunConfig,
    data: PretrainingData,
    dist: Distributed,
    checkpoint: Checkpoint | None = None,
) -> Trainer:
    """The masked or causal LM, per the objective (vocab_size and pad_token_id from the
    tokenizer; seeded so every rank starts from the same weights), its batches, evaluator and
    trainer (which a --resume continues from `checkpoint`, verified, or else the newest)."""
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
        checkpoint=checkpoint,
        data_source=token_digest(data.cache),
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
    checkpoint = latest_checkpoint(run.train.output_dir) if run.train.resume else None
    check_same_data(run, checkpoint)
    with distributed_job(run.train.device) as dist:
        data = data or prepare_data(run, dist, checkpoint)
        result = build_trainer(run, data, dist, checkpoint).fit()
        return result
