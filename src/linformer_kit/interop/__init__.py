"""Interoperability: convert pretrained Hugging Face BERT/RoBERTa checkpoints to Linformer,
and distil the converted model against the exact original."""

from .bert import convert_hf_model, linformer_config_from_hf, read_hf_config, read_hf_weights
from .distill import DistillSettings, distill
from .distill_run import DistillData, distill_checkpoint
from .projection_init import DEFAULT_INIT, INITS, init_projections, mean_pooling_matrix

__all__ = [
    "DEFAULT_INIT",
    "INITS",
    "DistillData",
    "DistillSettings",
    "convert_hf_model",
    "distill",
    "distill_checkpoint",
    "init_projections",
    "linformer_config_from_hf",
    "mean_pooling_matrix",
    "read_hf_config",
    "read_hf_weights",
]
