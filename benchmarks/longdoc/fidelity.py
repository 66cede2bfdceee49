"""How much of the exact long model a converted Linformer keeps before any fine-tuning, on real
documents at their own lengths: the cosine between each variant's and the exact model's
mean-pooled last hidden states (the sentence-transformers embedding), and the mean cosine of
their token outputs, per document, grouped by length.

    python benchmarks/longdoc/fidelity.py --data data/longdoc/pang_lee/test.jsonl \
        --variants k128@2048,k128@2048:adaptive,k256@2048,k256@2048:adaptive \
        --out benchmarks/longdoc/fidelity_pang_lee

Every variant shares one max_seq_len N (the teacher is the exact model extended to N, the
`exact@N` of `linformer bench-task`); variants are written as bench-task's `kK@N[:KIND]`.
Documents are taken evenly across the file (`prepare.py` sorts test files by length), one
at a time, unpadded. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from linformer_kit.data.classification import read_labelled
from linformer_kit.interop import convert_hf_model
from linformer_kit.interop.report import (
    TOKENIZER_NAME,
    calibration_ids,
    document_ids,
    minilm_path,
)
from linformer_kit.interop.task_bench_settings import parse_variants
from linformer_kit.training.compare import machine

BUCKETS = {"<=512": (0, 512), "513-1024": (513, 1024), ">1024": (1025, 10**9)}  # tokens


def documents(path: Path, source: Path, count: int, max_seq_len: int) -> list[torch.Tensor]:
    """`count` documents spread evenly over the file, tokenised ([CLS] ... [SEP]) and cut to
    max_seq_len, each (1, its length)."""
    texts = read_labelled(path)[0]
    picked = [texts[i * len(texts) // count] for i in range(min(count, len(texts)))]
    ids, mask = document_ids(source / TOKENIZER_NAME, picked, max_seq_len)
    return [row[real][None] for row, real in zip(ids, mask)]


@torch.no_grad()
def outputs(model: torch.nn.Module, docs: list[torch.Tensor], name: str) -> list[torch.Tensor]:
    """Last hidden states (N, dim) of each document."""
    model.eval()
    return [model(ids).last_hidden_state[0] for ids in tqdm(docs, desc=name, leave=False)]


def scores(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, float]:
    """Mean pooled-embedding and token cosine, overall and per length bucket."""
    pooled = [F.cosine_similarity(a.mean(0), b.mean(0), dim=0).item() for a, b in zip(got, want)]
    token = [F.cosine_similarity(a, b, dim=-1).mean().item() for a, b in zip(got, want)]
    row = {"pooled_cosine": statistics.mean(pooled), "token_cosine": statistics.mean(token)}
    for bucket, (low, high) in BUCKETS.items():
        inside = [p for p, w in zip(pooled, want) if low <= w.shape[0] <= high]
        row[f"pooled_cosine_{bucket}"] = statistics.mean(inside) if inside else None
        row[f"docs_{bucket}"] = len(inside)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="labelled JSONL or CSV")
    parser.add_argument("--source", type=Path, default=None, help="HF dir (default: MiniLM)")
    parser.add_argument("--variants", default="k128@2048,k128@2048:adaptive")
    parser.add_argument("--docs", type=int, default=64, help="documents scored")
    parser.add_argument("--calibration-texts", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/longdoc/fidelity"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    source = args.source or minilm_path()
    variants = parse_variants(args.variants)
    lengths = {v.max_seq_len for v in variants}
    if len(lengths) != 1:
        parser.error(f"every variant needs the same max_seq_len; got {sorted(lengths)}")
    (n,) = lengths
    if after := [v.name for v in variants if v.after]:
        parser.error(
            f"fidelity compares conversions of --source; {', '.join(after)} convert a fine-tuned "
            "classifier: drop :after"
        )
    docs = documents(args.data, source, args.docs, n)
    teacher = outputs(convert_hf_model(source, proj_dim=None, max_seq_len=n), docs, f"exact@{n}")
    calibration = calibration_ids(source, args.calibration_texts, n)
    rows = []
    for v in variants:
        model = convert_hf_model(
            source,
            proj_dim=v.proj_dim,
            max_seq_len=n,
            projection=v.projection,
            calibration_ids=calibration if v.projection == "linear" else None,
        )
        rows.append({"variant": v.name, **scores(outputs(model, docs, v.name), teacher)})
        print(json.dumps(rows[-1]))
    report = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "doc_lengths": {"median": statistics.median(d.shape[1] for d in docs), "count": len(docs)},
        "machine": machine(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    header = ["variant", "pooled cosine", "token cosine"]
    header += [f"pooled, {bucket} tokens (docs)" for bucket in BUCKETS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["variant"], row["pooled_cosine"], row["token_cosine"]] + [
            f"{row[f'pooled_cosine_{bucket}']} ({row[f'docs_{bucket}']})" for bucket in BUCKETS
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
