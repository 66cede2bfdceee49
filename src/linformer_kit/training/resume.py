"""What a `--resume` must keep: the model the checkpoint's weights belong to, the processes,
the data and its order, as the checkpoint's run recorded them; each check names what differs
and the run's value."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .. import hub
from ..models import LinformerPreTrainedModel
from .checkpoint import CHECKPOINTS_DIR, Checkpoint, latest_checkpoint
from .settings import RUN_CONFIG_NAME

logger = logging.getLogger(__name__)

# config fields a resumed run may change: regularisation, memory and the initial weights
# (which the checkpoint's replace); any other field is the architecture the weights belong to
RESUME_MAY_CHANGE = frozenset({"dropout", "attention_dropout", "checkpointing", "init_std"})


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"decoder.dim": 64, ...}: a config's nested fields (a seq2seq's) under dotted names."""
    flat: dict[str, Any] = {}
    for name, value in data.items():
        if isinstance(value, dict) and name not in ("id2label", "label2id"):
            flat.update(_flat(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def checkpoint_to_resume(found: Checkpoint | None, run_dir: Path) -> Checkpoint | None:
    """The checkpoint a resume goes on from, once the run's folder is held: the newest intact
    one, or the one the caller `found` before (to check the resume before the data's work),
    checked again: a run of the folder that ended in between could have saved newer ones, which
    a resume from the one found would overwrite.

    Raises:
        ValueError: naming both, when a checkpoint newer than the one found is there now.
    """
    if found is None:
        return latest_checkpoint(run_dir)
    newer = [p for p in (run_dir / CHECKPOINTS_DIR).glob("step-*") if p.name > found.path.name]
    if not newer:  # the usual case: no second verification of the checkpoints
        return found
    latest = latest_checkpoint(run_dir)  # a newer one that fails its check is no newer run's
    if latest is not None and latest.path.name != found.path.name:
        raise ValueError(
            f"{run_dir} went on while this --resume prepared (another run of it ended): its "
            f"newest checkpoint is {latest.path.name}, not {found.path.name} as found before; "
            f"start the --resume again"
        )
    return found


def check_resumable(
    checkpoint: Checkpoint, model: LinformerPreTrainedModel, world_size: int
) -> None:
    """Checks that a run of `world_size` processes training `model` can resume from
    `checkpoint`: as many processes (each one's data rows and RNG state go on), and the
    model `check_same_model` accepts.

    Raises:
        ValueError: naming what differs.
    """
    if len(checkpoint.state["rng"]) != world_size:
        raise ValueError(
            f"{checkpoint.path} was trained by {len(checkpoint.state['rng'])} processes: "
            f"resume it on as many (this run has {world_size})"
        )
    check_same_model(checkpoint.path, model)


# The TrainSettings a run's data order comes from (`RowSchedule.for_run`), which every
# --resume keeps.
DATA_ORDER = ("batch_size", "grad_accum_steps", "seed")


def check_resume_keeps(
    checkpoint: Checkpoint | None,
    run: Any,
    keeps: dict[str, tuple[str, ...]],
    continues: str,
    same: Callable[[str, Any, Any], bool | None] = lambda name, now, was: now == was,
    shown: Callable[[str, Any], str] = lambda name, value: repr(value),
) -> None:
    """Checks that a `--resume` goes on with the settings `keeps` names (section: fields) as
    `checkpoint`'s run_config.json recorded them: `run` is this run's config (its sections
    dataclasses), `same(name, now, was)` whether two values are one setting (None where it
    cannot be told from here, a path that does not exist from here: a warning), `shown` how
    a value is named. A run without a checkpoint passes.

    Raises:
        ValueError: "--resume continues `continues`", then each flag that differs with
            the run's value.
    """
    if checkpoint is None or not (checkpoint.path / RUN_CONFIG_NAME).is_file():
        return
    started = json.loads((checkpoint.path / RUN_CONFIG_NAME).read_text())
    # as run_config.json holds them (a tuple is a list there)
    now = json.loads(json.dumps({name: asdict(getattr(run, name)) for name in keeps}))
    changed = []
    for section, names in keeps.items():
        for name in (n for n in names if n in started.get(section, {})):
            value, before = now[section][name], started[section][name]
            flag = f"--{name.replace('_', '-')} {shown(name, value)} (the run's: "
            flag += f"{shown(name, before)})"
            verdict = same(name, value, before)
            if verdict is None:
                logger.warning(
                    "%s: the run's path does not exist from here (moved, removed, or relative "
                    "to where the run started), so it cannot be compared; going on as if the "
                    "same data",
                    flag,
                )
            elif not verdict:
                changed.append(flag)
    if changed:
        raise ValueError(
            f"--resume continues {continues}; these differ: {', '.join(changed)}. Give the "
            f"run's values, or start over in another --output-dir"
        )


def check_same_source(checkpoint: Checkpoint, source: dict[str, Any] | None) -> None:
    """Checks that a resume trains on the data `checkpoint`'s run trained on, as the trainer
    state's `data_source` names it (pretraining: the token stream's length and SHA-256); a
    checkpoint or a run that names none passes.

    Raises:
        ValueError: naming both.
    """
    was = checkpoint.state.get("data_source")
    if was is None or source is None or was == source:
        return
    shown = lambda s: ", ".join(f"{k} {str(v)[:16]}" for k, v in s.items())  # noqa: E731
    raise ValueError(
        f"--resume continues the training of {checkpoint.path} on the data it trained on "
        f"({shown(was)}); this run's is other ({shown(source)}): the data changed since (a "
        f"file added, removed or changed; seq2seq's docstrings: another Python's stdlib or a "
        f"tokenizer trained anew), so the run would go on, and validate, on other data than "
        f"it trained on. Restore the data, or start a fresh run in another --output-dir"
    )


def same_file(now: str, was: str) -> bool | None:
    """Whether two spellings of a path name one file or folder from here (None when the run's,
    `was`, does not exist from here: relative to the directory the run started in)."""
    if not os.path.exists(was):
        return None
    return os.path.realpath(now) == os.path.realpath(was)


def check_same_model(checkpoint: Path, model: LinformerPreTrainedModel) -> None:
    """Checks that `model` is the model whose weights `checkpoint` holds: the same class,
    constructor arguments and config, but for RESUME_MAY_CHANGE (weights of the same shapes
    would load into another activation, position scheme or projection without a word).

    Raises:
        ValueError: naming each difference, with the checkpoint's value.
    """
    meta = hub.read_config(checkpoint)
    saved = {
        "architecture": meta["architecture"],
        **_flat(meta["model_kwargs"], "model_kwargs."),
        **_flat(meta["config"].to_dict()),
    }
    now = {
        "architecture": type(model).__name__,
        **_flat(model.model_kwargs(), "model_kwargs."),
        **_flat(model.config.to_dict()),
    }
    changed = ", ".join(
        f"{name} {now.get(name)!r} (the checkpoint's: {saved.get(name)!r})"
        for name in sorted(saved.keys() | now.keys())
        if name.rsplit(".", 1)[-1] not in RESUME_MAY_CHANGE and saved.get(name) != now.get(name)
    )
    if changed:
        raise ValueError(
            f"--resume continues the model saved in {checkpoint}; this run's differs: "
            f"{changed}. Give the run's values, or start over in another --output-dir"
        )
