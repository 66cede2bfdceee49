"""Helpers shared by the subcommands: flags generated from dataclasses, text tables, report
JSON files."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any, TypeVar

from ..config import PROJECTIONS, SHARINGS
from ..files import check_output_path, check_replaceable, save_json
from ..interop.convert import DEFAULT_SHAPE
from ..training.checkpoint import CHECKPOINTS_DIR
from ..training.loop import TrainResult
from ..training.settings import RUN_CONFIG_NAME
from .overrides import collect_overrides

ConfigT = TypeVar("ConfigT")


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one `--flag` per field of a dataclass, typed and defaulted from the field."""
    for f in dataclasses.fields(cls):
        # A bool field becomes a --flag / --no-flag pair: bool("False") would be True.
        typed = (
            {"action": argparse.BooleanOptionalAction}
            if isinstance(f.default, bool)
            else {"type": type(f.default)}
        )
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            default=f.default,
            help=f"{f.metadata.get('help', '')} (default: {f.default})",
            **typed,
        )


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    """Builds a dataclass from the flags `add_dataclass_arguments` added."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def run_summary(result: TrainResult) -> dict[str, Any]:
    """The size, speed and memory columns every training command reports."""
    return {
        "steps": result.steps,
        "params": result.params,
        "s_per_step": result.sec_per_step,
        "tokens_per_s": result.tokens_per_s,
        "peak_mem_mb": result.peak_mem_mb,
    }


def print_checkpoints(result: TrainResult) -> None:
    """Prints the run's `last` and `best` checkpoints that exist: a run whose validation
    loss never improved on inf (all nan) has no `best`."""
    found = [str(result.run_dir / n) for n in ("last", "best") if (result.run_dir / n).exists()]
    missing = "" if len(found) == 2 else " (no best: no validation loss was a number)"
    print(f"checkpoints: {' and '.join(found) or 'none'}{missing}")


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain aligned text table of dict rows (floats to 4 significant digits)."""
    cells = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()] for row in rows]
    header = list(rows[0])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def check_report_path(path: str, flag: str = "--out") -> None:
    """Raises ValueError if a report could not be written at `path` (a directory there, or a
    file where a folder of its path should be), naming `flag`: checked before the work."""
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{flag} {path} is a directory; name a file, e.g. {out / 'report.json'}")
    check_output_path(out, directory=False, flag=flag)
    check_replaceable(out, "json", flag)


def write_report(result: dict[str, Any], path: str) -> Path:
    """Writes `result` as indented JSON to `path` (atomically, creating its folder); returns
    the path."""
    save_json(result, path)
    return Path(path)


def merged_run_config(cls: type[ConfigT], args: argparse.Namespace) -> tuple[ConfigT, dict]:
    """A run's config: the defaults, then `--config FILE` (a run_config.json or a run
    directory), then the flags given; and those flags, by section (`collect_overrides`).

    Args:
        cls: the run config's class (`RunConfig`, `Seq2SeqRunConfig`).
        args: the parsed command line.

    Raises:
        ValueError: for `--config` at a run's folder saved to another `output_dir` (moved
            or copied) without `--output-dir`.
    """
    config = config_path(args.config)
    base = cls.load(config).to_dict() if config else {}
    given = collect_overrides(args)
    sections = {section: {**base.get(section, {}), **values} for section, values in given.items()}
    run = cls.from_dict({**base, **sections})
    folder, recorded = config and Path(config), run.train.output_dir
    if folder and folder.name == RUN_CONFIG_NAME:  # a run's own file: its folder
        folder = folder.parent
    placed = "output_dir" in given.get("train", {})
    if folder and (folder / CHECKPOINTS_DIR).is_dir() and not placed:
        # a run's folder (not a checkpoint's) moved or copied, or named from elsewhere than
        # where it started: the run went on in, or started afresh at, the folder it was
        # saved to (from here), without a word
        if not (os.path.isdir(recorded) and os.path.samefile(folder, recorded)):
            where = "" if os.path.isabs(recorded) else ", relative to where it started"
            raise ValueError(
                f"--config {config} is of the run in {folder}, saved to --output-dir "
                f"{recorded}{where}: give --output-dir {folder} to go on with it there"
            )
    return run, given


def config_path(path: str | None) -> str | None:
    """`--config PATH` (None when not given), named as that flag when it is empty or does not
    exist."""
    if path is None:
        return None
    if not path:  # taken for no --config without a word
        raise ValueError("--config is empty (''); name a run_config.json or a run directory")
    if not Path(path).exists():
        raise FileNotFoundError(f"--config {path} does not exist")
    return path


def add_student_arguments(parser: argparse.ArgumentParser, proj_dim_help: str) -> None:
    """Adds `--max-seq-len`, `--proj-dim`, `--sharing` and `--projection`: the shape of a
    Linformer made from a pretrained model (`convert`, `distill`)."""
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="longest input of the converted model; beyond the source's position table "
        "(512 for BERT) the learned positions are copied block after block (Longformer's "
        "rule) (default: the source's)",
    )
    # None where not given: DEFAULT_SHAPE's, or the flags told apart from their defaults
    # (refused with `convert --exact`, checked against an existing `distill` student)
    parser.add_argument(
        "--proj-dim",
        type=int,
        default=None,
        help=f"{proj_dim_help} (default: {DEFAULT_SHAPE['proj_dim']})",
    )
    parser.add_argument(
        "--sharing",
        choices=SHARINGS,
        default=None,
        help=f"projection sharing (paper sec. 4) (default: {DEFAULT_SHAPE['sharing']})",
    )
    parser.add_argument(
        "--projection",
        choices=PROJECTIONS,
        default=None,
        help=f"sequence projection kind (default: {DEFAULT_SHAPE['projection']})",
    )
