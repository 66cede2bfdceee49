"""Deterministic batches: which rows every process reads at every step, and their masking.

A batch is a pure function of (seed, step, micro-batch, rank), so a resumed run reads exactly
the data an uninterrupted run would have read, and each DDP rank reads its own share.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..data.cache import PackedBlocks
from ..data.masking import IGNORE_INDEX, mask_tokens
from ..data.tokenizer import TextTokenizer
from .settings import TrainSettings

logger = logging.getLogger(__name__)

EVAL_SEED = 1234  # validation masking is fixed, so every evaluation scores the same tokens
# set apart from the other seeds drawn from the run's (an epoch's order, a rank's dropout),
# which a bare place in the stream would equal
MASKING = 0x6D61736B


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (a simple polynomial hash)."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + part) % (2**63 - 1)
    return value


@lru_cache(maxsize=4)
def epoch_order(size: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The shuffled order of `size` rows in `epoch`."""
    generator = torch.Generator().manual_seed(mix_seed(seed, epoch))
    return tuple(torch.randperm(size, generator=generator).tolist())


@dataclass
class RowSchedule:
    """Maps (step, micro-batch, rank) to dataset rows: the global stream of shuffled epochs is
    consumed `batch_size * grad_accum_steps * world_size` rows per step."""

    size: int
    batch_size: int
    grad_accum_steps: int
    world_size: int
    seed: int

    @classmethod
    def for_run(cls, size: int, train: TrainSettings, world_size: int) -> RowSchedule:
        """The schedule of a training run over `size` rows on `world_size` processes."""
        return cls(size, train.batch_size, train.grad_accum_steps, world_size, train.seed)

    def positions(self, step: int, micro: int, rank: int) -> range:
        """Places in the data stream of one micro-batch's rows: the same for N processes as
        for one process's N micro-batches."""
        per_step = self.batch_size * self.grad_accum_steps * self.world_size
        first = step * per_step + (micro * self.world_size + rank) * self.batch_size
        return range(first, first + self.batch_size)

    def rows(self, step: int, micro: int, rank: int) -> list[int]:
        """Dataset rows of one micro-batch."""
        places = (divmod(place, self.size) for place in self.positions(step, micro, rank))
        return [epoch_order(self.size, self.seed, epoch)[offset] for epoch, offset in places]

    def position(self, step: int) -> dict[str, int]:
        """Where the data stream stands before `step`: epoch and offset in it."""
        per_step = self.batch_size * self.grad_accum_steps * self.world_size
        epoch, offset = divmod(step * per_step, self.size)
        return {"epoch": epoch, "offset": offset}


def language_model_loss(model: nn.Module, batch: dict[str, Tensor], *, causal: bool) -> Tensor:
    """The loss of a causal or masked LM (or, as causal, an encoder-decoder) on `batch`
    (input_ids, labels, ...), without the logits (`return_logits=False`: the head and loss
    in chunks of rows); a masked LM's head runs only at the scored positions
    (`LinformerForMaskedLM`'s `scored_only`)."""
    return model(**batch, return_logits=False, **({} if causal else {"scored_only": True})).loss


