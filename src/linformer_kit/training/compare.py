"""The main job: pretrain Linformer and an exact-attention Transformer of identical size on
the same data, order, seed and step budget, as masked LMs and as causal LMs, then compare
validation perplexity, speed and memory (table, JSON and a plot)."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import platform
import shutil
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..causal_lm import LinformerForCausalLM
from ..checks import check_finite_non_negative, check_non_negative, check_positive
from ..config import LinformerConfig
from ..data.corpus import STDLIB
from ..data.pipeline import DataSettings, prepare_pretraining_data
from ..files import atomic_write, check_output_path, exclusive, replacing, save_figure, save_json
from ..masked_lm import LinformerForMaskedLM
from ..precision import cpu_features
from .batches import language_model_loss
from .loop import TrainResult
from .pretrain import pretrain
from .process import in_fresh_process
from .settings import OBJECTIVES, RunConfig, TrainSettings, use_threads

logger = logging.getLogger(__name__)

RESULT_NAME = "comparison.json"
VALIDATION_OVERHEAD = 1.1
PLOT_NAME = "comparison.png"
OBJECTIVE_NAMES = {"mlm": "masked LM", "clm": "causal LM"}
MODELS = ("linformer", "transformer")


@dataclass(kw_only=True)
class ComparisonSettings:
    """Settings of the Linformer-vs-Transformer pretraining comparison (`linformer demo`)."""

    output_dir: str = field(default="runs/demo", metadata={"help": "where every run is written"})
    publish_dir: str = field(
        default="", metadata={"help": "also copy the table and plot here (e.g. benchmarks/demo)"}
    )
    data: str = field(default=STDLIB, metadata={"help": "corpus: a path, or 'stdlib'"})
    glob: str = field(default="**/*.txt", metadata={"help": "files to read inside directories"})
    vocab_size: int = field(default=4096, metadata={"help": "byte-level BPE vocabulary"})
    seq_len: int = field(default=1024, metadata={"help": "tokens per sequence (max_seq_len)"})
    dim: int = field(default=128, metadata={"help": "model width"})
    depth: int = field(default=4, metadata={"help": "encoder layers"})
    num_heads: int = field(default=4, metadata={"help": "attention heads"})
    proj_dim: int = field(default=128, metadata={"help": "Linformer's k"})
    sharing: str = field(default="layerwise", metadata={"help": "none, headwise, kv, layerwise"})
    objectives: str = field(
        default="mlm,clm",
        metadata={"help": "model pairs to train: mlm (masked LM), clm (causal LM), or both"},
    )
    block_size: int = field(default=64, metadata={"help": "causal Linformer's block (clm)"})
    steps: int = field(default=500, metadata={"help": "optimiser steps per model"})
    batch_size: int = field(default=4, metadata={"help": "sequences per step"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    warmup_steps: int = field(default=50, metadata={"help": "warm-up steps"})
    eval_every: int = field(default=50, metadata={"help": "validate every N steps"})
    eval_batches: int = field(default=8, metadata={"help": "validation batches per evaluation"})
    seed: int = field(default=0, metadata={"help": "seed of weights, data order and masking"})
    budget_min: float = field(
        default=20.0,
        metadata={
            "help": "fewer steps where a probe says --steps would train longer than this "
            "many minutes (all models); 0: always --steps"
        },
    )
    threads: int = field(default=0, metadata={"help": "CPU threads (0 = torch's default)"})

    def __post_init__(self) -> None:
        chosen = self.objective_list
        if not chosen or any(o not in OBJECTIVES for o in chosen) or len(set(chosen)) < len(chosen):
            raise ValueError(
                "objectives must be a comma-separated list of distinct "
                f"{' and '.join(OBJECTIVES)}; got {self.objectives!r}"
            )
        # the rest is checked where it is used (these three were named as the run's
        # max_val_blocks and max_steps, with values the user never gave)
        for name in ("seq_len", "block_size", "steps", "batch_size"):
            check_positive(name, getattr(self, name))
        check_non_negative("eval_batches", self.eval_batches)
        if self.proj_dim > self.seq_len:  # (the config's error names its max_seq_len)
            raise ValueError(f"proj_dim ({self.proj_dim}) must be at most seq_len ({self.seq_len})")
        if "clm" in chosen and self.block_size >= self.seq_len:
            raise ValueError(
                f"block_size ({self.block_size}) must be below seq_len ({self.seq_len}): a "
                f"causal Linformer attends each block exactly, so at block_size >= seq_len "
                f"the causal pair would be exact attention twice"
            )
        check_finite_non_negative("budget_min", self.budget_min)

    @property
    def objective_list(self) -> list[str]:
        """The objectives of `objectives`, in order."""
        return [o.strip() for o in self.objectives.split(",") if o.strip()]

    def run_configs(self) -> dict[str, RunConfig]:
        """One run config per objective and model, named "mlm/linformer" and so on: the two
        models of a pair identical except for proj_dim (None = exact)."""
        model = LinformerConfig(
            max_seq_len=self.seq_len,
            dim=self.dim,
            depth=self.depth,
            num_heads=self.num_heads,
            proj_dim=self.proj_dim,
            sharing=self.sharing,
            dropout=0.0,
            attention_dropout=0.0,
            block_size=self.block_size,
        )
        data = DataSettings(
            data=[self.data],
            glob=self.glob,
            vocab_size=self.vocab_size,
            max_val_blocks=self.eval_batches * self.batch_size,
        )
        runs = {}
        pairs = [(o, m) for o in self.objective_list for m in MODELS]
        for objective, name in pairs:
            train = TrainSettings(
                output_dir=str(Path(self.output_dir) / objective / name),
                objective=objective,
                max_steps=self.steps,
                batch_size=self.batch_size,
                lr=self.lr,
                warmup_steps=self.warmup_steps,
                eval_every=self.eval_every,
                eval_batches=self.eval_batches,
                save_every=self.steps,
                log_every=10,
                seed=self.seed,
                keep_last=1,
                threads=self.threads,
            )
            proj_dim = self.proj_dim if name == "linformer" else None
            runs[f"{objective}/{name}"] = RunConfig(
                model=model.replace(proj_dim=proj_dim, causal=objective == "clm"),
                train=train,
                data=data,
            )
        return runs


def seconds_per_step(settings: ComparisonSettings) -> float:
    """Seconds one optimiser step of every model takes together on this machine, timed on
    random tokens (the best of two steps after a warm-up step) at the runs' `threads`: the
    probe that sizes the demo. It costs about three steps' time per model (a few seconds at
    the default sizes)."""
    threads = torch.get_num_threads()
    use_threads(settings.threads)  # each run's own (`--threads`): the probe ran at torch's
    try:
        return _probe_steps(settings)
    finally:
        torch.set_num_threads(threads)


def _probe_steps(settings: ComparisonSettings) -> float:
    total = 0.0
    ids = torch.randint(settings.vocab_size, (settings.batch_size, settings.seq_len))
    masked = torch.where(torch.rand(ids.shape) < 0.15, ids, -100)  # as masked-LM batches
    for run in settings.run_configs().values():
        torch.manual_seed(settings.seed)
        model_class = LinformerForCausalLM if run.model.causal else LinformerForMaskedLM
        model = model_class(run.model.replace(vocab_size=settings.vocab_size))
        labels = ids if run.model.causal else masked
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
        times = []
        for _ in range(3):
            begin = time.perf_counter()
            batch = {"input_ids": ids, "labels": labels}
            language_model_loss(model, batch, causal=run.model.causal).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - begin)
        total += min(times[1:])  # the first step is the warm-up
    return total


def fit_to_budget(settings: ComparisonSettings, step_s: float) -> ComparisonSettings:
    """The settings with fewer steps (warm-up and validation interval shrunk to match) where
    `steps` steps of `step_s` seconds, plus validation, would overrun `budget_min`.

    Args:
        settings: the requested comparison.
        step_s: seconds per step of all models together, from `seconds_per_step`.

    Returns:
        `settings` unchanged when it fits (or the budget is 0), else a shortened copy.
    """
    # Validation (eval_batches forward passes every eval_every steps) adds about 10%.
    cost = step_s * VALIDATION_OVERHEAD
    steps = max(1, int(settings.budget_min * 60 / cost))
    if not settings.budget_min or steps >= settings.steps:
        return settings
    logger.warning(
        "this machine takes %.2f s per training step of all %d models (probe), so %d steps "
        "would take about %.0f min, over the %g-min budget: running %d steps instead "
        "(--budget-min 0 runs all %d)",
        step_s,
        2 * len(settings.objective_list),
        settings.steps,
        settings.steps * cost / 60,
        settings.budget_min,
        steps,
        settings.steps,
    )
    return dataclasses.replace(
        settings,
        steps=steps,
        eval_every=min(settings.eval_every, steps),
        warmup_steps=min(settings.warmup_steps, steps // 10),
    )


def _row(name: str, run: RunConfig, result: TrainResult) -> dict[str, Any]:
    label = "Transformer (exact)" if run.model.is_exact else f"Linformer k={run.model.proj_dim}"
    if run.model.causal and not run.model.is_exact:
        label += f", block {run.model.block_size}"
    return {
        "objective": OBJECTIVE_NAMES[run.train.objective],
        "model": label,
        "params": result.params,
        "val_ppl": result.final["val_ppl"],
        "tokens_per_s": result.tokens_per_s,
        "sec_per_step": result.sec_per_step,
        "peak_rss_mb": result.peak_mem_mb,
        "train_s": max(r["train_s"] for r in result.records),
        "run": name,
    }


def plot_comparison(
    rows: list[dict[str, Any]], records: dict[str, list[dict[str, Any]]], path: Path
) -> None:
    """Validation perplexity vs step and vs training time, one line per model and one row of
    panels per objective."""
    from matplotlib.figure import Figure  # pyplot-free: the user's backend stays as it is

    objectives = list(dict.fromkeys(row["objective"] for row in rows))
    fig = Figure(figsize=(11, 4.2 * len(objectives)))
    axes = fig.subplots(len(objectives), 2, sharey="row", squeeze=False)
    for row in rows:
        panels = axes[objectives.index(row["objective"])]
        val = [r for r in records[row["run"]] if r["split"] == "val"]
        for axis, x in zip(panels, ("step", "train_s")):
            axis.plot(
                [r[x] for r in val], [r["val_ppl"] for r in val], marker="o", label=row["model"]
            )
    for objective, (by_step, by_time) in zip(objectives, axes):
        by_step.set(xlabel="optimiser step", ylabel=f"{objective}: validation perplexity")
        by_time.set(xlabel="training time (s)")
        for axis in (by_step, by_time):
            axis.set_yscale("log")
            axis.grid(True, which="both", alpha=0.3)
            axis.legend()
    fig.suptitle("Pretraining: Linformer vs exact attention, same data, steps and seed")
    fig.tight_layout()
    save_figure(fig, path)


def machine() -> dict[str, Any]:
    """What the numbers were measured on (with the load average: other jobs skew timings)."""
    return {
        "load_avg_1_5_15min": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_features(),
        "cpu_count": multiprocessing.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _demo_entries(output: Path) -> list[Path]:
    """A demo's comparison and runs in `output` (every objective's: a run left from another
    objective set would sit beside a comparison that does not describe it)."""
    entries = [output / name for name in (RESULT_NAME, PLOT_NAME)]
    return entries + [output / objective / model for objective in OBJECTIVES for model in MODELS]


def run_comparison(settings: ComparisonSettings) -> dict[str, Any]:
    """Prepares the corpus once, pretrains every model one after the other, writes
    comparison.json and comparison.png into `output_dir` (and `publish_dir` when set).

    A demo already in `output_dir` (its comparison and runs
    `{mlm,clm}/{linformer,transformer}`, whichever objectives it had) is replaced, as a
    WARNING says: moved aside until this one has written its comparison, and put back if
    it stops before (an error, Ctrl-C; a killed demo's on the next one's start).

    Raises:
        ValueError: if `output_dir` or `publish_dir` is a file (before any work).

    Returns:
        The comparison: settings, machine, one row per model, per objective the Linformer /
        Transformer perplexity ratio and speed-up, and every run's records.
    """
    check_output_path(settings.output_dir, directory=True, flag="--output-dir")
    if settings.publish_dir:
        check_output_path(settings.publish_dir, directory=True, flag="--publish-dir")
    with exclusive(Path(settings.output_dir), "demo"):  # a second demo: refused at once
        return _run_held(settings)


def _run_held(settings: ComparisonSettings) -> dict[str, Any]:
    """`run_comparison`'s work, its output folder held."""
    before = machine()
    before["threads"] = settings.threads or before["threads"]  # what each run is given
    requested = settings.steps
    # The tokenizer and token cache first: a missing corpus or a vocabulary too small is
    # named before the probe builds and steps every model (the probe's data are random).
    first = next(iter(settings.run_configs().values()))
    prepare_pretraining_data(first.data, first.model.max_seq_len)
    step_s = seconds_per_step(settings) if settings.budget_min else None
    if step_s is not None:
        logger.info("probe: %.2f s per training step of all models together", step_s)
        settings = fit_to_budget(settings, step_s)
    output = Path(settings.output_dir)
    with replacing(output, _demo_entries, "demo"):
        comparison = _compare(settings, before, step_s, requested)
    if settings.publish_dir:
        for name in (RESULT_NAME, PLOT_NAME):
            atomic_write(Path(settings.publish_dir) / name, partial(shutil.copy2, output / name))
    return comparison


def _compare(
    settings: ComparisonSettings, before: dict[str, Any], step_s: float | None, requested: int
) -> dict[str, Any]:
    """Trains every model and writes the comparison and its figure into the output."""
    runs = settings.run_configs()
    rows, records = [], {}
    for name, run in runs.items():
        result = in_fresh_process(pretrain, run)
        rows.append(_row(name, run, result))
        records[name] = result.records
    pairs = {}
    for objective in settings.objective_list:
        linformer, exact = (next(r for r in rows if r["run"] == f"{objective}/{m}") for m in MODELS)
        pairs[objective] = {
            "ppl_ratio": linformer["val_ppl"] / exact["val_ppl"],
            "speedup_per_step": exact["sec_per_step"] / linformer["sec_per_step"],
        }
    comparison = {
        "settings": dataclasses.asdict(settings),
        "machine": before,
        "probe": {"sec_per_step_both_models": step_s, "steps_requested": requested},
        "load_avg_after": machine()["load_avg_1_5_15min"],
        "rows": rows,
        "pairs": pairs,
        "records": records,
    }
    output = Path(settings.output_dir)
    save_json(comparison, output / RESULT_NAME)
    plot_comparison(rows, records, output / PLOT_NAME)
    return comparison
