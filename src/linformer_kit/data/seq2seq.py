"""(source, target) pairs for sequence-to-sequence models: padded batches, and the synthetic
copy / reverse tasks (random symbol strings of random lengths, generated from a seed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SYNTHETIC_TASKS = ("copy", "reverse")
# The synthetic vocabulary: three special ids, then the symbols.
SYNTHETIC_PAD, SYNTHETIC_BOS, SYNTHETIC_EOS = 0, 1, 2
SYNTHETIC_SPECIALS = 3


@dataclass
class Seq2SeqPairs:
    """Token-id pairs; targets are stored bare and framed as <bos> target <eos> in batches.

    Attributes:
        sources, targets: one list of ids per example.
        pad_id, bos_id, eos_id: the padding, decoder start and end tokens.
        source: where the pairs came from, for messages.
    """

    sources: list[list[int]]
    targets: list[list[int]]
    pad_id: int
    bos_id: int
    eos_id: int
    source: str = ""

    def __len__(self) -> int:
        return len(self.sources)

    def decoder_ids(self, row: int) -> list[int]:
        """The decoder input of example `row`: <bos> target <eos>."""
        return [self.bos_id, *self.targets[row], self.eos_id]

    def batch(self, rows: list[int]) -> dict[str, Tensor]:
        """Examples `rows`, right-padded to the batch's longest source and target.

        Returns:
            input_ids, key_padding_mask (B, N); decoder_input_ids, decoder_padding_mask and
            labels (B, M) (labels = decoder_input_ids: the model shifts them).
        """
        input_ids, key_padding_mask = pad([self.sources[r] for r in rows], self.pad_id)
        decoder_ids, decoder_mask = pad([self.decoder_ids(r) for r in rows], self.pad_id)
        return {
            "input_ids": input_ids,
            "key_padding_mask": key_padding_mask,
            "decoder_input_ids": decoder_ids,
            "decoder_padding_mask": decoder_mask,
            "labels": decoder_ids,
        }

    def subset(self, rows: list[int]) -> Seq2SeqPairs:
        """The pairs at `rows`, in that order."""
        return Seq2SeqPairs(
            [self.sources[r] for r in rows],
            [self.targets[r] for r in rows],
            self.pad_id,
            self.bos_id,
            self.eos_id,
            self.source,
        )


def pad(sequences: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pads id lists to the longest: ids (B, N) int64 and a bool mask, True at real ids."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), length, dtype=torch.bool)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[i, : len(seq)] = True
    return ids, mask


def synthetic_pairs(
    task: str,
    num: int,
    *,
    min_len: int,
    max_len: int,
    num_symbols: int,
    seed: int,
) -> Seq2SeqPairs:
    """Random symbol strings and their copy or reversal.

    Args:
        task: copy or reverse.
        num: examples.
        min_len, max_len: source lengths, drawn uniformly from [min_len, max_len].
        num_symbols: distinct symbols; their ids start at 3 (after pad, bos, eos).
        seed: the generator's seed.

    Raises:
        ValueError: for an unknown task or bad sizes.
    """
    if task not in SYNTHETIC_TASKS:
        raise ValueError(f"task must be one of {', '.join(SYNTHETIC_TASKS)}; got {task!r}")
    if not 1 <= min_len <= max_len or num < 1 or num_symbols < 2:
        raise ValueError(
            f"need 1 <= min_len <= max_len, num >= 1 and num_symbols >= 2; got min_len="
            f"{min_len}, max_len={max_len}, num={num}, num_symbols={num_symbols}"
        )
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=generator).tolist()
    sources = [
        (torch.randint(0, num_symbols, (n,), generator=generator) + SYNTHETIC_SPECIALS).tolist()
        for n in lengths
    ]
    targets = [s[::-1] if task == "reverse" else list(s) for s in sources]
    return Seq2SeqPairs(
        sources, targets, SYNTHETIC_PAD, SYNTHETIC_BOS, SYNTHETIC_EOS, f"synthetic {task}"
    )