@dataclass
class LMBatches:
    """Packed blocks for language modelling: fresh RoBERTa masking per step (dynamic masking),
    or, with `causal`, the blocks unmasked for next-token prediction."""

    blocks: PackedBlocks
    tokenizer: TextTokenizer
    schedule: RowSchedule
    mlm_probability: float = 0.15
    causal: bool = False

    def micro_batch(self, step: int, micro: int, rank: int) -> dict[str, Tensor]:
        """input_ids and labels (B, N) of one micro-batch."""
        # seeded by place: a block read twice in a step (a corpus of fewer blocks than a
        # step's rows) is masked twice, not copied
        places = self.schedule.positions(step, micro, rank)
        seeds = [mix_seed(self.schedule.seed, MASKING, place) for place in places]
        return self.label_rows(self.schedule.rows(step, micro, rank), seeds)

    def label_rows(self, rows: list[int], seeds: list[int]) -> dict[str, Tensor]:
        """input_ids and labels (B, N) of blocks `rows`, each masked by its own seed: a
        block's masks do not depend on the batch or the process that holds it (seeded by
        micro-batch and rank, N processes masked other tokens than one process with N
        micro-batches; validation's scored tokens moved with --batch-size)."""
        if self.causal:
            return self.label(self.blocks.batch(rows), torch.Generator())
        parts = [
            self.label(self.blocks.batch([row]), torch.Generator().manual_seed(seed))
            for row, seed in zip(rows, seeds, strict=True)
        ]
        return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}

    def label(self, ids: Tensor, generator: torch.Generator) -> dict[str, Tensor]:
        """input_ids and labels of blocks `ids` (B, N): causal labels are the inputs (the
        model shifts them), masked ones the tokens at the masked positions."""
        if self.causal:
            return {"input_ids": ids, "labels": ids}
        inputs, labels = mask_tokens(
            ids,
            mask_id=self.tokenizer.mask_id,
            vocab_size=self.tokenizer.vocab_size,
            special_ids=self.tokenizer.special_ids,
            generator=generator,
            mlm_probability=self.mlm_probability,
        )
        return {"input_ids": inputs, "labels": labels}

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        """The model's loss on one of these batches (`language_model_loss`)."""
        return language_model_loss(model, batch, causal=self.causal)

    def scored(self, batch: dict[str, Tensor]) -> int:
        """How many tokens the loss on `batch` averages over (a causal model has no target
        for the first position: it predicts each position's successor)."""
        labels = batch["labels"]
        targets = labels[:, 1:] if self.causal else labels
        return int((targets != IGNORE_INDEX).sum())


