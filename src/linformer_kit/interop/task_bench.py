"""Downstream accuracy of a converted model on a labelled long-document corpus: variants of one
pretrained Hugging Face model (exact truncated to its positions, Linformer at a longer length,
exact extended to it), each converted, fine-tuned with the same budget and scored on the test
file, beside a TF-IDF (1-2-grams) + logistic-regression baseline on the same split.

Each variant converts in one fresh process and fine-tunes in another, so its peak memory is
its own (the calibration of a data-driven projection init runs the exact model).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import multiprocessing
import re
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import hub
from ..config import PROJECTIONS, TRUNCATIONS, check_choice
from ..data.classification import load_classification, read_labelled
from ..data.tokenizer import load_tokenizer
from ..training.compare import machine
from ..training.evaluate import EvaluateSettings, evaluate_checkpoint
from ..training.finetune import (
    DEFAULT_TRUNCATION,
    PROJECTION_MODES,
    FinetuneSettings,
    finetune,
    finetune_train_settings,
)
from ..training.settings import markdown_table as table
from ..training.settings import save_json
from .convert import convert_to_dir
from .distill import DistillSettings
from .distill_run import DistillData, distill_checkpoint
from .report import minilm_path

logger = logging.getLogger(__name__)

_VARIANT = re.compile(r"(exact|k(\d+))@(\d+)(?::(\w+))?")


@dataclass(kw_only=True)
class TaskBenchSettings:
    """The corpus, the variants and the fine-tuning budget every variant gets."""

    train: str = field(default="", metadata={"help": "training JSONL or CSV", "required": True})
    val: str = field(default="", metadata={"help": "validation JSONL or CSV", "required": True})
    test: str = field(default="", metadata={"help": "test JSONL or CSV", "required": True})
    source: str = field(
        default="", metadata={"help": "Hugging Face model dir (default: all-MiniLM-L6-v2)"}
    )
    variants: str = field(
        default="exact@512,k256@2048,k128@2048,exact@2048",
        metadata={
            "help": "comma-separated exact@N or kK@N[:KIND] (N: max_seq_len, K: proj_dim, "
            "KIND: projection, default linear)"
        },
    )
    epochs: int = field(default=1, metadata={"help": "passes over the training set"})
    batch_size: int = field(default=8, metadata={"help": "sequences per micro-batch"})
    grad_accum_steps: int = field(
        default=1,
        metadata={"help": "micro-batches per step (a step sees batch_size x this sequences)"},
    )
    lr: float = field(default=0.0, metadata={"help": "peak learning rate (0 = finetune's)"})
    projections: str = field(
        default=FinetuneSettings.projections,  # finetune's default, defined once
        metadata={"help": "freeze or train the sequence projections (E, F)"},
    )
    truncation: str = field(
        default=DEFAULT_TRUNCATION,  # finetune's
        metadata={"help": "what a text longer than a variant's N keeps: head, tail or head+tail"},
    )
    calibration_texts: int = field(
        default=8, metadata={"help": "stdlib windows for the projection init"}
    )
    distill_steps: int = field(
        default=0,
        metadata={
            "help": "before fine-tuning, distil each Linformer variant this many steps (of 4 "
            "documents) against the exact model at its length, on the training texts "
            "(labels unused); 0 = no distillation"
        },
    )
    threads: int = field(default=0, metadata={"help": "CPU threads (0 = torch's default)"})
    seed: int = field(default=0, metadata={"help": "seed of conversion and fine-tuning"})
    work_dir: str = field(default="runs/bench_task", metadata={"help": "models and runs"})
    out: str = field(
        default="benchmarks/longdoc/report", metadata={"help": "writes OUT.json, .md, .png"}
    )

    def __post_init__(self) -> None:
        parse_variants(self.variants)
        for name in ("epochs", "batch_size", "grad_accum_steps", "calibration_texts"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        check_choice("projections", self.projections, PROJECTION_MODES)
        check_choice("truncation", self.truncation, TRUNCATIONS)
        if not isinstance(self.distill_steps, int) or self.distill_steps < 0:
            raise ValueError(f"distill_steps must be an integer >= 0, got {self.distill_steps!r}")


def parse_variants(spec: str) -> list[tuple[str, int | None, int, str]]:
    """`exact@512,k256@2048,k128@2048:adaptive` -> [(name, proj_dim or None, max_seq_len,
    projection kind), ...]; a Linformer variant without `:KIND` is `linear` (calibrated init).

    Raises:
        ValueError: naming the first malformed variant or unknown projection kind.
    """
    variants = []
    for name in (part.strip() for part in spec.split(",")):
        match = _VARIANT.fullmatch(name)
        if match is None or (match.group(1) == "exact" and match.group(4)):
            raise ValueError(
                f"variant {name!r} is not exact@N or kK@N[:KIND] "
                f"(e.g. exact@512, k256@2048, k128@2048:adaptive)"
            )
        projection = match.group(4) or "linear"
        check_choice("projection", projection, PROJECTIONS)
        proj_dim = int(match.group(2)) if match.group(2) else None
        variants.append((name, proj_dim, int(match.group(3)), projection))
    return variants


def _convert(
    source: str,
    out: Path,
    proj_dim: int | None,
    max_seq_len: int,
    projection: str,
    s: TaskBenchSettings,
) -> None:
    convert_to_dir(
        source,
        out,
        proj_dim=proj_dim,
        max_seq_len=max_seq_len,
        projection=projection,
        calibration_texts=s.calibration_texts,
        seed=s.seed,
    )


def _distill(source: str, model_dir: Path, s: TaskBenchSettings) -> dict[str, Any]:
    """Distils the converted Linformer in `model_dir` (saved back) on the training texts,
    scored on the validation texts; the cosine of the sentence embeddings to the exact
    model's before and after."""
    if s.threads:
        torch.set_num_threads(s.threads)
    train, val = read_labelled(s.train)[0], read_labelled(s.val)[0]
    history = distill_checkpoint(
        source,
        model_dir,
        DistillSettings(max_steps=s.distill_steps, seed=s.seed),
        DistillData(texts=len(train), heldout_texts=len(val)),
        documents=train,
        heldout_documents=val,
    )
    return {
        "distill_cosine_before": history[0]["cosine_mean"],
        "distill_cosine_after": history[-1]["cosine_mean"],
    }


