"""Does cutting SDPA's queries (`kernel_rule.choose_splits`) pay inside the layers?

`kernels_split.py` times one attention call; at batch 1 a GPU step of a whole attention or
encoder layer is bound by its launches, which each chunk adds (one SDPA forward and one
backward). Here ours (kv sharing, on the rule's kernel, attention dropout as given) runs
with the rule's cut and with each of `--cuts` chunks (1: uncut; a cut that does not leave
chunks of at least 64 queries runs uncut), and lucidrains' layer beside (where installed),
all timed interleaved per shape as `linformer bench` times them (medians of CUDA-event-timed
steps), and as bursts of 10 steps synchronised once (steps overlapping host and device, as
in a training loop). Writes OUT/splits.json and OUT/splits.png (each variant's time over
the rule's).

    PYTHONPATH=src python benchmarks/kernels_split_layers.py --device cuda
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from linformer_kit import kernels
from linformer_kit.bench.flops import Shape
from linformer_kit.bench.timing import Call, make_step, time_interleaved
from linformer_kit.bench.variants import Variant, peer_available
from linformer_kit.training.compare import machine

OUT = Path(__file__).parent / "kernels" / "cuda" / "split-layers"
BURST = 10  # steps per burst


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The device, shapes, cuts and output folder of a run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma-separated")
    parser.add_argument("--shapes", default="1x4096,1x8192,1x16384,1x32768,8x4096,8x8192",
                        help="comma-separated BATCHxN")  # fmt: skip
    parser.add_argument("--dim", type=int, default=256, help="model width (4 heads)")
    parser.add_argument("--k", type=int, default=256, help="projected length")
    parser.add_argument("--cuts", default="1,4", help="comma-separated chunk counts")
    parser.add_argument("--attention-dropout", type=float, default=0.0, help="ours' only")
    parser.add_argument("--repeats", type=int, default=25, help="timed rounds per shape")
    parser.add_argument("--out", type=Path, default=OUT, help="writes splits.json, .png")
    args = parser.parse_args(argv)
    args.dtype = args.dtype.split(",")
    args.shapes = [tuple(int(v) for v in part.split("x")) for part in args.shapes.split(",")]
    args.cuts = [int(cut) for cut in args.cuts.split(",")]
    return args


def cut_name(cut: int) -> str:
    """A variant's name: `uncut` or `cut CUT`."""
    return "uncut" if cut == 1 else f"cut {cut}"


def cutting(cut: int) -> Callable[..., int]:
    """`choose_splits` cutting every training call it may (not causal, chunks of at least
    64 queries) in `cut` chunks."""

    def splits(*, backward: bool, causal: bool, queries: int, **_: object) -> int:
        fits = backward and not causal and queries % cut == 0 and queries // cut >= 64
        return cut if fits else 1

    return splits


def steps_of(args: argparse.Namespace, shape: Shape, scope: str, dtype: str) -> dict:
    """name -> one training step: ours under the rule's cut and each cut, lucidrains'."""
    rule, steps = kernels.choose_splits, {}

    def under(step: Callable[[], None], cut: int | None) -> Callable[[], None]:
        def run() -> None:
            kernels.choose_splits = rule if cut is None else cutting(cut)
            try:
                step()
            finally:
                kernels.choose_splits = rule

        return run

    ours = Variant(
        name="ours kv", kind="ours", sharing="kv", attention_dropout=args.attention_dropout
    )
    variants = {"rule": (ours, None)} | {cut_name(cut): (ours, cut) for cut in args.cuts}
    if peer_available("lucidrains"):
        variants["lucidrains"] = (Variant(name="lucidrains", kind="lucidrains"), None)
    for name, (variant, cut) in variants.items():
        call = Call(variant=variant, shape=shape, scope=scope, backward=True, dtype=dtype,
                    device=args.device, threads=0)  # fmt: skip
        steps[name] = under(make_step(call), cut)
    return steps


def burst_ms(step: Callable[[], None], device: str) -> float:
    """ms per step of BURST steps run back to back, synchronised once."""
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    sync()
    begin = time.perf_counter()
    for _ in range(BURST):
        step()
    sync()
    return (time.perf_counter() - begin) / BURST * 1e3


def time_shape(args: argparse.Namespace, batch: int, n: int, scope: str, dtype: str) -> dict:
    """One row: each variant's median step and burst step (ms), and the rule's cut."""
    torch.manual_seed(0)
    shape = Shape(batch_size=batch, seq_len=n, dim=args.dim, num_heads=4, proj_dim=args.k,
                  ffn_dim=4 * args.dim)  # fmt: skip
    steps = steps_of(args, shape, scope, dtype)
    times = time_interleaved(steps, warmup=3, repeats=args.repeats, device=args.device)
    splits = kernels.choose_splits(device=torch.device(args.device), dtype=getattr(torch, dtype),
                                   backward=True, causal=False, queries=n, keys=args.k,
                                   groups=batch * 4)  # fmt: skip
    return {
        "batch": batch, "n": n, "scope": scope, "dtype": dtype, "rule_splits": splits,
        "attention_dropout": args.attention_dropout,
        "median_ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
        "burst_ms": {name: burst_ms(step, args.device) for name, step in steps.items()},
    }  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    """Each variant's median step over the rule's, per shape, one panel per scope x dtype."""
    panels = sorted({(r["scope"], r["dtype"]) for r in rows})
    fig = Figure(figsize=(4.6 * len(panels), 3.4))
    axes = fig.subplots(1, len(panels), squeeze=False).ravel()
    for axis, (scope, dtype) in zip(axes, panels):
        cells = [r for r in rows if (r["scope"], r["dtype"]) == (scope, dtype)]
        labels = [f"B{r['batch']}\n{r['n']}\n/{r['rule_splits']}" for r in cells]
        for name in cells[0]["median_ms"]:
            ratios = [r["median_ms"][name] / r["median_ms"]["rule"] for r in cells]
            axis.plot(range(len(cells)), ratios, marker="o", label=name)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xticks(range(len(cells)), labels, fontsize=7)
        axis.set(title=f"{scope}, {dtype}", ylabel="step time / the rule's")
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    """Times every shape, writes the table after each and the plot at the end."""
    args = parse_args(argv)
    given = " ".join(sys.argv[1:] if argv is None else argv)
    result = {
        "command": f"PYTHONPATH=src python benchmarks/kernels_split_layers.py {given}",
        "machine": machine(),
        "device": args.device,
        "rows": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    grid = list(itertools.product(args.shapes, ("attention", "layer"), args.dtype))
    for (batch, n), scope, dtype in tqdm(grid, desc="shapes"):
        result["rows"].append(time_shape(args, batch, n, scope, dtype))
        tqdm.write(json.dumps(result["rows"][-1]))
        (args.out / "splits.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result["rows"], args.out / "splits.png")


if __name__ == "__main__":
    main()
