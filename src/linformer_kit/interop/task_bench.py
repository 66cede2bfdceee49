"""Downstream accuracy of a converted model on a labelled long-document corpus: variants of one
pretrained Hugging Face model (exact truncated to its positions, Linformer at a longer length,
exact extended to it; or, `:after`, a Linformer converted from the bench's own fine-tuned
exact model), each converted, fine-tuned with the same budget and scored on the test file,
beside a TF-IDF (1-2-grams) + logistic-regression baseline on the same split.

Each variant converts in one fresh process and fine-tunes in another, so its peak memory is
its own (the calibration of a data-driven projection init runs the exact model).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from .. import hub
from ..data.classification import load_classification, read_labelled
from ..data.tokenizer import load_tokenizer
from ..files import check_replaceable, exclusive, replacing
from ..training.compare import machine
from ..training.evaluate import EvaluateSettings, evaluate_checkpoint
from ..training.finetune import finetune
from ..training.finetune_settings import (
    DEFAULT_TRUNCATION,
    FinetuneSettings,
    finetune_train_settings,
)
from ..training.process import in_fresh_process
from .convert import convert_to_dir
from .distill import DistillSettings
from .distill_run import DistillData, distill_checkpoint
from .report import minilm_path
from .task_bench_report import TFIDF, earlier_rows, report_file, write_task_report
from .task_bench_settings import TaskBenchSettings, Variant, parse_variants

logger = logging.getLogger(__name__)


def _best_validation(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The validation record of the run's `best` checkpoint (the first lowest val_loss, as
    the Trainer keeps it), the one the test scores; {} when nothing was validated."""
    scored = [r for r in records if r["split"] == "val"]
    return min(scored, key=lambda r: r["val_loss"]) if scored else {}


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


def _finetune_and_test(
    model_dir: Path, run_dir: Path, s: TaskBenchSettings, after: bool = False
) -> dict[str, Any]:
    """Fine-tunes the converted model (finetune's defaults, the bench's budget: its epochs,
    lr and a warm-up of 10% of the run; an :after variant: `after_epochs` at `after_lr` with
    finetune's warm-up), then scores its best checkpoint on the test file."""
    epochs = s.after_epochs if after else s.epochs
    overrides: dict[str, Any] = {"output_dir": str(run_dir), "batch_size": s.batch_size}
    overrides |= {"grad_accum_steps": s.grad_accum_steps, "threads": s.threads, "seed": s.seed}
    if after:
        overrides["lr"] = s.after_lr
    else:
        per_step = s.batch_size * s.grad_accum_steps
        steps = math.ceil(len(read_labelled(s.train)[0]) / per_step) * epochs
        overrides["warmup_steps"] = max(1, steps // 10)  # 10% of the run, however short
        overrides |= {"lr": s.lr} if s.lr else {}
    train = finetune_train_settings(**overrides)
    settings = FinetuneSettings(
        init=str(model_dir),
        data=s.train,
        eval=s.val,
        epochs=epochs,
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
        "val_acc": _best_validation(result.records).get("accuracy"),
        "steps": result.steps,
        "s_per_step": result.sec_per_step,
        "peak_mem_mb": peak,
        "train_s": max(r["train_s"] for r in result.records),
        "test_docs_cut": cut["cut"],
        "test_tokens_lost_mean": cut["tokens_lost_mean"],
    }


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
        "variant": TFIDF,
        "model": "TF-IDF 1-2-grams + logistic regression",
        "test_acc": correct / len(test_labels),
        "train_s": time.perf_counter() - start,
    }


def exact_checkpoint(v: Variant, s: TaskBenchSettings) -> Path:
    """The best checkpoint of this bench's exact@N run, which an :after variant converts.

    Raises:
        FileNotFoundError: if that run is not in the work directory.
    """
    path = Path(s.work_dir) / v.exact / "run" / "best"
    if not path.is_dir():
        raise FileNotFoundError(
            f"{v.name} converts the fine-tuned {v.exact}, and {path} is missing: put "
            f"{v.exact} before it in --variants (the same --work-dir keeps it for later runs)"
        )
    return path


def _variant_row(v: Variant, s: TaskBenchSettings) -> dict[str, Any]:
    """Converts and fine-tunes one variant, each in a fresh process, in WORK_DIR/NAME (what
    an earlier run left there is set aside until this one ends, `files.replacing`); its
    report row."""
    with replacing(Path(s.work_dir), lambda root: [root / v.name], f"run of {v.name}"):
        return _variant_run(v, s)


