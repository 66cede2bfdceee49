"""Long Range Arena (Tay et al. 2020): train Linformer and the exact Transformer (the same model
with `proj_dim=None`) on one task with LRA's published settings scaled by one knob, then report
test accuracy, time per step and peak memory beside the published numbers (JSON, PNG)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import torch

from ..config import LinformerConfig
from ..data.lra import LRASplit, LRATask, load_listops, load_pathfinder, load_text
from ..embeddings import init_weights
from ..files import check_output_path, check_replaceable, exclusive, save_json
from ..models import LinformerForSequenceClassification
from .batches import ClassificationBatches, ClassificationEvaluator, RowSchedule
from .checkpoint import check_run_dir
from .compare import machine
from .distributed import distributed_job, job_size
from .loop import Trainer
from .lra_report import SUMMARY_TITLE, model_label, plot_lra, write_summary
from .lra_settings import LRASettings, Recipe, check_task, check_task_flags
from .process import in_fresh_process
from .settings import TrainSettings

logger = logging.getLogger(__name__)

# in each model's run, OUT/TASK/MODEL/ (a run of one model leaves the other's as it was):
SETTINGS_NAME = "settings.json"  # the settings the run started with
DATA_NAME = "data.json"  # the parameters of the data it started with
# What a --resume may change: where and how the run goes on, not what it trains.
RESUME_MAY_CHANGE = ("resume", "threads", "device", "isolate", "output_dir", "cache_dir", "models")


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
        try:
            return load_listops(
                **sizes,
                min_length=settings.min_length,
                max_length=settings.max_length or 2000,
                max_depth=settings.max_depth,
                seed=settings.seed,
                cache_dir=cache,
            )
        except ValueError as err:  # a length that does not fit: say where 2000 came from
            if settings.max_length or "max_length" not in str(err):
                raise
            raise ValueError(f"{err} (LRA's, --max-length left at 0; give one)") from None
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


def init_like_lra(model: LinformerForSequenceClassification) -> None:
    """Re-initialises a freshly built model the way LRA's models start, in place.

    LRA's Flax models (lra_benchmarks/models/layers/common_layers.py, transformer.py) draw
    the token embeddings from N(0, 1), the attention and feed-forward kernels Xavier-uniform
    (biases about 0) and the classifier head's kernels LeCun-normal (std 1 / sqrt(fan_in));
    position embeddings, LayerNorms and Linformer's projections keep ours. Our default,
    BERT's N(0, 0.02) everywhere, is meant for fine-tuning: from scratch it leaves the
    two-layer head near a saddle. On IMDb's bytes (README, "Long Range Arena") a small exact
    model stayed at one class (49.1%) for 300 steps with it, and reached 54.8-58.6% with LRA's
    embeddings, kernels or head.
    """
    with torch.no_grad():
        model.linformer.embeddings.tokens.weight.normal_(0.0, 1.0)
        for module in model.linformer.encoder.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    module.bias.zero_()
        for module in model.head.modules():
            if isinstance(module, torch.nn.Linear):
                init_weights(module, module.in_features**-0.5)


def train_settings(task: str, settings: LRASettings, name: str) -> TrainSettings:
    """The trainer's settings of one model's run (checked on construction)."""
    recipe = settings.recipe(task)
    eval_every = settings.eval_every or max(1, recipe.steps // 10)
    return TrainSettings(
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
    train = train_settings(task, settings, name)
    with distributed_job(train.device) as dist:
        torch.manual_seed(settings.seed)  # both models start from the same seed
        model = LinformerForSequenceClassification(config, data.num_labels, pooling=recipe.pooling)
        init_like_lra(model)
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
    """Checks that `settings` continue the run of one model in `run_dir` (OUT/TASK/MODEL)
    as it started (its `settings.json`), but for RESUME_MAY_CHANGE; a run without that file
    passes.

    Raises:
        ValueError: naming each setting that differs, with the run's value.
    """
    path = run_dir / SETTINGS_NAME
    if not path.is_file():
        return
    started = json.loads(path.read_text())
    now = dataclasses.asdict(settings)
    names = [name for name in now if name in started and name not in RESUME_MAY_CHANGE]
    if changed := _differences(started, now, names):
        raise ValueError(
            f"--resume continues the run in {run_dir} with the settings it started with; "
            f"these differ: {changed}. Give the run's values, or start over without --resume"
        )


def check_same_data(run_dir: Path, params: dict[str, Any]) -> None:
    """Checks that a resumed run goes on with the data it started with: the parameters of its
    task's data (`data.json`; for text, a fingerprint of the files) are those of `params`. A
    run without that file passes.

    Raises:
        ValueError: naming each parameter that differs, with the run's value.
    """
    path = run_dir / DATA_NAME
    if not path.is_file():
        return
    started = json.loads(path.read_text())
    now = json.loads(json.dumps(params))  # as the file has it: lists for tuples
    if changed := _differences(started, now, sorted(started.keys() | now.keys())):
        raise ValueError(
            f"--resume continues the run in {run_dir} on the data it started with; these "
            f"differ: {changed} (text: a file under --data was added, removed or rewritten, "
            f"or this version reads it otherwise). Restore the data, or start over in another "
            f"--output-dir (or remove {run_dir})"
        )


def _differences(started: dict[str, Any], now: dict[str, Any], names: list[str]) -> str:
    """'name value (the run's: value), ...' for each of `names` whose values differ."""
    return ", ".join(
        f"{name} {now.get(name)!r} (the run's: {started.get(name)!r})"
        for name in names
        if started.get(name) != now.get(name)
    )


