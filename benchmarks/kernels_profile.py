"""Where a training step's time goes: ours and the peers, kernel by kernel.

One encoder layer (or attention layer, `--scope`) of the bench's shape (dim 256, 4 heads,
k 256, feed-forward 1024, no dropout), forward + backward, profiled with `torch.profiler`
for `--steps` steps after a warm-up: per variant the device time of every kernel (on a
GPU; on CPU each operator's own CPU time), grouped by name, the kernel count per step,
the operators by input shapes with the time of what each launched itself (`ops`: which
product of several of one name takes the time), the operators' own CPU time (`host`, by
name and by thread: on a GPU the cost of issuing the kernels, which bounds a step at
batch 1), and the step's wall time timed outside the profiler (`time_interleaved`: CUDA
events on a GPU). Ours runs with each sharing of
`--sharing` (kv by default), on the rule's kernel and pinned to each (`--kernel`);
`--compile inductor` adds every variant compiled (Inductor's generated kernels then appear
by their names; the spans a compiled graph marks on the GPU's timeline are not counted as
kernels), `reduce-overhead` every variant under CUDA graphs (`cudagraphs`: Inductor's
counts of graphs skipped, of partitions, between which ops run eagerly, and of inputs
copied into a graph's own at each replay). The peers need their packages (`linformer==0.2.3`,
`linformer-pytorch==0.19.3`); a missing one is skipped. On CPU glibc keeps freed memory
(`--no-keep-freed-memory`: its defaults), as `linformer bench` does while it times.

Writes OUT/profile.json (default benchmarks/kernels/cuda/profile, or kernels/profile on
CPU) and prints each variant's top kernels and operators.

    PYTHONPATH=src python benchmarks/kernels_profile.py --device cuda --n 4096 --batch 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from linformer_kit.bench.flops import Shape
from linformer_kit.bench.timing import module_step, time_interleaved
from linformer_kit.bench.variants import (
    PEERS,
    SCOPES,
    SHARINGS,
    Variant,
    build_variant,
    compile_limits,
    peer_available,
)
from linformer_kit.kernel_rule import KERNELS
from linformer_kit.training.compare import machine
from linformer_kit.training.settings import check_compile, keep_freed_memory

OUT = Path(__file__).parent / "kernels"
COMMAND = "PYTHONPATH=src python benchmarks/kernels_profile.py"
TOP = 15  # kernels listed per variant


def variants(kernels: list[str], compiles: list[str], sharings: list[str]) -> list[Variant]:
    """Ours with each sharing on each kernel ("rule": the rule's), the installed peers,
    each eager and under each compile setting."""
    eager = [
        Variant(
            name=f"linformer {s} [{k}]", kind="ours", sharing=s, kernel=None if k == "rule" else k
        )
        for s in sharings
        for k in kernels
    ]
    eager += [Variant(name=p, kind=p, sharing="headwise") for p in PEERS if peer_available(p)]
    out = list(eager)
    for c in compiles:
        out += [dataclasses.replace(v, name=f"{v.name} [compiled {c}]", compile=c) for v in eager]
    return out


def profile_step(step: Any, *, device: str, steps: int) -> dict[str, Any]:
    """Per-step device time of each kernel name (CPU: operator self time), summed over
    `steps` profiled calls of `step`; and `ops`: each operator with its input shapes and
    the device time of the kernels it launched itself (CPU: its self time), which tells
    apart products of one name (the projection's E^T X from the attention's, say); and
    `host`: the CPU side, each operator's own CPU time by name and by thread."""
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    host, threads = _host_time(prof)
    rows = host  # on CPU the operators are the kernels
    if device == "cuda":
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for event in prof.events():
            # Not the "## Call CompiledFxGraph ##" spans a compiled graph marks on the
            # device's timeline: they cover its kernels, which are counted themselves.
            annotation = getattr(event, "is_user_annotation", False)
            if event.device_type == torch.autograd.DeviceType.CUDA and not annotation:
                totals[event.name][0] += 1
                totals[event.name][1] += event.device_time_total
        rows = sorted(totals.items(), key=lambda item: -item[1][1])
    own = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if getattr(e, own) > 0]
    ops.sort(key=lambda e: -getattr(e, own))
    return {
        "kernels_per_step": sum(count for _, (count, _) in rows) / steps,
        "kernel_ms_per_step": round(sum(us for _, (_, us) in rows) / steps / 1e3, 4),
        "top": [
            {
                "name": name[:160],
                "calls_per_step": count / steps,
                "ms_per_step": round(us / steps / 1e3, 4),
            }
            for name, (count, us) in rows[:TOP]
        ],
        "ops": [
            {
                "name": e.key,
                "shapes": str(e.input_shapes)[:200],
                "calls_per_step": e.count / steps,
                "ms_per_step": round(getattr(e, own) / steps / 1e3, 4),
            }
            for e in ops[:TOP]
        ],
        # The CPU side (on a GPU, what launching takes): operators' own CPU time by name and
        # by thread (CUDA backwards run on the autograd engine's device thread). The step's
        # wall time less this is Python and the gaps between operators.
        "host": {
            "ms_per_step": round(sum(threads.values()) / steps / 1e3, 4),
            "threads_ms_per_step": [round(us / steps / 1e3, 4) for us in threads.values()],
            "top": [
                {
                    "name": name,
                    "calls_per_step": count / steps,
                    "ms_per_step": round(us / steps / 1e3, 4),
                }
                for name, (count, us) in host[:TOP]
            ],
        },
    }


