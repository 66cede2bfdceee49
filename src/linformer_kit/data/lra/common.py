"""What every Long Range Arena task shares: the split container, the on-disk cache of generated
data (one .npz per task and parameters) and the range checks of the generators' knobs."""

from __future__ import annotations

import json
import logging
import numbers
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ...files import atomic_write
from ...memory import check_fits
from ..cache import cache_key, default_cache_dir

logger = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")


def check_range(name: str, value: Any, low: int, high: int | None = None) -> None:
    """Raises a ValueError unless `value` is an integer in [low, high] (no upper bound: None)."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low
    if not ok or (high is not None and value > high):
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")


@dataclass
class LRASplit:
    """Token sequences padded to a common width, with their lengths and labels.

    Attributes:
        inputs: token ids (N, width), padded with the task's pad id past each length.
        lengths: real tokens of each row (N,).
        labels: class of each row (N,).
        source: what the rows came from, for messages.
    """

    inputs: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray
    source: str

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, rows: list[int], pad_id: int) -> dict[str, Tensor]:
        """Rows cut to the longest of them: input_ids, key_padding_mask (B, N), labels (B,).

        Args:
            rows: row indices.
            pad_id: unused (rows are padded when stored); kept for the batches' interface.
        """
        index = np.asarray(rows)
        lengths = torch.from_numpy(self.lengths[index].astype(np.int64))
        longest = int(lengths.max())
        ids = torch.from_numpy(self.inputs[index, :longest].astype(np.int64))  # (B, N)
        mask = torch.arange(longest)[None, :] < lengths[:, None]  # (B, N)
        labels = torch.from_numpy(self.labels[index].astype(np.int64))
        return {"input_ids": ids, "key_padding_mask": mask, "labels": labels}


@dataclass
class LRATask:
    """One task's three splits and what a model needs to read them.

    Attributes:
        name: listops, text or pathfinder.
        train, val, test: the splits.
        vocab_size: token ids lie in [0, vocab_size).
        num_labels: classes.
        pad_id: the padding token.
        params: the generator's parameters (the cache key), for reports.
    """

    name: str
    train: LRASplit
    val: LRASplit
    test: LRASplit
    vocab_size: int
    num_labels: int
    pad_id: int
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def max_seq_len(self) -> int:
        """The widest row of any split: the model's max_seq_len."""
        return max(s.inputs.shape[1] for s in (self.train, self.val, self.test))

    def majority_baseline(self) -> float:
        """Test accuracy of always answering the training set's most frequent class."""
        counts = np.bincount(self.train.labels, minlength=self.num_labels)
        return float(np.mean(self.test.labels == counts.argmax()))

    def best_constant_baseline(self) -> float:
        """Test accuracy of the best constant answer, the test set's most frequent class: what
        a model that learned nothing can score, above the majority class when the test set's
        class shares differ from the training set's (150 reviews: 43% / 57%)."""
        counts = np.bincount(self.test.labels, minlength=self.num_labels)
        return float(counts.max() / counts.sum())


def _save(task: LRATask, path: Path) -> None:
    arrays: dict[str, np.ndarray] = {}
    for name in SPLITS:
        split = getattr(task, name)
        arrays |= {
            f"{name}_inputs": split.inputs,
            f"{name}_lengths": split.lengths,
            f"{name}_labels": split.labels,
        }
    meta = {
        "name": task.name,
        "vocab_size": task.vocab_size,
        "num_labels": task.num_labels,
        "pad_id": task.pad_id,
        "params": task.params,
        "sources": {name: getattr(task, name).source for name in SPLITS},
    }
    # written aside and renamed: an interrupted build never leaves a partial cache.
    # Compressed: Pathfinder's images are mostly background (51 -> 4.2 MB for 50K
    # one-grey-level images; 42K of the older, shaded ones: 0.9 s to write, 0.17 s to
    # read), small enough to carry to another machine.
    packed = {"meta": np.asarray(json.dumps(meta)), **arrays}
    atomic_write(path, lambda tmp: np.savez_compressed(tmp, **packed))


