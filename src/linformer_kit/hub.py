"""Save and load models as `config.json` + `model.safetensors` (never pickle).

Shared tensors (a `layerwise` projection used by every layer) are written once; on load
every alias of a shared tensor is filled from that one entry. Files are written to a
temporary name and renamed, so an interrupted save never leaves a half-written file.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .config import LinformerConfig

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1


def atomic_write(path: Path, write: Any) -> None:
    """Calls `write(tmp_path)` then renames tmp_path to `path`, so readers see old or new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        # mkstemp creates the file private (0o600); give it the permissions the umask allows.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _alias_groups(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """Groups state-dict names that are views of the same memory (shared parameters)."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        key = (
            (
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tuple(tensor.shape),
                tensor.stride(),
            )
            if tensor.numel()
            else ("empty", name)
        )
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def save_pretrained(
    model: nn.Module, path: str | os.PathLike, architecture: str, model_kwargs: dict[str, Any]
) -> None:
    """Writes `config.json` and `model.safetensors` into directory `path`.

    Args:
        model: a model with a `config` attribute (LinformerConfig).
        path: output directory (created if missing).
        architecture: class name recorded for `from_pretrained`.
        model_kwargs: constructor arguments beyond the config (e.g. num_labels).
    """
    path = Path(path)
    state = model.state_dict()
    tensors = {group[0]: state[group[0]].contiguous() for group in _alias_groups(state)}
    meta = {
        "format_version": FORMAT_VERSION,
        "architecture": architecture,
        "config": model.config.to_dict(),
        "model_kwargs": model_kwargs,
    }
    atomic_write(path / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, {"format": "pt"}))
    text = json.dumps(meta, indent=2) + "\n"
    atomic_write(path / CONFIG_NAME, lambda tmp: Path(tmp).write_text(text))


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """Reads a saved model's `config.json`.

    Returns:
        A dict with `architecture`, `config` (a LinformerConfig) and `model_kwargs`.

    Raises:
        FileNotFoundError: if the directory or its config.json is missing.
        ValueError: if config.json is not valid JSON or holds an invalid config.
    """
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(
            f"no {CONFIG_NAME} in {Path(path)}: not a saved linformer-kit model"
        )
    try:
        meta = json.loads(file.read_text())
        config = LinformerConfig.from_dict(meta["config"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{file} is corrupt or not a linformer-kit config: {err}") from err
    return {
        "architecture": meta.get("architecture"),
        "config": config,
        "model_kwargs": meta.get("model_kwargs", {}),
    }


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Reads `model.safetensors` from a saved model directory.

    Raises:
        FileNotFoundError: if the file is missing.
        ValueError: if it is truncated or not a safetensors file.
    """
    file = Path(path) / WEIGHTS_NAME
    if not file.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {Path(path)}")
    try:
        return load_file(file)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file} is corrupt or truncated: {err}") from err


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Loads `tensors` into `model` strictly, filling every alias of a shared tensor.

    Raises:
        ValueError: listing missing, unexpected or mis-shaped weights.
    """
    state = model.state_dict()
    missing = [g[0] for g in _alias_groups(state) if not any(name in tensors for name in g)]
    unexpected = sorted(set(tensors) - set(state))
    wrong = [
        f"{n}: file {tuple(t.shape)} vs model {tuple(state[n].shape)}"
        for n, t in tensors.items()
        if n in state and t.shape != state[n].shape
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"weights in {source} do not match the model: missing {missing}, "
            f"unexpected {unexpected}, wrong shapes {wrong}"
        )
    model.load_state_dict(tensors, strict=False)
