"""What the training loop takes and gives: the batch source and evaluator it calls, the
settings it saves, the result it returns and the interruption it raises."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor


class BatchSource(Protocol):
    """Anything that yields the micro-batch of (step, micro-batch index, rank). A source
    whose micro-batches score different numbers of targets (masked tokens, padded targets)
    also has `scored(batch) -> int`, how many the loss on `batch` averages over: the step
    then weighs each micro-batch by it (`Trainer._loss_weights`)."""

    def micro_batch(self, step: int, micro: int, rank: int) -> dict[str, Tensor]: ...


Evaluator = Callable[[torch.nn.Module, torch.device], dict[str, float]]


class SavedConfig(Protocol):
    """A run's settings (RunConfig, FinetuneRunConfig) that write themselves as JSON."""

    def save(self, path: Path) -> None: ...


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; `step` is the step reached, `run_dir` holds the checkpoints."""

    def __init__(self, step: int, run_dir: Path) -> None:
        super().__init__(f"interrupted at step {step}")
        self.step, self.run_dir = step, run_dir

    def __reduce__(self) -> tuple[type, tuple[int, Path]]:
        # pickled whole: a run in a fresh process (`in_fresh_process`) raises it in its parent
        return type(self), (self.step, self.run_dir)


@dataclass
class TrainResult:
    """What a run measured: every metrics record, the final validation and throughput."""

    records: list[dict[str, Any]]
    final: dict[str, float]
    steps: int
    params: int
    tokens_per_s: float
    sec_per_step: float
    peak_mem_mb: float
    run_dir: Path
    best_val: float
