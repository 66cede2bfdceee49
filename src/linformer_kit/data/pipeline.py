"""From data arguments to packed train/validation blocks: tokenizer, token cache, split."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..checks import check_fraction, check_non_negative
from ..files import check_output_path
from .cache import (
    TOKENS_FORMAT,
    PackedBlocks,
    build_token_cache,
    cache_key,
    default_cache_dir,
    open_token_cache,
    split_blocks,
)
from .corpus import READ_FORMAT, STDLIB, Document, check_glob, fingerprint, iter_documents
from .tokenizer import TOKENIZER_NAME, TextTokenizer, load_tokenizer, train_tokenizer

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class DataSettings:
    """Where the pretraining text comes from and how it is tokenized and split."""

    data: list[str] = field(
        default_factory=lambda: [STDLIB],
        metadata={"help": "files, directories, JSONL files, 'stdlib' or hf:NAME[:CONFIG]"},
    )
    glob: str = field(default="**/*.txt", metadata={"help": "files to read inside directories"})
    skip_bad_files: bool = field(
        default=False,
        metadata={"help": "leave out empty or non-UTF-8 files (each logged) instead of stopping"},
    )
    text_field: str = field(
        default="text", metadata={"help": "JSONL field or CSV column holding the text"}
    )
    tokenizer: str = field(
        default="", metadata={"help": "an existing tokenizer.json; empty = train a BPE"}
    )
    vocab_size: int = field(default=8192, metadata={"help": "vocabulary of a trained BPE"})
    max_documents: int = field(default=0, metadata={"help": "read at most this many (0 = all)"})
    tokenizer_documents: int = field(
        default=0, metadata={"help": "train the BPE on the first N documents (0 = all)"}
    )
    val_fraction: float = field(default=0.02, metadata={"help": "share of blocks for validation"})
    max_val_blocks: int = field(default=0, metadata={"help": "cap on validation blocks (0 = none)"})
    cache_dir: str = field(
        default="", metadata={"help": "token cache directory (default ~/.cache/linformer-kit)"}
    )

    def __post_init__(self) -> None:
        for name in ("max_documents", "tokenizer_documents", "max_val_blocks"):
            check_non_negative(name, getattr(self, name), "0 = no limit")
        check_fraction("val_fraction", self.val_fraction)  # before any tokenizing
        check_glob(self.glob)
        if self.cache_dir:
            check_output_path(self.cache_dir, directory=True, flag="--cache-dir")


@dataclass
class PretrainingData:
    """A tokenizer and the packed train / validation blocks of a corpus."""

    tokenizer: TextTokenizer
    train: PackedBlocks
    val: PackedBlocks
    cache: Path


def _documents(
    settings: DataSettings, limit: int, skipped: dict[Path, str] | None
) -> Iterator[Document]:
    documents = iter_documents(
        settings.data,
        glob=settings.glob,
        text_field=settings.text_field,
        skip_bad_files=settings.skip_bad_files,
        skipped=skipped,
    )
    return itertools.islice(documents, limit or None)


def _corpus_id(settings: DataSettings) -> list:
    # Skipping is part of the corpus: a cache built while skipping bad files must not let a
    # later run without the flag pass over them.
    files = fingerprint(settings.data, settings.glob, settings.text_field)
    return [READ_FORMAT, files, settings.skip_bad_files]


def prepare_tokenizer(
    settings: DataSettings, skipped: dict[Path, str] | None = None
) -> TextTokenizer:
    """Loads `settings.tokenizer`, or trains a byte-level BPE on the corpus (cached by a hash
    of the corpus files and the vocabulary size, so the next run reuses it).

    Args:
        settings: the data settings.
        skipped: collects the bad files left out (see `iter_documents`).
    """
    if settings.tokenizer:
        return load_tokenizer(settings.tokenizer)
    limit = settings.tokenizer_documents or settings.max_documents
    key = cache_key(
        "tokenizer",
        _corpus_id(settings),
        settings.vocab_size,
        limit,
    )
    path = Path(settings.cache_dir or default_cache_dir()) / f"tokenizer-{key}" / TOKENIZER_NAME
    if path.is_file():
        logger.info("reusing the tokenizer %s", path)
        return load_tokenizer(path)
    documents = _documents(settings, limit, skipped)
    tokenizer = train_tokenizer((d.text for d in documents), settings.vocab_size)
    tokenizer.save(path)
    return tokenizer


def prepare_pretraining_data(settings: DataSettings, max_seq_len: int) -> PretrainingData:
    """Tokenizer, token cache (built once, keyed by a hash of the corpus files and the
    tokenizer) and the train / validation split into blocks of `max_seq_len` tokens.

    Raises:
        ValueError / FileNotFoundError: for missing or malformed data, naming file and line.
    """
    skipped: dict[Path, str] = {}  # shared, so the tokenizer and the cache report each once
    tokenizer = prepare_tokenizer(settings, skipped)
    key = cache_key(
        "tokens",
        TOKENS_FORMAT,
        _corpus_id(settings),
        tokenizer.tokenizer.to_str(),
        settings.max_documents,
    )
    directory = Path(settings.cache_dir or default_cache_dir()) / f"tokens-{key}"
    documents = _documents(settings, settings.max_documents, skipped)
    build_token_cache(documents, tokenizer, directory, skipped=skipped)
    tokens = open_token_cache(directory)
    train, val = split_blocks(tokens, max_seq_len, settings.val_fraction, settings.max_val_blocks)
    logger.info(
        "%d tokens: %d train and %d validation blocks of %d",
        len(tokens),
        len(train),
        len(val),
        max_seq_len,
    )
    return PretrainingData(tokenizer, train, val, directory)