def _finetune_and_test(model_dir: Path, run_dir: Path, s: TaskBenchSettings) -> dict[str, Any]:
    """Fine-tunes the converted model (finetune's defaults, the bench's budget), then scores
    its best checkpoint on the test file."""
    per_step = s.batch_size * s.grad_accum_steps
    steps = math.ceil(len(read_labelled(s.train)[0]) / per_step) * s.epochs
    overrides: dict[str, Any] = {"output_dir": str(run_dir), "batch_size": s.batch_size}
    overrides["grad_accum_steps"] = s.grad_accum_steps
    overrides["warmup_steps"] = max(1, steps // 10)  # 10% of the run, however short
    overrides |= {"threads": s.threads, "seed": s.seed} | ({"lr": s.lr} if s.lr else {})
    train = finetune_train_settings(**overrides)
    settings = FinetuneSettings(
        init=str(model_dir),
        data=s.train,
        eval=s.val,
        epochs=s.epochs,
        projections=s.projections,
        truncation=s.truncation,
    )
    result = finetune(settings, train)
    peak = result.peak_mem_mb  # training's peak, before the test pass
    test = evaluate_checkpoint(
        run_dir / "best",
        EvaluateSettings(data=[s.test], batch_size=s.batch_size, threads=s.threads),
    )[s.test]
    max_len = hub.read_config(model_dir)["config"].max_seq_len
    cut = load_classification(s.test, load_tokenizer(model_dir), max_seq_len=max_len).truncation()
    return {
        "test_acc": test["accuracy"],
        "test_f1": test["f1"],
        "val_acc": result.final.get("accuracy"),
        "steps": result.steps,
        "s_per_step": result.sec_per_step,
        "peak_mem_mb": peak,
        "train_s": max(r["train_s"] for r in result.records),
        "test_docs_cut": cut["cut"],
        "test_tokens_lost_mean": cut["tokens_lost_mean"],
    }


def _in_fresh_process(function: Any, *args: Any) -> Any:
    """`function(*args)` in a new process, logging at this process's level."""
    level = logging.getLogger().getEffectiveLevel()
    context = multiprocessing.get_context("spawn")
    setup = functools.partial(logging.basicConfig, level=level)
    with ProcessPoolExecutor(1, context, setup) as pool:
        return pool.submit(function, *args).result()


def tfidf_baseline(train: str, test: str) -> dict[str, Any]:
    """TF-IDF (1-2-grams, sublinear tf) + logistic regression (scikit-learn defaults) fitted
    on the `train` file, scored on the `test` file (labelled JSONL or CSV).

    Raises:
        ImportError: naming the package when scikit-learn is not installed.
    """
    try:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression
    except ImportError as err:
        raise ImportError(
            "the TF-IDF baseline needs scikit-learn: pip install 'linformer-kit[task]'"
        ) from err
    start = time.perf_counter()
    train_texts, train_labels, _ = read_labelled(train)
    test_texts, test_labels, _ = read_labelled(test)
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=2)
    classifier = LogisticRegression(max_iter=2000)
    classifier.fit(vectorizer.fit_transform(train_texts), [str(y) for y in train_labels])
    predicted = classifier.predict(vectorizer.transform(test_texts))
    correct = sum(p == str(y) for p, y in zip(predicted, test_labels))
    return {
        "variant": "tfidf",
        "model": "TF-IDF 1-2-grams + logistic regression",
        "test_acc": correct / len(test_labels),
        "train_s": time.perf_counter() - start,
    }


