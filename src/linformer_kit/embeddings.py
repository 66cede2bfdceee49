"""The pieces every model class shares: the embeddings and their position tables, the pooler,
the masked mean over real tokens, and BERT-style weight init."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .config import LinformerConfig
from .dropout import Dropout
from .input_checks import check_index_range


def sinusoidal_positions(max_seq_len: int, dim: int) -> Tensor:
    """The fixed sin/cos position table of "Attention Is All You Need": (max_seq_len, dim)."""
    position = torch.arange(max_seq_len, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(max_seq_len, dim)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq)[:, : dim // 2]
    return table


def masked_mean(hidden: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """Mean over the real tokens: (B, N, dim) -> (B, dim); over all when the mask is None."""
    if key_padding_mask is None:
        return hidden.mean(1)
    real = key_padding_mask[:, :, None]  # (B, N, 1)
    counts = real.sum(1).clamp(min=1).to(hidden.dtype)  # (B, 1)
    return hidden.masked_fill(~real, 0).sum(1) / counts


def init_weights(module: nn.Module, std: float) -> None:
    """BERT-style init for dense and embedding layers; projections keep their own init."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class LinformerEmbeddings(nn.Module):
    """Token + position (+ token type) embeddings; LayerNorm here for post-LN models (BERT)."""

    def __init__(self, config: LinformerConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.dim)
        self.positions = (
            nn.Embedding(config.max_seq_len, config.dim) if config.position == "learned" else None
        )
        if self.positions is None:
            table = sinusoidal_positions(config.max_seq_len, config.dim)
            self.register_buffer("sinusoid", table, persistent=False)
        self.token_types = (
            nn.Embedding(config.type_vocab_size, config.dim) if config.type_vocab_size else None
        )
        self.norm = (
            None if config.norm_first else nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        )
        self.dropout = Dropout(config.dropout)

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """(B, N) token ids -> (B, N, dim); positions 0..N-1 unless `position_ids` (B, N)."""
        seq_len = input_ids.shape[1]
        positions = self.positions.weight if self.positions is not None else self.sinusoid
        positions = positions[:seq_len] if position_ids is None else positions[position_ids]
        check_index_range(input_ids, self.tokens.num_embeddings, "input_ids")
        x = self.tokens(input_ids) + positions
        if token_type_ids is not None:
            if self.token_types is None:
                raise ValueError("token_type_ids given but the config has type_vocab_size=0")
            check_index_range(token_type_ids, self.token_types.num_embeddings, "token_type_ids")
            x = x + self.token_types(token_type_ids)
        elif self.token_types is not None:
            x = x + self.token_types.weight[0]
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


def causal_position_ids(
    input_ids: Tensor, key_padding_mask: Tensor | None, start: int = 0
) -> Tensor | None:
    """The positions of a causal model's tokens, when not simply 0..N-1: `start` onwards
    after `start` generated positions, or numbered over the real tokens only (so left
    padding changes no real output).

    Returns:
        (1, N) or (B, N) position ids, or None for 0..N-1.
    """
    seq_len = input_ids.shape[1]
    if start:
        return torch.arange(start, start + seq_len, device=input_ids.device)[None]
    if key_padding_mask is not None:
        return (key_padding_mask.long().cumsum(1) - 1).clamp(min=0)  # (B, N)
    return None


class LinformerPooler(nn.Module):
    """BERT's pooler: dense + tanh on the first token, (B, N, dim) -> (B, dim)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dense = nn.Linear(dim, dim)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))
