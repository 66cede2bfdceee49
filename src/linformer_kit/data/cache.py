"""The token cache: a corpus tokenized once into a memory-mapped file, reused across runs,
then packed into fixed-length blocks and split deterministically into train/validation."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..checks import check_fraction
from ..files import private_folder, save_json, sha256, umask_mode
from .corpus import Document
from .tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
TOKENS_FORMAT = 2  # the token cache's own: 2, special-token text in documents is text
TOKENS_NAME = "tokens.bin"
META_NAME = "meta.json"
SPLIT_SEED = 0  # the train/validation split never depends on the training seed


def default_cache_dir() -> Path:
    """`$LINFORMER_CACHE`, else `$XDG_CACHE_HOME/linformer-kit`, else `~/.cache/linformer-kit`."""
    if os.environ.get("LINFORMER_CACHE"):
        return Path(os.environ["LINFORMER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "linformer-kit"


def cache_key(*parts: object) -> str:
    """A short stable hash of JSON-serialisable parts."""
    text = json.dumps([CACHE_FORMAT, *parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _publish(tmp: Path, directory: Path) -> None:
    """Renames the finished `tmp` to `directory`, unless another process (a second run on
    the same corpus) published that cache first: the key is the same, so is the cache."""
    try:
        os.replace(tmp, directory)
    except OSError:
        if not (directory / META_NAME).is_file():
            raise
        logger.info("another process built the token cache %s first; using it", directory)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a `vocab_size` vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


def build_token_cache(
    documents: Iterable[Document],
    tokenizer: TextTokenizer,
    directory: Path,
    *,
    chunk: int = 512,
    skipped: Mapping[Path, str] | None = None,
) -> Path:
    """Tokenizes documents into `directory/tokens.bin` (separator token after each document),
    unless that cache already exists. Written in a temporary directory and renamed, so an
    interrupted build never leaves a partial cache.

    Args:
        documents: the corpus.
        tokenizer: turns each text into ids.
        directory: where the cache lives.
        chunk: documents tokenized per batch.
        skipped: the bad files `iter_documents` leaves out while `documents` is read; their
            count goes into the summary and the cache's metadata.

    Returns:
        The cache directory.

    Raises:
        ValueError: if the corpus holds no tokens.
    """
    if (directory / META_NAME).is_file():
        meta = read_meta(directory)
        logger.info("reusing the token cache %s%s", directory, _skipped_note(meta))
        return directory
    tmp = private_folder(directory)  # a killed build's is removed by the next
    dtype = token_dtype(tokenizer.vocab_size)
    count = num_documents = 0
    digest = hashlib.sha256()
    try:
        with open(tmp / TOKENS_NAME, "wb") as out:
            batch: list[str] = []
            progress = tqdm(desc="tokenizing", unit=" docs", leave=False)
            for document in itertools.chain(documents, [None]):
                if document is not None:
                    batch.append(document.text)
                if batch and (document is None or len(batch) == chunk):
                    for ids in tokenizer.encode_batch(batch):
                        data = np.asarray([*ids, tokenizer.sep_id], dtype=dtype).tobytes()
                        out.write(data)
                        digest.update(data)
                        count += len(ids)
                    num_documents += len(batch)
                    progress.update(len(batch))
                    batch = []
            progress.close()
        meta = {
            "dtype": dtype.name,
            "num_tokens": count + num_documents,  # a separator after each document
            "num_documents": num_documents,
            "skipped_files": len(skipped or {}),
            "sha256": digest.hexdigest(),  # of tokens.bin: what a resume checks
        }
        if count == 0:  # separators alone: nothing to learn, a loss of 0 / 0
            what = (
                f"no text (its {num_documents} documents are empty)"
                if num_documents
                else "no documents"
            )
            raise ValueError(f"the corpus holds {what}{_skipped_note(meta)}")
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        os.chmod(tmp, umask_mode(0o777))  # mkdtemp made it private (0o700): a shared cache
        _publish(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "cached %d tokens of %d documents in %s%s",
        meta["num_tokens"],
        num_documents,
        directory,
        _skipped_note(meta),
    )
    return directory


def _skipped_note(meta: dict) -> str:
    count = meta.get("skipped_files", 0)
    return f"; skipped {count} bad file{'s' * (count != 1)}" if count else ""


def open_token_cache(directory: Path) -> np.memmap:
    """The cached token stream as a read-only memory map.

    Raises:
        ValueError: if the cache is incomplete (its size disagrees with its metadata).
    """
    meta = read_meta(directory)
    file = directory / TOKENS_NAME
    dtype = np.dtype(meta["dtype"])
    if file.stat().st_size != meta["num_tokens"] * dtype.itemsize:
        raise ValueError(f"token cache {file} is truncated; delete {directory} to rebuild it")
    return np.memmap(file, dtype=dtype, mode="r")


def read_meta(directory: Path) -> dict[str, Any]:
    """A token cache's metadata, checked: a token dtype of `token_dtype`'s and a count (a
    hand-edited or damaged one crashed numpy, an "object" dtype the process).

    Raises:
        ValueError: naming the file, and the way on (delete the cache to rebuild it).
    """
    file = directory / META_NAME
    try:
        meta = json.loads(file.read_text())
        valid = (
            isinstance(meta, dict)
            and meta.get("dtype") in ("uint16", "uint32")
            and isinstance(meta.get("num_tokens"), int)
            and meta["num_tokens"] >= 0
        )
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError
        valid = False
    if not valid:
        raise ValueError(
            f"{file} is not a token cache's metadata (a dtype uint16 / uint32 and a "
            f"num_tokens); delete {directory} to rebuild it"
        )
    return meta


def token_digest(directory: Path) -> dict[str, int | str]:
    """The identity of a cached token stream: its length and SHA-256 (the metadata's; a cache
    an earlier version built has none: read from the file once, and written into its
    metadata where the cache is writable, not on every rank at every start)."""
    meta = read_meta(directory)
    if "sha256" not in meta:
        meta["sha256"] = sha256(directory / TOKENS_NAME)
        with contextlib.suppress(OSError):  # another user's cache: hashed again next time
            save_json(meta, directory / META_NAME)
    return {"num_tokens": meta["num_tokens"], "sha256": meta["sha256"]}


@dataclass
class PackedBlocks:
    """Fixed-length blocks of a token stream: block i holds tokens [i*L, (i+1)*L).

    Attributes:
        tokens: the memory-mapped token stream.
        block_len: tokens per block (the model's max_seq_len).
        indices: which blocks belong to this split.
    """

    tokens: np.ndarray
    block_len: int
    indices: np.ndarray

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Tensor:
        """Block i as an int64 tensor (block_len,)."""
        start = int(self.indices[i]) * self.block_len
        return torch.from_numpy(self.tokens[start : start + self.block_len].astype(np.int64))

    def batch(self, rows: list[int]) -> Tensor:
        """Blocks `rows` stacked: (len(rows), block_len)."""
        return torch.stack([self[i] for i in rows])


def split_blocks(
    tokens: np.ndarray, block_len: int, val_fraction: float, max_val_blocks: int = 0
) -> tuple[PackedBlocks, PackedBlocks]:
    """Packs a token stream into blocks and splits them by a fixed-seed permutation.

    Args:
        tokens: the token stream.
        block_len: tokens per block; the tail shorter than a block is dropped.
        val_fraction: share of blocks for validation, in (0, 1).
        max_val_blocks: cap on validation blocks (0 = no cap).

    Returns:
        (train, validation) blocks.

    Raises:
        ValueError: if the corpus is too small for one block in each split, or
            val_fraction leaves no block to train on.
    """
    check_fraction("val_fraction", val_fraction)
    num_blocks = len(tokens) // block_len
    num_val = max(1, round(num_blocks * val_fraction))
    if max_val_blocks:
        num_val = min(num_val, max_val_blocks)
    if num_blocks < 2:
        raise ValueError(
            f"the corpus has {len(tokens)} tokens: {num_blocks} blocks of {block_len}, too few "
            f"to split into train and validation; add data or lower max_seq_len"
        )
    if num_blocks - num_val < 1:  # (it was told as too small a corpus)
        raise ValueError(
            f"val_fraction {val_fraction} puts {num_val} of the {num_blocks} blocks in "
            f"validation, leaving none to train on; lower val_fraction or set max_val_blocks"
        )
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(SPLIT_SEED))
    order = order.numpy()
    return (
        PackedBlocks(tokens, block_len, np.sort(order[num_val:])),
        PackedBlocks(tokens, block_len, np.sort(order[:num_val])),
    )
