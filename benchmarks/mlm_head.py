"""What running the masked LM's head at the scored positions alone saves a training step.

`LinformerForMaskedLM(..., scored_only=True)` (what the trainers call) applies the LM head
(dense, GELU, LayerNorm, the tied vocab_size-way decoder) and the loss to the positions
with a label, 15 % of them under RoBERTa masking, instead of to all B x N. Per model: one
optimiser step (forward, loss, backward, AdamW, zeroed gradients) with the head at every
position (`full`) and at the scored ones (`scored`), same weights and batch, timed
interleaved (medians), and each way's loss on the batch in eval mode (they must agree).
Then, per way, `--memory-steps` steps in a fresh process with a new mask every step, as in
training, and its resident peak (VmHWM) after 5 steps and after all: the head at every
position, at the scored ones (their count rounded up to 64 rows, `SCORED_ROWS_MULTIPLE`),
and at exactly the scored ones (`scored exact`, whose new row count every step fragments
the heap).
Models: the demo's masked-LM pair (vocabulary 4096, n 1024, dim 128, 4 layers, batch 4;
Linformer k 128 layerwise, and exact attention), and a BERT-base-width one (vocabulary
30522, dim 768, 12 heads, 2 layers, n 512, batch 2, Linformer k 128 kv). Writes
OUT/ab.json.

    PYTHONPATH=src python benchmarks/mlm_head.py
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
from torch import Tensor
from tqdm.auto import tqdm

from linformer_kit import LinformerConfig, LinformerForMaskedLM, masked_lm
from linformer_kit.bench.timing import time_interleaved
from linformer_kit.training.compare import machine
from linformer_kit.training.distributed import peak_memory_mb
from linformer_kit.training.process import in_fresh_process

OUT = Path(__file__).parent / "mlm_head"
DEMO = dict(vocab_size=4096, max_seq_len=1024, dim=128, depth=4, num_heads=4, dropout=0.0)
BASE = dict(vocab_size=30522, max_seq_len=512, dim=768, depth=2, num_heads=12, dropout=0.0)
MODELS = {  # name -> (config fields, batch size)
    "demo Linformer (k 128, layerwise)": (dict(DEMO, proj_dim=128, sharing="layerwise"), 4),
    "demo Transformer (exact)": (dict(DEMO, proj_dim=None), 4),
    "BERT-base width, 2 layers (k 128, kv)": (dict(BASE, proj_dim=128, sharing="kv"), 2),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Rounds, threads and output folder of a run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timed rounds")
    parser.add_argument("--mlm-probability", type=float, default=0.15, help="scored share")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument(
        "--memory-steps", type=int, default=30, help="steps per way in a fresh process (0: none)"
    )
    parser.add_argument("--out", type=Path, default=OUT, help="writes ab.json there")
    return parser.parse_args(argv)


def model_and_optimizer(fields: dict) -> tuple[LinformerForMaskedLM, torch.optim.Optimizer]:
    """A masked LM of `fields` (seed 0) and its AdamW."""
    torch.manual_seed(0)
    model = LinformerForMaskedLM(LinformerConfig(**fields))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def masked_batch(fields: dict, batch: int, probability: float) -> tuple[Tensor, Tensor]:
    """Random input_ids (batch, max_seq_len) and labels scoring a `probability` share."""
    shape = (batch, fields["max_seq_len"])
    ids = torch.randint(5, fields["vocab_size"], shape)
    return ids, torch.where(torch.rand(shape) < probability, ids, -100)


def train_step(
    model: LinformerForMaskedLM,
    optimizer: torch.optim.Optimizer,
    ids: Tensor,
    labels: Tensor,
    scored_only: bool,
) -> None:
    """Forward, loss, backward, optimiser step, gradients cleared."""
    model(ids, labels=labels, scored_only=scored_only).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def steps(
    fields: dict, batch: int, probability: float
) -> tuple[dict[str, Callable[[], None]], dict[str, float]]:
    """One training step per way of running the head, and each way's eval-mode loss."""
    model, optimizer = model_and_optimizer(fields)
    ids, labels = masked_batch(fields, batch, probability)
    with torch.no_grad():
        model.eval()
        losses = {
            way: float(model(ids, labels=labels, scored_only=way == "scored").loss)
            for way in ("full", "scored")
        }
        model.train()
    calls = {
        way: functools.partial(train_step, model, optimizer, ids, labels, way == "scored")
        for way in ("full", "scored")
    }
    return calls, losses


def resident_peaks(
    fields: dict, batch: int, probability: float, way: str, steps: int, threads: int
) -> list[float]:
    """VmHWM in MiB after 5 training steps and after `steps`, a new mask every step (run it
    in a fresh process: the peak is the process's)."""
    torch.set_num_threads(threads)
    if way == "scored exact":
        masked_lm.SCORED_ROWS_MULTIPLE = 1  # this process's only
    model, optimizer = model_and_optimizer(fields)
    peaks = []
    for step in range(steps):
        train_step(model, optimizer, *masked_batch(fields, batch, probability), way != "full")
        for mark in (min(5, steps), steps):  # both entries even where they are one step
            if step + 1 == mark:
                peaks.append(peak_memory_mb(torch.device("cpu")))
    return peaks


def main(argv: list[str] | None = None) -> None:
    """Times every model both ways and writes ab.json."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name, (fields, batch) in tqdm(MODELS.items(), desc="models"):
        calls, losses = steps(fields, batch, args.mlm_probability)
        times = time_interleaved(calls, warmup=1, repeats=args.repeats, device="cpu")
        median = {way: statistics.median(seconds) * 1e3 for way, seconds in times.items()}
        rows.append(
            {
                "model": name,
                "config": fields,
                "batch_size": batch,
                "median_ms": median,
                "speedup": median["full"] / median["scored"],
                "eval_loss": losses,
                "times_ms": {way: [s * 1e3 for s in seconds] for way, seconds in times.items()},
            }
        )
        if args.memory_steps:
            run = (fields, batch, args.mlm_probability)
            rows[-1]["resident_peak_mib_after_5_and_all_steps"] = {
                way: in_fresh_process(resident_peaks, *run, way, args.memory_steps, args.threads)
                for way in ("full", "scored", "scored exact")
            }
        print(
            f"{name}: full {median['full']:.1f} ms, scored {median['scored']:.1f} ms "
            f"({rows[-1]['speedup']:.2f}x); eval loss {losses['full']:.5f} / "
            f"{losses['scored']:.5f}",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join(
            [
                "PYTHONPATH=src python benchmarks/mlm_head.py",
                *(sys.argv[1:] if argv is None else argv),
            ]
        ),
        "machine": machine(),
        "mlm_probability": args.mlm_probability,
        "memory_steps": args.memory_steps,
        "rows": rows,
    }
    (args.out / "ab.json").write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out / "ab.json")


if __name__ == "__main__":
    main()
