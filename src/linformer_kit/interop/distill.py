"""Self-distillation of a converted Linformer against its exact teacher.

The student (`convert_hf_model` with a k) learns to reproduce the exact teacher's outputs at
full length: the loss is the relative squared error of every layer's hidden state plus
(1 - cosine) of the mean-pooled last hidden state, the sentence embedding that is scored.
By default only the sequence projections (the paper's E, F) train; the pretrained weights
stay as they were, so what distillation changes is which k mixtures of positions the keys
and values are pooled into.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..config import LinformerConfig
from ..models import LinformerModel
from ..training.optim import build_optimizer, build_scheduler
from ..training.settings import TrainSettings
from .report import sentence_embeddings

logger = logging.getLogger(__name__)

TRAINABLES = ("projections", "all")
# Fields that must agree for the student to load the teacher's weights.
ARCHITECTURE = (
    "vocab_size",
    "max_seq_len",
    "dim",
    "depth",
    "num_heads",
    "ffn_dim",
    "activation",
    "norm_first",
    "position",
    "type_vocab_size",
)


@dataclass(kw_only=True)
class DistillSettings:
    """Settings of `distill` (also the `linformer distill` flags)."""

    trainable: str = field(
        default="projections", metadata={"help": "what trains: projections, or all weights"}
    )
    max_steps: int = field(default=120, metadata={"help": "optimiser steps"})
    batch_size: int = field(default=4, metadata={"help": "full-length windows per step"})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate (AdamW)"})
    warmup_steps: int = field(default=10, metadata={"help": "linear warm-up steps"})
    layer_weight: float = field(
        default=1.0, metadata={"help": "weight of the per-layer hidden-state error"}
    )
    eval_every: int = field(
        default=0, metadata={"help": "held-out cosine every N steps (0 = before and after)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the window order"})

    def __post_init__(self) -> None:
        if self.trainable not in TRAINABLES:
            raise ValueError(
                f"trainable must be one of {', '.join(TRAINABLES)}; got {self.trainable!r}"
            )
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.layer_weight < 0:
            raise ValueError(f"layer_weight must be >= 0, got {self.layer_weight}")
        self.train_settings()  # validates steps, batch size, lr and warm-up

    def train_settings(self) -> TrainSettings:
        """The optimiser / schedule recipe: AdamW without weight decay (it would pull the
        block-mean projections towards zero), warm-up then cosine decay."""
        return TrainSettings(
            max_steps=self.max_steps,
            batch_size=self.batch_size,
            lr=self.lr,
            weight_decay=0.0,
            warmup_steps=self.warmup_steps,
            schedule="cosine",
            seed=self.seed,
        )


@dataclass
class HeldOut:
    """Scored windows and the teacher's sentence embeddings of them."""

    ids: Tensor  # (B, N)
    reference: Tensor  # (B, dim)

    @classmethod
    def from_teacher(cls, teacher: LinformerModel, ids: Tensor) -> HeldOut:
        """Embeds `ids` with the exact teacher."""
        return cls(ids, sentence_embeddings(teacher, ids))

    def cosine(self, model: LinformerModel) -> Tensor:
        """Per-window cosine of `model`'s sentence embeddings vs the teacher's: (B,)."""
        return F.cosine_similarity(sentence_embeddings(model, self.ids), self.reference, dim=-1)


@torch.no_grad()
def layer_outputs(model: LinformerModel, ids: Tensor, batch_size: int = 8) -> Tensor:
    """Every layer's output (the embeddings excluded): (B, N) -> (depth, B, N, dim)."""
    chunks = [
        torch.stack(model(chunk, output_hidden_states=True).hidden_states[1:])
        for chunk in ids.split(batch_size)
    ]
    return torch.cat(chunks, dim=1)


def check_student(student: LinformerConfig, teacher: LinformerConfig) -> None:
    """Checks that `student` is a Linformer of `teacher`'s architecture.

    Raises:
        ValueError: naming every differing field, or if the student is exact.
    """
    differ = [
        f"{name}: student {getattr(student, name)!r}, teacher {getattr(teacher, name)!r}"
        for name in ARCHITECTURE
        if getattr(student, name) != getattr(teacher, name)
    ]
    if differ:
        raise ValueError("student and teacher architectures differ: " + "; ".join(differ))
    if student.is_exact:
        raise ValueError("the student has exact attention (proj_dim=None): nothing to distill")