@dataclass
class LMEvaluator:
    """Validation loss and perplexity on fixed-masked validation blocks, or next-token ones
    when the batches are causal."""

    batches: LMBatches
    batch_size: int
    max_batches: int = 0  # 0 = every validation block
    verbose: bool = False  # progress bar and warnings (rank 0 only: DDP shows one)
    key: str = field(default="val_loss", init=False)

    @torch.no_grad()
    def __call__(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Mean loss over the scored tokens (weighted by their count) and its exponential."""
        blocks = self.batches.blocks
        count = math.ceil(len(blocks) / self.batch_size)
        count = min(count, self.max_batches) if self.max_batches else count
        # The blocks scored, spread evenly over the validation split, which is in corpus
        # order: its first max_batches x batch_size were the corpus's first files (1.8 % of
        # a 100M-token corpus at the defaults).
        picked = min(len(blocks), count * self.batch_size)
        spread = [row * len(blocks) // picked for row in range(picked)]
        total = scored = 0.0
        for index in tqdm(range(count), desc="validation", leave=False, disable=not self.verbose):
            rows = spread[index * self.batch_size : (index + 1) * self.batch_size]
            batch = self.batches.label_rows(rows, [mix_seed(EVAL_SEED, row) for row in rows])
            n = self.batches.scored(batch)
            if not n:  # no token to score (a batch of separators): its loss is nan
                continue
            loss = self.batches.loss(model, {k: v.to(device) for k, v in batch.items()})
            total += float(loss) * n
            scored += n
        loss = total / scored if scored else math.nan
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


class LabelledRows(Protocol):
    """Labelled examples that pad their own batches: ClassificationData (tokenized files) or
    an LRA split (generated arrays)."""

    labels: Sequence[int]
    source: str

    def __len__(self) -> int: ...

    def batch(self, rows: list[int], pad_id: int) -> dict[str, Tensor]: ...


def in_order(
    data: LabelledRows,
    pad_id: int,
    batch_size: int,
    device: torch.device,
    *,
    desc: str,
    verbose: bool = True,
) -> Iterator[dict[str, Tensor]]:
    """Every example once, in order, as padded batches of `batch_size` on `device` (the last
    one shorter), behind a progress bar named `desc` (hidden when not `verbose`)."""
    starts = range(0, len(data), batch_size)
    for start in tqdm(starts, desc=desc, leave=False, disable=not verbose):
        rows = list(range(start, min(len(data), start + batch_size)))
        yield {k: v.to(device) for k, v in data.batch(rows, pad_id).items()}


@dataclass
class ClassificationBatches:
    """Shuffled, padded classification batches."""

    data: LabelledRows
    pad_id: int
    schedule: RowSchedule
    teacher_logits: Tensor | None = None  # (len(data), C): a teacher's, for distillation

    def micro_batch(self, step: int, micro: int, rank: int) -> dict[str, Tensor]:
        """input_ids, key_padding_mask (B, N) and labels (B,) of one micro-batch, and the
        teacher's logits of its rows (B, C) when there are some."""
        rows = self.schedule.rows(step, micro, rank)
        batch = self.data.batch(rows, self.pad_id)
        if self.teacher_logits is not None:
            batch["teacher_logits"] = self.teacher_logits[rows]
        return batch


@dataclass
class ClassificationEvaluator:
    """Loss, accuracy and macro F1 on a labelled set."""

    data: LabelledRows
    pad_id: int
    batch_size: int
    num_labels: int
    verbose: bool = False  # progress bar and warnings (rank 0 only: DDP shows one)
    key: str = field(default="val_loss", init=False)

    @torch.no_grad()
    def __call__(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Metrics over every example."""
        predictions, total = [], 0.0
        batches = in_order(
            self.data, self.pad_id, self.batch_size, device, desc="validation", verbose=self.verbose
        )
        for batch in batches:
            out = model(**batch)
            total += float(out.loss) * len(batch["labels"])
            predictions += out.logits.argmax(-1).tolist()
        metrics = classification_metrics(predictions, self.data.labels, self.num_labels)
        if self.verbose and len(set(predictions)) == 1 < len(set(self.data.labels)):
            logger.warning(
                "every prediction on %s is class %d (accuracy %.3f, F1 %.3f): the classifier "
                "does not tell the classes apart. Likely causes: a learning rate too high or "
                "too low (--lr), too few steps (--epochs, --max-steps), or texts truncated "
                "before the words that decide the label (--max-seq-len)",
                self.data.source,
                predictions[0],
                metrics["accuracy"],
                metrics["f1"],
            )
        return {"val_loss": total / len(self.data), **metrics}


def classification_metrics(
    predictions: list[int], labels: list[int], num_labels: int
) -> dict[str, float]:
    """Accuracy and macro-averaged F1 (classes absent from both lists are skipped)."""
    accuracy = sum(p == y for p, y in zip(predictions, labels)) / len(labels)
    scores = []
    for c in range(num_labels):
        tp = sum(p == c and y == c for p, y in zip(predictions, labels))
        fp = sum(p == c and y != c for p, y in zip(predictions, labels))
        fn = sum(p != c and y == c for p, y in zip(predictions, labels))
        if tp + fp + fn:
            scores.append(2 * tp / (2 * tp + fp + fn))
    return {"accuracy": accuracy, "f1": sum(scores) / len(scores)}


def real_tokens(batch: dict[str, Tensor]) -> int:
    """The real tokens a batch feeds the model, the decoder's included (a seq2seq run counted
    its sources alone: 2.5x too few on the copy task); padding is no token read (64 % more
    in a padded fine-tuning batch)."""
    count = 0
    for ids, mask in (
        ("input_ids", "key_padding_mask"),
        ("decoder_input_ids", "decoder_padding_mask"),
    ):
        if ids in batch:
            count += int(batch[mask].sum()) if mask in batch else batch[ids].numel()
    return count
