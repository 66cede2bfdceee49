"""Paired A/B of the attention kernel keeping its weights for backward (`keep_weights`) or
making them again, inside one layer's training step (or, with --depth, a whole encoder's of
that many layers, where each layer's weights wait in memory for the layers above): ours (kv
sharing, dim 256, 4 heads, k 256) at each n, rounds of a 3-step burst on each form
(`kernels._KEEP_WEIGHTS` 0 and 2^22), each burst's fastest step; the per-round ratio
recompute / keep and its quartiles -> ab.json beside this script.

    PYTHONPATH=src python benchmarks/kernels/zen3-avx2/keep-weights/ab.py \
        --n 1024,2048,4096 --scope attention --rounds 20
    ... --n 1024,2048,4096 --depth 6 --rounds 8 --out .../ab-encoder6.json
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from linformer_kit import kernels
from linformer_kit.bench.flops import Shape
from linformer_kit.bench.timing import module_step
from linformer_kit.bench.variants import Variant, build_variant
from linformer_kit.config import LinformerConfig
from linformer_kit.encoder import LinformerEncoder
from linformer_kit.training.compare import machine
from linformer_kit.training.settings import keep_freed_memory


def fastest(step, count: int) -> float:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def encoder(n: int, depth: int, dropout: float) -> torch.nn.Module:
    """A `depth`-layer encoder of the bench's layer shape, returning its hidden states."""
    config = LinformerConfig(
        max_seq_len=n, dim=256, depth=depth, num_heads=4, ffn_dim=1024, proj_dim=256,
        sharing="kv", dropout=0.0, attention_dropout=dropout,
    )  # fmt: skip
    layers = LinformerEncoder(config)

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)[0]

    return Hidden()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", default="1024,2048,4096")
    parser.add_argument("--scope", default="attention")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--depth", type=int, default=0, help="an encoder of this many layers")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).with_name("ab.json")))
    args = parser.parse_args()
    keep_freed_memory()
    torch.set_num_threads(2)
    before = machine()  # CPU model, flags, torch, load averages
    rows = []
    for n in map(int, args.n.split(",")):
        shape = Shape(batch_size=1, seq_len=n, dim=256, num_heads=4, proj_dim=256, ffn_dim=1024)
        x = torch.randn(1, n, 256, requires_grad=True)
        variant = Variant(name="ours", kind="ours", sharing="kv", attention_dropout=args.dropout)
        if args.depth:
            module = encoder(n, args.depth, args.dropout)
        else:
            module = build_variant(variant, shape, args.scope)
        step = module_step(module.train(), x, backward=True)
        recompute, keep = [], []
        for _ in range(args.rounds):
            for limit, times in ((0, recompute), (1 << 22, keep)):
                kernels._KEEP_WEIGHTS = limit
                step()
                times.append(fastest(step, 3) * 1e3)
        ratios = [a / b for a, b in zip(recompute, keep)]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        rows.append({
            "n": n, "recompute_ms": statistics.median(recompute),
            "keep_ms": statistics.median(keep), "ratio_median": median,
            "ratio_q1": q1, "ratio_q3": q3,
        })  # fmt: skip
        print(json.dumps(rows[-1]))
    settings = vars(args) | {"threads": 2}
    result = {"settings": settings, "machine": before, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
