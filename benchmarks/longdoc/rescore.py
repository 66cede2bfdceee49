"""Scores fine-tuned classifiers (bench-task's `WORK_DIR/VARIANT/run/best`, or any `finetune`
checkpoint) on another labelled file, beside TF-IDF + logistic regression fitted on their
training file: a larger test set than the one a bench-task run was scored on, for a
smaller standard error.

    python benchmarks/longdoc/rescore.py --train data/longdoc/pang_lee/train_500.jsonl \
        --test data/longdoc/pang_lee/heldout_900.jsonl \
        --runs exact@2048=runs/bench_task/exact@2048/run/best ... \
        --out benchmarks/longdoc/pang_lee_500_3ep_heldout_900

Writes OUT.json, OUT.md and OUT.png: accuracy and F1 of each run, with the binomial
standard error (the plot's bars: accuracy with 95% intervals, TF-IDF as a dashed line).
`--with EARLIER.json ...` adds the runs of earlier reports on the same test file, unscored
again (with no --runs: one table and plot of several reports).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from linformer_kit.data.classification import read_labelled
from linformer_kit.interop.task_bench import tfidf_baseline
from linformer_kit.training.compare import machine
from linformer_kit.training.evaluate import EvaluateSettings, evaluate_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", required=True, help="the runs' training file (for TF-IDF)")
    parser.add_argument("--test", required=True, help="labelled JSONL or CSV to score on")
    parser.add_argument("--runs", nargs="+", default=[], help="NAME=CHECKPOINT_DIR ...")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--with",
        dest="earlier",
        nargs="+",
        type=Path,
        default=[],
        help="earlier OUT.json files on the same --test: their runs join the table and plot",
    )
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    if not args.runs and not args.earlier:
        parser.error("nothing to report: give --runs, --with or both")
    runs = dict(run.split("=", 1) for run in args.runs)
    tfidf = tfidf_baseline(args.train, args.test)
    rows = [{"run": "TF-IDF 1-2-grams + logistic regression", "accuracy": tfidf["test_acc"]}]
    rows += earlier_rows(args.earlier, args.test)
    for name, checkpoint in runs.items():
        settings = EvaluateSettings(
            data=[args.test], batch_size=args.batch_size, threads=args.threads
        )
        metrics = evaluate_checkpoint(checkpoint, settings)[args.test]
        rows.append({"run": name, "checkpoint": checkpoint, **metrics})
        print(json.dumps(rows[-1]))
    count = len(read_labelled(args.test)[0])
    for row in rows:
        row["standard_error"] = math.sqrt(row["accuracy"] * (1 - row["accuracy"]) / count)
    report = {"train": args.train, "test": args.test, "examples": count, "rows": rows}
    report["machine"] = machine()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"| run | accuracy ({count} examples) | F1 | standard error |", "|---|---:|---:|---:|"]
    for row in rows:
        f1 = f"{row['f1']:.3f}" if "f1" in row else "-"
        lines.append(
            f"| {row['run']} | {row['accuracy']:.3f} | {f1} | {row['standard_error']:.3f} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot_report(report, args.out.with_suffix(".png"))
    print("\n".join(lines))


def earlier_rows(reports: list[Path], test: str) -> list[dict[str, Any]]:
    """The model rows (not TF-IDF) of earlier reports, each marked with the file it came from.

    Raises:
        SystemExit: if a report scored another test file (its figures would not compare).
    """
    rows = []
    for path in reports:
        report = json.loads(path.read_text())
        if report["test"] != test:
            raise SystemExit(f"--with {path} scored {report['test']}, not {test}")
        rows += [{**row, "from": str(path)} for row in report["rows"][1:]]
    return rows


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Horizontal bars of each run's accuracy with its 95% interval (1.96 standard errors),
    the TF-IDF baseline (the first row) as a dashed line."""
    baseline, *runs = report["rows"]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(runs) + 1.4))
    names = [row["run"] for row in runs][::-1]
    accuracy = [row["accuracy"] for row in runs][::-1]
    error = [1.96 * row["standard_error"] for row in runs][::-1]
    ax.barh(names, accuracy, xerr=error, color="tab:blue", alpha=0.8, capsize=3)
    ax.axvline(baseline["accuracy"], color="tab:red", linestyle="--", label=baseline["run"])
    low = min(accuracy + [baseline["accuracy"]]) - 0.1
    ax.set_xlim(max(0.0, low), 1.0)
    ax.set_xlabel(f"accuracy on {Path(report['test']).name} ({report['examples']} examples)")
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
