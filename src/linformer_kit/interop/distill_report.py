"""The before / after distillation benchmark: for each k, convert the teacher (attention
init), distil it (by default on the stdlib's calibration split), and score the
sentence-embedding cosine on the stdlib's held-out files before, during and after; plus a PNG
of the curves."""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure  # pyplot-free: the user's backend stays as it is

from ..files import save_figure
from .bert import convert_hf_model
from .distill import DistillSettings, HeldOut, distill
from .distill_run import DistillData
from .report import (
    calibration_ids,
    machine,
    model_tokenizer,
    stdlib_files,
    text_windows,
)

TARGET_COSINE = 0.95  # issue 6: mean cosine at k = 128 after distillation


def distillation_report(
    path: str | os.PathLike,
    proj_dims: list[int],
    settings: DistillSettings,
    data: DistillData,
    *,
    files: list[Path] | None = None,
    sharing: str = "layerwise",
    projection: str = "linear",
    max_seq_len: int | None = None,
) -> dict[str, Any]:
    """Distils one student per k and scores it on held-out text before, during and after.

    Teacher and students share one length: past the teacher's position table both are
    extended as `convert` extends them, and every window is that long.

    Args:
        path: Hugging Face model directory with config.json, model.safetensors, tokenizer.json.
        proj_dims: the k values.
        settings: the distillation recipe (the same for every k).
        data: window counts.
        files: the distillation text (`distillation_files`); None: the stdlib's calibration
            split.
        sharing: projection sharing of every student.
        projection: projection kind of every student (calibrated only when linear).
        max_seq_len: length of teacher, students and windows (None: the teacher's).

    Returns:
        A JSON-ready dict: `settings`, `machine`, one row per k and one curve per k.
    """
    path = Path(path)
    device = settings.torch_device()
    teacher = convert_hf_model(path, proj_dim=None, max_seq_len=max_seq_len).to(device)
    n = teacher.config.max_seq_len
    tokenizer = model_tokenizer(path, "the text")
    files = stdlib_files("calibration") if files is None else files
    ids = text_windows(tokenizer, files, n, data.texts, per_file=data.per_file)
    heldout_ids = text_windows(tokenizer, stdlib_files("heldout"), n, data.heldout_texts)
    heldout = HeldOut.from_teacher(teacher, heldout_ids.to(device))
    linear = projection == "linear"
    calibration = calibration_ids(path, data.calibration_texts, n) if linear else None
    rows, curves = [], {}
    for k in proj_dims:
        student = convert_hf_model(
            path,
            proj_dim=k,
            max_seq_len=n,
            sharing=sharing,
            projection=projection,
            calibration_ids=calibration,
        )
        start = time.perf_counter()
        history = distill(student, teacher, ids, settings, heldout=heldout)
        before, after = history[0], history[-1]
        rows.append(
            {
                "proj_dim": k,
                "cosine_before": before["cosine_mean"],
                "cosine_after": after["cosine_mean"],
                "cosine_min_before": before["cosine_min"],
                "cosine_min_after": after["cosine_min"],
                "distill_min": round((time.perf_counter() - start) / 60, 1),
            }
        )
        curves[str(k)] = history
    return {
        "command": "linformer distill --report",
        "model": str(path),
        "seq_len": n,
        "settings": {
            **asdict(settings),
            **asdict(data),
            "sharing": sharing,
            "projection": projection,
            "init": "attention" if linear else None,
        },
        "text": {"files": len(files), "under": os.path.commonpath(files)},
        "machine": {**machine(), "device": _device_name(device)},
        "target": {"proj_dim": 128, "cosine_mean": TARGET_COSINE},
        "rows": rows,
        "curves": curves,
    }


def _device_name(device: torch.device) -> str:
    """`cpu`, or the GPU's name (e.g. `cuda:0 NVIDIA H100 80GB HBM3`)."""
    if device.type != "cuda":
        return str(device)
    return f"{device} {torch.cuda.get_device_name(device)}"


def plot_curves(result: dict[str, Any], path: str | os.PathLike) -> None:
    """Held-out cosine vs distillation step, one line per k, with the target as a dashed line."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for k, history in result["curves"].items():
        steps = [record["step"] for record in history]
        ax.plot(steps, [record["cosine_mean"] for record in history], marker="o", label=f"k={k}")
    ax.axhline(TARGET_COSINE, color="grey", linestyle="--", label=f"target {TARGET_COSINE}")
    ax.set_xlabel("distillation step")
    ax.set_ylabel("held-out embedding cosine (mean)")
    trainable = result["settings"]["trainable"]
    ax.set_title(f"distillation ({trainable}) at n={result['seq_len']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
