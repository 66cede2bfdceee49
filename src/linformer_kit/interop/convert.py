"""A pretrained Hugging Face directory converted into a Linformer model directory: the
weights, the config and the source's tokenizer.json, with calibration text for the
data-driven projection inits."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..models import LinformerModel
from .bert import convert_hf_model
from .projection_init import DEFAULT_INIT
from .report import TOKENIZER_NAME, calibration_ids

DATA_DRIVEN = ("svd", "attention")  # inits that need calibration text


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
    """Converts `source` (see `convert_hf_model`) and saves it, with its tokenizer.json, in
    `out`. Data-driven inits calibrate on `calibration_texts` stdlib windows of the converted
    max_seq_len.

    Returns:
        The converted model.

    Raises:
        FileNotFoundError / ValueError: as `convert_hf_model`.
    """
    source = Path(source)
    data_driven = proj_dim is not None and projection == "linear"
    data_driven = data_driven and (init or DEFAULT_INIT) in DATA_DRIVEN
    calibration = calibration_ids(source, calibration_texts, max_seq_len) if data_driven else None
    model = convert_hf_model(
        source,
        proj_dim=proj_dim,
        max_seq_len=max_seq_len,
        sharing=sharing,
        projection=projection,
        init=init,
        calibration_ids=calibration,
        seed=seed,
    )
    model.save_pretrained(out)
    if (source / TOKENIZER_NAME).is_file():
        shutil.copy(source / TOKENIZER_NAME, Path(out) / TOKENIZER_NAME)
    return model