def _variant_row(
    name: str, proj_dim: int | None, max_seq_len: int, projection: str, s: TaskBenchSettings
) -> dict[str, Any]:
    """Converts and fine-tunes one variant, each in a fresh process; its report row."""
    source = s.source or str(minilm_path())
    folder = Path(s.work_dir) / name
    start = time.perf_counter()
    _in_fresh_process(_convert, source, folder / "model", proj_dim, max_seq_len, projection, s)
    convert_s = time.perf_counter() - start
    kind = "exact" if proj_dim is None else f"Linformer k={proj_dim}"
    if proj_dim is not None and projection != "linear":
        kind += f" {projection}"
    cut = f", {s.truncation} kept" if s.truncation != DEFAULT_TRUNCATION else ""
    distilled: dict[str, Any] = {}
    if proj_dim is not None and s.distill_steps:
        start = time.perf_counter()
        distilled = _in_fresh_process(_distill, source, folder / "model", s)
        distilled["distill_s"] = time.perf_counter() - start
        kind += " distilled"
    start = time.perf_counter()
    row = _in_fresh_process(_finetune_and_test, folder / "model", folder / "run", s)
    return {
        "variant": name,
        "model": f"{kind}, n={max_seq_len}{cut}",
        **row,
        **distilled,
        "convert_s": convert_s,
        "wall_s": time.perf_counter() - start,
        "load_avg_after": machine()["load_avg_1_5_15min"],  # other jobs skew the timings
    }


# Settings that do not change a variant's figures: what runs, and where files are written.
_NOT_COMPARED = ("variants", "work_dir", "out")
# Settings the bench gained after reports were committed, with the value those runs used.
_ADDED_LATER = {
    "grad_accum_steps": 1,
    "projections": "train",
    "distill_steps": 0,
    "truncation": "head",
}


