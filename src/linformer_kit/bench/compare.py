"""Train a few steps of Linformer and of the exact Transformer on random tokens, side by side."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..config import LinformerConfig
from ..models import LinformerForMaskedLM


@dataclass(kw_only=True)
class StepComparison:
    """Settings of `compare_training_steps` (also the `linformer demo` flags)."""

    seq_len: int = field(default=2048, metadata={"help": "tokens per sequence"})
    batch_size: int = field(default=2, metadata={"help": "sequences per step"})
    steps: int = field(default=6, metadata={"help": "timed optimiser steps per model"})
    warmup: int = field(default=2, metadata={"help": "untimed steps before timing"})
    dim: int = field(default=256, metadata={"help": "model width"})
    depth: int = field(default=4, metadata={"help": "encoder layers"})
    num_heads: int = field(default=4, metadata={"help": "attention heads"})
    proj_dim: int = field(default=256, metadata={"help": "Linformer's k"})
    sharing: str = field(default="layerwise", metadata={"help": "none, headwise, kv, layerwise"})
    vocab_size: int = field(default=8000, metadata={"help": "random-token vocabulary"})
    seed: int = field(default=0, metadata={"help": "seed for weights and tokens"})


def compare_training_steps(settings: StepComparison) -> list[dict[str, float | str | int]]:
    """Times masked-LM training steps of Linformer and exact attention with identical
    shapes, data and seed.

    Args:
        settings: model shape, sequence length and step counts.

    Returns:
        One row per model: name, parameters, first and last loss, median seconds per step.
    """
    base = LinformerConfig(
        vocab_size=settings.vocab_size,
        max_seq_len=settings.seq_len,
        dim=settings.dim,
        depth=settings.depth,
        num_heads=settings.num_heads,
        proj_dim=settings.proj_dim,
        sharing=settings.sharing,
        dropout=0.0,
        attention_dropout=0.0,
    )
    generator = torch.Generator().manual_seed(settings.seed)
    total = settings.warmup + settings.steps
    shape = (total, settings.batch_size, settings.seq_len)
    inputs = torch.randint(0, settings.vocab_size, shape, generator=generator)
    scored = torch.rand(shape, generator=generator) < 0.15
    labels = torch.where(scored, inputs, torch.full_like(inputs, -100))
    rows = []
    for name, config in (
        (f"Linformer k={settings.proj_dim}", base),
        ("Transformer (exact)", base.replace(proj_dim=None)),
    ):
        torch.manual_seed(settings.seed)
        model = LinformerForMaskedLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, times = [], []
        for step in tqdm(range(total), desc=name, leave=False):
            start = time.perf_counter()
            loss = model(inputs[step], labels=labels[step]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step >= settings.warmup:
                times.append(time.perf_counter() - start)
            losses.append(loss.item())
        rows.append(
            {
                "model": name,
                "params": sum(p.numel() for p in model.parameters()),
                "first_loss": losses[0],
                "last_loss": losses[-1],
                "sec_per_step": statistics.median(times),
            }
        )
    return rows
