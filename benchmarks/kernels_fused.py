"""The explicit kernel with dropout, A/B in one process: compiled (`csrc/attention.cpp`:
scores, softmax, mask and GEMMs per block of rows in one parallel loop) against the same
mask by PyTorch ops (`LINFORMER_KIT_NATIVE=0`), with SDPA without dropout as the yardstick;
interleaved rounds, so machine drift cancels out of the ratios. Writes OUT/ab.json.

    PYTHONPATH=src python benchmarks/kernels_fused.py --out benchmarks/kernels/fused
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from kernels import make_step  # benchmarks/kernels.py: the call as `attend` makes it

from linformer_kit import native
from linformer_kit.bench.timing import time_interleaved
from linformer_kit.training.compare import machine

KEYS, HEAD_DIM, DROPOUT = 256, 64, "train dropout 0.1"


def with_torch_ops(step: Callable[[], None]) -> Callable[[], None]:
    """The step with the compiled kernel switched off: the mask from PyTorch ops."""

    def run() -> None:
        with native.kernels_off():
            step()

    return run


def median_ms(steps: dict[str, Callable[[], None]], min_seconds: float) -> tuple[dict, int]:
    """Median milliseconds of each step, timed in interleaved rounds; and the rounds."""
    times = time_interleaved(steps, warmup=1, repeats=5, device="cpu", min_seconds=min_seconds)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return ms, len(next(iter(times.values())))


def write_report(args: argparse.Namespace, before: dict, rows: list[dict]) -> None:
    """OUT/ab.json: the settings, the machine before the run, and the rows."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"settings": vars(args), "machine": before, "rows": rows}
    (out / "ab.json").write_text(json.dumps(report, indent=1) + "\n")


def compiled_ops(threads: int) -> object:
    """The compiled kernels' ops, with torch's threads set; exits where they cannot run."""
    ops = native.cpu_ops()
    if ops is None:
        sys.exit("the compiled CPU kernels are not available here (no compiler?)")
    torch.set_num_threads(threads)
    return ops


def write_table(
    out: Path,
    script: str,
    argv: list[str] | None,
    before: dict,
    fields: dict,
    plot: Callable[[Path], None] | None = None,
) -> None:
    """OUT/table.json (the command that ran `script`, the machine before, the load after,
    and `fields`) and, where `plot` is given, OUT/table.png (drawn by it)."""
    out.mkdir(parents=True, exist_ok=True)
    command = [f"PYTHONPATH=src python benchmarks/{script}"]
    command += sys.argv[1:] if argv is None else argv
    result = {
        "command": " ".join(command),
        "machine": before,
        "load_avg_after": machine()["load_avg_1_5_15min"],
        **fields,
    }
    (out / "table.json").write_text(json.dumps(result, indent=1) + "\n")
    written = [out / "table.json"]
    if plot is not None:
        plot(out / "table.png")
        written.append(out / "table.png")
    print("wrote", *written)


def parse_ab_args(
    doc: str, argv: list[str] | None, out: str, min_seconds: float, **extra: dict
) -> argparse.Namespace:
    """The A/B scripts' flags (--n, --threads, --min-seconds, --out, its default `out` from
    the repository's root wherever the script is run from, and `extra`: flag ->
    add_argument keywords); exits where the compiled kernel cannot run; sets the threads."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--n", default="1024,4096,16384")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-seconds", type=float, default=min_seconds, help="per n")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / out))
    for flag, kwargs in extra.items():
        parser.add_argument(f"--{flag}", **kwargs)
    args = parser.parse_args(argv)
    if native.cpu_ops() is None:
        parser.error(f"the compiled kernel is not available (is {native.ENV_SWITCH}=0 set?)")
    torch.set_num_threads(args.threads)
    return args


def main(argv: list[str] | None = None) -> None:
    batch = {"type": int, "default": 1}
    args = parse_ab_args(__doc__, argv, "benchmarks/kernels/fused", 10.0, batch=batch)
    rows, before = [], machine()
    for n in (int(x) for x in args.n.split(",")):
        shape = (args.batch, n, KEYS, HEAD_DIM)
        fused = make_step(shape, DROPOUT, "explicit", "cpu", torch.float32)
        steps = {
            "torch ops": with_torch_ops(fused),
            "compiled": fused,
            "sdpa, no dropout": make_step(shape, "train", "sdpa", "cpu", torch.float32),
        }
        ms, rounds = median_ms(steps, args.min_seconds)
        row = {
            "n": n,
            "batch": args.batch,
            "median_ms": ms,
            "rounds": rounds,
            "compiled_speedup": ms["torch ops"] / ms["compiled"],
            "time_vs_sdpa_no_dropout": {
                name: ms[name] / ms["sdpa, no dropout"] for name in ("torch ops", "compiled")
            },
        }
        print(json.dumps(row))
        rows.append(row)
    write_report(args, before, rows)


if __name__ == "__main__":
    main()
