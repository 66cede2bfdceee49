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


def mark_stopped(error: Exception, step: int, run_dir: Path) -> None:
    """Marks an error that ended training at `step` (its traceback's last line says so).

    In a job of several processes, a peer's death reaches the others as an error in a
    collective, and torchrun's SIGTERM follows while it unwinds: the interrupt that reaches
    the command then finds the step and the checkpoints here (`stopped_at`).
    """
    try:
        error.add_note(f"training stopped at step {step} of {run_dir}")
        error.linformer_stopped_at = TrainingInterrupted(step, run_dir)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):  # a frozen exception: raised as it is, unmarked
        pass


def stopped_at(interrupt: KeyboardInterrupt) -> tuple[TrainingInterrupted | None, str]:
    """Where training stopped for an interrupt, and the error it came after ("" if none):
    the interrupt itself for Ctrl-C in the loop; for one that came while an error that ended
    training unwound, that error's mark (`mark_stopped`). Other errors the interrupt came
    during (one handled, as a lock's first try) are not named."""
    if isinstance(interrupt, TrainingInterrupted):
        return interrupt, ""
    error = interrupt.__context__
    while error is not None and not hasattr(error, "linformer_stopped_at"):
        error = error.__context__
    if error is None:
        return None, ""
    first = (str(error).strip().splitlines() or [""])[0]
    return error.linformer_stopped_at, f"{type(error).__name__}: {first}".rstrip(": ")


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
