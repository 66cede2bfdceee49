"""The compiled feed-forward kernel against PyTorch's modules, A/B in one process: the block
alone (dim 256, hidden 1024, GELU; fwd+bwd and inference) and one encoder layer without
dropout (4 heads, k 256, kv sharing, as `linformer bench --scope layer` builds it), with the
kernel and with `LINFORMER_KIT_NATIVE=0`, the attention pinned to SDPA in both (so only the
feed-forward block changes). Same weights, interleaved rounds. Writes OUT/ab.json.
`--dtype bfloat16`: under CPU bf16 autocast, the kernel's bf16 form (where the kernels'
bf16 GEMMs are AVX-512 BF16's dot products, `native.bf16_feedforward`) at every n, its row
threshold (`encoder.BF16_KERNEL_MIN_ROWS`, read off this table) lowered to 0 for the run.

    PYTHONPATH=src python benchmarks/kernels_feedforward.py --out benchmarks/kernels/feedforward
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from kernels_fused import median_ms, parse_ab_args, with_torch_ops, write_report
from torch import nn

from linformer_kit import encoder, native
from linformer_kit.bench.flops import Shape
from linformer_kit.bench.timing import module_step
from linformer_kit.bench.variants import Variant, build_variant
from linformer_kit.encoder import FeedForward
from linformer_kit.training.compare import machine

DIM, HIDDEN, HEADS, PROJ_DIM = 256, 1024, 4, 256


def make_step(
    module: nn.Module, n: int, backward: bool, autocast: torch.dtype | None
) -> Callable[[], None]:
    """`module_step` on a (1, n, dim) input that needs its gradient in training."""
    x = torch.randn(1, n, DIM, requires_grad=backward)
    return module_step(module, x, backward=backward, autocast=autocast)


def main(argv: list[str] | None = None) -> None:
    dtype = {"choices": ["float32", "bfloat16"], "default": "float32"}
    args = parse_ab_args(__doc__, argv, "benchmarks/kernels/feedforward", 20.0, dtype=dtype)
    autocast = torch.bfloat16 if args.dtype == "bfloat16" else None
    if autocast is not None:
        if not native.bf16_feedforward():
            raise SystemExit("the kernel's bf16 form needs AVX-512 BF16 and oneDNN's GEMMs")
        encoder.BF16_KERNEL_MIN_ROWS = 0  # (this process only: the table behind it)
    rows, before = [], machine()
    for n in (int(x) for x in args.n.split(",")):
        torch.manual_seed(0)
        ffn = FeedForward(dim=DIM, hidden_dim=HIDDEN)
        k = min(PROJ_DIM, n)  # (tiny n: the tests)
        shape = Shape(batch_size=1, seq_len=n, dim=DIM, num_heads=HEADS, proj_dim=k, ffn_dim=HIDDEN)
        variant = Variant(name="kv", kind="ours", sharing="kv", kernel="sdpa")
        layer = build_variant(variant, shape, "layer")
        kernel = {
            "feed-forward": make_step(ffn, n, True, autocast),
            "feed-forward inference": make_step(ffn, n, False, autocast),
            "encoder layer": make_step(layer, n, True, autocast),
        }
        steps = {}
        for name, step in kernel.items():
            steps[f"{name}, kernel"] = step
            steps[f"{name}, modules"] = with_torch_ops(step)
        ms, rounds = median_ms(steps, args.min_seconds)
        speedup = {name: ms[f"{name}, modules"] / ms[f"{name}, kernel"] for name in kernel}
        row = {"n": n, "median_ms": ms, "rounds": rounds, "kernel_speedup": speedup}
        print(json.dumps(row))
        rows.append(row)
    write_report(args, before, rows)


if __name__ == "__main__":
    main()