def _variant_run(v: Variant, s: TaskBenchSettings) -> dict[str, Any]:
    """`_variant_row`'s work, the earlier run of the variant set aside."""
    source = str(exact_checkpoint(v, s)) if v.after else s.source or str(minilm_path())
    folder = Path(s.work_dir) / v.name
    start = time.perf_counter()
    args = (v.proj_dim, v.max_seq_len, v.projection, s)
    in_fresh_process(_convert, source, folder / "model", *args)
    convert_s = time.perf_counter() - start
    kind = "exact" if v.proj_dim is None else f"Linformer k={v.proj_dim}"
    if v.proj_dim is not None and v.projection != "linear":
        kind += f" {v.projection}"
    if v.after:
        kind += f" from fine-tuned {v.exact}"
    cut = f", {s.truncation} kept" if s.truncation != DEFAULT_TRUNCATION else ""
    distilled: dict[str, Any] = {}
    if v.after and s.distill_steps:
        logger.info("%s: not distilled (converted from a fine-tuned classifier)", v.name)
    if v.proj_dim is not None and s.distill_steps and not v.after:
        start = time.perf_counter()
        distilled = in_fresh_process(_distill, source, folder / "model", s)
        distilled["distill_s"] = time.perf_counter() - start
        kind += " distilled"
    start = time.perf_counter()
    row = in_fresh_process(_finetune_and_test, folder / "model", folder / "run", s, v.after)
    return {
        "variant": v.name,
        "model": f"{kind}, n={v.max_seq_len}{cut}",
        **row,
        **distilled,
        **({"converted_from": source} if v.after else {}),
        "convert_s": convert_s,
        "wall_s": time.perf_counter() - start,
        "load_avg_after": machine()["load_avg_1_5_15min"],  # other jobs skew the timings
    }


def run_task_bench(s: TaskBenchSettings) -> dict[str, Any]:
    """Runs every variant and the TF-IDF baseline; writes OUT.json, OUT.md and OUT.png after
    each. Variants already in an OUT.json of the same settings are kept, not run again (a run
    cut short, or a variant added later, continues), except an `:after` variant whose
    exact@N runs again: it converts the new checkpoint.

    Returns:
        The report: settings, machine, one row per variant plus the baseline.

    Raises:
        FileNotFoundError: naming the flag of a data file that is not there (before the
            baseline and the first conversion, not after them).
        ValueError: when another bench-task holds the work folder (`files.exclusive`: it
            set this one's runs aside as a killed run's, then put them back over them).
    """
    for name in ("train", "val", "test"):
        if not Path(getattr(s, name)).is_file():
            raise FileNotFoundError(f"--{name} {getattr(s, name)!r}: no such file")
    variants = parse_variants(s.variants)
    check_replaceable(report_file(s.out, ".json"), "json")  # a user's files there were replaced
    check_replaceable(report_file(s.out, ".png"), "png")
    check_replaceable(report_file(s.out, ".md"), "text", begins="| model |")  # the table's
    with exclusive(Path(s.work_dir), "bench-task"):
        return _run_held(s, variants)


def _run_held(s: TaskBenchSettings, variants: list[Variant]) -> dict[str, Any]:
    """`run_task_bench`'s work, its work folder held."""
    earlier = earlier_rows(dataclasses.asdict(s))
    runs = {v.name for v in variants if v.name not in earlier}
    runs |= {v.name for v in variants if v.after and v.exact in runs}
    done = {v.name: earlier[v.name] for v in variants if v.name not in runs}
    # an earlier run's other variants stay in the report: variants are added one run at a time
    named = {v.name for v in variants} | {TFIDF}
    others = [row for name, row in earlier.items() if name not in named]
    report: dict[str, Any] = {"settings": dataclasses.asdict(s), "machine": machine()}
    tfidf = tfidf_baseline(s.train, s.test)

    def write() -> None:
        # Every row so far, kept ones included: a run killed in the next variant loses none.
        rows = [done[v.name] for v in variants if v.name in done]
        report["rows"] = [tfidf, *rows, *others]
        write_task_report(report, Path(s.out))

    for name in done:
        logger.info("%s: kept from the earlier %s.json", name, s.out)
    for row in others:
        logger.info("%s: kept from the earlier %s.json (not in --variants)", row["variant"], s.out)
    if earlier or not report_file(s.out, ".json").exists():  # not another settings' report
        write()  # until a variant has run: a stop in the first lost that report's rows
    for variant in variants:
        if variant.name in runs:
            done[variant.name] = _variant_row(variant, s)
            report["machine_after"] = machine()
            write()
    return report
