"""Save and load models as `config.json` + `model.safetensors` (never pickle).

Shared tensors (a `layerwise` projection used by every layer) are written once; on load
every alias of a shared tensor is filled from that one entry. Files are written in a
temporary folder and renamed, so an interrupted save never leaves a half-written file (and
the next save removes what a killed one left); both carry one random `save_id`
(config.json's field, the weights' metadata), and the weights their config too, so a save
interrupted between the two renames (the new weights beside the old config) loads the new
model whole, under the config saved in its weights.

A directory may carry a `manifest.json` (manifest.py), checked before it is loaded.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .config import LinformerConfig
from .files import atomic_write, check_output_path
from .manifest import CONFIG_NAME, MANIFEST_NAME, WEIGHTS_NAME
from .manifest import IntegrityError as IntegrityError  # importable from here, as before
from .manifest import check_before_load as check_before_load
from .manifest import verify_manifest as verify_manifest
from .manifest import write_manifest as write_manifest
from .seq2seq_config import config_from_dict

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
SAVE_ID = "save_id"  # config.json's field and the weights' metadata key: one save's pair


class NewerFormatError(ValueError):
    """A config.json of a format_version above `FORMAT_VERSION`: a newer library's."""


def _library_version() -> str:
    from . import __version__  # the package, imported by the time anything is saved

    return __version__


def pinned(path: str | os.PathLike) -> str | os.PathLike:
    """`path`, or the folder it links to when it is a link (a run's `last` / `best`), followed
    once: a load then reads every file of one save, though a live run moves the link to its
    next save meanwhile (read through the link, the manifest, config and weights could be
    of two)."""
    return Path(path).resolve() if Path(path).is_symlink() else path  # "run/last/" too


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
    state = model.state_dict()
    if on_meta := [name for name, t in state.items() if t.is_meta]:  # torch's NotImplementedError
        raise ValueError(
            f"the model's weights are on the meta device ({on_meta[0]}, ...): they hold no "
            f"values to save; give it weights first (model.to_empty(device=...), then load "
            f"or initialise them)"
        )
    check_output_path(path, directory=True, flag="path")  # "Not a directory"; "": the cwd
    path = Path(path)
    tensors = {group[0]: state[group[0]].contiguous() for group in _alias_groups(state)}
    save_id = uuid.uuid4().hex
    meta = {
        "format_version": FORMAT_VERSION,
        "linformer_kit_version": _library_version(),
        "architecture": architecture,
        "config": model.config.to_dict(),
        "model_kwargs": model_kwargs,
        SAVE_ID: save_id,
    }
    # a manifest there described the files this save replaces: left, it would refuse them
    (path / MANIFEST_NAME).unlink(missing_ok=True)
    text = json.dumps(meta, indent=2) + "\n"
    # The weights carry their config too: a save killed between the two renames leaves
    # the new weights beside the old config.json, and `read_config` then takes theirs.
    metadata = {"format": "pt", SAVE_ID: save_id, CONFIG_NAME: text}
    atomic_write(path / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata))
    atomic_write(path / CONFIG_NAME, lambda tmp: Path(tmp).write_text(text))


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """Reads a saved model's `config.json`, or, where that names another save than the
    weights beside it (a save interrupted between its two files), the config the weights
    carry, with a warning.

    Returns:
        A dict with `architecture`, `config` (a LinformerConfig, or a Seq2SeqConfig) and
        `model_kwargs`.

    Raises:
        FileNotFoundError: if the directory or its config.json is missing.
        ValueError: if config.json is not valid JSON or holds an invalid config.
    """
    if not Path(path).exists():  # said apart: a mistyped checkpoint folder is the usual cause
        raise FileNotFoundError(f"{Path(path)} does not exist (expected a checkpoint folder)")
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(
            f"no {CONFIG_NAME} in {Path(path)}: not a saved linformer-kit model"
        )
    try:
        meta = json.loads(file.read_text())
        if "config" not in meta and "model_type" in meta:  # transformers' config.json
            raise FileNotFoundError(
                f"{Path(path)} holds a Hugging Face model (model_type {meta['model_type']!r}), "
                f"not a linformer-kit one: convert it first (linformer convert --from "
                f"{Path(path)} --out DIR)"
            )
        saved_with = _weights_metadata(Path(path))
        if CONFIG_NAME in saved_with and _other_save(meta, saved_with):
            logger.warning(
                "%s is not the config %s was saved with (a save interrupted between the "
                "two files): using the config saved in the weights",
                file, Path(path) / WEIGHTS_NAME,
            )  # fmt: skip
            meta = json.loads(saved_with[CONFIG_NAME])
        if isinstance(meta, dict) and meta.get("format_version", 1) > FORMAT_VERSION:
            raise NewerFormatError(
                f"{file} was written by a newer linformer-kit ("
                f"{meta.get('linformer_kit_version', 'unknown version')}, format_version "
                f"{meta['format_version']}); this one ({_library_version()}) reads "
                f"format_version {FORMAT_VERSION}: upgrade linformer-kit to load it"
            )
        config = config_from_dict(meta["config"])
        if not isinstance(meta.get("model_kwargs", {}), dict):
            raise TypeError(f"model_kwargs is a {type(meta['model_kwargs']).__name__}")
    except NewerFormatError:
        raise
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(
            f"{file} is corrupt or not a config this linformer-kit ({_library_version()}) "
            f"reads: {err}"
        ) from err
    except RecursionError as err:  # nested too deep for the JSON parser
        raise ValueError(f"{file} is corrupt: nested too deep to read") from err
    return {
        "architecture": meta.get("architecture"),
        "config": config,
        "model_kwargs": meta.get("model_kwargs", {}),
    }


