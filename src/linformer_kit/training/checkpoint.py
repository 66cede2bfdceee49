"""Checkpoints: model (safetensors via save_pretrained), optimizer, scheduler, RNG states,
data position and run config, written so that a kill at any moment leaves the previous
checkpoint intact.

Layout of a run directory::

    checkpoints/step-00000100/   config.json, model.safetensors, trainer_state.pt,
                                 run_config.json, tokenizer.json, manifest.json
    last -> checkpoints/step-...  (symlinks, replaced atomically)
    best -> checkpoints/step-...

A checkpoint is assembled in a temporary directory, its manifest (size and SHA-256 of every
file, `manifest.write_manifest`) written last, then renamed into place; only then do the `last` /
`best` links move. So a checkpoint without a manifest is incomplete, and one whose files do
not match it is corrupt: resume skips both.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import hub, manifest
from ..checks import is_number
from ..data.tokenizer import TOKENIZER_NAME, TextTokenizer
from ..files import check_output_path, umask_mode
from ..models import LinformerPreTrainedModel
from .settings import RUN_CONFIG_NAME, RunConfig

logger = logging.getLogger(__name__)

STATE_NAME = "trainer_state.pt"
FULL_DISK_BYTES = 64 * 2**20  # torch.save's "unexpected pos" with less free: a full disk
CHECKPOINTS_DIR = "checkpoints"


@dataclass
class Checkpoint:
    """A verified checkpoint: its directory (loadable with `from_pretrained`) and trainer state."""

    path: Path
    state: dict[str, Any]


def _point(link: Path, target: Path) -> None:
    """Makes `link` a relative symlink to `target`, atomically (new link + rename)."""
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, link.parent), tmp)
    os.replace(tmp, link)


def step_dir(run_dir: str | Path, step: int) -> Path:
    """The checkpoint directory of `step` in a run."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{step:08d}"


def restore_links(run_dir: str | Path, resumed: Path, best_step: int | None) -> None:
    """Points `last` at the checkpoint a run resumes from and `best` at the one of
    `best_step` (as the run's state recorded it): a run stopped inside a save, after the
    checkpoint was written and before the links moved, left them on earlier checkpoints,
    `best` on a worse model whose keeping then let a prune remove the best."""
    # the run's own path (`resumed` is resolved: relative to a run folder reached through a
    # link, it named nothing)
    _point(Path(run_dir) / "last", Path(run_dir) / CHECKPOINTS_DIR / resumed.name)
    if best_step is None:  # saved by an earlier version
        return
    best = step_dir(run_dir, best_step)
    if best.is_dir():
        _point(Path(run_dir) / "best", best)
    else:
        logger.warning("the run's best checkpoint, %s, is gone: `best` is left as it is", best)


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
    final = step_dir(run_dir, step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        torch.save(state, tmp / STATE_NAME)
        if run_config is not None:
            run_config.save(tmp / RUN_CONFIG_NAME)
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_NAME)
        manifest.write_manifest(tmp, step=step)
        os.chmod(tmp, umask_mode(0o777))  # mkdtemp made it private (0o700)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except Exception as err:
        _check_write(err, final)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _point(Path(run_dir) / "last", final)
    if best:
        _point(Path(run_dir) / "best", final)
    _prune(Path(run_dir), keep_last)
    return final


class CheckpointWriteError(OSError):
    """A checkpoint the disk had no room for (the checkpoints before it are intact), or whose
    run folder was removed."""


def _check_write(err: Exception, final: Path) -> None:
    """Raises CheckpointWriteError for a save that failed on a full disk (torch.save says
    "unexpected pos", safetensors "No space left on device": a traceback either way, that
    named neither the disk nor the way on), or whose run folder was removed meanwhile (the
    error named a temporary file in it); other errors go on as they are."""
    run_dir = final.parent.parent
    if not run_dir.is_dir():  # torch.save: "Parent directory ... does not exist"
        raise CheckpointWriteError(
            f"the run folder {run_dir} was removed while the run went on: checkpoint "
            f"{final.name} could not be written, and the run stops"
        ) from err
    try:
        free = shutil.disk_usage(final.parent).free
    except OSError:
        return
    written = "unexpected pos" in str(err) and free < FULL_DISK_BYTES  # torch.save's, no errno
    full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(
        err
    )
    if full or written:
        raise CheckpointWriteError(
            f"no room to write checkpoint {final.name} in {final.parent} ({free / 2**20:.0f} "
            f"MiB free; {type(err).__name__}: {err}); the checkpoints before it are intact: "
            f"free some space, then continue with --resume"
        ) from err


