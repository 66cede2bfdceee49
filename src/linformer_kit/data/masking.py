"""RoBERTa-style dynamic masking: a fresh 15% of tokens is chosen every time a batch is drawn."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

IGNORE_INDEX = -100  # label of positions the loss skips


def mask_tokens(
    input_ids: Tensor,
    *,
    mask_id: int,
    vocab_size: int,
    special_ids: Sequence[int],
    generator: torch.Generator,
    mlm_probability: float = 0.15,
) -> tuple[Tensor, Tensor]:
    """Chooses positions to predict and corrupts them (80% mask, 10% random, 10% unchanged).

    Args:
        input_ids: (B, N) token ids; not modified.
        mask_id: id of the mask token.
        vocab_size: random replacements are drawn from [0, vocab_size).
        special_ids: ids never chosen (padding, separators).
        generator: the source of randomness, so a batch is reproducible from its seed.
        mlm_probability: share of (non-special) positions to predict, in (0, 1).

    Returns:
        (inputs, labels), both (B, N): corrupted inputs, and labels holding the original id
        at chosen positions and -100 elsewhere.

    Raises:
        ValueError: if mlm_probability is outside (0, 1).
    """
    if not 0.0 < mlm_probability < 1.0:
        raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
    shape = input_ids.shape
    special = torch.isin(input_ids, torch.tensor(list(special_ids), dtype=input_ids.dtype))
    chosen = (torch.rand(shape, generator=generator) < mlm_probability) & ~special
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    roll = torch.rand(shape, generator=generator)
    random_ids = torch.randint(0, vocab_size, shape, generator=generator, dtype=input_ids.dtype)
    inputs = torch.where(chosen & (roll < 0.8), torch.full_like(input_ids, mask_id), input_ids)
    inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, inputs)
    return inputs, labels
