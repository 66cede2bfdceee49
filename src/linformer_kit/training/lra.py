"""Long Range Arena (Tay et al. 2020): train Linformer and the exact Transformer (the same model
with `proj_dim=None`) on one task with LRA's published settings scaled by one knob, then report
test accuracy, time per step and peak memory beside the published numbers (JSON, PNG)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import PROJECTIONS, SHARINGS, LinformerConfig, check_choice
from ..data.lra import TASKS, LRASplit, LRATask, load_listops, load_pathfinder, load_text
from ..models import LinformerForSequenceClassification
from .batches import ClassificationBatches, ClassificationEvaluator, RowSchedule
from .compare import machine
from .distributed import setup_distributed, teardown_distributed
from .loop import Trainer
from .lra_report import model_label, plot_lra, write_summary
from .process import in_fresh_process
from .settings import TrainSettings, check_threads, save_json

logger = logging.getLogger(__name__)

MODELS = ("linformer", "transformer")
SETTINGS_NAME = "settings.json"  # OUT/TASK/: the settings the run started with
# What a --resume may change: where and how the run goes on, not what it trains.
RESUME_MAY_CHANGE = ("resume", "threads", "device", "isolate", "output_dir", "cache_dir")


@dataclass(frozen=True)
class Recipe:
    """A task's model and optimisation settings, and LRA's published accuracies (%)."""

    dim: int
    num_heads: int
    depth: int
    ffn_dim: int
    batch_size: int
    steps: int
    warmup_steps: int
    lr: float
    weight_decay: float
    dropout: float
    schedule: str
    pooling: str
    published: dict[str, float]

    def scaled(self, scale: float) -> Recipe:
        """Width (model and feed-forward) and steps times `scale`; depth and batch kept. The
        head size is kept too (fewer heads): attention's cost grows with the number of heads,
        not their size, and at width 64 LRA's 8 heads of 8 made a CPU step 4x slower (2.9 vs
        11.6 s, ListOps n = 1000, batch 32) for heads too narrow to score much."""
        heads = max(1, round(self.num_heads * scale))
        return dataclasses.replace(
            self,
            dim=heads * max(1, round(self.dim * scale / heads)),
            num_heads=heads,
            ffn_dim=max(1, round(self.ffn_dim * scale)),
            steps=max(1, round(self.steps * scale)),
            warmup_steps=round(self.warmup_steps * scale),
        )


# LRA's configs (github.com/google-research/long-range-arena, lra_benchmarks/*/configs). Their
# ListOps and text runs use lr 0.05 under "constant * linear_warmup * rsqrt_decay", whose peak
# is 0.05 / sqrt(warmup): that peak is the AdamW learning rate here. Pooling as theirs: the first
# position for ListOps and text ("CLS"; ListOps' first token is the outermost operator), the
# mean for Pathfinder. Published accuracies: their Table 1 (Linformer vs Transformer).
RECIPES = {
    "listops": Recipe(
        dim=512, num_heads=8, depth=6, ffn_dim=2048, batch_size=32, steps=5000,
        warmup_steps=1000, lr=0.05 / math.sqrt(1000), weight_decay=0.1, dropout=0.1,
        schedule="linear", pooling="cls", published={"linformer": 35.70, "transformer": 36.37},
    ),
    "text": Recipe(
        dim=256, num_heads=4, depth=4, ffn_dim=1024, batch_size=32, steps=20000,
        warmup_steps=8000, lr=0.05 / math.sqrt(8000), weight_decay=0.1, dropout=0.1,
        schedule="linear", pooling="cls", published={"linformer": 53.94, "transformer": 64.27},
    ),
    # Pathfinder-32: 200 epochs of 160K images at batch 512, one warm-up epoch, cosine decay.
    "pathfinder": Recipe(
        dim=128, num_heads=4, depth=1, ffn_dim=128, batch_size=512, steps=62400,
        warmup_steps=312, lr=1e-3, weight_decay=0.0, dropout=0.2,
        schedule="cosine", pooling="mean", published={"linformer": 76.34, "transformer": 71.40},
    ),
}  # fmt: skip


@dataclass(kw_only=True)
class LRASettings:
    """How to run one Long Range Arena task (`linformer lra TASK`)."""

    output_dir: str = field(default="runs/lra", metadata={"help": "where runs and reports go"})
    scale: float = field(
        default=1.0, metadata={"help": "multiplies LRA's model width and steps (0, 1]"}
    )
    steps: int = field(default=0, metadata={"help": "optimiser steps (0 = LRA's x scale)"})
    warmup_steps: int = field(
        default=-1, metadata={"help": "learning-rate warm-up (-1 = LRA's share of the steps)"}
    )
    batch_size: int = field(default=0, metadata={"help": "sequences per step (0 = LRA's)"})
    lr: float = field(default=0.0, metadata={"help": "peak learning rate (0 = LRA's)"})
    proj_dim: int = field(default=256, metadata={"help": "Linformer's k (at most the length)"})
    sharing: str = field(default="layerwise", metadata={"help": "none, headwise, kv, layerwise"})
    projection: str = field(
        default="linear",
        metadata={
            "help": "Linformer's sequence projection: linear (the paper's), conv, pool, "
            "random or adaptive"
        },
    )
    num_train: int = field(default=0, metadata={"help": "training examples (0 = LRA's)"})
    num_eval: int = field(
        default=0, metadata={"help": "validation and test examples each (0 = LRA's)"}
    )
    min_length: int = field(default=500, metadata={"help": "listops: shortest expression"})
    max_length: int = field(
        default=0, metadata={"help": "listops: longest expression; text: bytes (0 = LRA's)"}
    )
    max_depth: int = field(default=10, metadata={"help": "listops: operator nesting"})
    contour_length: int = field(default=14, metadata={"help": "pathfinder: dashes (hard: 14)"})
    data: str = field(default="", metadata={"help": "text: class folders or a label,text CSV"})
    data_where: str = field(
        default="",
        metadata={"help": "text: COLUMN=VALUE keeps only those rows of a CSV with a header"},
    )
    eval_every: int = field(default=0, metadata={"help": "validate every N steps (0 = 10 per run)"})
    seed: int = field(default=0, metadata={"help": "seed of the data, weights and order"})
    threads: int = field(default=0, metadata={"help": "CPU threads (0 = torch's default)"})
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    isolate: bool = field(
        default=True, metadata={"help": "train each model in a fresh process (own peak memory)"}
    )
    cache_dir: str = field(default="", metadata={"help": "data cache (empty: the default)"})
    resume: bool = field(
        default=False,
        metadata={
            "help": "continue each model's run in output_dir from its last checkpoint (saved "
            "at every validation); a finished one is only tested again"
        },
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.scale <= 1.0:
            raise ValueError(f"scale must be in (0, 1], got {self.scale!r}")
        for name in ("steps", "batch_size", "num_train", "num_eval", "max_length", "eval_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < -1:
            raise ValueError(
                f"warmup_steps must be an integer >= 0, or -1 for LRA's share of the steps; "
                f"got {self.warmup_steps!r}"
            )
        if self.lr < 0:
            raise ValueError(f"lr must be >= 0 (0 = LRA's), got {self.lr!r}")
        if not isinstance(self.proj_dim, int) or self.proj_dim < 1:
            raise ValueError(f"proj_dim must be an integer >= 1, got {self.proj_dim!r}")
        check_choice("sharing", self.sharing, SHARINGS)  # here, not after the data is made
        check_choice("projection", self.projection, PROJECTIONS)
        check_threads(self.threads)

    def recipe(self, task: str) -> Recipe:
        """The task's recipe, scaled, with this run's overrides. Fewer or more `steps` keep
        LRA's warm-up share of them (text: 8K of 20K), so the peak learning rate is reached."""
        recipe = RECIPES[check_task(task)].scaled(self.scale)
        steps = self.steps or recipe.steps
        warmup = round(recipe.warmup_steps * steps / recipe.steps)
        return dataclasses.replace(
            recipe,
            steps=steps,
            warmup_steps=warmup if self.warmup_steps < 0 else self.warmup_steps,
            batch_size=self.batch_size or recipe.batch_size,
            lr=self.lr or recipe.lr,
        )