def _other_save(config: Any, metadata: dict[str, str]) -> bool:
    """Whether a config.json's contents and its weights' metadata name different saves."""
    ids = config.get(SAVE_ID) if isinstance(config, dict) else None, metadata.get(SAVE_ID)
    return None not in ids and ids[0] != ids[1]


def _weights_metadata(path: Path) -> dict[str, str]:
    """The metadata in the header of `path`'s weights ({} without a readable file:
    `read_weights` names what is wrong)."""
    try:
        with safe_open(path / WEIGHTS_NAME, "pt") as handle:
            return handle.metadata() or {}
    except (SafetensorError, OSError):
        return {}


def read_encoder_config(path: str | os.PathLike, seq2seq_advice: str) -> dict[str, Any]:
    """`read_config` of a model with one encoder (masked / causal LM, classifier, backbone).

    Raises:
        ValueError: for an encoder-decoder, with `seq2seq_advice` (what to run instead).
    """
    meta = read_config(path)
    check_encoder(meta, path, seq2seq_advice)
    return meta


def check_encoder(meta: dict[str, Any], path: str | os.PathLike, seq2seq_advice: str) -> None:
    """Raises a ValueError, with `seq2seq_advice`, if `read_config`'s `meta` is an
    encoder-decoder's."""
    if not isinstance(meta["config"], LinformerConfig):
        raise ValueError(
            f"{path} is a {meta['architecture']} (an encoder-decoder): {seq2seq_advice}"
        )


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Reads `model.safetensors` from a saved model directory.

    Raises:
        FileNotFoundError: if the file is missing.
        ValueError: if it is truncated or not a safetensors file, or the directory's
            config.json was written by another save (`SAVE_ID`) and the weights, saved
            before their config went into them, carry none.
    """
    file = Path(path) / WEIGHTS_NAME
    if not file.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {Path(path)}")
    try:
        with safe_open(file, "pt") as handle:  # the header once: metadata and tensors
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file} is corrupt or truncated: {err}") from err
    config = Path(path) / CONFIG_NAME
    if CONFIG_NAME not in metadata and config.is_file():
        try:
            config_meta = json.loads(config.read_text())
        except json.JSONDecodeError:
            config_meta = {}  # `read_config` names a corrupt config
        if _other_save(config_meta, metadata):
            raise ValueError(
                f"{config} and {file} were written by different saves (a save_pretrained "
                f"interrupted between them, or a config copied from another model): save "
                f"the model again"
            )
    return tensors


def warn_not_finite(tensors: dict[str, torch.Tensor], source: str | os.PathLike) -> None:
    """Warns, naming them, of weights that hold nan or inf (a diverged run's): loaded without
    a word, the model's outputs were nan. float8 has no isfinite: checked in float32."""
    broken = [
        name
        for name, t in tensors.items()
        if t.is_floating_point()
        and not (t.float() if t.element_size() == 1 else t).isfinite().all()
    ]
    if broken:
        warnings.warn(
            f"{source}: {len(broken)} weights hold nan or inf ({', '.join(broken[:3])}"
            f"{', ...' if len(broken) > 3 else ''}): the model's outputs will not be "
            f"numbers (saved from a run that diverged?)",
            stacklevel=3,  # the caller of from_pretrained
        )


def weights_dtype(tensors: dict[str, torch.Tensor], source: str | os.PathLike) -> torch.dtype:
    """The one floating dtype of a model file's tensors (`from_pretrained(dtype="auto")`).

    Raises:
        ValueError: if the file holds floating tensors of several dtypes, or none.
    """
    found = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(found) != 1:
        names = sorted(str(d) for d in found) or "none"
        raise ValueError(f"{source}: dtype='auto' needs floating tensors of one dtype, got {names}")
    return found.pop()


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Loads `tensors` into `model` strictly, filling every alias of a shared tensor.

    Raises:
        ValueError: listing missing, unexpected or mis-shaped weights, or naming tensors
            the model shares (one Parameter) that the file holds different (saved with
            another `sharing`: loading them would keep the last and drop the others).
    """
    state = model.state_dict()
    groups = _alias_groups(state)
    missing = [g[0] for g in groups if not any(name in tensors for name in g)]
    unexpected = sorted(set(tensors) - set(state))
    wrong = [
        f"{n}: file {tuple(t.shape)} vs model {tuple(state[n].shape)}"
        for n, t in tensors.items()
        if n in state and t.shape != state[n].shape
    ]
    wrong += [  # integers cast to weights without a word
        f"{n}: file {t.dtype} vs model {state[n].dtype}"
        for n, t in tensors.items()
        if n in state and t.is_floating_point() != state[n].is_floating_point()
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"weights in {source} do not match the model: missing {missing}, "
            f"unexpected {unexpected}, wrong shapes {wrong}"
        )
    for group in groups:
        saved = [name for name in group if name in tensors]
        if any(not torch.equal(tensors[saved[0]], tensors[name]) for name in saved[1:]):
            raise ValueError(
                f"weights in {source} hold {', '.join(saved)} as different tensors, which "
                f"this model shares as one (its projection sharing differs from the saved "
                f"model's); load it with the sharing it was saved with"
            )
    model.load_state_dict(tensors, strict=False)
