"""Attention maps: one layer's and head's context-mapping matrix for one text.

For exact attention it is the n x n matrix P; for a Linformer the n x k matrix P̄ over the
projected keys (paper eq. 7), whose columns are mixtures of positions, not tokens.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ..models import LinformerModel
from .inputs import check_one_matrix, checkpoint_tokenizer, encode_text, load_backbone
from .plots import figure_format, plot_attention_map


def check_index(name: str, value: int, count: int) -> None:
    """Raises ValueError unless 0 <= value < count."""
    if not 0 <= value < count:
        raise ValueError(f"{name} must be in [0, {count - 1}], got {value}")


@torch.no_grad()
def attention_map(model: LinformerModel, input_ids: Tensor, layer: int, head: int) -> Tensor:
    """The attention matrix of one layer and head for one unpadded sequence.

    Args:
        model: a backbone.
        input_ids: (1, n) token ids.
        layer: layer index, 0-based.
        head: head index, 0-based.

    Returns:
        (n, M) float32 with M = n for exact attention and k for Linformer.

    Raises:
        ValueError: for a layer or head out of range, or a batch of more than one sequence.
    """
    check_index("layer", layer, model.config.depth)
    check_index("head", head, model.config.num_heads)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be (1, n), got shape {tuple(input_ids.shape)}")
    attentions = model.eval()(input_ids, output_attentions=True).attentions
    return attentions[layer][0, head].float()  # (n, M)


def write_attention_map(
    path: str | os.PathLike, text: str, layer: int, head: int, out: str | os.PathLike
) -> tuple[int, int]:
    """Plots one layer's and head's attention map of a checkpoint for `text` into a figure.

    Args:
        path: checkpoint directory (config.json, model.safetensors, tokenizer.json).
        text: the text to encode.
        layer: layer index, 0-based.
        head: head index, 0-based.
        out: output figure (its suffix names the format).

    Returns:
        The map's shape (n, M).

    Raises:
        FileNotFoundError: if the checkpoint has no tokenizer.json.
        ValueError: for a layer or head out of range, or a text without tokens.
    """
    figure_format(out)  # before the model runs
    model = load_backbone(path)
    check_one_matrix(model.config, [layer], path)
    tokenizer = checkpoint_tokenizer(path, model.config.vocab_size)
    if tokenizer is None:
        raise FileNotFoundError(f"no tokenizer.json in {path}: needed to encode --text")
    input_ids, labels = encode_text(tokenizer, text, model.config.max_seq_len)
    matrix = attention_map(model, input_ids, layer, head)
    proj_dim = model.config.proj_dims[layer]
    kind = "exact attention" if proj_dim is None else f"Linformer, k = {proj_dim}"
    if proj_dim is not None and matrix.shape[1] != proj_dim:  # pooled: ceil(n / block) rows
        kind += f", {matrix.shape[1]} rows at n = {matrix.shape[0]}"
    plot_attention_map(
        matrix.numpy(),
        out,
        query_labels=labels,
        key_labels=labels if proj_dim is None else None,
        title=f"{os.fspath(path)}: layer {layer}, head {head} ({kind})",
    )
    return tuple(matrix.shape)
