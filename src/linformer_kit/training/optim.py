"""AdamW with decoupled weight decay (not on norms, biases, projections' bias) and a warm-up +
linear / cosine decay schedule."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..models import LinformerModel
from .settings import TrainSettings


def build_optimizer(model: nn.Module, settings: TrainSettings) -> torch.optim.AdamW:
    """AdamW over every trainable parameter once (shared projections included once);
    one-dimensional tensors (biases, LayerNorm weights) get no weight decay.

    A task model's pooler, frozen and not run (`LinformerModel(pooled=False)`), stays in its
    group without a gradient (AdamW skips it): runs that trained it until 2026-11-29 saved
    optimizer states that count it, and resume."""
    unrun = _unrun_pooler(model)
    params = [p for p in model.parameters() if p.requires_grad or id(p) in unrun]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, settings.beta2), eps=1e-6)


def _unrun_pooler(model: nn.Module) -> set[int]:
    """The ids of the parameters of the poolers `model`'s backbones keep but do not run."""
    return {
        id(p)
        for m in model.modules()
        if isinstance(m, LinformerModel) and m.pooler is not None and not m.pooled
        for p in m.pooler.parameters()
    }


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, state: dict[str, Any], model: nn.Module
) -> None:
    """Loads a checkpoint's optimizer state, whose groups may leave out the pooler a task
    model keeps without running it (runs that froze it, by hand or, for an hour on
    2026-11-29, by default): then it leaves the groups of `optimizer` too."""
    saved = [len(group["params"]) for group in state["param_groups"]]
    if saved != [len(group["params"]) for group in optimizer.param_groups]:
        unrun = _unrun_pooler(model)
        kept = [[p for p in g["params"] if id(p) not in unrun] for g in optimizer.param_groups]
        if [len(params) for params in kept] == saved:
            for group, params in zip(optimizer.param_groups, kept):
                group["params"] = params
    optimizer.load_state_dict(state)


def apply_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    settings: TrainSettings,
) -> None:
    """Sets this run's lr, weight decay, beta2 and schedule on an optimizer and schedule
    loaded from a checkpoint, whose state dicts bring back the saved run's: a resumed run
    may change them (`--lr`, `--max-steps` under a decaying schedule), and the next step's
    lr is then the new schedule's at the step reached. Unchanged settings give the very
    values the checkpoint held (the same product LambdaLR computes)."""
    scheduler.base_lrs = [settings.lr] * len(optimizer.param_groups)
    decays = (settings.weight_decay, 0.0)
    for group, decay in zip(optimizer.param_groups, decays):
        group.update(initial_lr=settings.lr, weight_decay=decay, betas=(0.9, settings.beta2))
        group["lr"] = settings.lr * lr_factor(scheduler.last_epoch, settings)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def lr_factor(step: int, settings: TrainSettings) -> float:
    """Multiplier of the peak learning rate at `step`: linear warm-up, then decay to 0."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    if settings.schedule == "constant":
        return 1.0
    span = max(1, settings.max_steps - settings.warmup_steps)
    progress = min(1.0, (step - settings.warmup_steps) / span)
    if settings.schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


def build_scheduler(
    optimizer: torch.optim.Optimizer, settings: TrainSettings
) -> torch.optim.lr_scheduler.LambdaLR:
    """The warm-up + decay schedule as a LambdaLR (its state goes into checkpoints)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, settings))