def _host_time(prof: Any) -> tuple[list[tuple[str, list[float]]], dict[int, float]]:
    """(operator name, [calls, own CPU µs]) from the most CPU time down, and own CPU µs
    by thread (most first), of a profile's CPU operators."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_thread: dict[int, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CPU and event.self_cpu_time_total > 0:
            by_name[event.name][0] += 1
            by_name[event.name][1] += event.self_cpu_time_total
            by_thread[event.thread] += event.self_cpu_time_total
    threads = dict(sorted(by_thread.items(), key=lambda item: -item[1]))
    return sorted(by_name.items(), key=lambda item: -item[1][1]), threads


def main(argv: list[str] | None = None) -> None:
    """Profiles every variant in turn and writes profile.json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--n", type=int, default=4096, help="sequence length")
    parser.add_argument("--batch", type=int, default=1, help="batch size")
    parser.add_argument("--dim", type=int, default=256, help="model width")
    parser.add_argument("--proj-dim", type=int, default=256, help="k")
    parser.add_argument("--scope", choices=SCOPES, default="layer")
    parser.add_argument(
        "--kernel", default="rule," + ",".join(KERNELS), help="ours: rule, sdpa, explicit"
    )
    parser.add_argument("--sharing", default="kv", help="ours: comma-separated sharings")
    parser.add_argument(
        "--compile",
        default="",
        help="comma-separated: inductor, reduce-overhead, aot_eager, each also with +autograd",
    )
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="unprofiled steps first")
    parser.add_argument("--out", type=Path, default=None, help="writes profile.json there")
    parser.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU: glibc keeps freed memory (training.keep_freed_memory), as the bench times",
    )
    args = parser.parse_args(argv)
    kept = args.device == "cpu" and args.keep_freed_memory and keep_freed_memory()
    kernels = [k for k in args.kernel.split(",") if k]
    unknown = [k for k in kernels if k not in ("rule", *KERNELS)]
    if unknown:
        parser.error(
            f"--kernel: unknown {', '.join(unknown)}; choose from rule, {', '.join(KERNELS)}"
        )
    sharings = [s for s in args.sharing.split(",") if s]
    if not sharings or set(sharings) - set(SHARINGS):
        parser.error(f"--sharing: {args.sharing!r}; choose from {', '.join(SHARINGS)}")
    compiles = [c for c in args.compile.split(",") if c]
    for setting in compiles:
        try:
            check_compile(setting, args.device)
        except ValueError as err:
            parser.error(f"--compile: {err}")
    out_dir = args.out or (OUT / "profile" if args.device == "cpu" else OUT / "cuda" / "profile")
    shape = Shape(
        batch_size=args.batch,
        seq_len=args.n,
        dim=args.dim,
        num_heads=4,
        proj_dim=args.proj_dim,
        ffn_dim=4 * args.dim,
    )
    results = {}
    with compile_limits():
        for variant in variants(kernels, compiles, sharings):
            torch.manual_seed(0)
            counters.clear()
            module = build_variant(variant, shape, args.scope).to(args.device).train()
            x = torch.randn(
                shape.batch_size, shape.seq_len, shape.dim, device=args.device, requires_grad=True
            )
            step = module_step(module, x, backward=True, compile=variant.compile)
            for _ in range(args.warmup):
                step()
            wall = time_interleaved(
                {"step": step}, warmup=0, repeats=max(args.steps, 5), device=args.device
            )["step"]
            row = {"wall_ms": round(statistics.median(wall) * 1e3, 3)}
            row |= profile_step(step, device=args.device, steps=args.steps)
            # Inductor's CUDA graphs (`reduce-overhead`): graphs skipped, partitions (the ops
            # between them run eagerly) and inputs copied into the graphs' own at each replay
            row["cudagraphs"] = {
                name: count for name, count in counters["inductor"].items() if "cudagraph" in name
            }
            # "+autograd": the backward graphs compiled autograd captured (none: it did not run)
            row["compiled_autograd"] = dict(counters["compiled_autograd"])
            results[variant.name] = row
            print(
                f"{variant.name}: wall {row['wall_ms']} ms, kernels {row['kernel_ms_per_step']} ms "
                f"in {row['kernels_per_step']:g} per step",
                flush=True,
            )
            for top in row["top"][:8]:
                print(
                    f"    {top['ms_per_step']:8.3f} ms",
                    f"x{top['calls_per_step']:<5g} {top['name'][:100]}",
                )
            host = row["host"]
            print(
                f"  host: {host['ms_per_step']} ms of operators' own CPU time a step, by "
                f"thread {host['threads_ms_per_step']}"
            )
            if row["cudagraphs"]:
                print(f"  CUDA graphs: {row['cudagraphs']}")
            print("  by operator and input shapes:")
            for op in row["ops"][:8]:
                print(
                    f"    {op['ms_per_step']:8.3f} ms",
                    f"x{op['calls_per_step']:<5g} {op['name'][:50]} {op['shapes'][:80]}",
                )
            torch._dynamo.reset()
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join([COMMAND, *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine(),
        "shape": dataclasses.asdict(shape),
        "scope": args.scope,
        "freed_memory_kept": kept,
        "variants": results,
    }
    (out_dir / "profile.json").write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", out_dir / "profile.json")


if __name__ == "__main__":
    main()
