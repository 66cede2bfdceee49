"""Self-distillation of a converted Linformer against its exact teacher.

The student (`convert_hf_model` with a k) learns to reproduce the exact teacher's outputs at
full length: the loss is the relative squared error of every layer's hidden state plus
(1 - cosine) of the mean-pooled last hidden state, the sentence embedding that is scored.
By default every weight trains (at a fine-tuning learning rate), so the rest of the network
adapts to keys and values pooled into k mixtures; `trainable='projections'` trains only the
sequence projections (the paper's E, F) and keeps the pretrained weights as they were.
The teacher's targets are computed batch by batch, so the distillation text is not limited by
memory (precomputed, 4096 MiniLM windows of 512 tokens would hold 19 GB of targets).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..checks import check_choice, check_finite_non_negative
from ..config import LinformerConfig
from ..embeddings import masked_mean
from ..models import LinformerModel
from ..precision import bf16_autocast
from ..training.distributed import resolve_device
from ..training.optim import build_optimizer, build_scheduler
from ..training.settings import TrainSettings
from .report import sentence_embeddings, trim_padding

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
        default="all", metadata={"help": "what trains: all weights, or projections only"}
    )
    max_steps: int = field(default=60, metadata={"help": "optimiser steps"})
    batch_size: int = field(default=4, metadata={"help": "full-length windows per step"})
    lr: float = field(default=1e-4, metadata={"help": "peak learning rate (AdamW)"})
    warmup_steps: int = field(default=10, metadata={"help": "linear warm-up steps"})
    layer_weight: float = field(
        default=1.0, metadata={"help": "weight of the per-layer hidden-state error"}
    )
    eval_every: int = field(
        default=0, metadata={"help": "held-out cosine every N steps (0 = before and after)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the window order"})
    device: str = field(
        default="auto", metadata={"help": "auto (CUDA when available), cpu, cuda or cuda:N"}
    )
    precision: str = field(
        default="fp32",
        metadata={"help": "fp32, or bf16 autocast of the student (the teacher stays fp32)"},
    )

    def __post_init__(self) -> None:
        check_choice("trainable", self.trainable, TRAINABLES)
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        check_finite_non_negative("layer_weight", self.layer_weight)
        if self.device != "auto":
            self.torch_device()  # names the allowed devices, or says CUDA is missing
        self.train_settings()  # validates steps, batch size, lr, warm-up and precision

    def torch_device(self) -> torch.device:
        """The device distillation runs on (teacher targets, student and held-out windows).

        Raises:
            ValueError: for an unknown device, or CUDA asked for on a machine without it.
        """
        return resolve_device(self.device)

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
            precision=self.precision,
            seed=self.seed,
        )


@dataclass
class HeldOut:
    """Scored windows (or padded documents) and the teacher's sentence embeddings of them."""

    ids: Tensor  # (B, N)
    reference: Tensor  # (B, dim)
    key_padding_mask: Tensor | None = None  # (B, N), True at real tokens; None: no padding

    @classmethod
    def from_teacher(
        cls, teacher: LinformerModel, ids: Tensor, key_padding_mask: Tensor | None = None
    ) -> HeldOut:
        """Embeds `ids` with the exact teacher (on `ids`' device)."""
        reference = sentence_embeddings(teacher, ids, key_padding_mask=key_padding_mask)
        return cls(ids, reference, key_padding_mask)

    def to(self, device: torch.device) -> HeldOut:
        """These windows and embeddings on `device`."""
        mask = None if self.key_padding_mask is None else self.key_padding_mask.to(device)
        return HeldOut(self.ids.to(device), self.reference.to(device), mask)

    def cosine(self, model: LinformerModel) -> Tensor:
        """Per-window cosine of `model`'s sentence embeddings vs the teacher's: (B,)."""
        got = sentence_embeddings(model, self.ids, key_padding_mask=self.key_padding_mask)
        return F.cosine_similarity(got, self.reference, dim=-1)


