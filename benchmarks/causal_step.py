"""Training-step time of a causal LM: causal Linformer vs the exact causal Transformer.

Forward + backward + AdamW step of the same model shape on random tokens, for several
sequence lengths; warm-up, then the median of repeats, the two models' steps interleaved in
the same run.
Writes benchmarks/causal_step/results.json (or into --out).

    PYTHONPATH=src python benchmarks/causal_step.py [--seq-lens 512,1024] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from linformer_kit import LinformerConfig, LinformerForCausalLM
from linformer_kit.files import save_json
from linformer_kit.training.compare import machine

SEQ_LENS = (512, 1024, 2048, 4096)
BATCH, WARMUP, REPEATS = 2, 1, 5


def make_step(proj_dim: int | None, seq_len: int) -> Callable[[], float]:
    """One training step of a fresh model as a closure returning its seconds."""
    torch.manual_seed(0)
    cfg = LinformerConfig(
        vocab_size=4096, max_seq_len=seq_len, dim=128, depth=4, num_heads=4, proj_dim=proj_dim,
        causal=True, block_size=64, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = LinformerForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 4096, (BATCH, seq_len))

    def step() -> float:
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    return step


def step_seconds(seq_len: int) -> tuple[float, float]:
    """Median step seconds of (Linformer, exact), their steps interleaved so that load
    from other processes falls on both alike."""
    steps = make_step(128, seq_len), make_step(None, seq_len)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(WARMUP + REPEATS):
        for step, record in zip(steps, times):
            seconds = step()
            if i >= WARMUP:
                record.append(seconds)
    return statistics.median(times[0]), statistics.median(times[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)))
    parser.add_argument("--out", default=str(Path(__file__).parent / "causal_step"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # steady timings on a shared machine
    rows = []
    for seq_len in (int(n) for n in args.seq_lens.split(",")):
        linformer, exact = step_seconds(seq_len)
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_json(meta, out / "results.json")  # atomic: a kill leaves the last results


if __name__ == "__main__":
    main()
