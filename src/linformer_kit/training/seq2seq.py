"""Sequence-to-sequence training and evaluation: the model recipe, the run config, batches of
(source, target) pairs, an evaluator (loss, token accuracy, ROUGE-L of greedy decodes) and
the train / evaluate entry points over the shared Trainer (checkpoints, resume, DDP)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import hub
from ..causal_lm import next_token_targets
from ..checks import check_choice
from ..config import LinformerConfig
from ..data.masking import IGNORE_INDEX
from ..data.seq2seq import Seq2SeqData, Seq2SeqDataSettings, Seq2SeqPairs, load_seq2seq_data
from ..data.tokenizer import TextTokenizer
from ..seq2seq import LinformerForSeq2SeqLM
from ..seq2seq_config import Seq2SeqConfig
from .batches import RowSchedule, language_model_loss
from .checkpoint import check_run_dir, latest_checkpoint
from .distributed import distributed_job, resolve_device
from .loop import Trainer, TrainResult
from .resume import DATA_ORDER, check_resume_keeps
from .rouge import rouge_l, words
from .settings import RunConfig, TrainSettings, _build, use_threads

DEFAULT_OUTPUT = "runs/seq2seq"
SPLITS = ("val", "test")


@dataclass(kw_only=True)
class Seq2SeqModelSettings:
    """The encoder-decoder's shape; the vocabulary and lengths come from the data."""

    dim: int = field(default=256, metadata={"help": "model width (both sides)"})
    depth: int = field(default=4, metadata={"help": "encoder layers"})
    decoder_depth: int = field(default=2, metadata={"help": "decoder layers"})
    num_heads: int = field(default=4, metadata={"help": "attention heads; must divide dim"})
    ffn_dim: int | None = field(default=None, metadata={"help": "feed-forward width (4 * dim)"})
    proj_dim: int | None = field(
        default=128,
        metadata={"help": "k of the encoder and the cross-attention; none = exact"},
    )
    decoder_proj_dim: int | None = field(
        default=None, metadata={"help": "k of the causal decoder self-attention; none = exact"}
    )
    projection: str = field(default="linear", metadata={"help": "linear, conv, pool or random"})
    sharing: str = field(default="layerwise", metadata={"help": "none, headwise, kv, layerwise"})
    block_size: int = field(default=32, metadata={"help": "causal decoder's exact window"})
    dropout: float = field(default=0.1, metadata={"help": "dropout (also on attention)"})
    share_embeddings: bool = field(
        default=True, metadata={"help": "one token embedding for source and target"}
    )

    def config(self, data: Seq2SeqData, settings: Seq2SeqDataSettings) -> Seq2SeqConfig:
        """The Seq2SeqConfig for a task's vocabulary and lengths."""
        common = dict(
            vocab_size=data.vocab_size,
            dim=self.dim,
            num_heads=self.num_heads,
            ffn_dim=self.ffn_dim,
            projection=self.projection,
            sharing=self.sharing,
            dropout=self.dropout,
            attention_dropout=self.dropout,
            pad_token_id=data.train.pad_id,
        )

        def side(name: str, **fields: Any) -> LinformerConfig:
            try:
                return LinformerConfig(**common, **fields)
            except ValueError as err:  # say which side's flags, not only the config's field
                raise ValueError(f"the {name}: {err}") from None

        encoder = side(
            "encoder (--max-source-len, --proj-dim, --depth)",
            depth=self.depth,
            max_seq_len=settings.max_source_len,
            proj_dim=self.proj_dim,
        )
        decoder = side(
            "decoder (--max-target-len, --decoder-proj-dim, --decoder-depth)",
            depth=self.decoder_depth,
            max_seq_len=settings.max_target_len,
            proj_dim=self.decoder_proj_dim,
            causal=True,
            block_size=self.block_size,
        )
        return Seq2SeqConfig(
            encoder=encoder,
            decoder=decoder,
            share_embeddings=self.share_embeddings,
            decoder_start_token_id=data.train.bos_id,
            eos_token_id=data.train.eos_id,
        )


