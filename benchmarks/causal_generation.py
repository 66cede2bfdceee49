"""Generation cost per token as the text grows: causal Linformer vs the exact causal Transformer.

For each position n, encodes a random prompt of n - 1 tokens into the generation states
(one pass, not timed), then times single-token steps there (median of repeats) and
measures the states' size. Same model shape for both; untrained weights (the cost does not
depend on them). Writes benchmarks/causal_generation/results.json (or into --out).

    PYTHONPATH=src python benchmarks/causal_generation.py [--positions 1024,2048] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from linformer_kit import LinformerConfig, LinformerForCausalLM
from linformer_kit.files import save_json
from linformer_kit.training.compare import machine

POSITIONS = (1024, 2048, 4096, 8192, 16384)
STEPS, REPEATS = 16, 5


def state_bytes(states: list) -> int:
    tensors = [t for s in states for t in vars(s).values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(model: LinformerForCausalLM, position: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, position - 1), generator=gen)
    token = prompt[:, -1:]
    times = []
    with torch.no_grad():
        for _ in range(REPEATS):
            states = model.init_states()
            model(prompt, states=states)
            start = time.perf_counter()
            for _ in range(STEPS):
                model(token, states=states)
            times.append((time.perf_counter() - start) / STEPS)
    return {
        "position": position,
        "ms_per_token": round(statistics.median(times) * 1e3, 3),
        "state_bytes": state_bytes(states),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", default=",".join(map(str, POSITIONS)))
    parser.add_argument("--out", default=str(Path(__file__).parent / "causal_generation"))
    args = parser.parse_args(argv)
    positions = [int(n) for n in args.positions.split(",")]
    torch.set_num_threads(1)  # steady timings on a shared machine
    base = dict(
        vocab_size=4096, max_seq_len=max(positions) + STEPS, dim=128, depth=2, num_heads=4,
        causal=True, block_size=64, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    results = {}
    for name, proj_dim in (("linformer k=128", 128), ("exact", None)):
        torch.manual_seed(0)
        model = LinformerForCausalLM(LinformerConfig(**base, proj_dim=proj_dim)).eval()
        results[name] = [measure(model, n) for n in positions]
        first, last = results[name][0], results[name][-1]
        results[name + " last/first"] = round(last["ms_per_token"] / first["ms_per_token"], 2)
        print(name, results[name], results[name + " last/first"], flush=True)
    meta = {
        "command": "PYTHONPATH=src python benchmarks/causal_generation.py",
        "machine": machine(),  # CPU model, torch capability, ISA flags, load
        "model": base,
        "steps": STEPS,
        "repeats": REPEATS,
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_json(meta, out / "results.json")  # atomic: a kill leaves the last results


if __name__ == "__main__":
    main()
