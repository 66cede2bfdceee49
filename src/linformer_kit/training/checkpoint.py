"""Checkpoints: model (safetensors via save_pretrained), optimizer, scheduler, RNG states,
data position and run config, written so that a kill at any moment leaves the previous
checkpoint intact.

Layout of a run directory::

    checkpoints/step-00000100/   config.json, model.safetensors, trainer_state.pt,
                                 run_config.json, tokenizer.json, manifest.json
    last -> checkpoints/step-...  (symlinks, replaced atomically)
    best -> checkpoints/step-...

A checkpoint is assembled in a temporary directory, its manifest (size and SHA-256 of every
file) written last, then renamed into place; only then do the `last` / `best` links move.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data.tokenizer import TOKENIZER_NAME, TextTokenizer
from ..models import LinformerPreTrainedModel
from .settings import RUN_CONFIG_NAME, RunConfig

logger = logging.getLogger(__name__)

STATE_NAME = "trainer_state.pt"
MANIFEST_NAME = "manifest.json"
CHECKPOINTS_DIR = "checkpoints"


@dataclass
class Checkpoint:
    """A verified checkpoint: its directory (loadable with `from_pretrained`) and trainer state."""

    path: Path
    state: dict[str, Any]


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _point(link: Path, target: Path) -> None:
    """Makes `link` a relative symlink to `target`, atomically (new link + rename)."""
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, link.parent), tmp)
    os.replace(tmp, link)


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: LinformerPreTrainedModel,
    state: dict[str, Any],
    run_config: RunConfig | None,
    tokenizer: TextTokenizer | None,
    best: bool,
    keep_last: int,
) -> Path:
    """Writes the checkpoint of `step` and moves `last` (and `best`) to it.

    Args:
        run_dir: the run directory.
        step: optimiser steps done.
        model: the unwrapped model.
        state: trainer state (optimizer, scheduler, RNG, data position, counters).
        run_config: the run's config, saved beside the weights.
        tokenizer: saved beside the weights so the checkpoint is self-contained.
        best: also point `best` here.
        keep_last: step checkpoints to keep (the best one is always kept).

    Returns:
        The checkpoint directory.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        torch.save(state, tmp / STATE_NAME)
        if run_config is not None:
            run_config.save(tmp / RUN_CONFIG_NAME)
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_NAME)
        files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in tmp.iterdir()}
        (tmp / MANIFEST_NAME).write_text(json.dumps({"step": step, "files": files}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _point(Path(run_dir) / "last", final)
    if best:
        _point(Path(run_dir) / "best", final)
    _prune(Path(run_dir), keep_last)
    return final


def _prune(run_dir: Path, keep_last: int) -> None:
    steps = sorted((run_dir / CHECKPOINTS_DIR).glob("step-*"))
    best = run_dir / "best"
    keep = {p.resolve() for p in steps[-keep_last:]} | (
        {best.resolve()} if best.exists() else set()
    )
    for path in steps:
        if path.resolve() not in keep:
            shutil.rmtree(path, ignore_errors=True)


def verify_checkpoint(path: Path) -> None:
    """Checks every file of a checkpoint against its manifest.

    Raises:
        ValueError: naming the checkpoint and the missing, truncated or altered file.
    """
    path = Path(path)
    manifest = path / MANIFEST_NAME
    if not manifest.is_file():
        raise ValueError(f"checkpoint {path} is incomplete: it has no {MANIFEST_NAME}")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as err:
        raise ValueError(f"checkpoint {path}: {MANIFEST_NAME} is corrupt ({err})") from err
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise ValueError(f"checkpoint {path} is incomplete: {name} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise ValueError(
                f"checkpoint {path} is corrupt: {name} has {size} bytes, expected "
                f"{expected['bytes']} (truncated during a write?)"
            )
        if _sha256(file) != expected["sha256"]:
            raise ValueError(f"checkpoint {path} is corrupt: {name} does not match its checksum")


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Verifies a checkpoint and reads its trainer state.

    Raises:
        FileNotFoundError: if the directory does not exist.
        ValueError: if it is incomplete or corrupt.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    verify_checkpoint(path)
    state = torch.load(path / STATE_NAME, map_location="cpu", weights_only=True)
    return Checkpoint(path.resolve(), state)


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    """The newest checkpoint of a run that verifies; corrupt ones are skipped with a warning.

    Returns:
        The checkpoint, or None when the run has none.
    """
    run_dir = Path(run_dir)
    candidates = sorted((run_dir / CHECKPOINTS_DIR).glob("step-*"), reverse=True)
    for path in candidates:
        try:
            return load_checkpoint(path)
        except ValueError as err:
            logger.warning("skipping a checkpoint: %s", err)
    return None