def _load(path: Path) -> LRATask:
    with np.load(path) as stored:
        meta = json.loads(str(stored["meta"]))
        splits = {
            name: LRASplit(
                stored[f"{name}_inputs"],
                stored[f"{name}_lengths"],
                stored[f"{name}_labels"],
                meta["sources"][name],
            )
            for name in SPLITS
        }
    task = LRATask(
        name=meta["name"],
        vocab_size=meta["vocab_size"],
        num_labels=meta["num_labels"],
        pad_id=meta["pad_id"],
        params=meta["params"],
        **splits,
    )
    if problem := _task_problem(task):  # a cache from elsewhere: made again
        raise ValueError(f"{path}: {problem}")
    return task


def _task_problem(task: LRATask) -> str | None:
    """What makes a loaded task other than one `_save` wrote (labels, ids or lengths out
    of range trained without a word), or None."""
    sizes = (task.vocab_size, task.num_labels, task.pad_id)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sizes):
        return f"vocab_size, num_labels, pad_id {sizes} are not counts"
    for name in SPLITS:
        split = getattr(task, name)
        arrays = (split.inputs, split.lengths, split.labels)
        if not all(a.dtype.kind in "iu" for a in arrays) or split.inputs.ndim != 2:
            return f"its {name} split is not integer (rows, width) inputs with lengths"
        rows, width = split.inputs.shape
        if split.lengths.shape != (rows,) or split.labels.shape != (rows,):
            return f"its {name} split has {rows} rows of inputs but other lengths or labels"
        if rows and not (
            split.lengths.min() >= 1
            and split.lengths.max() <= width
            and split.inputs.max() < task.vocab_size
            and split.labels.min() >= 0
            and split.labels.max() < task.num_labels
        ):
            return f"its {name} split holds lengths, ids or labels out of range"
    return None


def cache_path(name: str, params: dict[str, Any], cache_dir: str | Path | None = None) -> Path:
    """Where a task generated with `params` is cached: `<cache>/lra/<name>-<key>.npz`."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return root / "lra" / f"{name}-{cache_key('lra', name, params)}.npz"


def cached_task(
    name: str,
    params: dict[str, Any],
    build: Callable[[], LRATask],
    cache_dir: str | Path | None = None,
) -> LRATask:
    """The task from its cache file, else `build()`, saved to the cache first.

    Args:
        name: the task.
        params: everything the data depends on (the cache key).
        build: makes the task when the cache has none.
        cache_dir: the cache's root (None: the project's default cache directory).

    Returns:
        The task.
    """
    path = cache_path(name, params, cache_dir)
    if path.is_file():
        try:
            task = _load(path)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
            # Written atomically here, but a cache copied from elsewhere can be cut short.
            logger.warning(
                "the cached %s data %s is unreadable (%r): made again", name, path, error
            )
        else:
            logger.info("reusing the %s data cached in %s", name, path)
            return task
    task = build()
    _save(task, path)
    logger.info("cached the %s data in %s", name, path)
    return task


def generated_task(
    name: str,
    generate: Callable[..., LRASplit],
    sizes: dict[str, int],
    shape: dict[str, Any],
    *,
    seed: int,
    version: int,
    cache_dir: str | Path | None,
    row_bytes: int,
    **task: Any,
) -> LRATask:
    """A task whose splits a generator draws, each from its own stream, generated once and cached.

    Args:
        name: the task.
        generate: draws a split: `generate(num, seed=..., **shape)`.
        sizes: rows per split ("train", "val", "test").
        shape: the generator's knobs.
        seed: the data seed; split `s` draws from `f"{seed}/{s}"`.
        version: the generator's version (part of the cache key).
        cache_dir: the cache root (None: the project's default).
        row_bytes: the bytes of a row (its tokens, padded), to refuse splits no memory holds.
        **task: `LRATask`'s other fields (vocab_size, num_labels, pad_id).

    Raises:
        ValueError: for a split size below 1, or splits this machine's memory could never hold.
    """
    for split, num in sizes.items():
        check_range(f"num_{split}", num, 1)
    rows = sum(sizes.values())  # 10**12 failed in numpy's allocator, with a traceback
    check_fits(rows * row_bytes, f"{name}: {rows} rows of {row_bytes} bytes (num_train, ...)")
    params = {**{f"num_{k}": n for k, n in sizes.items()}, **shape, "seed": seed}
    params["version"] = version

    def build() -> LRATask:
        splits = {
            split: generate(num, seed=f"{seed}/{split}", **shape) for split, num in sizes.items()
        }
        return LRATask(name, params=params, **task, **splits)

    return cached_task(name, params, build, cache_dir)
