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
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..config import LinformerConfig, check_choice
from ..data.corpus import list_files
from ..models import LinformerModel
from ..precision import bf16_autocast
from ..training.distributed import resolve_device
from ..training.optim import build_optimizer, build_scheduler
from ..training.settings import TrainSettings
from .bert import convert_hf_model
from .report import (
    TOKENIZER_NAME,
    calibration_ids,
    sentence_embeddings,
    stdlib_files,
    text_windows,
)

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
        if self.layer_weight < 0:
            raise ValueError(f"layer_weight must be >= 0, got {self.layer_weight}")
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
    """Scored windows and the teacher's sentence embeddings of them."""

    ids: Tensor  # (B, N)
    reference: Tensor  # (B, dim)

    @classmethod
    def from_teacher(cls, teacher: LinformerModel, ids: Tensor) -> HeldOut:
        """Embeds `ids` with the exact teacher (on `ids`' device)."""
        return cls(ids, sentence_embeddings(teacher, ids))

    def to(self, device: torch.device) -> HeldOut:
        """These windows and embeddings on `device`."""
        return HeldOut(self.ids.to(device), self.reference.to(device))

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


def distillation_loss(student: Sequence[Tensor], teacher: Tensor, layer_weight: float) -> Tensor:
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
    heldout: HeldOut | None = None,
) -> list[dict[str, float | None]]:
    """Trains `student` in place to reproduce the exact `teacher`'s layer outputs on `ids`.

    Dropout stays off (eval mode): the target is the teacher's deterministic output, computed
    in fp32 for each batch. Both models, the windows and `heldout` are moved to
    `settings.device` (a no-op where they are); the student stays there.

    Args:
        student: the converted Linformer.
        teacher: the exact model it was converted from (`convert_hf_model(..., proj_dim=None)`).
        ids: (B, N) distillation windows; keep them apart from the scored text.
        settings: the recipe.
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
    device = settings.torch_device()
    student.to(device)
    teacher.to(device).eval()
    ids = ids.to(device)
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
            batch = ids[next(batches)]
            targets = layer_outputs(teacher, batch)
            with autocast:
                out = student(batch, output_hidden_states=True)
            layers = [hidden.float() for hidden in out.hidden_states[1:]]
            loss = distillation_loss(layers, targets, settings.layer_weight)
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


@dataclass(kw_only=True)
class DistillData:
    """Which windows are distilled on and which are scored (also `linformer distill` flags)."""

    texts: int = field(default=256, metadata={"help": "distillation windows"})
    per_file: int = field(default=8, metadata={"help": "most distillation windows per file"})
    heldout_texts: int = field(default=64, metadata={"help": "held-out windows scored"})
    calibration_texts: int = field(
        default=16, metadata={"help": "calibration windows of the attention init"}
    )
    glob: str = field(default="**/*.txt", metadata={"help": "files read inside --data dirs"})


def distillation_files(data: list[str] | None, glob: str) -> list[Path]:
    """The files distilled on: those `data` names (files, or directories' `glob` matches), or
    the stdlib's calibration split when None.

    Raises:
        FileNotFoundError: for a missing path or a directory without matches.
        ValueError: if a file is one of the held-out files the cosine is scored on.
    """
    if not data:
        return stdlib_files("calibration")
    files = [file for spec in data for file in list_files(spec, glob)]
    scored = {file.resolve() for file in stdlib_files("heldout")}
    overlap = [file for file in files if file.resolve() in scored]
    if overlap:
        raise ValueError(
            f"{len(overlap)} data files (e.g. {overlap[0]}) are held-out files the cosine is "
            "scored on; distil on other text (default: the stdlib's calibration split)"
        )
    return files


def distill_checkpoint(
    teacher_dir: str | os.PathLike,
    student_dir: str | os.PathLike,
    settings: DistillSettings,
    data: DistillData,
    *,
    files: list[Path],
    proj_dim: int = 128,
    sharing: str = "layerwise",
) -> list[dict[str, float | None]]:
    """Distils the Linformer in `student_dir` against the exact `teacher_dir` and saves it
    back there (with the teacher's tokenizer.json). A `student_dir` without a model is first
    filled by converting the teacher with `proj_dim`, `sharing` and the attention init.

    Args:
        teacher_dir: Hugging Face BERT/RoBERTa directory with tokenizer.json.
        student_dir: Linformer model directory (`linformer convert` output), or a new one.
        settings: the recipe.
        data: window counts.
        files: the distillation text (`distillation_files`).
        proj_dim: k of a newly converted student.
        sharing: sharing of a newly converted student.

    Returns:
        `distill`'s history, scored on `data.heldout_texts` stdlib held-out windows.

    Raises:
        FileNotFoundError: for a missing teacher, tokenizer or data file.
        ValueError: if the student does not match the teacher, or on bad settings.
    """
    teacher_dir, student_dir = Path(teacher_dir), Path(student_dir)
    device = settings.torch_device()
    teacher = convert_hf_model(teacher_dir, proj_dim=None).to(device)
    tokenizer = teacher_dir / TOKENIZER_NAME
    calibration = calibration_ids(teacher_dir, data.calibration_texts)  # checks tokenizer.json
    n = teacher.config.max_seq_len
    if (student_dir / "config.json").is_file():
        student = LinformerModel.from_pretrained(student_dir)
    else:
        logger.info("no model in %s: converting %s at k=%d", student_dir, teacher_dir, proj_dim)
        student = convert_hf_model(
            teacher_dir, proj_dim=proj_dim, sharing=sharing, calibration_ids=calibration
        )
    ids = text_windows(tokenizer, files, n, data.texts, per_file=data.per_file)
    heldout_ids = text_windows(tokenizer, stdlib_files("heldout"), n, data.heldout_texts)
    history = distill(
        student,
        teacher,
        ids,
        settings,
        heldout=HeldOut.from_teacher(teacher, heldout_ids.to(device)),
    )
    student.cpu().save_pretrained(student_dir)
    shutil.copy(tokenizer, student_dir / TOKENIZER_NAME)
    return history