def _earlier_rows(s: TaskBenchSettings) -> dict[str, dict[str, Any]]:
    """Rows of an earlier OUT.json with the same settings (bar `_NOT_COMPARED`), by variant.
    A setting the earlier report lacks (added to the bench since) counts as `_ADDED_LATER`
    says."""
    path = Path(s.out).with_suffix(".json")
    if not path.is_file():
        return {}
    earlier = json.loads(path.read_text())

    def compared(settings: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in (_ADDED_LATER | settings).items() if k not in _NOT_COMPARED}

    if compared(earlier["settings"]) != compared(dataclasses.asdict(s)):
        return {}
    return {row["variant"]: row for row in earlier["rows"]}


def run_task_bench(s: TaskBenchSettings) -> dict[str, Any]:
    """Runs every variant and the TF-IDF baseline; writes OUT.json, OUT.md and OUT.png after
    each. Variants already in an OUT.json of the same settings are kept, not run again (a run
    cut short, or a variant added later, continues).

    Returns:
        The report: settings, machine, one row per variant plus the baseline.
    """
    earlier = _earlier_rows(s)
    report: dict[str, Any] = {
        "settings": dataclasses.asdict(s),
        "machine": machine(),
        "rows": [tfidf_baseline(s.train, s.test)],
    }
    write_task_report(report, Path(s.out))
    for name, proj_dim, max_seq_len, projection in parse_variants(s.variants):
        if name in earlier:
            logger.info("%s: kept from the earlier %s.json", name, s.out)
            report["rows"].append(earlier[name])
            continue
        report["rows"].append(_variant_row(name, proj_dim, max_seq_len, projection, s))
        report["machine_after"] = machine()
        write_task_report(report, Path(s.out))
    write_task_report(report, Path(s.out))
    return report


COLUMNS = {
    "model": "model",
    "test_acc": "test accuracy",
    "s_per_step": "s / step",
    "peak_mem_mb": "peak memory (MB)",
    "train_s": "training (s)",
    "wall_s": "wall (s)",
    "test_docs_cut": "test docs cut",
}


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The report rows as a Markdown table (missing figures as a dash)."""
    return table(rows, COLUMNS, {"test_acc": 3, "s_per_step": 3})


def plot_task_report(report: dict[str, Any], path: Path) -> None:
    """Test accuracy, time per step and peak memory of every variant (baseline as a line)."""
    from matplotlib.figure import Figure  # pyplot-free: the user's backend stays as it is

    rows = [r for r in report["rows"] if r["variant"] != "tfidf"]
    baseline = next(r["test_acc"] for r in report["rows"] if r["variant"] == "tfidf")
    fig = Figure(figsize=(12, 4))
    axes = fig.subplots(1, 3)
    names = [r["variant"] for r in rows]
    for axis, key, label, fmt in zip(
        axes,
        ("test_acc", "s_per_step", "peak_mem_mb"),
        ("test accuracy", "seconds per step", "peak memory (MB)"),
        ("%.3f", "%.2f", "%.0f"),
    ):
        bars = axis.bar(names, [r[key] for r in rows], color="tab:blue")
        axis.bar_label(bars, fmt=fmt)  # near-equal bars differ in the figures, not the heights
        axis.margins(y=0.12)
        axis.set(ylabel=label)
        axis.grid(True, axis="y", alpha=0.3)
        axis.tick_params(axis="x", rotation=20)
    axes[0].axhline(
        baseline,
        color="tab:red",
        linestyle="--",
        label=f"TF-IDF + log. regression ({baseline:.3f})",
    )
    axes[0].legend(loc="lower right")
    fig.suptitle(f"Fine-tuned on {Path(report['settings']['train']).parent.name or 'the corpus'}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_task_report(report: dict[str, Any], out: Path) -> None:
    """OUT.json (everything), OUT.md (the table) and OUT.png (once a variant has run)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    save_json(report, out.with_suffix(".json"))
    out.with_suffix(".md").write_text(markdown_table(report["rows"]))
    if len(report["rows"]) > 1:
        plot_task_report(report, out.with_suffix(".png"))
