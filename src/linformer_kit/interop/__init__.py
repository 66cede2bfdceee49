"""Interoperability: convert pretrained Hugging Face BERT/RoBERTa checkpoints to Linformer."""

from .bert import convert_hf_model, linformer_config_from_hf, read_hf_config, read_hf_weights
from .projection_init import DEFAULT_INIT, INITS, init_projections, mean_pooling_matrix

__all__ = [
    "DEFAULT_INIT",
    "INITS",
    "convert_hf_model",
    "init_projections",
    "linformer_config_from_hf",
    "mean_pooling_matrix",
    "read_hf_config",
    "read_hf_weights",
]