@torch.no_grad()
def layer_outputs(
    model: LinformerModel, ids: Tensor, batch_size: int = 8, key_padding_mask: Tensor | None = None
) -> Tensor:
    """Every layer's output (the embeddings excluded): (B, N) -> (depth, B, N, dim)."""
    masks = [None] * len(ids) if key_padding_mask is None else key_padding_mask.split(batch_size)
    chunks = [
        torch.stack(model(chunk, mask, output_hidden_states=True).hidden_states[1:])
        for chunk, mask in zip(ids.split(batch_size), masks)
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


def hidden_state_loss(
    student: Sequence[Tensor],
    teacher: Tensor,
    layer_weight: float,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Mean relative squared error of the layer outputs, times `layer_weight`, plus the mean
    (1 - cosine) of the mean-pooled last layer; padded positions count in neither.

    Args:
        student: the student's layer outputs, depth x (B, N, dim).
        teacher: the teacher's, (depth, B, N, dim).
        layer_weight: weight of the hidden-state term.
        key_padding_mask: (B, N), True at real tokens; None: every position is real.
    """
    layers = torch.stack(student)  # (L, B, N, D)
    real = torch.ones_like(teacher[0, :, :, 0]) if key_padding_mask is None else key_padding_mask
    weights = real.to(teacher.dtype)[None, :, :, None]  # (1, B, N, 1)
    squared = ((layers - teacher).pow(2) * weights).sum((1, 2, 3))  # (L,)
    error = squared / (teacher.pow(2) * weights).sum((1, 2, 3))
    pooled = [masked_mean(hidden[-1], key_padding_mask) for hidden in (layers, teacher)]
    cosine = F.cosine_similarity(*pooled, dim=-1)  # (B,)
    return layer_weight * error.mean() + (1 - cosine).mean()


def set_trainable(model: LinformerModel, trainable: str) -> list[torch.nn.Parameter]:
    """Freezes all but the trained parameters and returns those.

    Raises:
        ValueError: if `trainable='projections'` and the projections hold no parameters.
    """
    check_choice("trainable", trainable, TRAINABLES)
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
    teacher: LinformerModel,
    ids: Tensor,
    settings: DistillSettings,
    *,
    key_padding_mask: Tensor | None = None,
    heldout: HeldOut | None = None,
) -> list[dict[str, float | None]]:
    """Trains `student` in place to reproduce the exact `teacher`'s layer outputs on `ids`.

    Dropout stays off (eval mode): the target is the teacher's deterministic output, computed
    in fp32 for each batch. Both models, the windows and `heldout` are moved to
    `settings.device` (a no-op where they are); the student stays there.

    Args:
        student: the converted Linformer.
        teacher: the exact model it was converted from (`convert_hf_model(..., proj_dim=None)`).
        ids: (B, N) distillation windows, or right-padded documents; keep them apart from
            the scored text.
        settings: the recipe.
        key_padding_mask: (B, N), True at real tokens, for padded documents (each batch is
            cut to its longest; padding counts in no loss term).
        heldout: scored before training, every `eval_every` steps and at the end.

    Returns:
        One record per evaluation: step, mean training loss since the last record (None
        at step 0) and, with `heldout`, the cosine mean and min.

    Raises:
        ValueError: on mismatched models or shapes, nothing to train or an unavailable device.
    """
    check_student(student.config, teacher.config)
    if ids.dim() != 2 or ids.shape[1] > student.config.max_seq_len:
        raise ValueError(
            f"ids {tuple(ids.shape)} must be (batch, length <= max_seq_len="
            f"{student.config.max_seq_len})"
        )
    if key_padding_mask is not None and key_padding_mask.shape != ids.shape:
        raise ValueError(
            f"key_padding_mask {tuple(key_padding_mask.shape)} must match ids {tuple(ids.shape)}"
        )
    device = settings.torch_device()
    student.to(device)
    teacher.to(device).eval()
    ids = ids.to(device)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(device)
    if heldout is not None:
        heldout = heldout.to(device)
    params = set_trainable(student, settings.trainable)
    recipe = settings.train_settings()
    optimizer = build_optimizer(student, recipe)
    scheduler = build_scheduler(optimizer, recipe)
    autocast = bf16_autocast(
        device, enabled=recipe.precision == "bf16", alternative="--precision fp32"
    )
    student.eval()
    history = [_record(student, 0, None, heldout)]
    losses: list[float] = []
    batches = _batches(len(ids), settings.batch_size, settings.seed)
    bar = tqdm(range(1, settings.max_steps + 1), desc=f"distill k={student.config.proj_dim}")
    try:
        for step in bar:
            rows = next(batches)
            batch, mask = ids[rows], None
            if key_padding_mask is not None:
                batch, mask = trim_padding(batch, key_padding_mask[rows])
            targets = layer_outputs(teacher, batch, key_padding_mask=mask)
            with autocast:
                out = student(batch, mask, output_hidden_states=True)
            layers = [hidden.float() for hidden in out.hidden_states[1:]]
            loss = hidden_state_loss(layers, targets, settings.layer_weight, mask)
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
) -> dict[str, float | None]:
    record: dict[str, float | None] = {"step": step, "loss": loss and round(loss, 5)}
    if heldout is not None:
        cosine = heldout.cosine(model)
        record["cosine_mean"] = round(cosine.mean().item(), 4)
        record["cosine_min"] = round(cosine.min().item(), 4)
    logger.info("distillation %s", record)
    return record
