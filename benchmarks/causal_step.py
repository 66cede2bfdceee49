"""Training-step time of a causal LM: causal Linformer vs the exact causal Transformer.

Forward + backward + AdamW step of the same model shape on random tokens, for several
sequence lengths; warm-up, then the median of repeats, both models timed in the same run.
Writes benchmarks/causal_step/results.json.

    PYTHONPATH=src python benchmarks/causal_step.py
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from linformer_kit import LinformerConfig, LinformerForCausalLM
from linformer_kit.training.compare import machine

SEQ_LENS = (512, 1024, 2048, 4096)
BATCH, WARMUP, REPEATS = 2, 1, 3


def step_seconds(proj_dim: int | None, seq_len: int) -> float:
    torch.manual_seed(0)
    cfg = LinformerConfig(
        vocab_size=4096, max_seq_len=seq_len, dim=128, depth=4, num_heads=4, proj_dim=proj_dim,
        causal=True, block_size=64, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = LinformerForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 4096, (BATCH, seq_len))
    times = []
    for i in range(WARMUP + REPEATS):
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)  # steady timings on a shared machine
    rows = []
    for seq_len in SEQ_LENS:
        linformer, exact = step_seconds(128, seq_len), step_seconds(None, seq_len)
        row = {
            "seq_len": seq_len,
            "linformer_s": round(linformer, 4),
            "exact_s": round(exact, 4),
            "speedup": round(exact / linformer, 2),
        }
        print(row, flush=True)
        rows.append(row)
    meta = {
        "command": "PYTHONPATH=src python benchmarks/causal_step.py",
        "machine": machine(),  # CPU model, torch capability, ISA flags, load
        "model": {"dim": 128, "depth": 4, "num_heads": 4, "proj_dim": 128, "block_size": 64},
        "batch": BATCH,
        "rows": rows,
    }
    out = Path(__file__).parent / "causal_step"
    out.mkdir(exist_ok=True)
    (out / "results.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
