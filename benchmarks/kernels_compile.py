"""Does `torch.compile` of a whole encoder pay on CPU? Eager vs compiled, same weights.

A 2-layer encoder (dim 256, 4 heads, k 256, kv sharing, the default dropouts 0.1 / 0.1) at
n = 4096, batch 1: training (forward + backward) and inference, eager and compiled timed
interleaved in one run (medians), plus the one-off compile time of each.
Writes benchmarks/kernels/compile.json.

    PYTHONPATH=src python benchmarks/kernels_compile.py
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from linformer_kit import LinformerConfig, LinformerEncoder
from linformer_kit.bench.timing import time_interleaved
from linformer_kit.training.compare import machine

SEQ_LEN, THREADS, WARMUP, REPEATS = 4096, 1, 1, 5
OUT = Path(__file__).parent / "kernels"


def step(module: nn.Module, training: bool) -> Callable[[], None]:
    """One call: forward + backward in training, forward under inference_mode otherwise."""
    x = torch.randn(1, SEQ_LEN, 256, requires_grad=training)

    def run() -> None:
        if not training:
            with torch.inference_mode():
                module(x)
            return
        x.grad = None
        module.zero_grad(set_to_none=True)
        module(x)[0].square().mean().backward()

    return run


def main() -> None:
    """Compiles once per mode (timed), then times eager and compiled interleaved."""
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    config = LinformerConfig(
        max_seq_len=SEQ_LEN, dim=256, depth=2, num_heads=4, proj_dim=256, sharing="kv"
    )
    encoder = LinformerEncoder(config)
    compiled = torch.compile(encoder)
    steps, compile_s = {}, {}
    for training in (True, False):
        encoder.train(training)
        mode = "training" if training else "inference"
        steps[f"{mode} eager"] = step(encoder, training)
        steps[f"{mode} compiled"] = step(compiled, training)
        begin = time.perf_counter()
        steps[f"{mode} compiled"]()  # the compile itself
        compile_s[mode] = time.perf_counter() - begin
    rows = {}
    for mode in ("training", "inference"):
        encoder.train(mode == "training")
        pair = {name: fn for name, fn in steps.items() if name.startswith(mode)}
        times = time_interleaved(pair, warmup=WARMUP, repeats=REPEATS, device="cpu")
        eager, fast = (statistics.median(times[f"{mode} {kind}"]) for kind in ("eager", "compiled"))
        rows[mode] = {
            "eager_ms": round(eager * 1e3, 1),
            "compiled_ms": round(fast * 1e3, 1),
            "speedup": round(eager / fast, 3),
            "compile_s": round(compile_s[mode], 1),
        }
        print(mode, rows[mode], flush=True)
    OUT.mkdir(exist_ok=True)
    result = {
        "command": "PYTHONPATH=src python benchmarks/kernels_compile.py",
        "machine": machine(),
        "model": "LinformerEncoder depth 2, dim 256, 4 heads, k 256, kv, dropout 0.1 / 0.1",
        "seq_len": SEQ_LEN,
        "threads": THREADS,
        "rows": rows,
    }
    (OUT / "compile.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
