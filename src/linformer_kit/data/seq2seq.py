"""(source, target) pairs for sequence-to-sequence models: padded batches, the synthetic copy /
reverse tasks (random symbol strings of random lengths, generated from a seed) and the stdlib
docstring task, behind one loader."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from torch import Tensor

from ..checks import check_choice, check_positive
from ..memory import check_fits
from .cache import cache_key, default_cache_dir
from .corpus import STDLIB, fingerprint
from .docstrings import check_split_fractions, extract_stdlib_pairs, split_by_file
from .tokenizer import (
    TOKENIZER_NAME,
    TextTokenizer,
    check_vocab_size,
    load_tokenizer,
    train_tokenizer,
)

SYNTHETIC_TASKS = ("copy", "reverse")
TASKS = ("docstrings", *SYNTHETIC_TASKS)
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
    check_choice("task", task, SYNTHETIC_TASKS)
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


# The flags of one kind of task (`Seq2SeqDataSettings`' help says which): refused with another.
DOCSTRINGS_ONLY = ("vocab_size", "val_fraction", "test_fraction")
SYNTHETIC_ONLY = ("num_train", "num_eval", "min_len", "max_len", "num_symbols")


@dataclass(kw_only=True)
class Seq2SeqDataSettings:
    """Which (source, target) task to train on, and how long its sides may be."""

    task: str = field(
        default="docstrings",
        metadata={"help": "docstrings (stdlib code -> summary), copy or reverse (synthetic)"},
    )
    max_source_len: int = field(default=1024, metadata={"help": "source tokens kept (n)"})
    max_target_len: int = field(
        default=64, metadata={"help": "decoder tokens, start and end included (m)"}
    )
    vocab_size: int = field(default=8192, metadata={"help": "docstrings: BPE vocabulary"})
    val_fraction: float = field(default=0.05, metadata={"help": "docstrings: share of files"})
    test_fraction: float = field(default=0.05, metadata={"help": "docstrings: share of files"})
    num_train: int = field(default=20000, metadata={"help": "synthetic: training pairs"})
    num_eval: int = field(default=500, metadata={"help": "synthetic: val and test pairs each"})
    min_len: int = field(default=4, metadata={"help": "synthetic: shortest source"})
    max_len: int = field(default=32, metadata={"help": "synthetic: longest source"})
    num_symbols: int = field(default=16, metadata={"help": "synthetic: distinct symbols"})
    data_seed: int = field(default=0, metadata={"help": "seed of the split / the generated pairs"})
    cache_dir: str = field(
        default="",
        metadata={"help": "parsed stdlib and tokenizer (default ~/.cache/linformer-kit)"},
    )

    def __post_init__(self) -> None:
        check_choice("task", self.task, TASKS)
        if self.max_target_len < 3 or self.max_source_len < 1:
            raise ValueError(
                f"need max_source_len >= 1 and max_target_len >= 3 (start, a token, end); "
                f"got {self.max_source_len} and {self.max_target_len}"
            )
        if self.task != "docstrings" and self.max_len > min(
            self.max_source_len, self.max_target_len - 2
        ):
            raise ValueError(
                f"max_len ({self.max_len}) must fit both sides: at most max_source_len "
                f"({self.max_source_len}) and max_target_len - 2 ({self.max_target_len - 2})"
            )
        for name in ("num_train", "num_eval"):
            check_positive(name, getattr(self, name))
        if self.task != "docstrings":  # 10**12 pairs failed in the allocator, naming no flag
            pairs = self.num_train + 2 * self.num_eval  # validation and test: num_eval each
            what = f"{pairs} pairs (num_train + 2 x num_eval) of {self.min_len} tokens or more"
            check_fits(16 * pairs * self.min_len, what)  # int64 sources and targets
        if self.task == "docstrings":  # before the stdlib is parsed
            check_split_fractions(self.val_fraction, self.test_fraction)
            check_vocab_size(self.vocab_size)

    def check_flags(self, given: Iterable[str]) -> None:
        """Raises ValueError naming the fields among `given` (flags on the command line) that
        the task does not read: they were ignored without a word. Not checked on a saved
        run's settings, which an earlier version saved with them."""
        other = [f"--{name.replace('_', '-')}" for name in given if name not in self.read()]
        if other:
            kind = "synthetic tasks" if self.task == "docstrings" else "docstrings task"
            raise ValueError(
                f"{', '.join(other)} set the data of the {kind} only; --task {self.task} "
                f"would ignore them"
            )

    def read(self) -> tuple[str, ...]:
        """The fields the task's data comes from (the other kind of task's left out)."""
        other = SYNTHETIC_ONLY if self.task == "docstrings" else DOCSTRINGS_ONLY
        return tuple(f.name for f in fields(self) if f.name not in other)


