"""Does `--compile` pay in training? `pretrain` of the demo's models (`linformer demo`'s
defaults: the standard library's source, BPE 4096, n 1024, dim 128, 4 layers, k 128
layerwise, batch 4, no dropout), eager and under each `--compile` setting, each run in a
fresh process, rounds alternating the settings. Per model and setting: the median step
(`TrainResult.sec_per_step`, the first tenth of the steps, compilation included, skipped),
tokens per second over the whole run and the final validation loss.

Writes OUT/result.json (default benchmarks/train_compile/) and prints the table.

    PYTHONPATH=src python benchmarks/train_compile.py --compile inductor --steps 40
    PYTHONPATH=src python benchmarks/train_compile.py --device cuda \
        --compile inductor,reduce-overhead
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
from pathlib import Path

from linformer_kit.files import save_json
from linformer_kit.training import pretrain
from linformer_kit.training.compare import ComparisonSettings, machine
from linformer_kit.training.process import in_fresh_process
from linformer_kit.training.settings import RunConfig, check_compile

OUT = Path(__file__).parent / "train_compile"
COMMAND = "PYTHONPATH=src python benchmarks/train_compile.py"
TINY = {"vocab_size": 300, "seq_len": 128, "dim": 32, "depth": 1, "proj_dim": 16}


def timed_run(run: RunConfig, setting: str, device: str, out_dir: Path) -> dict[str, float]:
    """One `pretrain` of `run` under a compile setting ("" eager), in a fresh process."""
    train = dataclasses.replace(
        run.train, output_dir=str(out_dir), compile=setting, device=device,
        eval_every=run.train.max_steps,
    )  # fmt: skip
    result = in_fresh_process(pretrain, dataclasses.replace(run, train=train))
    return {
        "sec_per_step": result.sec_per_step,
        "tokens_per_s": result.tokens_per_s,
        "val_loss": result.final.get("val_loss", float("nan")),
    }


def summarise(runs: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, dict]:
    """Per model and setting: the median step, its speed-up over eager, the final losses."""
    summary = {}
    for model, by_setting in runs.items():
        eager = statistics.median(r["sec_per_step"] for r in by_setting[""])
        for setting, records in by_setting.items():
            step = statistics.median(r["sec_per_step"] for r in records)
            summary[f"{model} [{setting or 'eager'}]"] = {
                "sec_per_step": step,
                "speedup_vs_eager": eager / step,
                "val_loss": [r["val_loss"] for r in records],
            }
    return summary


def main(argv: list[str] | None = None) -> None:
    """Times `pretrain` eager and under each --compile setting, in alternating processes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", default="inductor", help="comma-separated settings")
    parser.add_argument("--models", default="mlm/linformer,mlm/transformer", help="demo runs")
    parser.add_argument("--steps", type=int, default=40, help="optimiser steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per model and setting")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    parser.add_argument("--out", type=Path, default=OUT, help="writes result.json there")
    parser.add_argument(
        "--tiny", action="store_true", help="a 1-layer width-32 model on 20 documents (checks)"
    )
    args = parser.parse_args(argv)
    settings = ["", *(c for c in args.compile.split(",") if c)]
    for setting in settings[1:]:
        try:
            check_compile(setting, args.device)
        except ValueError as err:
            parser.error(f"--compile: {err}")
    size = TINY if args.tiny else {}
    configs = ComparisonSettings(steps=args.steps, threads=args.threads, **size).run_configs()
    if args.tiny:
        configs = {
            name: dataclasses.replace(run, data=dataclasses.replace(run.data, max_documents=20))
            for name, run in configs.items()
        }
    models = [m for m in args.models.split(",") if m]
    if set(models) - set(configs):
        parser.error(f"--models: {args.models!r}; choose from {', '.join(configs)}")
    runs = {m: {s: [] for s in settings} for m in models}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for model in models:
                for setting in settings if round_ % 2 == 0 else settings[::-1]:
                    name = f"{model} [{setting or 'eager'}]"
                    out_dir = Path(scratch) / f"{name}-{round_}".replace("/", "-")
                    record = timed_run(configs[model], setting, args.device, out_dir)
                    runs[model][setting].append(record)
                    print(f"{name} round {round_}: {record}")
    summary = summarise(runs)
    settings_json = vars(args) | {"out": str(args.out)}
    result = {"command": COMMAND, "settings": settings_json, "machine": machine()}
    save_json(result | {"summary": summary, "runs": runs}, args.out / "result.json")
    for name, row in summary.items():
        ms, speedup = row["sec_per_step"] * 1e3, row["speedup_vs_eager"]
        print(f"{name:40s} {ms:8.1f} ms a step  {speedup:.2f}x eager")
    print(f"wrote {args.out / 'result.json'}")


if __name__ == "__main__":
    main()
