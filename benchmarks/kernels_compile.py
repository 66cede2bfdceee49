"""Does `torch.compile` of a whole encoder pay? Eager vs compiled, same weights.

A 2-layer encoder (dim 256, 4 heads, k 256, kv sharing, the default dropouts 0.1 / 0.1, the
attention's `--attention-dropout`) at n = 4096 (`--n`), batch 1 (`--batch`): training
(forward + backward) and inference, eager and compiled timed interleaved in one run
(medians), plus the one-off compile time of each. On CPU the compiled kernels
(`native.cpu_ops`) are built first, so the compiled graph calls them. On a GPU also
`mode="reduce-overhead"` (CUDA graphs: at batch 1 a layer's time is mostly kernel
launches), its error recorded if it fails, and the peak memory of one eager and one
compiled step. `--autocast bf16` runs the forwards under bf16 autocast. `--kernel
sdpa|explicit` pins the attention kernel of every call, eager and compiled
(`kernel_rule.use_kernel`; default the rule's, whose compiled CUDA cells were read off
such pinned runs, `cuda/compiled-split/`).
Writes benchmarks/kernels/compile.json (CPU, one thread unless `--threads`) or, with
`--device cuda`, benchmarks/kernels/cuda/compile.json (CUDA-event timing); `--out` another
folder.

    PYTHONPATH=src python benchmarks/kernels_compile.py
    PYTHONPATH=src python benchmarks/kernels_compile.py --device cuda --out benchmarks/kernels/cuda
    PYTHONPATH=src python benchmarks/kernels_compile.py --device cuda --n 16384 --kernel explicit
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from linformer_kit import LinformerConfig, LinformerEncoder, native
from linformer_kit.bench.timing import module_step, time_interleaved
from linformer_kit.kernel_rule import KERNELS
from linformer_kit.training.compare import machine

THREADS, WARMUP, REPEATS = 1, 1, 5
OUT = Path(__file__).parent / "kernels"
COMMAND = "PYTHONPATH=src python benchmarks/kernels_compile.py"


def main(argv: list[str] | None = None) -> None:
    """Compiles once per mode (timed), then times eager and compiled interleaved."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--n", type=int, default=4096, help="sequence length")
    parser.add_argument("--batch", type=int, default=1, help="batch size")
    parser.add_argument(
        "--attention-dropout", type=float, default=0.1, help="dropout on the attention weights"
    )
    parser.add_argument(
        "--autocast", choices=("none", "bf16"), default="none", help="forward under autocast"
    )
    parser.add_argument(
        "--kernel", choices=("rule", *KERNELS), default="rule", help="attention kernel"
    )
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend (aot_eager: no codegen)"
    )
    parser.add_argument("--threads", type=int, default=THREADS, help="CPU threads")
    parser.add_argument(
        "--out", type=Path, default=None, help="writes compile.json there (default: per device)"
    )
    args = parser.parse_args(argv)
    kernel = None if args.kernel == "rule" else args.kernel
    autocast = torch.bfloat16 if args.autocast == "bf16" else None
    args.out = args.out or (OUT if args.device == "cpu" else OUT / args.device)
    torch.set_num_threads(args.threads)
    if args.device == "cpu":
        native.cpu_ops()  # built before tracing, as any eager step would: the graph calls them
    torch.manual_seed(0)
    config = LinformerConfig(
        max_seq_len=args.n,
        dim=256,
        depth=2,
        num_heads=4,
        proj_dim=min(256, args.n),  # (tiny n: the runbook's smoke run)
        sharing="kv",
        attention_dropout=args.attention_dropout,
    )
    encoder = LinformerEncoder(config).to(args.device)
    variants = {"compiled": torch.compile(encoder, backend=args.backend)}
    if args.device == "cuda":
        variants["compiled reduce-overhead"] = torch.compile(encoder, mode="reduce-overhead")
    steps, compile_s, errors = {}, {}, {}
    for training in (True, False):
        encoder.train(training)
        mode = "training" if training else "inference"
        x = torch.randn(args.batch, args.n, 256, device=args.device, requires_grad=training)
        steps[f"{mode} eager"] = module_step(
            encoder, x, backward=training, autocast=autocast, kernel=kernel
        )
        for kind, module in variants.items():
            name = f"{mode} {kind}"
            steps[name] = module_step(
                module, x, backward=training, autocast=autocast, kernel=kernel
            )
            begin = time.perf_counter()
            try:
                for _ in range(3 if "reduce-overhead" in kind else 1):  # graphs record on call 3
                    steps[name]()  # the compile itself
            except Exception as error:  # noqa: BLE001 (CUDA graphs are optional: say why not)
                errors[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                print(name, "failed:", errors[name], flush=True)
                del steps[name]
                continue
            if args.device == "cuda":
                torch.cuda.synchronize()
            compile_s[name] = time.perf_counter() - begin
    rows = {}
    for mode in ("training", "inference"):
        encoder.train(mode == "training")
        pair = {name: fn for name, fn in steps.items() if name.startswith(mode)}
        times = time_interleaved(pair, warmup=WARMUP, repeats=REPEATS, device=args.device)
        eager = statistics.median(times[f"{mode} eager"])
        rows[mode] = {"eager_ms": round(eager * 1e3, 1)}
        if args.device == "cuda":
            rows[mode]["eager_peak_mib"] = _peak_mib(steps[f"{mode} eager"])
        for kind in variants:
            name, key = f"{mode} {kind}", kind.replace("compiled", "").strip(" ")
            prefix = f"{key.replace('-', '_')}_" if key else ""
            if name in errors:
                rows[mode][f"{prefix}error"] = errors[name]
                continue
            fast = statistics.median(times[name])
            rows[mode][f"{prefix}compiled_ms"] = round(fast * 1e3, 1)
            rows[mode][f"{prefix}speedup"] = round(eager / fast, 3)
            rows[mode][f"{prefix}compile_s"] = round(compile_s[name], 1)
            if args.device == "cuda" and not prefix:  # a CUDA graph's pool is not counted
                rows[mode]["compiled_peak_mib"] = _peak_mib(steps[name])
        print(mode, rows[mode], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join([COMMAND, *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine(),
        "model": "LinformerEncoder depth 2, dim 256, 4 heads, k 256, kv, dropout 0.1 / "
        f"{args.attention_dropout} (hidden / attention)",
        "seq_len": args.n,
        "batch": args.batch,
        "autocast": args.autocast,
        "attention_dropout": args.attention_dropout,
        "kernel": args.kernel,
        "backend": args.backend,
        "device": args.device,
        "threads": args.threads,
        "rows": rows,
        # Where dynamo split the graphs (reason: count): each break costs a call to eager.
        "graph_breaks": dict(torch._dynamo.utils.counters["graph_break"]),
    }
    (args.out / "compile.json").write_text(json.dumps(result, indent=2) + "\n")


def _peak_mib(step: Callable[[], None]) -> float:
    """Peak CUDA memory allocated during one call of `step`, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return round(torch.cuda.max_memory_allocated() / 2**20, 1)


if __name__ == "__main__":
    main()
