"""Default-config training against dropout-free training on CPU, A/B in one process: one
encoder layer (dim 256, 4 heads, k 256, kv sharing, feed-forward 1024) with the config's
default dropouts (0.1 on the sub-layer outputs, 0.1 on the attention weights), with and
without the compiled dropout kernel (`LINFORMER_KIT_NATIVE=0`: `nn.Dropout` and the
attention mask by PyTorch ops), and with both dropouts at 0. Same weights, forward +
backward with a random output gradient, interleaved rounds. Writes OUT/ab.json.

    PYTHONPATH=src python benchmarks/kernels_dropout.py --out benchmarks/kernels/dropout
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from linformer_kit import LinformerConfig, LinformerEncoder, native
from linformer_kit.bench.timing import time_interleaved
from linformer_kit.training.compare import machine

DIM, HEADS, PROJ_DIM = 256, 4, 256


def encoder(n: int, dropout: float) -> nn.Module:
    """One kv-shared layer at the given dropouts, weights from seed 0 (equal across calls)."""
    torch.manual_seed(0)
    config = LinformerConfig(
        max_seq_len=n,
        dim=DIM,
        depth=1,
        num_heads=HEADS,
        proj_dim=min(PROJ_DIM, n),  # (tiny n: the tests)
        sharing="kv",
        dropout=dropout,
        attention_dropout=dropout,
    )
    return LinformerEncoder(config).train()


def make_step(module: nn.Module, n: int, native_on: bool) -> Callable[[], None]:
    """Forward + backward of (1, n, dim) inputs with a random output gradient."""
    x = torch.randn(1, n, DIM, requires_grad=True)
    grad = torch.randn(1, n, DIM)

    def step() -> None:
        if not native_on:
            os.environ[native.ENV_SWITCH] = "0"
        try:
            x.grad = None
            module.zero_grad(set_to_none=True)
            module(x)[0].backward(grad)
        finally:
            os.environ.pop(native.ENV_SWITCH, None)

    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="1024,4096,16384")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-seconds", type=float, default=20.0, help="per n")
    parser.add_argument("--out", default="benchmarks/kernels/dropout")
    args = parser.parse_args(argv)
    if native.dropout_ops() is None:
        parser.error(f"the compiled kernel is not available (is {native.ENV_SWITCH}=0 set?)")
    torch.set_num_threads(args.threads)
    rows, before = [], machine()
    for n in (int(x) for x in args.n.split(",")):
        default, free = encoder(n, 0.1), encoder(n, 0.0)
        steps = {
            "dropout 0.1, compiled kernel": make_step(default, n, True),
            "dropout 0.1, PyTorch ops": make_step(default, n, False),
            "no dropout": make_step(free, n, True),
        }
        times = time_interleaved(
            steps, warmup=1, repeats=5, device="cpu", min_seconds=args.min_seconds
        )
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        row = {
            "n": n,
            "median_ms": ms,
            "rounds": len(times["no dropout"]),
            "time_vs_no_dropout": {name: ms[name] / ms["no dropout"] for name in list(steps)[:2]},
            "compiled_speedup": ms["dropout 0.1, PyTorch ops"] / ms["dropout 0.1, compiled kernel"],
        }
        print(json.dumps(row))
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"settings": vars(args), "machine": before, "rows": rows}
    (out / "ab.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
