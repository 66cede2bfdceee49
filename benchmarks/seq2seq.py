"""Encoder-decoder Linformer vs the exact encoder-decoder Transformer.

`cost`: source n = 4096, target m = 128. Time and peak memory of one training step (forward,
backward, AdamW) and of generating tokens (the encoder run once, then one decoder step per
token with the memory projected once), each configuration in a fresh process (its own peak
memory), the models interleaved and repeated (medians). Untrained weights: cost does not
depend on them.

`task`: the stdlib docstring task (function body -> docstring summary), both models trained
for the same steps with `linformer seq2seq train` side by side (one thread each, so they share
the machine alike), then scored on the test split with `linformer seq2seq evaluate`'s library
function (loss, token accuracy, ROUGE-L and exact match of greedy decodes).

    PYTHONPATH=src python benchmarks/seq2seq.py cost
    PYTHONPATH=src python benchmarks/seq2seq.py task --steps 600
    PYTHONPATH=src python benchmarks/seq2seq.py plot

Writes benchmarks/seq2seq/{cost,task}.json and seq2seq.png (or into --out DIR).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).parent / "seq2seq"
N, M, BATCH = 4096, 128, 2
MODELS = {"linformer": 256, "exact": None}  # encoder / cross-attention k
SHAPE = dict(vocab_size=8192, dim=256, num_heads=4, ffn_dim=1024, dropout=0.0)
DEPTHS = (4, 2)  # encoder, decoder layers
GENERATED = 32  # tokens timed per generation
REPEATS = 3


def build(name: str):
    from linformer_kit import LinformerConfig, LinformerForSeq2SeqLM, Seq2SeqConfig

    torch.manual_seed(0)
    proj_dim = MODELS[name]
    config = Seq2SeqConfig(
        encoder=LinformerConfig(
            **SHAPE, attention_dropout=0.0, depth=DEPTHS[0], max_seq_len=N, proj_dim=proj_dim
        ),
        decoder=LinformerConfig(
            **SHAPE,
            attention_dropout=0.0,
            depth=DEPTHS[1],
            max_seq_len=M + 1,
            proj_dim=None if proj_dim is None else 32,
            causal=True,
            block_size=32,
        ),
        share_embeddings=True,
    )
    return LinformerForSeq2SeqLM(config)


def measure(name: str, what: str) -> dict:
    """One measurement in this (fresh) process: median seconds and the peak resident set."""
    from linformer_kit.training.distributed import peak_memory_mb

    torch.set_num_threads(1)
    model = build(name)
    base = peak_memory_mb(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(3, SHAPE["vocab_size"], (BATCH, N), generator=gen)
    times = []
    if what == "train":
        tgt = torch.randint(3, SHAPE["vocab_size"], (BATCH, M), generator=gen)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(REPEATS + 1):  # the first is warm-up
            start = time.perf_counter()
            model(src, tgt, labels=tgt).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        per = statistics.median(times[1:])
    else:
        model.eval()
        with torch.no_grad():
            for _ in range(REPEATS):
                start = time.perf_counter()
                memory = model.encode(src)
                encoded = time.perf_counter()
                states = model.init_states()
                token = torch.zeros(BATCH, 1, dtype=torch.long)
                for _ in range(GENERATED):
                    logits = model(None, token, memory=memory, states=states).logits
                    token = logits[:, -1:].argmax(-1)
                times.append(((encoded - start), (time.perf_counter() - encoded) / GENERATED))
        per = statistics.median(t[1] for t in times)
        encode_s = statistics.median(t[0] for t in times)
    result = {
        "model": name,
        "what": what,
        "seconds": round(per, 4),
        "peak_mem_mb": round(peak_memory_mb(torch.device("cpu")), 1),
        "model_mem_mb": round(base, 1),
    }
    if what == "generate":
        result["encode_seconds"] = round(encode_s, 4)
    return result


def cost(out: Path) -> None:
    from linformer_kit.training.compare import machine

    rows = []
    for round_ in range(2):  # interleaved: the machine's load hits both models alike
        for what in ("train", "generate"):
            for name in MODELS:
                line = (
                    subprocess.run(
                        [sys.executable, __file__, "_measure", name, what],
                        check=True,
                        capture_output=True,
                        text=True,
                    )
                    .stdout.strip()
                    .splitlines()[-1]
                )
                rows.append({**json.loads(line), "round": round_})
                print(rows[-1], flush=True)
    summary = {}
    for what in ("train", "generate"):
        for name in MODELS:
            mine = [r for r in rows if r["model"] == name and r["what"] == what]
            summary[f"{name} {what}"] = {
                "seconds": statistics.median(r["seconds"] for r in mine),
                "peak_mem_mb": statistics.median(r["peak_mem_mb"] for r in mine),
            }
        ratio = summary[f"exact {what}"]["seconds"] / summary[f"linformer {what}"]["seconds"]
        summary[f"exact/linformer {what} time"] = round(ratio, 2)
    report = {
        "command": "PYTHONPATH=src python benchmarks/seq2seq.py cost",
        "machine": machine(),
        "shape": {**SHAPE, "encoder_depth": DEPTHS[0], "decoder_depth": DEPTHS[1]},
        "n": N,
        "m": M,
        "batch": BATCH,
        "linformer": "encoder and cross-attention k=256 (layerwise), causal decoder k=32 block 32",
        "threads": 1,
        "generated_tokens_timed": GENERATED,
        "rows": rows,
        "summary": summary,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost.json").write_text(json.dumps(report, indent=2) + "\n")


def task(steps: int, runs: Path, out: Path) -> None:
    from linformer_kit.training.compare import machine
    from linformer_kit.training.seq2seq import evaluate_seq2seq

    flags = {
        "--task": "docstrings", "--max-source-len": "512", "--max-target-len": "48",
        "--dim": "128", "--depth": "2", "--decoder-depth": "2", "--num-heads": "4",
        "--max-steps": str(steps), "--batch-size": "8", "--lr": "1e-3", "--warmup-steps": "30",
        "--eval-every": str(max(1, steps // 4)), "--eval-batches": "8", "--threads": "1",
        "--save-every": str(steps),
    }  # fmt: skip
    proj = {"linformer": "64", "exact": "none"}
    commands = {
        name: [
            sys.executable, "-m", "linformer_kit.cli", "seq2seq", "train",
            *[x for kv in flags.items() for x in kv],
            "--proj-dim", proj[name], "--output-dir", str(runs / name),
        ]
        for name in proj
    }  # fmt: skip
    before = machine()
    started = time.time()
    jobs = {n: subprocess.Popen(c, stderr=subprocess.DEVNULL) for n, c in commands.items()}
    for name, job in jobs.items():
        if job.wait():
            raise SystemExit(f"the {name} run failed (exit {job.returncode})")
    rows = []
    for name in proj:
        records = [json.loads(x) for x in (runs / name / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["split"] == "train"]
        test = evaluate_seq2seq(runs / name / "last", split="test", batch_size=32, threads=2)
        rows.append(
            {
                "model": f"Linformer k={proj[name]}" if name == "linformer" else "exact",
                "test": test,
                "s_per_step_median": statistics.median(
                    r["train_s"] / r["step"] for r in train[len(train) // 2 :]
                ),
                "records": records,
            }
        )
        print(rows[-1]["model"], test, flush=True)
    report = {
        "command": f"PYTHONPATH=src python benchmarks/seq2seq.py task --steps {steps}",
        "train_commands": {n: " ".join(["linformer", *c[3:]]) for n, c in commands.items()},
        "machine": before,
        "wall_s": round(time.time() - started),
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "task.json").write_text(json.dumps(report, indent=2) + "\n")


def plot(out: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4))
    axes = fig.subplots(1, 3)
    if (out / "cost.json").is_file():
        summary = json.loads((out / "cost.json").read_text())["summary"]
        for axis, key, label in (
            (axes[0], "seconds", "seconds (train step; per generated token)"),
            (axes[1], "peak_mem_mb", "peak resident MB"),
        ):
            for i, what in enumerate(("train", "generate")):
                for j, name in enumerate(MODELS):
                    value = summary[f"{name} {what}"][key]
                    axis.bar(i + 0.4 * j, value, 0.4, color=f"C{j}", label=name if i == 0 else None)
            axis.set_xticks([0.2, 1.2], ["training step", "generated token"])
            axis.set(ylabel=label, title=f"n={N}, m={M}, batch {BATCH}, 1 thread")
            axis.set_yscale("log")
            axis.legend()
    if (out / "task.json").is_file():
        for row in json.loads((out / "task.json").read_text())["rows"]:
            val = [r for r in row["records"] if r["split"] == "val"]
            axes[2].plot(
                [r["step"] for r in val], [r["val_loss"] for r in val], "o-", label=row["model"]
            )
        axes[2].set(xlabel="step", ylabel="validation loss", title="stdlib docstrings")
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(out / "seq2seq.png", dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["cost", "task", "plot", "_measure"], help="which part")
    parser.add_argument("args", nargs="*", help="_measure: model and measurement")
    parser.add_argument("--steps", type=int, default=600, help="task: training steps per model")
    parser.add_argument("--runs", default="runs/seq2seq-bench", help="task: run directories")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="the JSON and figure's folder"
    )
    args = parser.parse_args(argv)
    if args.what == "_measure":
        print(json.dumps(measure(*args.args)))
        return
    if args.what == "cost":
        cost(args.out)
    elif args.what == "task":
        task(args.steps, Path(args.runs), args.out)
    plot(args.out)


if __name__ == "__main__":
    main()
