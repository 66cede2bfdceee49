"""Long Range Arena reports: one task's plot, and the table of every task run into one output
directory beside LRA's published accuracies, the majority class and the best constant answer."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..data.lra import TASKS
from ..files import atomic_write, save_figure
from .settings import markdown_table

COLUMNS = {
    "task": "task",
    "length": "n",
    "model": "model",
    "test_acc": "test acc %",
    "published": "LRA %",
    "majority": "majority %",
    "constant": "best constant %",
    "s_per_step": "s / step",
    "speedup": "step time: exact / this",
    "peak_mem_mb": "peak MB",
    "steps": "steps",
}


def model_label(name: str, proj_dim: int | None, projection: str = "linear") -> str:
    """A report row's model name: `linformer` with its k (and its projection unless the
    paper's `linear`), or `transformer` (exact)."""
    if name == "transformer":
        return "Transformer (exact)"
    return f"Linformer k={proj_dim}" + ("" if projection == "linear" else f" {projection}")


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One table row per model of a task's report: accuracies in %, the exact model's time
    per step over this model's (NaN without an exact model; a model that died has NaN figures)."""
    exact = model_label("transformer", None)
    exact_s = next((r["s_per_step"] for r in report["rows"] if r["model"] == exact), math.nan)
    return [
        {
            "task": report["task"],
            "length": report["data"]["max_seq_len"],
            "model": row["model"],
            "test_acc": row["test_acc"],
            "published": row["published"],
            "majority": 100 * report["majority_baseline"],
            "constant": 100 * report.get("best_constant_baseline", math.nan),  # older reports
            "s_per_step": row["s_per_step"],
            "speedup": exact_s / row["s_per_step"],
            "peak_mem_mb": row["peak_mem_mb"],
            "steps": row["steps"],
        }
        for row in report["rows"]
    ]


SUMMARY_TITLE = "# Long Range Arena, this library's Linformer and exact Transformer"


def write_summary(output_dir: str | Path) -> Path:
    """Writes `output_dir/summary.md`: the table of every task whose report (`TASK.json`) is
    in `output_dir`, in LRA's order, with each run's machine. Returns its path."""
    output = Path(output_dir)
    reports = [
        json.loads((output / f"{task}.json").read_text())
        for task in TASKS
        if (output / f"{task}.json").is_file()
    ]
    rows = [row for report in reports for row in summary_rows(report)]
    lines = [SUMMARY_TITLE, ""]
    lines.append(
        markdown_table(
            rows,
            COLUMNS,
            {
                "test_acc": 1,
                "published": 2,
                "majority": 1,
                "constant": 1,
                "s_per_step": 2,
                "speedup": 2,
            },
        )
    )
    for report in reports:
        lines.append(f"- {report['task']}: {_recipe(report)}; {_where(report)}")
    path = output / "summary.md"
    atomic_write(path, lambda tmp: tmp.write_text("\n".join(lines) + "\n"))
    return path


def counted(number: int, noun: str) -> str:
    """`1 head`, `4 heads`: a count and its noun, plural unless one."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _recipe(report: dict[str, Any]) -> str:
    """The model and data a report's rows were trained with."""
    recipe, sizes = report["recipe"], report["data"]["sizes"]
    return (
        f"scale {report['settings']['scale']}: width {recipe['dim']}, "
        f"{counted(recipe['depth'], 'layer')}, {counted(recipe['num_heads'], 'head')}, "
        f"{recipe.get('pooling', 'mean')} pooling, "
        f"{recipe['steps']} steps of {recipe['batch_size']}; {sizes[0]} / {sizes[1]} / "
        f"{sizes[2]} examples"
    )


def _where(report: dict[str, Any]) -> str:
    """The device and load a report's timings come from."""
    found = report["machine"]
    cpu = found.get("cpu") or {}
    device = found.get("cuda") or (
        f"{cpu.get('model', 'CPU')} ({', '.join(cpu.get('flags', [])) or 'no ISA flags read'}), "
        f"{report['settings']['threads'] or found.get('threads')} threads"
    )
    load = found.get("load_avg_1_5_15min")
    return device + (f", load average {load[0]:.1f} at the start" if load else "")


def plot_lra(report: dict[str, Any], path: Path) -> None:
    """Validation accuracy vs step for both models, and test accuracy beside LRA's."""
    from matplotlib.figure import Figure  # pyplot-free: the user's backend stays as it is

    fig = Figure(figsize=(11, 4.2))
    curves, bars = fig.subplots(1, 2)
    for row in report["rows"]:
        val = [r for r in row["records"] if r["split"] == "val"]
        curves.plot(
            [r["step"] for r in val],
            [100 * r["accuracy"] for r in val],
            marker="o",
            label=row["model"],
        )
    majority = 100 * report["majority_baseline"]
    for axis in (curves, bars):
        axis.axhline(majority, color="grey", linestyle="--", label="majority class")
        axis.grid(True, alpha=0.3)
    if "best_constant_baseline" in report:  # older reports lack it
        constant = 100 * report["best_constant_baseline"]
        bars.axhline(constant, color="black", linestyle=":", label="best constant (test)")
    curves.set(xlabel="optimiser step", ylabel="validation accuracy (%)")
    names = [row["model"] for row in report["rows"]]
    x = range(len(names))
    bars.bar(
        [i - 0.2 for i in x],
        [row["test_acc"] for row in report["rows"]],
        0.4,
        label="this run (test)",
    )
    bars.bar(
        [i + 0.2 for i in x],
        [row["published"] for row in report["rows"]],
        0.4,
        label="LRA, Table 1",
    )
    bars.set_xticks(list(x), names)
    bars.set(ylabel="test accuracy (%)")
    curves.legend()
    bars.legend()
    fig.suptitle(f"Long Range Arena: {report['task']} (scale {report['settings']['scale']})")
    fig.tight_layout()
    save_figure(fig, path)  # an interrupt left a truncated PNG in place of the last one
