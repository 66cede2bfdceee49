"""The table behind `linformer_kit.kernels.choose_kernel`: SDPA vs the explicit kernel.

One attention call (B = 1, H = 4) at each n x k x head_dim, in three modes: training with
attention dropout 0.1, training without, and inference (forward only). For each shape the
six (mode, kernel) steps are timed interleaved (medians of rotated rounds), so every ratio
comes from the same seconds of a shared machine. Writes benchmarks/kernels/table.json and
table.png (explicit's speed-up over SDPA, > 1: explicit is faster).

    PYTHONPATH=src python benchmarks/kernels.py
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from linformer_kit.bench.timing import time_interleaved
from linformer_kit.kernels import KERNELS, dot_product_attention
from linformer_kit.training.compare import machine

SEQ_LENS, PROJ_DIMS, HEAD_DIMS = (1024, 4096, 16384), (64, 256, 1024), (32, 64, 128)
MODES = {"train dropout 0.1": (True, 0.1), "train": (True, 0.0), "inference": (False, 0.0)}
HEADS, WARMUP, REPEATS, MIN_SECONDS = 4, 1, 5, 2.0
# One thread: on a shared, oversubscribed machine a 2-thread OpenMP region waits for its
# descheduled thread at every barrier, which adds a load-dependent constant to every op.
THREADS = 1
OUT = Path(__file__).parent / "kernels"


def make_step(n: int, k: int, d: int, mode: str, kernel: str) -> Callable[[], None]:
    """One attention call of (1, H, n, d) queries over k keys, as `attend` receives them:
    q, k, v are head-split views of (1, n, H * d) activations."""
    backward, dropout_p = MODES[mode]
    q = torch.randn(1, n, HEADS, d, requires_grad=backward)
    keys = torch.randn(1, k, HEADS, d, requires_grad=backward)
    values = torch.randn(1, k, HEADS, d, requires_grad=backward)
    grad = torch.randn(1, HEADS, n, d)

    def step() -> None:
        args = (q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
        if not backward:
            with torch.inference_mode():
                dot_product_attention(*args, kernel=kernel)
            return
        for t in (q, keys, values):
            t.grad = None
        dot_product_attention(*args, dropout_p=dropout_p, kernel=kernel).backward(grad)

    return step


def plot(rows: list[dict], path: Path) -> None:
    """explicit's speed-up over SDPA, one panel per mode, (k, head_dim) x n cells."""
    fig = Figure(figsize=(4.2 * len(MODES), 3.6))
    axes = fig.subplots(1, len(MODES), squeeze=False)[0]
    shapes = list(itertools.product(PROJ_DIMS, HEAD_DIMS))
    for axis, mode in zip(axes, MODES):
        cells = {(r["k"], r["head_dim"], r["n"]): r["explicit_speedup"] for r in rows
                 if r["mode"] == mode}  # fmt: skip
        values = [[cells[(k, d, n)] for n in SEQ_LENS] for k, d in shapes]
        axis.imshow(values, cmap="RdYlGn", vmin=0.25, vmax=1.75, aspect="auto")
        for i, line in enumerate(values):
            for j, value in enumerate(line):
                axis.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
        axis.set_xticks(range(len(SEQ_LENS)), [str(n) for n in SEQ_LENS], fontsize=7)
        axis.set_yticks(range(len(shapes)), [f"k={k} d={d}" for k, d in shapes], fontsize=7)
        axis.set(title=f"{mode}: SDPA time / explicit time", xlabel="n")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    """Times every shape, writes the table and the plot."""
    torch.set_num_threads(THREADS)
    before, rows = machine(), []
    shapes = list(itertools.product(SEQ_LENS, PROJ_DIMS, HEAD_DIMS))
    for n, k, d in tqdm(shapes, desc="shapes"):
        torch.manual_seed(0)
        steps = {
            (mode, kernel): make_step(n, k, d, mode, kernel)
            for mode, kernel in itertools.product(MODES, KERNELS)
        }
        times = time_interleaved(
            steps, warmup=WARMUP, repeats=REPEATS, device="cpu", min_seconds=MIN_SECONDS
        )
        for mode in MODES:
            sdpa, explicit = (statistics.median(times[(mode, kr)]) * 1e3 for kr in KERNELS)
            rows.append(
                {"mode": mode, "n": n, "k": k, "head_dim": d, "sdpa_ms": round(sdpa, 3),
                 "explicit_ms": round(explicit, 3), "explicit_speedup": round(sdpa / explicit, 3)}
            )  # fmt: skip
            tqdm.write(json.dumps(rows[-1]))
    OUT.mkdir(exist_ok=True)
    result = {
        "command": "PYTHONPATH=src python benchmarks/kernels.py",
        "machine": before,
        "heads": HEADS,
        "batch": 1,
        "threads": THREADS,
        "rows": rows,
    }
    (OUT / "table.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, OUT / "table.png")


if __name__ == "__main__":
    main()
