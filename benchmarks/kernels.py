"""The table behind `linformer_kit.kernel_rule.choose_kernel`: SDPA vs the explicit kernel.

One attention call (H = 4) at each batch x n x k x head_dim, in three modes: training with
attention dropout 0.1, training without, and inference (forward only). For each shape the
six (mode, kernel) steps are timed interleaved (medians of rotated rounds), so every ratio
comes from the same seconds of a shared machine. Writes OUT/table.json and OUT/table.png
(explicit's speed-up over SDPA, > 1: explicit is faster). `--causal`: exact causal attention
(n keys, `is_causal=True`) instead of n queries over k keys, into OUT/causal.

    PYTHONPATH=src python benchmarks/kernels.py                  # the committed CPU table
    PYTHONPATH=src python benchmarks/kernels.py --device cuda --dtype float32,bfloat16 \
        --batch 1,8 --out benchmarks/kernels/cuda                # the GPU table (issue 17)
    PYTHONPATH=src python benchmarks/kernels.py --causal --n 1024,2048,4096 \
        --head-dim 64                                            # exact causal attention
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from linformer_kit.bench.timing import time_interleaved
from linformer_kit.kernel_rule import KERNELS
from linformer_kit.kernels import dot_product_attention, sdpa
from linformer_kit.precision import warn_if_bf16_is_slow
from linformer_kit.training.compare import machine

# n per device: a GPU reaches the lengths where issue 17 saw SDPA's fp32 kernel lose.
SEQ_LENS = {"cpu": "1024,4096,16384", "cuda": "1024,4096,16384,65536"}
PROJ_DIMS, HEAD_DIMS = "64,256,1024", "32,64,128"
DTYPES = ("float32", "bfloat16", "float16")
MODES = {"train dropout 0.1": (True, 0.1), "train": (True, 0.0), "inference": (False, 0.0)}
HEADS, WARMUP, REPEATS, MIN_SECONDS = 4, 1, 5, 2.0
# One thread: on a shared, oversubscribed machine a 2-thread OpenMP region waits for its
# descheduled thread at every barrier, which adds a load-dependent constant to every op.
THREADS = 1
OUT = Path(__file__).parent / "kernels"


def make_step(
    shape: tuple[int, int, int | str, int],
    mode: str,
    kernel: str,
    device: str,
    dtype: torch.dtype,
    splits: int | None = None,
) -> Callable[[], None]:
    """One attention call of (B, H, n, d) queries over k keys, as `attend` receives them:
    q, k, v are head-split views of (B, n, H * d) activations. `shape` is (B, n, k, d);
    k = "n": exact causal attention over the n keys. `splits`: instead of `kernel`, SDPA with
    its queries cut into that many chunks (`kernels.sdpa`), not the rule's count."""
    attention = dot_product_attention
    if splits is not None:
        attention = functools.partial(sdpa, splits=splits)
        kernel = None
    backward, dropout_p = MODES[mode]
    batch, n, k, d = shape
    causal = k == "n"
    k = n if causal else k
    like = {"device": device, "dtype": dtype}
    q = torch.randn(batch, n, HEADS, d, **like, requires_grad=backward)
    keys = torch.randn(batch, k, HEADS, d, **like, requires_grad=backward)
    values = torch.randn(batch, k, HEADS, d, **like, requires_grad=backward)
    grad = torch.randn(batch, HEADS, n, d, **like)
    kernel_arg = {} if kernel is None else {"kernel": kernel}

    def step() -> None:
        args = (q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
        if not backward:
            with torch.inference_mode():
                attention(*args, is_causal=causal, **kernel_arg)
            return
        for t in (q, keys, values):
            t.grad = None
        out = attention(*args, dropout_p=dropout_p, is_causal=causal, **kernel_arg)
        out.backward(grad)

    return step


def plot(rows: list[dict], path: Path) -> None:
    """explicit's speed-up over SDPA: one panel per (dtype, batch) and mode, with
    (k, head_dim) x n cells."""
    panels = sorted({(r["dtype"], r["batch"]) for r in rows})
    seq_lens = sorted({r["n"] for r in rows})
    shapes = sorted({(r["k"], r["head_dim"]) for r in rows})
    fig = Figure(figsize=(4.2 * len(MODES), 3.6 * len(panels)))
    axes = fig.subplots(len(panels), len(MODES), squeeze=False)
    for (dtype, batch), line in zip(panels, axes):
        for axis, mode in zip(line, MODES):
            cells = {(r["k"], r["head_dim"], r["n"]): r.get("explicit_speedup") for r in rows
                     if (r["mode"], r["dtype"], r["batch"]) == (mode, dtype, batch)}  # fmt: skip
            values = [[cells.get((k, d, n)) or math.nan for n in seq_lens] for k, d in shapes]
            axis.imshow(values, cmap="RdYlGn", vmin=0.25, vmax=1.75, aspect="auto")
            for i, cell_line in enumerate(values):
                for j, value in enumerate(cell_line):
                    axis.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
            axis.set_xticks(range(len(seq_lens)), [str(n) for n in seq_lens], fontsize=7)
            axis.set_yticks(range(len(shapes)), [f"k={k} d={d}" for k, d in shapes], fontsize=7)
            axis.set(title=f"{dtype}, B={batch}, {mode}:\nSDPA time / explicit time", xlabel="n")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The device, dtypes, shapes and output folder of a run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", default="float32", help=f"comma-separated, of {DTYPES}")
    parser.add_argument("--batch", default="1", help="comma-separated batch sizes")
    parser.add_argument("--n", default="", help="comma-separated n (default: per device)")
    parser.add_argument("--k", default=PROJ_DIMS, help="comma-separated k")
    parser.add_argument("--head-dim", default=HEAD_DIMS, help="comma-separated head_dim")
    parser.add_argument("--causal", action="store_true", help="exact causal, n keys (no --k)")
    parser.add_argument("--min-seconds", type=float, default=MIN_SECONDS, help="per shape")
    parser.add_argument("--out", type=Path, default=None, help="writes table.json, table.png")
    args = parser.parse_args(argv)
    if args.causal and args.k != PROJ_DIMS:
        parser.error("--causal attends to the n keys: drop --k")
    args.out = args.out or (OUT / "causal" if args.causal else OUT)  # never the rule's table
    args.n = args.n or SEQ_LENS[args.device]
    for name in ("batch", "n", "k", "head_dim"):
        setattr(args, name, [int(part) for part in getattr(args, name).split(",")])
    if args.causal:
        args.k = ["n"]
    args.dtype = args.dtype.split(",")
    for name in args.dtype:
        if name not in DTYPES:
            parser.error(f"--dtype must be among {', '.join(DTYPES)}; got {name!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was asked for but torch sees no GPU")
    return args


def main(argv: list[str] | None = None) -> None:
    """Times every shape, writes the table and the plot."""
    args = parse_args(argv)
    torch.set_num_threads(THREADS)
    if "bfloat16" in args.dtype:
        warn_if_bf16_is_slow(args.device, "--dtype float32")
    before, rows = machine(), []
    args.out.mkdir(parents=True, exist_ok=True)
    command = "PYTHONPATH=src python benchmarks/kernels.py " + " ".join(argv or sys.argv[1:])
    grid = list(itertools.product(args.dtype, args.batch, args.n, args.k, args.head_dim))
    for dtype, batch, n, k, d in tqdm(grid, desc="shapes"):
        torch.manual_seed(0)
        cell = {"dtype": dtype, "batch": batch, "n": n, "k": k, "head_dim": d}
        times, errors = time_shape((batch, n, k, d), args.device, getattr(torch, dtype), args)
        for mode in MODES:
            row = {"mode": mode, **cell}
            ms = {kr: statistics.median(times[(mode, kr)]) * 1e3 for kr in KERNELS
                  if (mode, kr) in times}  # fmt: skip
            row.update({f"{kr}_ms": float(f"{ms[kr]:.4g}") for kr in ms})
            if len(ms) == len(KERNELS):
                row["explicit_speedup"] = round(ms["sdpa"] / ms["explicit"], 3)
            row.update({f"{kr}_error": e for (m, kr), e in errors.items() if m == mode})
            rows.append(row)
            tqdm.write(json.dumps(row))
        # After every shape, so that a run stopped early keeps the shapes it finished.
        result = {"command": command, "machine": before, "device": args.device,
                  "heads": HEADS, "threads": THREADS, "rows": rows}  # fmt: skip
        (args.out / "table.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.out / "table.png")


def time_shape(
    shape: tuple[int, int, int | str, int],
    device: str,
    dtype: torch.dtype,
    args: argparse.Namespace,
) -> tuple[dict[tuple[str, str], list[float]], dict[tuple[str, str], str]]:
    """The six (mode, kernel) steps of one shape, timed interleaved: seconds per call, and
    the error of each step that failed its first call (out of memory, say), left out."""
    steps, errors = {}, {}
    for mode, kernel in itertools.product(MODES, KERNELS):
        try:
            step = make_step(shape, mode, kernel, device, dtype)
            step()
            steps[(mode, kernel)] = step
        except RuntimeError as error:  # one step failing must not cost the table the rest
            errors[(mode, kernel)] = str(error).splitlines()[0][:200]
            tqdm.write(f"{shape} {mode} {kernel}: {errors[(mode, kernel)]}")
        step = None  # a failed step's tensors are freed before the next step is built
        if device == "cuda" and (mode, kernel) in errors:
            torch.cuda.empty_cache()
    times = time_interleaved(
        steps, warmup=WARMUP, repeats=REPEATS, device=device, min_seconds=args.min_seconds
    )
    return times, errors


if __name__ == "__main__":
    main()
