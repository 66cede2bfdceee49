"""Time per fine-tuning step of converted MiniLM variants on the same real documents, the
variants interleaved round by round in one process, so a busy or throttled machine slows
them alike and the ratios hold (bench-task times each variant in its own run).

    python benchmarks/longdoc/step_time.py --data data/longdoc/pang_lee/test.jsonl \
        --variants exact@2048,k512@2048:adaptive,k256@2048:adaptive \
        --out benchmarks/longdoc/step_time_pang_lee

A step is what `bench-task --batch-size 2 --grad-accum-steps 4` runs: forward and backward
of 4 micro-batches of 2 documents ([CLS] ... [SEP], cut at N, each micro-batch padded to its
longer document), in training mode (dropout on), sequence projections frozen (finetune's
default), through a mean-pooled 2-class head. The
documents are drawn evenly across the file (prepare.py sorts test files by length). Writes
OUT.json and OUT.md: the median step time per variant and its speed-up over the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from linformer_kit.data.classification import read_labelled
from linformer_kit.embeddings import masked_mean
from linformer_kit.interop import convert_hf_model
from linformer_kit.interop.report import TOKENIZER_NAME, document_ids, minilm_path
from linformer_kit.interop.task_bench_settings import parse_variants
from linformer_kit.training.compare import machine
from linformer_kit.training.finetune import freeze_projections


def micro_batches(path: Path, source: Path, n: int, batches: int, size: int) -> list[tuple]:
    """`batches` micro-batches of `size` documents spread evenly over the file: (ids, mask)."""
    texts = read_labelled(path)[0]
    count = batches * size
    picked = [texts[i * len(texts) // count] for i in range(count)]
    ids, mask = document_ids(source / TOKENIZER_NAME, picked, n)
    out = []
    for start in range(0, count, size):
        rows = slice(start, start + size)
        longest = int(mask[rows].sum(1).max())
        out.append((ids[rows, :longest], mask[rows, :longest]))
    return out


def step(model: torch.nn.Module, head: torch.nn.Linear, batches: list[tuple]) -> float:
    """Seconds for forward + backward of every micro-batch (gradients accumulate)."""
    start = time.perf_counter()
    for ids, mask in batches:
        hidden = model(ids, key_padding_mask=mask).last_hidden_state
        logits = head(masked_mean(hidden, mask))
        F.cross_entropy(logits, torch.zeros(len(ids), dtype=torch.long)).backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    head.zero_grad(set_to_none=True)
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="labelled JSONL or CSV")
    parser.add_argument("--source", type=Path, default=None, help="HF dir (default: MiniLM)")
    parser.add_argument("--variants", default="exact@2048,k512@2048:adaptive")
    parser.add_argument("--batch-size", type=int, default=2, help="documents per micro-batch")
    parser.add_argument("--grad-accum-steps", type=int, default=4, help="micro-batches a step")
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/longdoc/step_time"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    source = args.source or minilm_path()
    variants = parse_variants(args.variants)
    models = {}
    for v in variants:  # an :after variant has the same architecture: the same cost
        model = convert_hf_model(
            source, proj_dim=v.proj_dim, max_seq_len=v.max_seq_len, projection=v.projection
        )
        freeze_projections(model)  # as finetune and bench-task do by default
        head = torch.nn.Linear(model.config.dim, 2)
        n = v.max_seq_len
        batches = micro_batches(args.data, source, n, args.grad_accum_steps, args.batch_size)
        models[v.name] = (model.train(), head, batches)
        step(*models[v.name])  # warm-up, untimed
    times: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(args.rounds):
        for name, parts in models.items():
            times[name].append(step(*parts))
        print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
    first = statistics.median(times[variants[0].name])
    rows = [
        {
            "variant": name,
            "s_per_step": round(statistics.median(t), 3),
            "speedup_vs_first": round(first / statistics.median(t), 2),
            "tokens_per_step": sum(int(mask.sum()) for _, mask in models[name][2]),
            "steps_s": [round(x, 3) for x in t],
        }
        for name, t in times.items()
    ]
    report = {"settings": {k: str(v) for k, v in vars(args).items()}, "machine": machine()}
    report["rows"] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"| variant | s / step (median of {args.rounds}) | speed-up vs {variants[0].name} |"]
    lines.append("|---|---:|---:|")
    lines += [f"| {r['variant']} | {r['s_per_step']} | {r['speedup_vs_first']}x |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