def _prune(run_dir: Path, keep_last: int) -> None:
    """Removes all but the newest `keep_last` checkpoints and the best one, and whatever a
    kill in the middle of an earlier save left (`.tmp-*`: one writer, rank 0, so none is
    being written now)."""
    for stale in (run_dir / CHECKPOINTS_DIR).glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    steps = sorted((run_dir / CHECKPOINTS_DIR).glob("step-*"))
    best = run_dir / "best"
    keep = {p.resolve() for p in steps[-keep_last:]} | (
        {best.resolve()} if best.exists() else set()
    )
    for path in steps:
        if path.resolve() not in keep:
            shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Verifies a checkpoint against its manifest and reads its trainer state.

    Raises:
        FileNotFoundError: if the directory does not exist.
        manifest.IntegrityError: if it is incomplete or corrupt (a ValueError).
    """
    path = Path(hub.pinned(path))
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    manifest.verify_manifest(path, required=True, listed=(STATE_NAME,))
    try:
        state = torch.load(path / STATE_NAME, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        raise manifest.IntegrityError(path, [f"{STATE_NAME} is unreadable ({err})"]) from err
    if problem := _state_problem(state):
        raise manifest.IntegrityError(path, [f"{STATE_NAME} is not a trainer state: {problem}"])
    return Checkpoint(path.resolve(), state)


def _state_problem(state: Any) -> str | None:
    """What makes `state` other than a trainer state `Trainer._state` saved (a file the
    resume failed on in a traceback), or None."""
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not a dict"
    checks = {
        "step": lambda v: is_number(v) and isinstance(v, int) and v >= 0,
        "tokens": is_number,
        "train_s": is_number,
        "best": is_number,
        "optimizer": lambda v: isinstance(v, dict),
        "scheduler": lambda v: isinstance(v, dict),
        "rng": lambda v: (
            isinstance(v, list)
            and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in v)
        ),
    }
    bad = next((name for name, valid in checks.items() if not valid(state.get(name))), None)
    return bad and f"its {bad} is {str(state.get(bad))[:40]!r}"


def restore_rng(state: dict[str, Any], rank: int, device: torch.device) -> None:
    """Puts back process `rank`'s random number generators as `state` (a checkpoint's) saved
    them: the CPU's, and the GPU's when `device` is one and the run saved it (a run saved on
    the CPU has none: the GPU's then goes on from this process's seed, with a warning)."""
    torch.set_rng_state(state["rng"][rank])
    if device.type != "cuda":
        return
    if not state["cuda_rng"]:
        logger.warning(
            "the checkpoint was saved by a run on the CPU: the GPU's random numbers (dropout) "
            "go on from this run's seed, not from where that run stopped"
        )
        return
    torch.cuda.set_rng_state(state["cuda_rng"][rank], device)


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    """The newest checkpoint of a run that verifies; corrupt ones are skipped with a warning.

    Returns:
        The checkpoint, or None when the run has no checkpoint at all.

    Raises:
        ValueError: when the run has checkpoints but none is intact, listing what is wrong
            with each and the ways on.
    """
    run_dir = Path(run_dir)
    candidates = sorted((run_dir / CHECKPOINTS_DIR).glob("step-*"), reverse=True)
    problems = []
    for path in candidates:
        try:
            checkpoint = load_checkpoint(path)
        except manifest.IntegrityError as err:
            problems.append(f"{path.name}: {'; '.join(err.problems)}")
            continue
        for problem in problems:
            logger.warning("skipping a corrupt checkpoint in %s: %s", run_dir, problem)
        return checkpoint
    if not candidates:
        return None
    raise ValueError(
        f"no intact checkpoint to resume from in {run_dir}: every one failed its integrity "
        f"check\n"
        + "".join(f"  {problem}\n" for problem in problems)
        + f"To go on, either start a fresh run in another --output-dir, or remove the corrupt "
        f"checkpoints (rm -r {run_dir / CHECKPOINTS_DIR}) to start again from step 0 in {run_dir}."
    )


def check_run_dir(run_dir: str | Path, *, resume: bool) -> None:
    """Raises ValueError, before any work, for an --output-dir that is a file, or (a fresh
    run) one holding another run's checkpoints or a `best` / `last` that is not a link."""
    run_dir = Path(run_dir)
    check_output_path(run_dir, directory=True, flag="--output-dir")
    if resume:
        return
    if any((run_dir / CHECKPOINTS_DIR).glob("step-*")):
        raise ValueError(
            f"{run_dir} already holds checkpoints: pass --resume to continue that run, "
            f"or choose another --output-dir"
        )
    for name in ("best", "last"):  # a run's are links to its checkpoints
        path = run_dir / name
        if path.exists() and not path.is_symlink():
            raise ValueError(
                f"{path} is not a run's checkpoint link, and a run would replace it: "
                f"choose another --output-dir"
            )
