"""A folder's `manifest.json`: the size and SHA-256 of each of its files, checked on load.

Training checkpoints carry one (it marks a checkpoint complete); any saved model may. Loading
a folder that has one checks it first, so a truncated or altered file is refused instead of
silently loaded. `verify=False`, or LINFORMER_NO_VERIFY=1 in the environment (the command
line's switch), skips the check for files changed on purpose.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from .files import save_json, sha256

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"  # a saved model's files, which a manifest must list
WEIGHTS_NAME = "model.safetensors"
MANIFEST_NAME = "manifest.json"
NO_VERIFY_ENV = "LINFORMER_NO_VERIFY"
OPT_OUT = (
    f"If the files were changed on purpose, load with verify=False (from_pretrained), "
    f"or set {NO_VERIFY_ENV}=1 in the environment (the linformer command)."
)


class IntegrityError(ValueError):
    """A directory's files do not match its manifest.json: missing, resized or altered.

    Attributes:
        path: the directory.
        problems: one line per file found wrong.
    """

    def __init__(self, path: Path, problems: list[str], advice: str = "") -> None:
        self.path, self.problems = path, problems
        message = f"{path} failed its integrity check: {'; '.join(problems)}"
        super().__init__(f"{message}; refusing to load it. {advice}" if advice else message)


def write_manifest(path: str | os.PathLike, **fields: Any) -> None:
    """Writes `manifest.json` into directory `path`: size and SHA-256 of every file there.

    Args:
        path: the directory, complete (files added later are not covered).
        **fields: extra entries recorded beside `files` (e.g. the training step).
    """
    path = Path(path)
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
        for p in sorted(path.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    save_json({**fields, "files": files}, path / MANIFEST_NAME)


def verify_manifest(
    path: str | os.PathLike,
    *,
    required: bool = False,
    advice: str = "",
    listed: tuple[str, ...] = (),
) -> bool:
    """Checks every file listed in `path/manifest.json`: present, same size, same SHA-256;
    and that it lists the model's own files (config, weights, and `listed`) where they are.

    Args:
        path: the directory.
        required: a missing manifest is an error (a checkpoint's marks it complete).
        advice: appended to the error message (what the user can do).
        listed: other files the manifest must list (a checkpoint's trainer state).

    Returns:
        True when a manifest was checked, False when there is none (and none is required).

    Raises:
        IntegrityError: naming the directory and, for each wrong file, what is wrong.
    """
    path = Path(path)
    manifest = path / MANIFEST_NAME
    if not manifest.is_file():
        if required:
            raise IntegrityError(path, [f"no {MANIFEST_NAME}: the checkpoint is incomplete"])
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError(f"its files are a {type(files).__name__}, not a mapping")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise IntegrityError(path, [f"{MANIFEST_NAME} is unreadable ({err!r})"], advice) from err
    # a manifest leaving out a file the loaders read let it change unchecked
    problems = [
        f"{name} is not in {MANIFEST_NAME}"
        for name in (CONFIG_NAME, WEIGHTS_NAME, *listed)
        if name not in files and ((path / name).exists() or name in listed)
    ]
    for name, expected in files.items():
        file = path / name
        if name in ("", ".", "..") or Path(name).name != name:  # never a file elsewhere
            problems.append(f"{name!r} is not a file name of this folder")
        elif not isinstance(expected, dict) or not (
            isinstance(expected.get("bytes"), int) and isinstance(expected.get("sha256"), str)
        ):
            problems.append(f"{name}'s entry is not {{bytes, sha256}}: {expected!r}")
        elif not file.is_file():
            problems.append(f"{name} is missing")
        elif (size := file.stat().st_size) != expected["bytes"]:
            problems.append(
                f"{name} has {size} bytes, expected {expected['bytes']} (truncated or replaced)"
            )
        elif sha256(file) != expected["sha256"]:
            problems.append(f"{name} was altered (same size, but its SHA-256 differs)")
    if problems:
        raise IntegrityError(path, problems, advice)
    return True


def check_before_load(path: str | os.PathLike, verify: bool = True) -> None:
    """The check run before loading a directory a user names: its manifest, if it has one.

    Args:
        path: the directory.
        verify: False skips the check, as does LINFORMER_NO_VERIFY=1 in the environment.

    Raises:
        IntegrityError: naming the wrong files and the opt-out.
    """
    if verify and os.environ.get(NO_VERIFY_ENV, "").lower() not in ("1", "true", "yes", "on"):
        verify_manifest(path, advice=OPT_OUT)
    elif (Path(path) / MANIFEST_NAME).is_file():
        logger.warning("%s: not checked against its %s (verification off)", path, MANIFEST_NAME)