@dataclass(kw_only=True)
class Seq2SeqRunConfig(RunConfig):
    """Everything a seq2seq run needs; saved as run_config.json beside its checkpoints
    (`save` and `load` as for pretraining runs)."""

    model: Seq2SeqModelSettings
    train: TrainSettings
    data: Seq2SeqDataSettings

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_sections(
        cls, model: dict[str, Any], train: dict[str, Any], data: dict[str, Any]
    ) -> Seq2SeqRunConfig:
        """Builds a run config from its sections; missing fields take their defaults (the
        run directory: runs/seq2seq).

        Raises:
            ValueError: on an unknown field.
        """
        return cls(
            model=_build(Seq2SeqModelSettings, model),
            train=_build(TrainSettings, {"output_dir": DEFAULT_OUTPUT, **train}),
            data=_build(Seq2SeqDataSettings, data),
        )


@dataclass
class Seq2SeqBatches:
    """Shuffled, padded (source, target) batches."""

    pairs: Seq2SeqPairs
    schedule: RowSchedule

    def micro_batch(self, step: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
        """One micro-batch (see `Seq2SeqPairs.batch`)."""
        return self.pairs.batch(self.schedule.rows(step, micro, rank))

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's loss on one of these batches, without the logits (the decoder's loss
        in chunks of rows, as a causal LM's: `language_model_loss`)."""
        return language_model_loss(model, batch, causal=True)

    def scored(self, batch: dict[str, torch.Tensor]) -> int:
        """How many target tokens the loss on `batch` averages over (each real position's
        successor, when that is real too: `next_token_targets`)."""
        targets = next_token_targets(batch["labels"], batch["decoder_padding_mask"])
        return int((targets != IGNORE_INDEX).sum())


@dataclass
class Seq2SeqEvaluator:
    """Loss and token accuracy with the reference target fed in (teacher forcing); with
    `generate`, also ROUGE-L and exact match of greedy decodes against the references."""

    pairs: Seq2SeqPairs
    batch_size: int
    max_batches: int = 0  # 0 = every pair
    tokenizer: TextTokenizer | None = None  # scores words of decoded text; None: token ids
    generate: bool = False
    verbose: bool = False
    key: str = field(default="val_loss", init=False)

    def _units(self, ids: list[int]) -> list:
        """What ROUGE-L counts: the words of the decoded text, or the ids themselves."""
        if self.tokenizer is None:
            return ids
        return words(self.tokenizer.tokenizer.decode(ids))

    def _decoded(self, tokens: torch.Tensor) -> list[list[int]]:
        """Generated rows without the start token, cut before the end token."""
        rows = []
        for row in tokens[:, 1:].tolist():
            end = row.index(self.pairs.eos_id) if self.pairs.eos_id in row else len(row)
            rows.append(row[:end])
        return rows

    @torch.no_grad()
    def __call__(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Metrics over the pairs (the first max_batches batches)."""
        count = math.ceil(len(self.pairs) / self.batch_size)
        count = min(count, self.max_batches) if self.max_batches else count
        loss_sum = scored = correct = 0.0
        rouge, exact = [], []
        for index in tqdm(range(count), desc="evaluation", leave=False, disable=not self.verbose):
            rows = list(
                range(index * self.batch_size, min(len(self.pairs), (index + 1) * self.batch_size))
            )
            batch = {k: v.to(device) for k, v in self.pairs.batch(rows).items()}
            out = model(**batch)
            targets = batch["labels"][:, 1:]
            real = batch["decoder_padding_mask"][:, 1:] & batch["decoder_padding_mask"][:, :-1]
            n = int(real.sum())
            loss_sum += float(out.loss) * n
            scored += n
            correct += int(((out.logits[:, :-1].argmax(-1) == targets) & real).sum())
            if self.generate:
                limit = model.config.decoder.max_seq_len - 1
                tokens = model.generate(
                    batch["input_ids"], limit, batch["key_padding_mask"], temperature=0
                )
                for row, ids in zip(rows, self._decoded(tokens)):
                    exact.append(ids == self.pairs.targets[row])
                    rouge.append(rouge_l(self._units(ids), self._units(self.pairs.targets[row])))
        loss = loss_sum / max(scored, 1)
        metrics = {"val_loss": loss, "token_accuracy": correct / max(scored, 1)}
        if self.generate:
            metrics |= {"rouge_l": sum(rouge) / len(rouge), "exact_match": sum(exact) / len(exact)}
        return metrics


# What a seq2seq --resume keeps, beside the fields the task's pairs and split come from (but
# where they are cached): the order they come in.
RESUME_KEEPS = {"train": DATA_ORDER}


def train_seq2seq(run: Seq2SeqRunConfig, data: Seq2SeqData | None = None) -> TrainResult:
    """Trains an encoder-decoder per `run` (under torchrun: one process of a DDP job).

    Args:
        run: model, training and data settings.
        data: the task's pairs, to share them between runs (else loaded here).

    Returns:
        The run's records, final validation metrics (loss, token accuracy) and throughput.
    """
    check_run_dir(run.train.output_dir, resume=run.train.resume)  # before the data loads
    checkpoint = latest_checkpoint(run.train.output_dir) if run.train.resume else None
    if run.train.resume:
        continues = f"the training of {checkpoint and checkpoint.path} on its pairs and order"
        pairs = tuple(name for name in run.data.read() if name != "cache_dir")
        check_resume_keeps(checkpoint, run, {"data": pairs, **RESUME_KEEPS}, continues)
    data = data or load_seq2seq_data(run.data)
    config = run.model.config(data, run.data)
    settings = run.train
    with distributed_job(settings.device) as dist:
        torch.manual_seed(settings.seed)  # every rank starts from the same weights
        model = LinformerForSeq2SeqLM(config)
        schedule = RowSchedule.for_run(len(data.train), settings, dist.world_size)
        evaluator = Seq2SeqEvaluator(
            data.val, settings.batch_size, settings.eval_batches, verbose=dist.is_main
        )
        batches = Seq2SeqBatches(data.train, schedule)
        result = Trainer(
            model=model,
            batches=batches,
            evaluator=evaluator,
            settings=settings,
            dist=dist,
            run_config=run,
            tokenizer=data.tokenizer,
            loss_fn=batches.loss,
            checkpoint=checkpoint,
            data_source=data.digest(),
        ).fit()
        return result


def evaluate_seq2seq(
    path: str | Path,
    *,
    split: str = "test",
    batch_size: int = 16,
    max_examples: int = 0,
    device: str = "auto",
    threads: int = 0,
) -> dict[str, float]:
    """Scores a seq2seq checkpoint on its task's val or test split: loss, token accuracy,
    and ROUGE-L and exact match of greedy decodes. The task and split come from the
    checkpoint's run_config.json, so the pairs are the ones held out in training.

    Args:
        path: a checkpoint directory (e.g. runs/seq2seq/best).
        split: val or test.
        batch_size: pairs per batch.
        max_examples: score the first N pairs only (0 = all).
        device: auto, cpu or cuda.
        threads: CPU threads (0 = torch's default).

    Raises:
        ValueError / FileNotFoundError: for a bad split or a missing or corrupt checkpoint.
    """
    check_choice("split", split, SPLITS)
    if batch_size < 1 or max_examples < 0:
        raise ValueError(
            f"need batch_size >= 1 and max_examples >= 0; got {batch_size} and {max_examples}"
        )
    use_threads(threads)
    architecture = hub.read_config(path)["architecture"]
    if architecture != LinformerForSeq2SeqLM.__name__:
        raise ValueError(
            f"{path} is a {architecture}, not an encoder-decoder: evaluate it with "
            f"`linformer evaluate {path} --data ...`"
        )
    run = Seq2SeqRunConfig.load(path)
    data = load_seq2seq_data(run.data)
    pairs = getattr(data, split)
    if max_examples:
        pairs = pairs.subset(list(range(min(max_examples, len(pairs)))))
    target = resolve_device(device)
    model = LinformerForSeq2SeqLM.from_pretrained(path).to(target)
    evaluator = Seq2SeqEvaluator(
        pairs, batch_size, tokenizer=data.tokenizer, generate=True, verbose=True
    )
    return {"examples": float(len(pairs)), **evaluator(model, target)}
