"""A pretrained Hugging Face directory, or an exact checkpoint of this library (e.g. a
classifier fine-tuned at full length), converted into a Linformer model directory: the
weights, the config and the source's tokenizer.json, with calibration text for the
data-driven projection inits."""

from __future__ import annotations

import logging
import os
import shutil
from functools import partial
from pathlib import Path

import torch

from .. import hub
from ..checks import check_non_negative, check_positive
from ..files import atomic_write, check_output_path, exclusive
from ..masked_lm import LinformerForMaskedLM
from ..models import LinformerForSequenceClassification, LinformerModel, LinformerPreTrainedModel
from ..training.checkpoint import CHECKPOINTS_DIR, STATE_NAME
from ..training.settings import RUN_CONFIG_NAME
from .bert import convert_hf_model, read_hf_config
from .projection_init import DEFAULT_INIT, init_projections
from .report import TOKENIZER_NAME, calibration_ids

logger = logging.getLogger(__name__)

# A converted Linformer's shape where the caller names none (`convert`, a new `distill`
# student).
DEFAULT_SHAPE = {"proj_dim": 128, "sharing": "layerwise", "projection": "linear"}

DATA_DRIVEN = ("svd", "attention")  # inits that need calibration text
# Checkpoints of this library that `convert` takes: the bidirectional encoders.
ENCODERS = {
    cls.__name__: cls
    for cls in (LinformerModel, LinformerForMaskedLM, LinformerForSequenceClassification)
}


def is_linformer_checkpoint(source: str | os.PathLike) -> bool:
    """Whether `source` was written by this library (its config.json names an architecture)
    rather than by Hugging Face transformers.

    Raises:
        ValueError: for a config.json that is not a JSON object, naming it.
    """
    if not (Path(source) / hub.CONFIG_NAME).is_file():
        return False
    return "architecture" in read_hf_config(source)  # a bad file named, as a JSON object


def convert_to_dir(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    proj_dim: int | None,
    max_seq_len: int | None = None,
    sharing: str = "layerwise",
    projection: str = "linear",
    init: str | None = None,
    calibration_texts: int = 16,
    seed: int = 0,
) -> LinformerModel:
    """Converts `source` (a Hugging Face directory: `convert_hf_model`; an exact checkpoint
    of this library: `convert_checkpoint`) and saves it, with its tokenizer.json, in `out`.
    Data-driven inits calibrate on `calibration_texts` stdlib windows of the converted
    max_seq_len.

    Returns:
        The converted model (its backbone, for a checkpoint with a head).

    Raises:
        FileNotFoundError / ValueError: as `convert_hf_model` or `convert_checkpoint`; a
            ValueError before any work for `out` the source folder itself, a training
            checkpoint or a folder with a config.json of no model of this library's, a
            max_seq_len below 1, or calibration_texts below 0 (data-driven inits: 1).
    """
    source = Path(source)
    if Path(out).resolve() == source.resolve():
        raise ValueError(
            f"--out {out} is the source folder: the conversion would overwrite the model it "
            f"reads; name another folder"
        )
    check_output_path(out, directory=True)
    # `best` is a link into the run's checkpoints; a run's folder holds its run_config.json
    if (Path(out) / STATE_NAME).is_file() or (Path(out) / CHECKPOINTS_DIR).is_dir():
        raise ValueError(
            f"--out {out} is a training run or checkpoint: the conversion would replace its "
            f"files; name another folder"
        )
    try:
        ours = is_linformer_checkpoint(out)
    except ValueError:
        ours = False
    if (Path(out) / hub.CONFIG_NAME).is_file() and not ours:  # it was replaced, and the files
        raise ValueError(  # beside it (a Hugging Face model's tokenizer.json) removed
            f"--out {out} holds a {hub.CONFIG_NAME} of no model of this library's (a Hugging "
            f"Face model's?): the conversion would replace it; name another folder"
        )
    if max_seq_len is not None:
        check_positive("max_seq_len", max_seq_len)
    check_non_negative("calibration_texts", calibration_texts)  # unused without calibration
    data_driven = proj_dim is not None and projection == "linear"
    data_driven = data_driven and (init or DEFAULT_INIT) in DATA_DRIVEN
    if data_driven and init is None and not (source / TOKENIZER_NAME).is_file():
        logger.info("no %s in %s to calibrate on: mean-pooling init", TOKENIZER_NAME, source)
        data_driven = False  # init_projections' default without calibration ids
    if data_driven:
        check_positive("calibration_texts", calibration_texts)
    options = {
        "proj_dim": proj_dim,
        "max_seq_len": max_seq_len,
        "sharing": sharing,
        "projection": projection,
        "init": init,
        "seed": seed,
    }
    with exclusive(Path(out), "conversion"):  # two into one folder mixed their files
        model: LinformerPreTrainedModel
        if is_linformer_checkpoint(source):
            texts = calibration_texts if data_driven else 0
            model = convert_checkpoint(source, calibration_texts=texts, **options)
        else:
            ids = calibration_ids(source, calibration_texts, max_seq_len) if data_driven else None
            model = convert_hf_model(source, calibration_ids=ids, **options)
        # with its tokenizer, and the run config of a training checkpoint (what `evaluate` reads
        # texts as: a classifier fine-tuned on texts cut shorter than its model is scored on those)
        extras = (TOKENIZER_NAME, RUN_CONFIG_NAME)
        if (Path(out) / hub.CONFIG_NAME).is_file():
            logger.warning("replacing the model in %s", out)
            for name in extras:  # the replaced model's go first: an interrupt never leaves a mix
                if (Path(out) / name).is_file():
                    (Path(out) / name).unlink()
                    if not (source / name).is_file():
                        logger.warning("removed the replaced model's %s from %s", name, out)
        model.save_pretrained(out)
        for name in (n for n in extras if (source / n).is_file()):
            atomic_write(Path(out) / name, partial(shutil.copy2, source / name))
        return model.backbone


