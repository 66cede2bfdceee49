"""How to scale causal Linformer's prefix summaries E[:L]^T X[:L] as the prefix L grows.

Trains the same tiny byte-level causal LM on the Python standard library's source with the
summary rows multiplied by 1 (the paper's projection, unscaled), 1 / sqrt(L) or 1 / L, for
the learned (`linear`) and the fixed (`random`) projection, from the same seed, data order
and steps; reports validation loss overall and by position (first block, which has no
summary, and the last quarter, where L is largest). Writes
benchmarks/causal_scaling/results_seed{SEED}.json (or into --out DIR).

    PYTHONPATH=src python benchmarks/causal_scaling.py --seed 0   # and --seed 1
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import torch

from linformer_kit import LinformerConfig, LinformerForCausalLM, attention, causal
from linformer_kit.training.compare import machine

SCALES = {
    "none": lambda n: torch.ones_like(n, dtype=torch.float64),
    "rsqrt": lambda n: n.clamp(min=1).to(torch.float64).rsqrt(),
    "mean": lambda n: 1.0 / n.clamp(min=1).to(torch.float64),
}
SEQ_LEN, BLOCK, PROJ_DIM, BATCH, STEPS = 512, 32, 16, 8, 300


def byte_corpus(limit: int = 4_000_000) -> torch.Tensor:
    """The stdlib's .py files as one byte stream (vocabulary 256), in sorted file order."""
    data = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data += path.read_bytes()
        if len(data) >= limit:
            break
    return torch.tensor(list(data[:limit]), dtype=torch.long)


def windows(stream: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - SEQ_LEN, (count,), generator=gen)
    return torch.stack([stream[s : s + SEQ_LEN] for s in starts.tolist()])  # (count, N)


def run(projection: str, name: str, stream: torch.Tensor, valid: torch.Tensor, seed: int) -> dict:
    causal.summary_scale = attention.summary_scale = SCALES[name]
    torch.manual_seed(seed)
    cfg = LinformerConfig(
        vocab_size=256, max_seq_len=SEQ_LEN, dim=64, depth=2, num_heads=4, proj_dim=PROJ_DIM,
        projection=projection, causal=True, block_size=BLOCK, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = LinformerForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    start = time.perf_counter()
    for _ in range(STEPS):
        batch = windows(stream, BATCH, gen)
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        logits = model(valid).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), valid[:, 1:], reduction="none"
        ).mean(0)  # (N - 1,): loss by position
    row = {
        "projection": projection,
        "scale": name,
        "val_loss": nll.mean().item(),
        "val_loss_first_block": nll[: BLOCK - 1].mean().item(),
        "val_loss_last_quarter": nll[-SEQ_LEN // 4 :].mean().item(),
        "train_s": round(time.perf_counter() - start, 1),
    }
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="model init and data order")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "causal_scaling", help="JSON folder"
    )
    args = parser.parse_args(argv)
    seed, out = args.seed, args.out
    torch.set_num_threads(2)
    stream = byte_corpus()
    split = int(len(stream) * 0.9)
    valid = windows(stream[split:], 32, torch.Generator().manual_seed(2))
    rows = [
        run(projection, name, stream[:split], valid, seed)
        for projection in ("linear", "random")
        for name in SCALES
    ]
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": f"PYTHONPATH=src python benchmarks/causal_scaling.py --seed {seed}",
        "machine": machine(),  # CPU model, torch capability, ISA flags, load
        "settings": {"seq_len": SEQ_LEN, "block_size": BLOCK, "proj_dim": PROJ_DIM},
        "model": {"dim": 64, "depth": 2, "num_heads": 4, "vocab": "bytes"},
        "training": {"batch": BATCH, "steps": STEPS, "lr": 3e-3, "optimizer": "AdamW"},
        "rows": rows,
    }
    (out / f"results_seed{seed}.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
