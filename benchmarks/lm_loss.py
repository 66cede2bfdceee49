"""What computing a language model's loss in chunks of rows, without its logits, saves.

`model(..., return_logits=False)` (what the trainers call) runs the tied vocab_size-way
head and the cross-entropy through `losses.linear_cross_entropy`: one chunk of rows'
logits at a time, made, turned into the loss and into their own gradient, and consumed by
the gradient GEMMs while in cache. Two parts:

- `loss`: the head and loss alone (forward + backward) on random hidden states, as full
  logits + `F.cross_entropy` (`logits`) and chunked at several row counts per chunk
  (`chunk R`; `default_chunk`: `losses.chunk_rows`' choice), timed interleaved;
- `step`: one optimiser step (forward, loss, backward, AdamW, zeroed gradients) of whole
  models, logits returned (`logits`) or not (`chunked`), same weights and batch, timed
  interleaved (medians), each way's eval-mode loss (they must agree), and each way's peak
  memory over `--memory-steps` steps in a fresh process (CPU: resident peak, VmHWM; CUDA:
  peak allocated).

Models: the demo's causal pair (vocabulary 4096, n 1024, dim 128, 4 layers, batch 4;
Linformer k 128 layerwise, and exact attention), its masked Linformer (head at the scored
positions, 15 %, both ways), and a GPT-2-vocabulary causal Linformer (50257, dim 768, 12
heads, 2 layers, n 512, batch 2, k 128 kv). Writes OUT/ab.json and OUT/ab.png.

    PYTHONPATH=src python benchmarks/lm_loss.py
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import Tensor
from tqdm.auto import tqdm

from linformer_kit import LinformerConfig, LinformerForCausalLM, LinformerForMaskedLM, losses
from linformer_kit.bench.timing import time_interleaved
from linformer_kit.training.compare import machine
from linformer_kit.training.distributed import peak_memory_mb
from linformer_kit.training.process import in_fresh_process

OUT = Path(__file__).parent / "lm_loss"
DEMO = dict(vocab_size=4096, max_seq_len=1024, dim=128, depth=4, num_heads=4, dropout=0.0)
GPT2 = dict(vocab_size=50257, max_seq_len=512, dim=768, depth=2, num_heads=12, dropout=0.0)
MODELS = {  # name -> (config fields, batch size)
    "demo causal Linformer (k 128, layerwise)": (
        dict(DEMO, proj_dim=128, sharing="layerwise", causal=True),
        4,
    ),
    "demo causal Transformer (exact)": (dict(DEMO, proj_dim=None, causal=True), 4),
    "demo masked Linformer (k 128, layerwise)": (dict(DEMO, proj_dim=128, sharing="layerwise"), 4),
    "GPT-2 vocabulary, 2 layers (k 128, kv)": (
        dict(GPT2, proj_dim=128, sharing="kv", causal=True),
        2,
    ),
}
LOSS_SHAPES = {  # name -> (rows, dim, vocab_size), rows per chunk to time
    "demo causal head (4 x 1024 rows, dim 128, vocabulary 4096)": (
        (4096, 128, 4096),
        (64, 128, 256, 512, 1024, 4096),
    ),
    "GPT-2 head (2 x 512 rows, dim 768, vocabulary 50257)": (
        (1024, 768, 50257),
        (64, 128, 256, 512, 1024),
    ),
}
# `--tiny`: the same plumbing at toy sizes (the GPU runbook's smoke run, the tests).
TINY = dict(vocab_size=50, max_seq_len=16, dim=16, depth=1, num_heads=2, proj_dim=8)
TINY_MODELS = {"tiny causal": (dict(TINY, causal=True, block_size=4), 2), "tiny masked": (TINY, 2)}
TINY_LOSS_SHAPES = {"tiny head": ((40, 8, 30), (7, 40))}
WAYS = ("logits", "chunked")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Rounds, threads, device and output folder of a run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timed rounds")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--memory-steps", type=int, default=10, help="steps per way in a fresh process (0: none)"
    )
    parser.add_argument("--tiny", action="store_true", help="toy sizes: checks the plumbing")
    parser.add_argument("--out", type=Path, default=OUT, help="writes ab.json and ab.png there")
    return parser.parse_args(argv)


def chunked_loss(hidden: Tensor, weight: Tensor, targets: Tensor, rows: int) -> None:
    """`linear_cross_entropy` with `rows` rows per chunk, forward + backward."""
    losses.linear_cross_entropy(hidden, weight, targets, rows_per_chunk=rows).backward()


def full_loss(hidden: Tensor, weight: Tensor, targets: Tensor) -> None:
    """The full logits and `F.cross_entropy`, forward + backward."""
    F.cross_entropy(F.linear(hidden, weight), targets).backward()


def time_losses(
    shape: tuple[int, int, int], chunks: tuple[int, ...], repeats: int, device: str
) -> dict:
    """Median ms of the head and loss alone, with full logits and at each rows per chunk."""
    rows, dim, vocab = shape
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, dim, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) * dim**-0.5).to(device).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    calls = {"logits": functools.partial(full_loss, hidden, weight, targets)}
    for count in chunks:
        calls[f"chunk {count}"] = functools.partial(chunked_loss, hidden, weight, targets, count)
    times = time_interleaved(calls, warmup=1, repeats=repeats, device=device)
    return {way: statistics.median(seconds) * 1e3 for way, seconds in times.items()}


def model_and_optimizer(fields: dict, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A causal or masked LM of `fields` (seed 0) and its AdamW."""
    torch.manual_seed(0)
    cls = LinformerForCausalLM if fields.get("causal") else LinformerForMaskedLM
    model = cls(LinformerConfig(**fields)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def batch_for(fields: dict, batch: int, device: str) -> dict[str, Tensor]:
    """Random input_ids and labels: the ids (causal) or 15 % of them (masked, scored_only)."""
    shape = (batch, fields["max_seq_len"])
    ids = torch.randint(5, fields["vocab_size"], shape)
    if fields.get("causal"):
        return {"input_ids": ids.to(device), "labels": ids.to(device)}
    labels = torch.where(torch.rand(shape) < 0.15, ids, -100)
    return {"input_ids": ids.to(device), "labels": labels.to(device), "scored_only": True}


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict, way: str
) -> None:
    """Forward, loss, backward, optimiser step, gradients cleared."""
    model(**batch, return_logits=way == "logits").loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def peak(fields: dict, batch: int, way: str, steps: int, threads: int, device: str) -> float:
    """Peak memory in MiB over `steps` training steps, a new batch every step (run it in a
    fresh process: the peak is the process's)."""
    torch.set_num_threads(threads)
    model, optimizer = model_and_optimizer(fields, device)
    for _ in range(steps):
        train_step(model, optimizer, batch_for(fields, batch, device), way)
    return peak_memory_mb(torch.device(device))