def run_lra(task: str, settings: LRASettings) -> dict[str, Any]:
    """Prepares the task's data once, trains the models (both unless `settings.models` says
    otherwise) one after the other and writes `<output_dir>/<task>.json` and `<task>.png`
    (this call's models), then `summary.md` over every task reported in `output_dir`. Earlier
    runs of the task are refused, or with `settings.resume` continued from their last
    checkpoints (a model's time per step is then that of this call's steps, or the whole
    run's mean when none was left); one that saved no checkpoint is replaced.

    Args:
        task: listops, text or pathfinder.
        settings: the run.

    Returns:
        The report: task, settings, scaled recipe, data, machine, majority and best-constant
        baselines (fractions), one row per model (accuracies in %) with its records.

    Raises:
        ValueError: for an unknown task or bad settings, an earlier run's checkpoints
            without `settings.resume`, settings a resumed run did not start with, or a
            torchrun job of several processes.
    """
    if job_size() > 1:  # each rank trained on the others' rows and wrote the same files
        raise ValueError(
            f"lra trains in one process, one model after the other; this is process "
            f"{os.environ.get('RANK', '?')} of a job of {job_size()}: run it without torchrun"
        )
    check_task_flags(check_task(task), settings)
    check_output_path(settings.output_dir, directory=True, flag="--output-dir")
    report = Path(settings.output_dir) / task  # a user's files of these names were replaced
    check_replaceable(report.with_suffix(".json"), "json", "--output-dir")
    check_replaceable(report.with_suffix(".png"), "png", "--output-dir")
    check_replaceable(report.with_name("summary.md"), "text", "--output-dir", SUMMARY_TITLE)
    if settings.cache_dir:
        check_output_path(settings.cache_dir, directory=True, flag="--cache-dir")
    for name in settings.model_names:  # a bad setting is named before anything is written
        train_settings(task, settings, name)
    run_dir = Path(settings.output_dir) / task
    with exclusive(run_dir, f"lra {task} run"):  # a second one removed this one's runs
        return _run_task(task, settings, run_dir)


def _run_task(task: str, settings: LRASettings, run_dir: Path) -> dict[str, Any]:
    """`run_lra`'s work, the task's folder held."""
    for name in settings.model_names:  # before the data or the runs are touched
        # an earlier run's checkpoints are the user's: continued (--resume) or refused
        check_run_dir(run_dir / name, resume=settings.resume)
        if settings.resume:
            check_resumable(run_dir / name, settings)
    data = load_task(task, settings)  # generated here once; the runs read the cache
    for name in settings.model_names:
        if settings.resume:
            check_same_data(run_dir / name, data.params)
        else:  # a run stopped before its first checkpoint: its settings and logs alone
            shutil.rmtree(run_dir / name, ignore_errors=True)
    for name in settings.model_names:
        (run_dir / name).mkdir(parents=True, exist_ok=True)
        save_json(dataclasses.asdict(settings), run_dir / name / SETTINGS_NAME)
        save_json(data.params, run_dir / name / DATA_NAME)
    if settings.proj_dim > data.max_seq_len and "linformer" in settings.model_names:
        logger.warning(  # the table said k = 16, without a word, for a --proj-dim of 10**12
            "--proj-dim %d exceeds the task's length %d: the Linformer runs at k = %d",
            settings.proj_dim,
            data.max_seq_len,
            data.max_seq_len,
        )
    before = machine()
    rows = []
    for name in settings.model_names:
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