def convert_checkpoint(
    source: str | os.PathLike,
    *,
    proj_dim: int | None,
    max_seq_len: int | None = None,
    sharing: str = "layerwise",
    projection: str = "linear",
    init: str | None = None,
    calibration_texts: int = 0,
    seed: int = 0,
) -> LinformerPreTrainedModel:
    """An exact checkpoint of this library with Linformer attention: every weight, the head
    (a fine-tuned classifier's included) and its arguments kept, the sequence projections
    built and initialised as `convert_hf_model` does. Fine-tuning the exact model at full
    length first and converting it after keeps what it learned (README, long documents).

    Args:
        source: a LinformerModel, LinformerForMaskedLM or LinformerForSequenceClassification
            directory with exact attention (proj_dim None).
        proj_dim: the Linformer k.
        max_seq_len: None or the checkpoint's own (its positions were trained at it).
        sharing, projection, init, seed: as `convert_hf_model`.
        calibration_texts: stdlib windows for the data-driven inits (0: none).

    Raises:
        ValueError: for another architecture, a checkpoint that is not exact, no k, or
            another max_seq_len.
    """
    meta = hub.read_config(source)
    cls = ENCODERS.get(meta["architecture"])
    config = meta["config"]
    if cls is None:
        raise ValueError(
            f"{source} is a {meta['architecture']}; convert takes an encoder checkpoint "
            f"({', '.join(ENCODERS)}) or a Hugging Face directory"
        )
    if proj_dim is None or not config.is_exact:
        attention = "exact" if config.is_exact else f"Linformer (k={config.proj_dim})"
        raise ValueError(
            f"{source} has {attention} attention: converting a checkpoint of this library "
            f"takes an exact one and a --proj-dim (not --exact)"
        )
    if max_seq_len not in (None, config.max_seq_len):
        raise ValueError(
            f"--max-seq-len {max_seq_len}: {source} was trained at {config.max_seq_len} "
            f"positions, so it converts at {config.max_seq_len}; a longer model comes from a "
            f"Hugging Face directory (convert --from HF_DIR --max-seq-len N)"
        )
    exact = cls.from_pretrained(source)
    target = config.replace(proj_dim=proj_dim, sharing=sharing, projection=projection)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(target, **meta["model_kwargs"])
    missing, unexpected = model.load_state_dict(exact.state_dict(), strict=False)
    if unexpected or any(".proj_" not in name for name in missing):
        raise ValueError(f"{source}: weights do not map: missing {missing}, extra {unexpected}")
    model.eval()
    calibration = None
    if calibration_texts:
        calibration = calibration_ids(source, calibration_texts, config.max_seq_len)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        init_projections(model.backbone, init, teacher=exact.backbone, calibration_ids=calibration)
    return model