def time_steps(fields: dict, batch: int, repeats: int, device: str) -> dict:
    """Each way's median step ms, every timing, and eval-mode loss."""
    model, optimizer = model_and_optimizer(fields, device)
    inputs = batch_for(fields, batch, device)
    with torch.no_grad():
        model.eval()
        losses_ = {way: float(model(**inputs, return_logits=way == "logits").loss) for way in WAYS}
        model.train()
    calls: dict[str, Callable[[], None]] = {
        way: functools.partial(train_step, model, optimizer, inputs, way) for way in WAYS
    }
    times = time_interleaved(calls, warmup=1, repeats=repeats, device=device)
    return {
        "median_ms": {way: statistics.median(seconds) * 1e3 for way, seconds in times.items()},
        "times_ms": {way: [s * 1e3 for s in seconds] for way, seconds in times.items()},
        "eval_loss": losses_,
    }


def plot(rows: list[dict], path: Path, memory: bool) -> None:
    """Step time (and peak memory) of each model, both ways, as bars."""
    panels = 2 if memory else 1
    fig = Figure(figsize=(6 * panels, 4))
    axes = fig.subplots(1, panels, squeeze=False)
    names = [row["model"].split(" (")[0] for row in rows]
    for ax, key, label in zip(axes[0], ("median_ms", "peak_mib"), ("ms per step", "peak MiB")):
        for offset, way in ((-0.2, "logits"), (0.2, "chunked")):
            ax.bar(
                [i + offset for i in range(len(rows))], [r[key][way] for r in rows], 0.4, label=way
            )
        ax.set_xticks(range(len(rows)), names, rotation=15, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("training step: logits returned vs loss in chunks (return_logits=False)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    """Times the loss alone and every model both ways; writes ab.json and ab.png."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    loss_rows = []
    models, shapes = (TINY_MODELS, TINY_LOSS_SHAPES) if args.tiny else (MODELS, LOSS_SHAPES)
    for name, (shape, chunks) in tqdm(shapes.items(), desc="head and loss"):
        median = time_losses(shape, chunks, args.repeats, args.device)
        default = losses.chunk_rows(shape[0], shape[2], torch.device(args.device))
        loss_rows.append(
            {"shape": name, "rows_dim_vocab": shape, "default_chunk": default, "median_ms": median}
        )
        print(name, ", ".join(f"{way} {ms:.1f} ms" for way, ms in median.items()), flush=True)
    rows = []
    for name, (fields, batch) in tqdm(models.items(), desc="models"):
        row = {"model": name, "config": fields, "batch_size": batch}
        row |= time_steps(fields, batch, args.repeats, args.device)
        row["speedup"] = row["median_ms"]["logits"] / row["median_ms"]["chunked"]
        if args.memory_steps:
            run = (fields, batch)
            row["peak_mib"] = {
                way: in_fresh_process(peak, *run, way, args.memory_steps, args.threads, args.device)
                for way in WAYS
            }
        rows.append(row)
        print(
            f"{name}: logits {row['median_ms']['logits']:.1f} ms, chunked "
            f"{row['median_ms']['chunked']:.1f} ms ({row['speedup']:.2f}x); eval loss "
            f"{row['eval_loss']['logits']:.5f} / {row['eval_loss']['chunked']:.5f}"
            + (
                f"; peak {row['peak_mib']['logits']:.0f} / {row['peak_mib']['chunked']:.0f} MiB"
                if args.memory_steps
                else ""
            ),
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    command = [
        "PYTHONPATH=src python benchmarks/lm_loss.py",
        *(sys.argv[1:] if argv is None else argv),
    ]
    result = {
        "command": " ".join(command),
        "machine": machine(),
        "device": args.device,
        "memory_steps": args.memory_steps,
        "loss": loss_rows,
        "rows": rows,
    }
    (args.out / "ab.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, args.out / "ab.png", memory=bool(args.memory_steps))
    print("wrote", args.out / "ab.json", "and", args.out / "ab.png")


if __name__ == "__main__":
    main()