def check_task(task: str) -> str:
    """Returns `task`, or raises a ValueError naming the known tasks."""
    if task not in TASKS:
        raise ValueError(f"unknown LRA task {task!r}; known: {', '.join(TASKS)}")
    return task


def _cap(split: LRASplit, num: int) -> LRASplit:
    if not num or num >= len(split):
        return split
    return LRASplit(split.inputs[:num], split.lengths[:num], split.labels[:num], split.source)


def load_task(task: str, settings: LRASettings) -> LRATask:
    """The task's data (generated or read once, then from the cache), sized by `settings`.

    Raises:
        ValueError: for an unknown task, text without --data, or a knob out of range.
    """
    cache = settings.cache_dir or None
    sizes = {}
    if settings.num_train:
        sizes["num_train"] = settings.num_train
    if settings.num_eval:
        sizes |= {"num_val": settings.num_eval, "num_test": settings.num_eval}
    if check_task(task) == "listops":
        return load_listops(
            **sizes,
            min_length=settings.min_length,
            max_length=settings.max_length or 2000,
            max_depth=settings.max_depth,
            seed=settings.seed,
            cache_dir=cache,
        )
    if task == "pathfinder":
        return load_pathfinder(
            **sizes, contour_length=settings.contour_length, seed=settings.seed, cache_dir=cache
        )
    if not settings.data:
        raise ValueError("lra text needs --data: a folder of class folders or a label,text CSV")
    data = load_text(
        settings.data,
        max_length=settings.max_length or 4000,
        where=settings.data_where,
        seed=settings.seed,
        cache_dir=cache,
    )
    return dataclasses.replace(
        data,
        train=_cap(data.train, settings.num_train),
        val=_cap(data.val, settings.num_eval),
        test=_cap(data.test, settings.num_eval),
    )