@dataclass
class Seq2SeqData:
    """A task's splits, its vocabulary size and its tokenizer (None: synthetic ids)."""

    train: Seq2SeqPairs
    val: Seq2SeqPairs
    test: Seq2SeqPairs
    vocab_size: int
    tokenizer: TextTokenizer | None

    def digest(self) -> dict[str, int | str]:
        """The identity of the training and validation pairs: their count and the SHA-256
        of their ids, recorded in every checkpoint (a resume on other pairs, from a stdlib
        or a cache changed since, or a tokenizer trained anew, went on without a word)."""
        digest = hashlib.sha256()
        for pairs in (self.train, self.val):
            for ids in (*pairs.sources, *pairs.targets):
                digest.update(len(ids).to_bytes(8, "little") + array("q", ids).tobytes())
        return {"num_pairs": len(self.train.sources) + len(self.val.sources),
                "sha256": digest.hexdigest()}  # fmt: skip


def _docstring_data(settings: Seq2SeqDataSettings) -> Seq2SeqData:
    pairs = extract_stdlib_pairs(settings.cache_dir or None)
    splits = split_by_file(pairs, settings.data_seed, settings.val_fraction, settings.test_fraction)
    key = cache_key(
        "docstring-tokenizer",
        fingerprint([STDLIB], "", ""),
        [settings.data_seed, settings.val_fraction, settings.test_fraction, settings.vocab_size],
    )  # the training split decides the tokenizer
    path = Path(settings.cache_dir or default_cache_dir()) / f"tokenizer-{key}" / TOKENIZER_NAME
    if path.is_file():
        tokenizer = load_tokenizer(path)
    else:
        texts = (t for p in splits["train"] for t in (p.code, p.summary))
        tokenizer = train_tokenizer(texts, settings.vocab_size)
        tokenizer.save(path)
    specials = (tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id)

    def encode(split: str) -> Seq2SeqPairs:
        chosen = splits[split]
        sources = tokenizer.encode_batch([p.code for p in chosen])
        targets = tokenizer.encode_batch([p.summary for p in chosen])
        return Seq2SeqPairs(
            [s[: settings.max_source_len] for s in sources],
            [t[: settings.max_target_len - 2] for t in targets],
            *specials,
            f"stdlib docstrings ({split})",
        )

    train, val, test = (encode(split) for split in ("train", "val", "test"))
    return Seq2SeqData(train, val, test, tokenizer.vocab_size, tokenizer)


def load_seq2seq_data(settings: Seq2SeqDataSettings) -> Seq2SeqData:
    """The task's train / val / test pairs: the stdlib docstrings (parsed and a BPE trained
    on the training split once, then cached) or generated synthetic pairs.

    Raises:
        ValueError: for an unknown task or sizes out of range.
    """
    if settings.task == "docstrings":
        return _docstring_data(settings)
    sizes = dict(
        min_len=settings.min_len, max_len=settings.max_len, num_symbols=settings.num_symbols
    )
    train, val, test = (
        synthetic_pairs(settings.task, num, **sizes, seed=settings.data_seed * 3 + offset)
        for offset, num in enumerate((settings.num_train, settings.num_eval, settings.num_eval))
    )
    return Seq2SeqData(train, val, test, settings.num_symbols + SYNTHETIC_SPECIALS, None)
