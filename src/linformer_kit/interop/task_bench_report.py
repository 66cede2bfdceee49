"""bench-task's report: the Markdown table and the plot of test accuracy, time per step and
peak memory per variant, beside the TF-IDF baseline; the rows an earlier report of the same
settings holds (`earlier_rows`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..files import atomic_write, save_figure, save_json
from ..training.settings import markdown_table as table

logger = logging.getLogger(__name__)

TFIDF = "tfidf"  # the baseline's row

COLUMNS = {
    "model": "model",
    "test_acc": "test accuracy",
    "s_per_step": "s / step",
    "peak_mem_mb": "peak memory (MB)",
    "train_s": "training (s)",
    "wall_s": "wall (s)",
    "test_docs_cut": "test docs cut",
}


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The report rows as a Markdown table (missing figures as a dash)."""
    return table(rows, COLUMNS, {"test_acc": 3, "s_per_step": 3})


def plot_task_report(report: dict[str, Any], path: Path) -> None:
    """Test accuracy, time per step and peak memory of every variant (baseline as a line)."""
    from matplotlib.figure import Figure  # pyplot-free: the user's backend stays as it is

    rows = [r for r in report["rows"] if r["variant"] != TFIDF]
    baseline = next(r["test_acc"] for r in report["rows"] if r["variant"] == TFIDF)
    fig = Figure(figsize=(12, 4))
    axes = fig.subplots(1, 3)
    names = [r["variant"].replace(":", "\n", 1) for r in rows]  # k512@2048 / adaptive:after
    for axis, key, label, fmt in zip(
        axes,
        ("test_acc", "s_per_step", "peak_mem_mb"),
        ("test accuracy", "seconds per step", "peak memory (MB)"),
        ("%.3f", "%.2f", "%.0f"),
    ):
        bars = axis.bar(names, [r[key] for r in rows], color="tab:blue")
        axis.bar_label(bars, fmt=fmt)  # near-equal bars differ in the figures, not the heights
        axis.margins(y=0.12)
        axis.set(ylabel=label)
        axis.grid(True, axis="y", alpha=0.3)
        axis.tick_params(axis="x", labelsize=8)
    axes[0].axhline(
        baseline,
        color="tab:red",
        linestyle="--",
        label=f"TF-IDF + log. regression ({baseline:.3f})",
    )
    axes[0].legend(loc="lower right")
    fig.suptitle(f"Fine-tuned on {Path(report['settings']['train']).parent.name or 'the corpus'}")
    fig.tight_layout()
    save_figure(fig, path)


def report_file(out: str | Path, suffix: str) -> Path:
    """OUT + suffix (`.json`, `.md`, `.png`): a dot inside OUT's name stays (`runs/x.v1` ->
    `runs/x.v1.json`); OUT given as one of the three files is read as its stem."""
    out = Path(out)
    stem = out.with_suffix("") if out.suffix in (".json", ".md", ".png") else out
    return stem.with_name(stem.name + suffix)


def write_task_report(report: dict[str, Any], out: Path) -> None:
    """OUT.json (everything), OUT.md (the table) and OUT.png (once a variant has run; an
    earlier one removed until then), each written atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    save_json(report, report_file(out, ".json"))
    text = markdown_table(report["rows"])
    atomic_write(report_file(out, ".md"), lambda tmp: Path(tmp).write_text(text))
    if len(report["rows"]) > 1:
        plot_task_report(report, report_file(out, ".png"))
    else:  # an earlier report's figure would show variants this one does not hold
        report_file(out, ".png").unlink(missing_ok=True)


# Settings that do not change a variant's figures: what runs, and where files are written.
_NOT_COMPARED = ("variants", "work_dir", "out")
# Settings the bench gained after reports were committed, with the value those runs used.
_ADDED_LATER = {
    "grad_accum_steps": 1,
    "projections": "train",
    "distill_steps": 0,
    "truncation": "head",
    "after_epochs": 2,
    "after_lr": 3e-5,
}


def earlier_rows(settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rows of an earlier OUT.json with the same settings (bar `_NOT_COMPARED`), by variant.
    A setting the earlier report lacks (added to the bench since) counts as `_ADDED_LATER`
    says; other settings log a warning and keep nothing.

    Args:
        settings: this run's `TaskBenchSettings` as a dict (`out` names the report).

    Raises:
        ValueError: OUT.json exists but is not a bench-task report.
    """
    path = report_file(settings["out"], ".json")
    if not path.is_file():
        return {}
    try:
        earlier = json.loads(path.read_text())
        earlier["settings"], earlier["rows"]  # noqa: B018 (a report has both)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{path} is not a bench-task report ({error!r}); give another --out, or move it"
        ) from None

    def compared(settings: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in (_ADDED_LATER | settings).items() if k not in _NOT_COMPARED}

    before, now = compared(earlier["settings"]), compared(settings)
    if before != now:
        differ = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        logger.warning(
            "%s was made with other settings (%s): this run replaces its rows",
            path,
            ", ".join(differ),
        )
        return {}
    return {row["variant"]: row for row in earlier["rows"]}
