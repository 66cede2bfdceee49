"""Hugging Face-shaped model directories written for the interop tests (no downloads)."""

import json
import shutil

import torch
from safetensors.torch import save_file

from linformer_kit import LinformerModel
from linformer_kit.interop import linformer_config_from_hf
from linformer_kit.interop.bert import EMBEDDING_NAMES, LAYER_NAMES
from linformer_kit.interop.report import minilm_path

N = 64  # the tiny model's position table


def write_tiny_bert(path, *, hidden_size=32, seed=0):
    """A random 2-layer BERT directory (config.json, model.safetensors, tokenizer.json) whose
    attention weights are scaled up: peaked attention that moves the outputs, as in a trained
    model (at the default init scale a Linformer of it is already almost exact)."""
    hf = {
        "model_type": "bert",
        "vocab_size": 30522,
        "hidden_size": hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 2 * hidden_size,
        "max_position_embeddings": N,
        "type_vocab_size": 2,
    }
    torch.manual_seed(seed)
    model = LinformerModel(linformer_config_from_hf(hf, proj_dim=None))
    to_hf = {mine: theirs for theirs, mine in EMBEDDING_NAMES.items() if "pooler" not in theirs}
    to_hf |= {mine: theirs for theirs, mine in LAYER_NAMES.items()}
    tensors = {}
    for name, tensor in model.state_dict().items():
        module, _, param = name.rpartition(".")
        if module.startswith("encoder.layers."):
            _, _, index, inner = module.split(".", 3)
            scale = 20.0 if inner.startswith("attn.to_") else 1.0
            key = f"bert.encoder.layer.{index}.{to_hf[inner]}.{param}"
            tensors[key] = (tensor * scale).contiguous()
        else:
            tensors[f"bert.{to_hf[module]}.{param}"] = tensor.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(path / "model.safetensors"))
    shutil.copy(minilm_path() / "tokenizer.json", path / "tokenizer.json")
    return path
