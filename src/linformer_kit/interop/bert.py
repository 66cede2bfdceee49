"""Read a Hugging Face BERT/RoBERTa directory (config.json + model.safetensors) into a
LinformerModel, with safetensors alone (no `transformers`).

The mapping is one-to-one: every backbone tensor of the checkpoint has exactly one place in
`LinformerModel` (post-LN layers, GELU, biases, token types, pooler where present); task heads
(`cls.*`, `lm_head.*`, ...) are dropped with a log line. With `proj_dim=None` the converted
model is the same Transformer; with a `proj_dim` the sequence projections are new and get
initialised by `init_projections`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from .. import manifest
from ..config import LinformerConfig
from ..models import LinformerModel
from .projection_init import init_projections

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "camembert")
# RoBERTa-family models number positions from pad_token_id + 1 (fairseq's convention).
OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert")
# Weights of task heads and buffers: dropped, since LinformerModel is the backbone only.
HEAD_PREFIXES = ("cls.", "lm_head.", "classifier.", "qa_outputs.", "pre_classifier.")
IGNORED = ("embeddings.position_ids",)

# Hugging Face name (after the model prefix) -> LinformerModel name.
EMBEDDING_NAMES = {
    "embeddings.word_embeddings": "embeddings.tokens",
    "embeddings.position_embeddings": "embeddings.positions",
    "embeddings.token_type_embeddings": "embeddings.token_types",
    "embeddings.LayerNorm": "embeddings.norm",
    "pooler.dense": "pooler.dense",
}
LAYER_NAMES = {
    "attention.self.query": "attn.to_q",
    "attention.self.key": "attn.to_k",
    "attention.self.value": "attn.to_v",
    "attention.output.dense": "attn.to_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "ffn.up",
    "output.dense": "ffn.down",
    "output.LayerNorm": "ffn_norm",
}
# Old TF-converted checkpoints name LayerNorm parameters gamma / beta.
PARAM_NAMES = {"weight": "weight", "bias": "bias", "gamma": "weight", "beta": "bias"}
_LAYER = re.compile(r"encoder\.layer\.(\d+)\.(.+)")


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """Reads the `config.json` of a Hugging Face model directory.

    Raises:
        FileNotFoundError: if the directory or its config.json is missing.
        ValueError: if config.json is not a JSON object.
    """
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {Path(path)}: not a Hugging Face model dir")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON (line {err.lineno}): {err.msg}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def read_hf_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """Reads `model.safetensors` of a Hugging Face model directory, or the shards its
    `model.safetensors.index.json` lists (`save_pretrained(max_shard_size=...)`).

    Raises:
        FileNotFoundError: if there is no model.safetensors nor an index (pickled .bin files
            are refused), or a shard is missing.
        ValueError: if a file is truncated or not a safetensors file, the index is malformed,
            or the directory has a manifest.json that its files do not match
            (`manifest.check_before_load`).
    """
    folder = Path(path)
    weights = _weights_file(folder)
    if not weights.is_file():
        hint = " (pytorch_model.bin is pickle: re-save it as safetensors)" * any(
            folder.glob("*.bin")
        )
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {folder}{hint}")
    sharded = weights.name != WEIGHTS_NAME
    files = [folder / name for name in _shards(weights)] if sharded else [weights]
    manifest.check_before_load(path)
    tensors: dict[str, Tensor] = {}
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file}, a shard {weights.name} lists, is missing")
        try:
            tensors |= load_file(file)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{file} is corrupt or truncated: {err}") from err
    return tensors


def _weights_file(folder: Path) -> Path:
    """What messages name as a directory's weights: model.safetensors, or the index of its
    shards."""
    file = folder / WEIGHTS_NAME
    return file if file.is_file() else folder / f"{WEIGHTS_NAME}.index.json"


def _shards(index: Path) -> list[str]:
    """The shard file names a `model.safetensors.index.json` maps tensors to, each once.

    Raises:
        ValueError: naming the index, if it is not JSON with a `weight_map` of file names.
    """
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{index} is not a shard index (a weight_map): {err!r}") from err
    if not names or not all(isinstance(n, str) and Path(n).name == n for n in names):
        raise ValueError(f"{index}: the weight_map names no file of its folder ({names[:3]})")
    return names


def linformer_config_from_hf(
    hf: dict[str, Any], *, pooler: bool = False, source: str = CONFIG_NAME, **overrides: Any
) -> LinformerConfig:
    """Translates a Hugging Face BERT/RoBERTa config into a LinformerConfig.

    Args:
        hf: the parsed config.json.
        pooler: whether the checkpoint has a pooler.
        source: file name used in error messages.
        **overrides: LinformerConfig fields to set (proj_dim, sharing, projection, ...).

    Raises:
        ValueError: listing every unsupported or missing setting at once.
    """
    problems = []
    required = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "max_position_embeddings",
    )
    problems += [f"missing {key!r}" for key in required if key not in hf]
    model_type = hf.get("model_type", "bert")
    if model_type not in MODEL_TYPES:
        problems.append(f"model_type {model_type!r} (supported: {', '.join(MODEL_TYPES)})")
    activation = hf.get("hidden_act", "gelu")
    if activation not in ("gelu", "relu"):
        problems.append(f"hidden_act {activation!r} (supported: gelu (erf), relu)")
    position_type = hf.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        problems.append(f"position_embedding_type {position_type!r} (supported: absolute)")
    for flag in ("is_decoder", "add_cross_attention"):
        if hf.get(flag):
            problems.append(f"{flag}=true (only encoders convert)")
    if problems:
        raise ValueError(f"cannot convert {source}: " + "; ".join(problems))
    # transformers' own defaults when the key is absent: RoBERTa-family configs pad with 1
    pad_token_id = hf.get("pad_token_id")
    if pad_token_id is None:
        pad_token_id = 1 if model_type in OFFSET_POSITIONS else 0
    offset = pad_token_id + 1 if model_type in OFFSET_POSITIONS else 0
    fields = dict(
        vocab_size=hf["vocab_size"],
        max_seq_len=hf["max_position_embeddings"] - offset,
        dim=hf["hidden_size"],
        depth=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        ffn_dim=hf["intermediate_size"],
        activation=activation,
        norm_first=False,
        position="learned",
        type_vocab_size=hf.get("type_vocab_size", 0),
        pooler=pooler,
        pad_token_id=pad_token_id,
        dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        init_std=hf.get("initializer_range", 0.02),
    )
    try:
        return LinformerConfig(**{**fields, **overrides})
    except ValueError as err:
        raise ValueError(f"cannot convert {source}: {err}") from err


def _strip_prefix(tensors: dict[str, Tensor], source: str) -> tuple[dict[str, Tensor], str]:
    """Removes the model prefix (`bert.`, `roberta.`, none) from backbone names."""
    anchor = "embeddings.word_embeddings.weight"
    found = [name for name in tensors if name.endswith(anchor)]
    if len(found) != 1:
        raise ValueError(
            f"{source}: expected exactly one '*{anchor}' tensor to locate the backbone, "
            f"found {found or 'none'}"
        )
    prefix = found[0][: -len(anchor)]
    backbone, dropped = {}, []
    for name, tensor in tensors.items():
        if name.startswith(prefix):
            backbone[name[len(prefix) :]] = tensor
        elif name.startswith(HEAD_PREFIXES):
            dropped.append(name)
        else:
            backbone[name] = tensor  # reported as unknown below
    if dropped:  # a fine-tuned classifier's head among them: said, not dropped silently
        logger.warning(
            "dropping %d task-head tensors of %s (e.g. %s): the converted model is the "
            "encoder; `linformer finetune --init` trains a head on it",
            len(dropped),
            source,
            dropped[0],
        )
    return backbone, prefix


def _target_name(hf_name: str) -> str | None:
    """LinformerModel name of a prefix-free Hugging Face tensor name, None if unknown."""
    module, _, param = hf_name.rpartition(".")
    if param not in PARAM_NAMES:
        return None
    match = _LAYER.fullmatch(module)
    if match:
        inner = LAYER_NAMES.get(match.group(2))
        target = inner and f"encoder.layers.{match.group(1)}.{inner}"
    else:
        target = EMBEDDING_NAMES.get(module)
    return target and f"{target}.{PARAM_NAMES[param]}"


def extend_positions(table: Tensor, max_seq_len: int) -> Tensor:
    """The first `max_seq_len` rows of `table` (n0, dim) repeated block after block:
    row i is table[i mod n0] (Longformer's copy rule)."""
    repeats = -(-max_seq_len // table.shape[0])  # ceil
    return table.repeat(repeats, 1)[:max_seq_len]


def map_hf_weights(
    tensors: dict[str, Tensor],
    model: LinformerModel,
    *,
    position_offset: int = 0,
    position_rows: int | None = None,
    source: str = "",
) -> dict[str, Tensor]:
    """Renames (and checks) Hugging Face backbone tensors to `model`'s state-dict names.

    Args:
        tensors: the checkpoint's tensors.
        model: the target; its state dict gives the expected names and shapes.
        position_offset: first position row used (RoBERTa: pad_token_id + 1).
        position_rows: learned positions in the checkpoint (after the offset); when the model
            has more or fewer, the table is extended or cut by `extend_positions`.
            None: exactly the model's.
        source: file name used in error messages.

    Returns:
        Every non-projection tensor of `model`, converted to its dtype.

    Raises:
        ValueError: listing missing, unknown and mis-shaped tensors (by checkpoint name).
    """
    backbone, prefix = _strip_prefix(tensors, source)
    state = model.state_dict()
    expected = {name for name in state if ".proj_" not in name}
    mapped, unknown, wrong, misshaped = {}, [], [], set()
    for hf_name, tensor in backbone.items():
        if hf_name in IGNORED:
            continue
        target = _target_name(hf_name)
        if target not in expected:
            unknown.append(prefix + hf_name if target else hf_name)
            continue
        expected_shape = state[target].shape
        if target == "embeddings.positions.weight":
            rows = position_rows or expected_shape[0]
            tensor = tensor[position_offset : position_offset + rows]
            if tensor.shape == (rows, expected_shape[1]):
                tensor = extend_positions(tensor, expected_shape[0])
            else:
                expected_shape = torch.Size((rows, expected_shape[1]))
        if tensor.shape != expected_shape:
            misshaped.add(target)
            wrong.append(
                f"{prefix}{hf_name}: file {tuple(tensor.shape)}, config needs "
                f"{tuple(expected_shape)}"
            )
            continue
        mapped[target] = tensor.to(state[target].dtype)
    missing = sorted(expected - set(mapped) - misshaped)
    if unknown or wrong or missing:
        raise ValueError(
            f"{source} does not match its config.json: missing {missing} (LinformerModel names), "
            f"unknown {sorted(unknown)}, wrong shapes {wrong}"
        )
    return mapped


def has_pooler(tensors: dict[str, Tensor]) -> bool:
    """Whether a checkpoint holds a BERT pooler (`*pooler.dense.weight`)."""
    return any(name.endswith("pooler.dense.weight") for name in tensors)


def convert_hf_model(
    path: str | os.PathLike,
    *,
    proj_dim: int | list[int] | None = 128,
    max_seq_len: int | None = None,
    sharing: str = "layerwise",
    projection: str = "linear",
    init: str | None = None,
    calibration_ids: Tensor | None = None,
    seed: int = 0,
) -> LinformerModel:
    """Converts a Hugging Face BERT/RoBERTa directory into a LinformerModel (eval mode).

    Args:
        path: directory with config.json and model.safetensors.
        proj_dim: the Linformer k (one int, or one per layer); None converts exactly.
        max_seq_len: longest input of the converted model; beyond the checkpoint's
            positions the table is extended by `extend_positions`. None: the checkpoint's.
        sharing: none, headwise, kv or layerwise.
        projection: linear, conv, pool or random.
        init: projection init for `linear` (xavier, mean, svd or attention); None picks
            attention with calibration ids, else mean.
            Other kinds take None: conv starts as mean pooling, pool and random are fixed.
        calibration_ids: (B, max_seq_len) token ids, at the converted max_seq_len;
            required by svd and attention.
        seed: seed of the random projection inits.

    Returns:
        The converted model with the checkpoint's weights.

    Raises:
        FileNotFoundError: if a file is missing.
        ValueError: on an unsupported config or weights that do not match it.
    """
    hf = read_hf_config(path)
    tensors = read_hf_weights(path)
    source = str(_weights_file(Path(path)))
    found = {"pooler": has_pooler(tensors), "source": str(Path(path) / CONFIG_NAME)}
    learned = linformer_config_from_hf(hf, **found, proj_dim=None).max_seq_len
    # k is checked against the converted length, which may exceed the learned positions.
    config = linformer_config_from_hf(
        hf,
        **found,
        proj_dim=proj_dim,
        sharing=sharing,
        projection=projection,
        max_seq_len=max_seq_len or learned,
    )
    if max_seq_len is not None and max_seq_len > learned:
        logger.info(
            "extending %d learned positions to %d by copying the table block after block",
            learned,
            max_seq_len,
        )
    offset = config.pad_token_id + 1 if hf.get("model_type") in OFFSET_POSITIONS else 0
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LinformerModel(config)
    weights = map_hf_weights(
        tensors, model, position_offset=offset, position_rows=learned, source=source
    )
    model.load_state_dict(weights, strict=False)
    model.eval()
    if not config.is_exact:
        teacher = None
        if calibration_ids is not None:
            teacher = LinformerModel(config.replace(proj_dim=None)).eval()
            teacher.load_state_dict(weights, strict=False)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            init_projections(model, init, teacher=teacher, calibration_ids=calibration_ids)
    return model
