"""The compiled attention kernel's bf16 GEMMs off MKL: AVX-512 BF16's dot products
(`csrc/bf16_gemm.h`) against the inputs widened to fp32 for oneDNN's micro-kernel (what ran
before, `LINFORMER_KIT_BF16_GEMM=widen`), with fp32 as the yardstick. One attention call
(B 1, 4 heads, k 256, head_dim 64), training (fwd+bwd) and inference, without dropout, the
explicit kernel pinned. The switch is read once per process, so each way runs in its own
process, the two alternating for `--rounds` rounds (medians over them: the machine's drift
falls on both). Writes OUT/ab.json.

Only where the kernels' bf16 GEMMs leave MKL (`native.kernel_gemm() == "onednn"`: AMD CPUs
with AVX-512) and the kernels were built with AVX-512 BF16; elsewhere it says so and stops.

    PYTHONPATH=src python benchmarks/kernels_bf16_gemm.py --out benchmarks/kernels/amd-epyc/bf16-dot
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from kernels import make_step  # benchmarks/kernels.py: the call as `attend` makes it
from kernels_fused import median_ms, write_report

from linformer_kit import native
from linformer_kit.precision import bf16_support
from linformer_kit.training.compare import machine

KEYS, HEAD_DIM = 256, 64
MODES = ("train", "inference")
WAYS = {"dot": {}, "widened": {native.BF16_GEMM_SWITCH: "widen"}}


def child(args: argparse.Namespace) -> None:
    """One process's medians: {mode: {n: {dtype: ms}}} as one JSON line."""
    torch.set_num_threads(args.threads)
    out: dict = {}
    for mode in MODES:
        for n in (int(x) for x in args.n.split(",")):
            steps = {
                str(dtype).removeprefix("torch."): make_step(
                    (1, n, KEYS, HEAD_DIM), mode, "explicit", "cpu", dtype
                )
                for dtype in (torch.float32, torch.bfloat16)
            }
            ms, _ = median_ms(steps, args.min_seconds)
            out.setdefault(mode, {})[str(n)] = ms
    print(json.dumps(out))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", default="1024,4096,16384")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="processes per way")
    parser.add_argument("--min-seconds", type=float, default=3.0, help="per n, per process")
    parser.add_argument("--out", default=str(Path(__file__).parent / "kernels/amd-epyc/bf16-dot"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    if native.cpu_ops() is None or native.kernel_gemm() != "onednn" or not bf16_support().native:
        parser.error("needs the compiled kernels with their GEMMs on oneDNN and native bf16")
    before = machine()
    argv_child = [sys.executable, __file__, "--child", "--n", args.n, "--threads"]
    argv_child += [str(args.threads), "--min-seconds", str(args.min_seconds)]
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way, env in WAYS.items():
            done = subprocess.run(
                argv_child, env={**os.environ, **env}, check=True, capture_output=True, text=True
            )
            runs[way].append(json.loads(done.stdout.splitlines()[-1]))
    rows = []
    for mode in MODES:
        for n in args.n.split(","):
            ms = {
                f"{dtype}, {way}": statistics.median(r[mode][n][dtype] for r in runs[way])
                for way in WAYS
                for dtype in ("float32", "bfloat16")
            }
            fp32 = statistics.median(ms[f"float32, {way}"] for way in WAYS)
            row = {
                "mode": mode,
                "n": int(n),
                "median_ms": ms,
                "dot_speedup": ms["bfloat16, widened"] / ms["bfloat16, dot"],
                "bf16_speedup_vs_fp32": {way: fp32 / ms[f"bfloat16, {way}"] for way in WAYS},
            }
            print(json.dumps(row))
            rows.append(row)
    write_report(args, before, rows)


if __name__ == "__main__":
    main()
