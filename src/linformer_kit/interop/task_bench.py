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
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .. import hub
from ..config import (
    PROJECTIONS,
    TRUNCATIONS,
    check_choice,
    check_non_negative,
    check_positive,
    check_proj_dim,
)
from ..data.classification import load_classification, read_labelled
from ..data.tokenizer import load_tokenizer
from ..files import replacing
from ..training.compare import machine
from ..training.evaluate import EvaluateSettings, evaluate_checkpoint
from ..training.finetune import finetune
from ..training.finetune_settings import (
    DEFAULT_TRUNCATION,
    PROJECTION_MODES,
    FinetuneSettings,
    finetune_train_settings,
)
from ..training.process import in_fresh_process
from ..training.settings import check_lr
from .convert import convert_to_dir
from .distill import DistillSettings
from .distill_run import DistillData, distill_checkpoint
from .report import minilm_path
from .task_bench_report import TFIDF, earlier_rows, report_file, write_task_report

logger = logging.getLogger(__name__)

_VARIANT = re.compile(r"(exact|k(\d+))@(\d+)((?::\w+)*)")
AFTER = "after"  # the variant suffix: convert the fine-tuned exact@N, then fine-tune briefly


class Variant(NamedTuple):
    """One bench-task variant, parsed from its name (`parse_variants`)."""

    name: str
    proj_dim: int | None  # None: exact attention
    max_seq_len: int
    projection: str
    after: bool  # converted from this bench's fine-tuned exact@N instead of the source

    @property
    def exact(self) -> str:
        """The exact variant of the same length: what an :after variant converts."""
        return f"exact@{self.max_seq_len}"


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
            "help": "comma-separated exact@N or kK@N[:KIND][:after] (N: max_seq_len, K: "
            "proj_dim, KIND: projection, default linear; :after converts this bench's "
            "fine-tuned exact@N, head kept, then fine-tunes --after-epochs at --after-lr)"
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
    after_epochs: int = field(
        default=2, metadata={"help": "epochs of an :after variant (from the exact classifier)"}
    )
    after_lr: float = field(default=3e-5, metadata={"help": "peak learning rate of :after"})
    calibration_texts: int = field(
        default=8, metadata={"help": "stdlib windows for the projection init"}
    )
    distill_steps: int = field(
        default=0,
        metadata={
            "help": "before fine-tuning, distil each Linformer variant this many steps (of 4 "
            "documents) against the exact model at its length, on the training texts "
            "(labels unused); not :after ones, converted from the bench's own classifier, "
            "not from a Hugging Face teacher; 0 = no distillation"
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
        names = ("epochs", "batch_size", "grad_accum_steps", "after_epochs", "calibration_texts")
        for name in names:
            check_positive(name, getattr(self, name))
        check_non_negative("threads", self.threads)
        check_lr("lr", self.lr, zero="0 = finetune's")
        check_lr("after_lr", self.after_lr)
        check_choice("projections", self.projections, PROJECTION_MODES)
        check_choice("truncation", self.truncation, TRUNCATIONS)
        check_non_negative("distill_steps", self.distill_steps)


def _best_validation(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The validation record of the run's `best` checkpoint (the first lowest val_loss, as
    the Trainer keeps it), the one the test scores; {} when nothing was validated."""
    scored = [r for r in records if r["split"] == "val"]
    return min(scored, key=lambda r: r["val_loss"]) if scored else {}


def parse_variants(spec: str) -> list[Variant]:
    """`exact@512,k256@2048,k128@2048:adaptive,k512@2048:adaptive:after` -> Variants; a
    Linformer variant without `:KIND` is `linear` (calibrated init).

    Raises:
        ValueError: naming the first malformed variant, unknown projection kind, K
            outside [1, N] or (conv, pool) not dividing N, a variant named twice, or an
            :after variant listed before its exact@N.
    """
    variants: list[Variant] = []
    for name in (part.strip() for part in spec.split(",")):
        match = _VARIANT.fullmatch(name)
        suffixes = match.group(4).split(":")[1:] if match else []
        after = suffixes[-1:] == [AFTER]
        kinds = suffixes[:-1] if after else suffixes
        if match is None or len(kinds) > 1 or (match.group(1) == "exact" and suffixes):
            raise ValueError(
                f"variant {name!r} is not exact@N or kK@N[:KIND][:after] "
                f"(e.g. exact@512, k256@2048, k128@2048:adaptive, k512@2048:adaptive:after)"
            )
        projection = kinds[0] if kinds else "linear"
        check_choice("projection", projection, PROJECTIONS)
        proj_dim = int(match.group(2)) if match.group(2) else None
        max_seq_len = int(match.group(3))
        if max_seq_len < 1:
            raise ValueError(f"variant {name!r}: N must be >= 1")
        if proj_dim is not None:
            try:
                check_proj_dim(proj_dim, max_seq_len, projection)
            except ValueError as err:
                raise ValueError(
                    f"variant {name!r} (K = proj_dim, N = max_seq_len): {err}"
                ) from None
        variants.append(Variant(name, proj_dim, max_seq_len, projection, after))
    names = [v.name for v in variants]
    if len(set(names)) < len(names):  # trained once, reported twice
        raise ValueError(f"variants names one twice: {spec!r}")
    for i, v in enumerate(variants):
        if v.after and v.exact in names[i + 1 :]:
            raise ValueError(f"{v.name} converts the fine-tuned {v.exact}: list {v.exact} first")
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
    """
    for name in ("train", "val", "test"):
        if not Path(getattr(s, name)).is_file():
            raise FileNotFoundError(f"--{name} {getattr(s, name)!r}: no such file")
    variants = parse_variants(s.variants)
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
