"""Plots of a sweep: time and peak memory vs n (log-log, one line per variant), and a
Table-3-style grid of speed-up and memory saving over exact SDPA for n x k."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # pyplot-free: the user's backend stays as it is


def _label(row: dict[str, Any], with_dtype: bool) -> str:
    label = row["variant"] if row["k"] is None else f"{row['variant']} k={row['k']}"
    return f"{label} {row['dtype']}" if with_dtype else label


def plot_scaling(rows: list[dict[str, Any]], path: Path, *, title: str) -> None:
    """Median time and peak memory vs n, one panel per scope, one line per variant and k."""
    scopes = list(dict.fromkeys(r["scope"] for r in rows))
    with_dtype = len({r["dtype"] for r in rows}) > 1
    fig = Figure(figsize=(6.5 * len(scopes), 9))
    axes = fig.subplots(2, len(scopes), squeeze=False)
    for col, scope in enumerate(scopes):
        lines: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            if row["scope"] == scope and row["status"] == "ok":
                lines.setdefault(_label(row, with_dtype), []).append(row)
        for label, points in lines.items():
            exact = points[0]["kind"] in ("sdpa", "naive")
            style = {"linestyle": "--" if exact else "-", "marker": "o", "label": label}
            axes[0][col].plot([p["n"] for p in points], [p["median_ms"] for p in points], **style)
            memory = [p for p in points if p["peak_mem_mb"]]
            if memory:
                axes[1][col].plot(
                    [p["n"] for p in memory], [p["peak_mem_mb"] for p in memory], **style
                )
        axes[0][col].set(title=f"{scope}: median time", ylabel="ms")
        axes[1][col].set(title=f"{scope}: peak memory", ylabel="MiB", xlabel="sequence length n")
        for axis in axes[:, col]:
            axis.set(xscale="log", yscale="log")
            axis.set_xscale("log", base=2)
            axis.grid(True, which="both", alpha=0.3)
            if axis.lines:
                axis.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_grid(rows: list[dict[str, Any]], path: Path, *, title: str) -> None:
    """Speed-up and memory saving of each of our sharing modes over exact SDPA, n x k
    (the paper's Table 3 layout), for the encoder layer when timed, else the attention, in
    the first dtype of the sweep."""
    scopes = {r["scope"] for r in rows}
    scope = "layer" if "layer" in scopes else "attention"
    dtype = rows[0]["dtype"] if rows else "float32"
    ours = [r for r in rows if (r["scope"], r["dtype"], r["kind"]) == (scope, dtype, "ours")]
    variants = list(dict.fromkeys(r["variant"] for r in ours))
    seq_lens = sorted({r["n"] for r in ours})
    proj_dims = sorted({r["k"] for r in ours})
    metrics = [
        (metric, name)
        for metric, name in (
            ("speedup_vs_sdpa", "speed-up over exact SDPA"),
            ("memory_saving_vs_sdpa", "memory saving over exact SDPA"),
            ("speedup_vs_naive", "speed-up over naive exact"),
            ("memory_saving_vs_naive", "memory saving over naive exact"),
        )
        if any(r.get(metric) for r in ours)
    ] or [("speedup_vs_sdpa", "speed-up over exact SDPA")]
    fig = Figure(
        figsize=(
            1.5 + 0.8 * len(seq_lens) * max(len(variants), 1),
            1.0 + (0.6 + 0.45 * len(proj_dims)) * len(metrics),
        )
    )
    axes = fig.subplots(len(metrics), max(len(variants), 1), squeeze=False)
    for col, variant in enumerate(variants):
        cells = {(r["k"], r["n"]): r for r in ours if r["variant"] == variant}
        for line, (metric, name) in enumerate(metrics):
            axis = axes[line][col]
            values = [
                [(cells.get((k, n)) or {}).get(metric) or float("nan") for n in seq_lens]
                for k in proj_dims
            ]
            # log colour scale centred on 1x: green faster/smaller, red slower/larger.
            logs = [[math.log2(v) if v == v else float("nan") for v in row] for row in values]
            axis.imshow(logs, cmap="RdYlGn", vmin=-6, vmax=6, aspect="auto")
            for i, row in enumerate(values):
                for j, value in enumerate(row):
                    text = "-" if value != value else f"{value:.2g}x"
                    axis.text(j, i, text, ha="center", va="center", fontsize=8)
            axis.set_xticks(range(len(seq_lens)), [str(n) for n in seq_lens], fontsize=7)
            axis.set_yticks(range(len(proj_dims)), [f"k={k}" for k in proj_dims])
            axis.set_title(f"{variant}: {name}", fontsize=8)
            axis.set_xlabel("n", fontsize=8)
    fig.suptitle(f"{scope}, {dtype} ({title})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