def distillation_loss(student: tuple[Tensor, ...], teacher: Tensor, layer_weight: float) -> Tensor:
    """Mean relative squared error of the layer outputs, times `layer_weight`, plus the mean
    (1 - cosine) of the mean-pooled last layer.

    Args:
        student: the student's layer outputs, depth x (B, N, dim).
        teacher: the teacher's, (depth, B, N, dim).
        layer_weight: weight of the hidden-state term.
    """
    layers = torch.stack(student)  # (L, B, N, D)
    error = (layers - teacher).pow(2).mean((1, 2, 3)) / teacher.pow(2).mean((1, 2, 3))  # (L,)
    cosine = F.cosine_similarity(layers[-1].mean(1), teacher[-1].mean(1), dim=-1)  # (B,)
    return layer_weight * error.mean() + (1 - cosine).mean()


def set_trainable(model: LinformerModel, trainable: str) -> list[torch.nn.Parameter]:
    """Freezes all but the trained parameters and returns those.

    Raises:
        ValueError: if `trainable='projections'` and the projections hold no parameters.
    """
    if trainable not in TRAINABLES:
        raise ValueError(f"trainable must be one of {', '.join(TRAINABLES)}; got {trainable!r}")
    for name, param in model.named_parameters():
        param.requires_grad_(trainable == "all" or ".proj_" in name)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            f"projection={model.config.projection!r} has no learned parameters to distil; "
            "use trainable='all' or a linear / conv projection"
        )
    return params


def _batches(count: int, batch_size: int, seed: int) -> Iterator[Tensor]:
    """Endless batches of window indices: a fresh shuffle each pass over the data."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(count, generator=generator)
        yield from order.split(batch_size)


def distill(
    student: LinformerModel,
    ids: Tensor,
    targets: Tensor,
    settings: DistillSettings,
    *,
    heldout: HeldOut | None = None,
) -> list[dict[str, float]]:
    """Trains `student` in place to reproduce the teacher's layer outputs on `ids`.

    Dropout stays off (eval mode): the target is the teacher's deterministic output.

    Args:
        student: the converted Linformer.
        ids: (B, N) distillation windows; keep them apart from the scored text.
        targets: the exact teacher's `layer_outputs` of `ids`, (depth, B, N, dim).
        settings: the recipe.
        heldout: scored before training, every `eval_every` steps and at the end.

    Returns:
        One record per evaluation: step, mean training loss since the last record and,
        with `heldout`, the cosine mean and min.

    Raises:
        ValueError: on mismatched shapes or nothing to train.
    """
    if ids.dim() != 2 or targets.shape[:3] != (student.config.depth, *ids.shape):
        raise ValueError(
            f"targets {tuple(targets.shape)} must be (depth={student.config.depth}, "
            f"*ids.shape={tuple(ids.shape)}, dim)"
        )
    if ids.shape[1] > student.config.max_seq_len:
        raise ValueError(
            f"windows of {ids.shape[1]} tokens exceed max_seq_len={student.config.max_seq_len}"
        )
    params = set_trainable(student, settings.trainable)
    recipe = settings.train_settings()
    optimizer = build_optimizer(student, recipe)
    scheduler = build_scheduler(optimizer, recipe)
    student.eval()
    history = [_record(student, 0, None, heldout)]
    losses: list[float] = []
    batches = _batches(len(ids), settings.batch_size, settings.seed)
    bar = tqdm(range(1, settings.max_steps + 1), desc=f"distill k={student.config.proj_dim}")
    try:
        for step in bar:
            batch = next(batches)
            out = student(ids[batch], output_hidden_states=True)
            loss = distillation_loss(out.hidden_states[1:], targets[:, batch], settings.layer_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, recipe.clip_grad_norm)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            every = settings.eval_every
            if step == settings.max_steps or (every and step % every == 0):
                history.append(_record(student, step, sum(losses) / len(losses), heldout))
                losses.clear()
    finally:
        for param in student.parameters():
            param.requires_grad_(True)
    return history


def _record(
    model: LinformerModel, step: int, loss: float | None, heldout: HeldOut | None
) -> dict[str, float]:
    record: dict[str, float] = {"step": step}
    if loss is not None:
        record["loss"] = round(loss, 5)
    if heldout is not None:
        cosine = heldout.cosine(model)
        record["cosine_mean"] = round(cosine.mean().item(), 4)
        record["cosine_min"] = round(cosine.min().item(), 4)
    logger.info("distillation %s", record)
    return record
