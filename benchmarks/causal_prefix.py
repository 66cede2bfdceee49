"""Causal Linformer attention (fwd+bwd) with the prefix sums chunked (`causal._exclusive_sums`,
O(M) in the M = n / block_size blocks) against one (M, M) triangle (the earlier code, O(M^2)
work and memory), interleaved in the same run. Equal up to SCAN_CHUNK blocks (one chunk).
Writes benchmarks/causal_prefix/results.json (or into --out).

    PYTHONPATH=src python benchmarks/causal_prefix.py [--seq-lens 4096,16384] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from linformer_kit import causal, causal_attention
from linformer_kit.files import save_json
from linformer_kit.training.compare import machine

SEQ_LENS = (2048, 4096, 8192, 16384)
BLOCK_SIZES = (64, 16)
BATCH, HEADS, HEAD_DIM, PROJ_DIM = 2, 4, 32, 128
WARMUP, REPEATS = 1, 5


def one_triangle(products: Tensor, scale: Tensor) -> Tensor:
    """The earlier prefix sums: one (M, M) strictly lower-triangular product, scales folded."""
    blocks = products.shape[1]
    earlier = torch.ones(blocks, blocks, dtype=products.dtype).tril(-1) * scale[:, None]
    return torch.bmm(earlier.expand(products.shape[0], -1, -1), products)


def layer_seconds(seq_len: int, block_size: int) -> dict[str, float]:
    """Median fwd+bwd seconds of the causal layer with each prefix-sum implementation."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, seq_len, HEAD_DIM, requires_grad=True) for _ in range(3))
    proj = torch.randn(seq_len, PROJ_DIM, requires_grad=True)
    chunked = causal._exclusive_sums  # noqa: SLF001 (the function measured)
    ways: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
        "chunked": chunked,
        "one_triangle": one_triangle,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for i in range(WARMUP + REPEATS):
            for name, sums in ways.items():
                causal._exclusive_sums = sums  # noqa: SLF001
                start = time.perf_counter()
                causal_attention(q, k, v, proj, proj, block_size=block_size).sum().backward()
                if i >= WARMUP:
                    times[name].append(time.perf_counter() - start)
    finally:
        causal._exclusive_sums = chunked  # noqa: SLF001
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)))
    parser.add_argument("--out", default=str(Path(__file__).parent / "causal_prefix"))
    args = parser.parse_args(argv)
    rows = []
    for block_size in BLOCK_SIZES:
        for seq_len in (int(n) for n in args.seq_lens.split(",")):
            seconds = layer_seconds(seq_len, block_size)
            row = {
                "seq_len": seq_len,
                "block_size": block_size,
                "blocks": seq_len // block_size,
                "chunked_ms": round(seconds["chunked"] * 1e3, 1),
                "one_triangle_ms": round(seconds["one_triangle"] * 1e3, 1),
                "speedup": round(seconds["one_triangle"] / seconds["chunked"], 2),
            }
            print(row, flush=True)
            rows.append(row)
    meta = {
        "command": "PYTHONPATH=src python benchmarks/causal_prefix.py",
        "machine": machine(),  # CPU model, torch capability, ISA flags, load
        "shape": {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "proj_dim": PROJ_DIM},
        "scan_chunk": causal.SCAN_CHUNK,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_json(meta, out / "results.json")  # atomic: a kill leaves the last results


if __name__ == "__main__":
    main()
