"""Plots of a sweep: time and peak memory vs n (log-log, one line per variant), ours'
speed against the faster peer vs n, and a Table-3-style grid of speed-up and memory saving
over exact SDPA for n x k."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.figure import Figure  # pyplot-free: the user's backend stays as it is

from ..files import save_figure
from .summary import PeerPoint, peer_ratios

# One line style per dtype of a sweep, in the order asked for; a variant keeps its colour.
DTYPE_STYLES = ("-", "--", ":", "-.")


def _label(row: dict[str, Any]) -> str:
    return row["variant"] if row["k"] is None else f"{row['variant']} k={row['k']}"


def _colours(labels: list[str]) -> dict[str, Any]:
    """A distinct colour per label (tab10, tab20 beyond ten), in first-seen order."""
    labels = list(dict.fromkeys(labels))
    cmap = colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {label: cmap(i % cmap.N) for i, label in enumerate(labels)}


def _line(label: str, dtype: str, dtypes: list[str], colours: dict[str, Any]) -> dict[str, Any]:
    """A line's style: its variant's colour, its dtype's line style, dtype in the label
    where the sweep has several."""
    return {
        "color": colours[label],
        "linestyle": DTYPE_STYLES[dtypes.index(dtype) % len(DTYPE_STYLES)],
        "label": f"{label} {dtype}" if len(dtypes) > 1 else label,
    }


def _log2_n_axis(axis: Any) -> None:
    axis.set_xscale("log", base=2)
    axis.grid(True, which="both", alpha=0.3)
    if axis.lines:
        axis.legend(fontsize=7)


def plot_scaling(rows: list[dict[str, Any]], path: Path, *, title: str) -> None:
    """Median time and peak memory vs n, one panel per scope, one line per variant and k
    (its colour) in each dtype (its line style); exact attention's points are squares."""
    scopes = list(dict.fromkeys(r["scope"] for r in rows))
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    colours = _colours([_label(r) for r in rows])
    fig = Figure(figsize=(6.5 * len(scopes), 9))
    axes = fig.subplots(2, len(scopes), squeeze=False)
    for col, scope in enumerate(scopes):
        lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for row in rows:
            if row["scope"] == scope and row["status"] == "ok":
                lines.setdefault((_label(row), row["dtype"]), []).append(row)
        for (label, dtype), points in lines.items():
            style = _line(label, dtype, dtypes, colours)
            style["marker"] = "s" if points[0]["kind"] in ("sdpa", "naive") else "o"
            axes[0][col].plot([p["n"] for p in points], [p["median_ms"] for p in points], **style)
            memory = [p for p in points if p["peak_mem_mb"]]
            if memory:
                axes[1][col].plot(
                    [p["n"] for p in memory], [p["peak_mem_mb"] for p in memory], **style
                )
        axes[0][col].set(title=f"{scope}: median time", ylabel="ms", yscale="log")
        axes[1][col].set(
            title=f"{scope}: peak memory", ylabel="MiB", xlabel="sequence length n", yscale="log"
        )
        for axis in axes[:, col]:
            _log2_n_axis(axis)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def plot_peers(summary: dict[str, Any], path: Path, *, title: str) -> bool:
    """The faster peer's median time over ours vs n (above 1: ours faster), one panel per
    scope, one line per variant of ours and k (its colour) in each dtype (its line style):
    `summary.peer_ratios`, with a bar over the quartiles of the same ratio round by round
    where the summary has them.

    Returns:
        Whether there was anything to draw (a sweep without peers writes no file).
    """
    panels: dict[str, dict[tuple[str, str], list[PeerPoint]]] = {}
    for (scope, dtype, label), points in peer_ratios(summary).items():
        panels.setdefault(scope, {})[(label, dtype)] = points
    if not panels:
        return False
    dtypes = list(dict.fromkeys(d for lines in panels.values() for _, d in lines))
    colours = _colours([label for lines in panels.values() for label, _ in lines])
    fig = Figure(figsize=(6.5 * len(panels), 5))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for axis, (scope, lines) in zip(axes, panels.items()):
        axis.axhline(1.0, color="grey", linewidth=1)
        for (label, dtype), points in lines.items():
            (line,) = axis.plot(
                [n for n, _, _ in points],
                [ratio for _, ratio, _ in points],
                marker="o",
                **_line(label, dtype, dtypes, colours),
            )
            bars = [(n, *quartiles) for n, _, quartiles in points if quartiles]
            if bars:
                ns, lows, highs = zip(*bars)
                axis.vlines(ns, lows, highs, colors=line.get_color(), linewidth=3, alpha=0.4)
        axis.set(
            title=f"{scope}: faster peer's time / ours",
            xlabel="sequence length n",
            ylabel="x (above 1: ours faster)",
        )
        _log2_n_axis(axis)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    return True


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
    save_figure(fig, path, dpi=110)


def plot_result(result: dict[str, Any], out: Path, *, title: str) -> None:
    """A sweep's plots in `out` (`run_bench`'s result, or its bench.json read back):
    scaling.png, grid.png, and peers.png where peers were timed (else none, not even an
    earlier run's)."""
    plot_scaling(result["rows"], out / "scaling.png", title=title)
    plot_grid(result["rows"], out / "grid.png", title=title)
    if not plot_peers(result["summary"], out / "peers.png", title=title):
        (out / "peers.png").unlink(missing_ok=True)
