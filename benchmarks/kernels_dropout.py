"""Default-config training against dropout-free training on CPU, A/B in one process: one
encoder layer (dim 256, 4 heads, k 256, kv sharing, feed-forward 1024) with the config's
default dropouts (0.1 on the sub-layer outputs, 0.1 on the attention weights), with and
without the compiled dropout kernel (`LINFORMER_KIT_NATIVE=0`: `nn.Dropout` and the
attention mask by PyTorch ops), and with both dropouts at 0. Same weights, forward +
backward with a random output gradient, interleaved rounds; `--precision bf16`: under bf16
autocast, as `--precision bf16` trains. Writes OUT/ab.json.

    PYTHONPATH=src python benchmarks/kernels_dropout.py --out benchmarks/kernels/dropout
    PYTHONPATH=src python benchmarks/kernels_dropout.py --precision bf16 \
        --out benchmarks/kernels/bf16/dropout
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from kernels_fused import median_ms, parse_ab_args, with_torch_ops, write_report
from torch import nn

from linformer_kit import LinformerConfig, LinformerEncoder
from linformer_kit.bench.timing import module_step
from linformer_kit.precision import warn_if_bf16_is_slow
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


def make_step(module: nn.Module, n: int, bf16: bool) -> Callable[[], None]:
    """`module_step` in training (under bf16 autocast if `bf16`) on a (1, n, dim) input
    that needs its gradient."""
    x = torch.randn(1, n, DIM, requires_grad=True)
    return module_step(module, x, backward=True, autocast=torch.bfloat16 if bf16 else None)


def main(argv: list[str] | None = None) -> None:
    precision = {"choices": ("fp32", "bf16"), "default": "fp32", "help": "bf16: autocast"}
    args = parse_ab_args(__doc__, argv, "benchmarks/kernels/dropout", 20.0, precision=precision)
    if args.precision == "bf16":
        warn_if_bf16_is_slow("cpu", "--precision fp32")
    rows, before, bf16 = [], machine(), args.precision == "bf16"
    for n in (int(x) for x in args.n.split(",")):
        default = make_step(encoder(n, 0.1), n, bf16)
        steps = {
            "dropout 0.1, compiled kernel": default,
            "dropout 0.1, PyTorch ops": with_torch_ops(default),
            "no dropout": make_step(encoder(n, 0.0), n, bf16),
        }
        ms, rounds = median_ms(steps, args.min_seconds)
        row = {
            "n": n,
            "precision": args.precision,
            "median_ms": ms,
            "rounds": rounds,
            "time_vs_no_dropout": {name: ms[name] / ms["no dropout"] for name in list(steps)[:2]},
            "compiled_speedup": ms["dropout 0.1, PyTorch ops"] / ms["dropout 0.1, compiled kernel"],
        }
        print(json.dumps(row))
        rows.append(row)
    write_report(args, before, rows)


if __name__ == "__main__":
    main()