def train_model(task: str, settings: LRASettings, name: str) -> dict[str, Any]:
    """Trains one model (`linformer` or `transformer`) on the task and scores it on the test set.

    Returns:
        The report row (accuracies in %, time per step, peak memory) and the run's records.
    """
    data = load_task(task, settings)
    recipe = settings.recipe(task)
    config = LinformerConfig(
        vocab_size=data.vocab_size,
        max_seq_len=data.max_seq_len,
        dim=recipe.dim,
        depth=recipe.depth,
        num_heads=recipe.num_heads,
        ffn_dim=recipe.ffn_dim,
        proj_dim=None if name == "transformer" else min(settings.proj_dim, data.max_seq_len),
        sharing=settings.sharing,
        projection=settings.projection,
        dropout=recipe.dropout,
        attention_dropout=recipe.dropout,
        pad_token_id=data.pad_id,
    )
    eval_every = settings.eval_every or max(1, recipe.steps // 10)
    train = TrainSettings(
        output_dir=str(Path(settings.output_dir) / task / name),
        max_steps=recipe.steps,
        batch_size=recipe.batch_size,
        lr=recipe.lr,
        weight_decay=recipe.weight_decay,
        warmup_steps=recipe.warmup_steps,
        schedule=recipe.schedule,
        eval_every=eval_every,
        save_every=eval_every,  # what --resume continues from
        log_every=max(1, min(10, recipe.steps)),
        keep_last=1,
        seed=settings.seed,
        device=settings.device,
        threads=settings.threads,
        resume=settings.resume,
    )
    dist = setup_distributed(train.device)
    try:
        torch.manual_seed(settings.seed)  # both models start from the same seed
        model = LinformerForSequenceClassification(config, data.num_labels, pooling=recipe.pooling)
        schedule = RowSchedule(len(data.train), recipe.batch_size, 1, 1, settings.seed)
        evaluate = {
            split: ClassificationEvaluator(
                getattr(data, split), data.pad_id, recipe.batch_size, data.num_labels
            )
            for split in ("val", "test")
        }
        result = Trainer(
            model=model,
            batches=ClassificationBatches(data.train, data.pad_id, schedule),
            evaluator=evaluate["val"],
            settings=train,
            dist=dist,
        ).fit()
        model.eval()
        test = evaluate["test"](model, dist.device)
    finally:
        teardown_distributed()
    return {
        "model": model_label(name, config.proj_dim, settings.projection),
        "test_acc": 100 * float(test["accuracy"]),
        "published": recipe.published[name],
        "val_acc": 100 * float(result.final.get("accuracy", math.nan)),
        "s_per_step": result.sec_per_step,
        "peak_mem_mb": result.peak_mem_mb,
        "params": result.params,
        "steps": result.steps,
        "records": result.records,
    }


def _train_in_fresh_process(task: str, settings: LRASettings, name: str) -> dict[str, Any]:
    """`train_model` in a new process, so each model's peak memory is its own.

    Raises:
        RuntimeError: if that process dies without a result (killed, mostly out of memory).
    """
    try:
        return in_fresh_process(train_model, task, settings, name)
    except BrokenProcessPool as err:
        raise RuntimeError(
            f"the {name} run on {task} died without a result (killed; most likely out of "
            f"memory: exact attention grows as n^2); lower --batch-size or --max-length"
        ) from err


def _failed_row(
    name: str, recipe: Recipe, proj_dim: int, projection: str, error: str
) -> dict[str, Any]:
    """The report row of a model whose run died: no figures, the reason."""
    nan = math.nan
    return {
        "model": model_label(name, proj_dim, projection),
        "test_acc": nan,
        "published": recipe.published[name],
        "val_acc": nan,
        "s_per_step": nan,
        "peak_mem_mb": nan,
        "params": 0,
        "steps": 0,
        "records": [],
        "error": error,
    }


def check_resumable(run_dir: Path, settings: LRASettings) -> None:
    """Checks that `settings` continue the run in `run_dir` as it started (its
    `settings.json`), but for RESUME_MAY_CHANGE; a run without that file passes.

    Raises:
        ValueError: naming each setting that differs, with the run's value.
    """
    path = run_dir / SETTINGS_NAME
    if not path.is_file():
        return
    started = json.loads(path.read_text())
    now = dataclasses.asdict(settings)
    changed = [
        f"{name} {value!r} (the run's: {started[name]!r})"
        for name, value in now.items()
        if name not in RESUME_MAY_CHANGE and name in started and started[name] != value
    ]
    if changed:
        raise ValueError(
            f"--resume continues the run in {run_dir} with the settings it started with; "
            f"these differ: {', '.join(changed)}. Give the run's values, or start over "
            f"without --resume"
        )


def run_lra(task: str, settings: LRASettings) -> dict[str, Any]:
    """Prepares the task's data once, trains both models one after the other and writes
    `<output_dir>/<task>.json` and `<task>.png`, then `summary.md` over every task reported in
    `output_dir`. Earlier runs of the task are replaced, or with `settings.resume` continued
    from their last checkpoints (a model's time per step is then that of this call's steps,
    or the whole run's mean when none was left).

    Args:
        task: listops, text or pathfinder.
        settings: the run.

    Returns:
        The report: task, settings, scaled recipe, data, machine, majority and best-constant
        baselines (fractions), one row per model (accuracies in %) with its records.

    Raises:
        ValueError: for an unknown task or bad settings, or settings a resumed run did not
            start with.
    """
    run_dir = Path(settings.output_dir) / task
    if settings.resume:
        check_resumable(run_dir, settings)
    data = load_task(task, settings)  # generated here once; the runs read the cache
    if not settings.resume:
        for name in MODELS:
            shutil.rmtree(run_dir / name, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_json(dataclasses.asdict(settings), run_dir / SETTINGS_NAME)
    before = machine()
    rows = []
    for name in MODELS:
        if not settings.isolate:
            rows.append(train_model(task, settings, name))
            continue
        try:
            rows.append(_train_in_fresh_process(task, settings, name))
        except RuntimeError as err:  # a model that runs out of memory is a finding, not a crash
            logger.error("%s", err)
            proj_dim = min(settings.proj_dim, data.max_seq_len)
            recipe = settings.recipe(task)
            rows.append(_failed_row(name, recipe, proj_dim, settings.projection, str(err)))
    report = {
        "task": task,
        "settings": dataclasses.asdict(settings),
        "recipe": dataclasses.asdict(settings.recipe(task)),
        "data": {
            **data.params,
            "max_seq_len": data.max_seq_len,
            "sizes": [len(data.train), len(data.val), len(data.test)],
        },
        "machine": before,
        "load_avg_after": machine()["load_avg_1_5_15min"],  # other jobs skew the timings
        "majority_baseline": data.majority_baseline(),
        "best_constant_baseline": data.best_constant_baseline(),
        "rows": rows,
    }
    output = Path(settings.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    save_json(report, output / f"{task}.json")
    plot_lra(report, output / f"{task}.png")
    write_summary(output)
    return report
