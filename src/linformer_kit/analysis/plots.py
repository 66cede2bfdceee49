"""Matplotlib figures of the analysis tools, written atomically (PNG, or the format a path's
suffix names).

Figures are built with `matplotlib.figure.Figure`, not pyplot, so importing this module never
changes the user's matplotlib backend (a notebook keeps its inline plots)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .. import files
from ..files import check_output_path, check_replaceable

MAX_TICK_LABELS = 64  # beyond this many tokens an axis shows positions, not token text
MAX_ANNOTATED_CELLS = 256  # the heatmap prints its values when it has at most this many cells


def figure_format(path: str | Path) -> str:
    """The image format a figure path names by its suffix (png, pdf, svg, jpg...; png
    without one).

    Raises:
        ValueError: for a suffix matplotlib cannot write, naming those it can, a path where
            no file can be written (`check_output_path`), or a file there that is no image
            of that format (`check_replaceable`).
    """
    check_output_path(path, directory=False)
    suffix = Path(path).suffix.lower().lstrip(".")
    formats = Figure().canvas.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise ValueError(
            f"{path}: matplotlib writes no .{suffix} figure; name one of "
            f"{', '.join('.' + name for name in sorted(formats))}"
        )
    image_format = suffix or "png"
    check_replaceable(path, image_format)
    return image_format


def save_figure(fig: Figure, path: str | Path) -> None:
    """Writes a figure atomically, in the format its suffix names (`figure_format`)."""
    files.save_figure(fig, path, image_format=figure_format(path))


def plot_spectrum(report: dict, path: str | Path, title: str) -> None:
    """The paper's Figure 1 for one model.

    Left: the normalised cumulative singular values of P, averaged over heads, one curve per
    layer. Right: each head's cumulative value at index `report["index"]` (layers x heads).

    Args:
        report: the dict from `spectrum.summarize`.
        path: output PNG.
        title: figure title (e.g. the checkpoint's name).
    """
    layers = report["layers"]
    index, n = report["index"], report["seq_len"]
    recommended = report["recommendation"]
    fig = Figure(figsize=(12.5, 4.8))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.25, 1]})
    colors = matplotlib.colormaps["viridis"](np.linspace(0.0, 0.9, len(layers)))
    for layer, color in zip(layers, colors):
        curve = layer["mean_curve"]
        left.plot(np.arange(1, len(curve) + 1), curve, color=color, label=f"layer {layer['layer']}")
    left.axhline(recommended["mass"], color="0.6", lw=0.8, ls=":")
    left.axvline(
        recommended["proj_dim"],
        color="tab:red",
        lw=1.0,
        ls="--",
        label=f"k = {recommended['proj_dim']}: {recommended['mass']:.0%} in every layer",
    )
    left.set_xscale("log")  # the mass sits in the first few values; a linear axis hides them
    left.set_xlabel("singular value index (log scale)")
    left.set_ylabel("normalised cumulative singular value")
    matrix = "P" if all(layer["proj_dim"] is None for layer in layers) else "P̄ (n × k)"
    left.set_title(f"spectrum of {matrix}, mean over heads (n = {n})")
    left.set_ylim(0, 1.02)
    # from below 1: a recommended k of 1 drawn on the axis's edge was not seen
    left.set_xlim(0.9, max(2, *(len(layer["mean_curve"]) for layer in layers)))
    left.grid(alpha=0.3)
    left.legend(loc="best", fontsize=8, ncol=1 + len(layers) // 8)

    values = np.array([layer["value_at_index"] for layer in layers])  # (layers, heads)
    lowest = min(values.min(), 0.999)
    image = right.imshow(values, cmap="viridis", aspect="auto", vmin=lowest, vmax=1.0)
    right.set_xlabel("head")
    right.set_ylabel("layer")
    right.set_xticks(range(values.shape[1]))
    right.set_yticks(range(values.shape[0]))
    right.set_title(f"cumulative value at index {index}")
    if values.size <= MAX_ANNOTATED_CELLS:
        middle = (lowest + 1.0) / 2  # the colour scale's: all 1.0 was white on yellow
        size = 8 if values.shape[1] <= 8 else 6
        for (row, col), value in np.ndenumerate(values):
            color = "black" if value > middle else "white"
            right.text(
                col, row, f"{value:.3f}", ha="center", va="center", color=color, fontsize=size
            )
    fig.colorbar(image, ax=right, fraction=0.046, pad=0.04)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    save_figure(fig, path)


def plot_attention_map(
    matrix: np.ndarray,
    path: str | Path,
    *,
    query_labels: list[str],
    key_labels: list[str] | None,
    title: str,
) -> None:
    """One attention matrix as a heatmap with a colorbar.

    Args:
        matrix: (n, M) attention weights, rows summing to 1.
        path: output PNG.
        query_labels: one label per row (the tokens).
        key_labels: one label per column (tokens, for exact attention), or None for the k
            projected rows of a Linformer (then the axis shows their index).
        title: figure title.
    """
    rows, cols = matrix.shape
    width = min(16.0, max(6.0, 0.22 * cols + 3.0))
    height = min(16.0, max(4.5, 0.22 * rows + 2.0))
    fig = Figure(figsize=(width, height))
    ax = fig.subplots()
    image = ax.imshow(matrix, cmap="viridis", aspect="auto", interpolation="nearest")
    ax.set_ylabel(f"query token (n = {rows})")
    if rows <= MAX_TICK_LABELS:
        ax.set_yticks(range(rows), query_labels, fontsize=7)
    if key_labels is None:
        ax.set_xlabel(f"projected key row (k = {cols})")
        # the rows' numbers (the default ticks fell between them: -0.5, 0.5, ...)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if cols <= MAX_TICK_LABELS:
            ax.set_xticks(range(cols))
    else:
        ax.set_xlabel(f"key token (n = {cols})")
        if cols <= MAX_TICK_LABELS:
            ax.set_xticks(range(cols), key_labels, fontsize=7, rotation=90)
    fig.colorbar(image, ax=ax, label="attention weight", fraction=0.046, pad=0.04)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
