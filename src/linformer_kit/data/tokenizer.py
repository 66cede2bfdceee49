"""Tokenizers: train a byte-level BPE (Hugging Face `tokenizers`) or load a tokenizer.json."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..files import atomic_write

logger = logging.getLogger(__name__)

TOKENIZER_NAME = "tokenizer.json"
SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")  # RoBERTa's ids 0..4
# The BPE trainer reserves ~72 bytes per token up front: 10**12 aborted the process in its
# allocator. 2**24 is far above any model's vocabulary (Llama 3's: 128,256).
MAX_VOCAB_SIZE = 2**24
# Names the special tokens go by in RoBERTa-style and BERT-style vocabularies.
ROLES = {
    "pad": ("<pad>", "[PAD]"),
    "mask": ("<mask>", "[MASK]"),
    "sep": ("</s>", "[SEP]"),
    "cls": ("<s>", "[CLS]"),
}


@dataclass
class TextTokenizer:
    """A `tokenizers.Tokenizer` with the ids of the special tokens training needs.

    Attributes:
        tokenizer: the wrapped Hugging Face tokenizer.
        pad_id, mask_id, sep_id, cls_id: ids of padding, mask, separator and start tokens.
    """

    tokenizer: Tokenizer
    pad_id: int
    mask_id: int
    sep_id: int
    cls_id: int

    # (the count of tokens, the largest id + 1) as last measured: the vocabulary is read
    # again only once tokens are added
    _largest: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def vocab_size(self) -> int:
        """The ids a model must hold: the largest id + 1, special tokens included (the count
        of tokens where they are numbered 0, 1, ..., as a trained BPE's are; a tokenizer.json
        with an id past its count had it taken for a valid one)."""
        count = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if self._largest is None or self._largest[0] != count:
            largest = max(self.tokenizer.get_vocab(with_added_tokens=True).values())
            self._largest = (count, largest + 1)
        return self._largest[1]

    @property
    def special_ids(self) -> list[int]:
        """Ids never chosen for masking."""
        return sorted({self.pad_id, self.mask_id, self.sep_id, self.cls_id})

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens (parallel in Rust).

        Raises:
            ValueError: naming the first text that is not Unicode text (an unpaired
                surrogate: half of a character, or a byte of a command line that was not
                UTF-8), which the Rust side refused with a TypeError naming nothing.
        """
        try:
            encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        except TypeError:
            for i, text in enumerate(texts):
                if isinstance(text, str) and (bad := _unencodable(text)) is not None:
                    raise ValueError(
                        f"text {i} ({text[:40]!r}) holds {text[bad]!r} at character {bad}: "
                        f"half of a character (an unpaired surrogate), or a byte that was not "
                        f"UTF-8; not text"
                    ) from None
            raise
        return [e.ids for e in encodings]

    def save(self, path: Path) -> None:
        """Writes `tokenizer.json` atomically."""
        atomic_write(Path(path), lambda tmp: self.tokenizer.save(str(tmp)))


def _unencodable(text: str) -> int | None:
    """The index of the first character of `text` UTF-8 cannot encode, or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def from_tokenizer(tokenizer: Tokenizer, source: str) -> TextTokenizer:
    """Finds the special tokens of a tokenizer, encodes special-token text in documents as
    plain text, and switches off the truncation and padding a
    tokenizer.json may carry: this library cuts and pads sequences itself, to the model's
    `--max-seq-len` (MiniLM's tokenizer.json truncates every text to 128 tokens and pads it
    to 128, which would silently cut long documents whatever the model accepts).

    Raises:
        ValueError: if it lacks a padding, mask or separator token.
    """
    tokenizer.no_truncation()
    tokenizer.no_padding()
    # Text is text: "</s>" or "<mask>" written in a document (HTML, code about tokenizers;
    # the stdlib holds both) is encoded as characters, never as the separator or mask ids
    # the pipeline and the models give their own meaning (HF's `split_special_tokens`).
    tokenizer.encode_special_tokens = True
    ids = {}
    for role, names in ROLES.items():
        found = [tokenizer.token_to_id(n) for n in names if tokenizer.token_to_id(n) is not None]
        if not found:
            raise ValueError(f"{source}: the tokenizer has no {role} token (one of {names})")
        ids[role] = found[0]
    return TextTokenizer(tokenizer, ids["pad"], ids["mask"], ids["sep"], ids["cls"])


def load_tokenizer(path: str | Path, *, model_vocab_size: int | None = None) -> TextTokenizer:
    """Loads a `tokenizer.json` file (or the one inside a directory).

    Args:
        path: the file, or a checkpoint directory holding one.
        model_vocab_size: the vocabulary of the model the tokenizer will feed; a tokenizer
            with more tokens is refused (its ids past the model's would fail in the embedding).

    Raises:
        FileNotFoundError: if the path does not exist, or names a directory without one.
        ValueError: if it cannot be parsed, lacks the special tokens, or has more tokens than
            `model_vocab_size`.
    """
    file = Path(path)
    if not file.exists():
        # Said apart from "no tokenizer in it": a mistyped checkpoint folder is the usual cause.
        raise FileNotFoundError(
            f"{file} does not exist (expected a checkpoint folder or a {TOKENIZER_NAME})"
        )
    if file.is_dir():
        file = file / TOKENIZER_NAME
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer at {file}")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception on parse errors
        raise ValueError(f"{file} is not a valid tokenizer.json: {err}") from err
    loaded = from_tokenizer(tokenizer, str(file))
    if model_vocab_size is not None and loaded.vocab_size > model_vocab_size:
        raise ValueError(
            f"{file} has {loaded.vocab_size} token ids (0 to {loaded.vocab_size - 1}) but the "
            f"model only {model_vocab_size}: not the tokenizer it was trained with"
        )
    return loaded


def check_vocab_size(vocab_size: int) -> None:
    """Raises ValueError unless a byte-level BPE can have `vocab_size` tokens: at least the
    256 bytes and the special tokens, and at most `MAX_VOCAB_SIZE`."""
    minimum = 256 + len(SPECIAL_TOKENS)
    if not minimum <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be in [{minimum}, {MAX_VOCAB_SIZE}] for byte-level BPE, got "
            f"{vocab_size}"
        )


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> TextTokenizer:
    """Trains a byte-level BPE tokenizer (GPT-2 / RoBERTa style) on `texts`.

    Args:
        texts: the training texts.
        vocab_size: size of the vocabulary, special tokens included; at least 261
            (the 256 bytes plus the 5 special tokens).

    Raises:
        ValueError: if vocab_size is too small.
    """
    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    logger.info("trained a byte-level BPE tokenizer with %d tokens", tokenizer.get_vocab_size())
    return from_tokenizer(tokenizer, "trained tokenizer")
