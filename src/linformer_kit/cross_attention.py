"""Cross-attention: m decoder queries over an encoder memory of length n projected n -> k.

The memory is projected exactly as self-attention projects its keys and values (padding
zeroed before the projection, the real positions gathered first and projected by the first
rows of E and F), so padding anywhere in the memory never changes the output, and m and n
are independent: O(m k) per layer instead of O(m n). A generating decoder projects the
memory once and keeps the k rows in its `MemoryCache`, so every new token costs O(k),
however long the memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .attention import LinformerSelfAttention
from .functional import attend, exact_attention, linformer_attention, real_tokens_first
from .input_checks import check_input, check_key_padding_mask, check_seq_len
from .linear_backend import apply_linear
from .projection import SequenceProjection


def cross_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    proj_k: Tensor | None = None,
    proj_v: Tensor | None = None,
    *,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> Tensor:
    """Attention of M queries over a memory of N keys and values projected to K rows.

    Args:
        q: (B, H, M, D) decoder queries; M need not equal N.
        k, v: (B, H, N, D) memory keys and values, N <= max_seq_len.
        proj_k, proj_v: (max_seq_len, K) shared across heads, or (H, max_seq_len, K); both
            None for exact cross-attention. Pass `proj_k` alone for key-value sharing.
        key_padding_mask: optional bool (B, N), True at real memory positions, anywhere
            (padding never changes the output: `linformer_attention`).
        dropout_p: dropout on the attention weights (pass 0.0 in eval mode).
        scale: softmax scale; default 1 / sqrt(D).

    Returns:
        (B, H, M, D). A memory with no real position gives zeros.

    Raises:
        ValueError: if N exceeds max_seq_len, the mask has the wrong shape or dtype, or
            proj_v is given without proj_k.
    """
    if proj_k is None:
        if proj_v is not None:  # it ran exact attention without a word
            raise ValueError("proj_v needs proj_k: pass both, proj_k alone (shared), or neither")
        return exact_attention(q, k, v, key_padding_mask, dropout_p, scale)
    proj_v = proj_k if proj_v is None else proj_v
    return linformer_attention(q, k, v, proj_k, proj_v, key_padding_mask, dropout_p, scale)


@dataclass
class MemoryCache:
    """One cross-attention layer's projected memory, computed once per generation.

    Attributes:
        keys, values: (B, H, K, D) (exact: (B, H, N, D)); None until the first step.
        mask: bool (B, K) of the rows that may be attended to, or None when all may.
    """

    keys: Tensor | None = None
    values: Tensor | None = None
    mask: Tensor | None = None


class LinformerCrossAttention(LinformerSelfAttention):
    """Multi-head attention of a decoder sequence over a projected encoder memory.

    The query, key, value and output layers and the projection of the keys and values are
    those of `LinformerSelfAttention` (including projecting the memory before the key/value
    layers when that is cheaper); only the keys and values come from the memory.

    Args:
        dim: model width (decoder and memory).
        num_heads: attention heads; must divide dim.
        max_seq_len: longest memory accepted (the encoder's max_seq_len).
        proj_k, proj_v: the memory's key and value projections (None: exact).
        dropout: dropout on the attention weights (training only).
        bias: whether the q/k/v/out linear layers have biases.
    """

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        max_seq_len: int,
        proj_k: SequenceProjection | None = None,
        proj_v: SequenceProjection | None = None,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__(
            dim=dim,
            num_heads=num_heads,
            max_seq_len=max_seq_len,
            proj_k=proj_k,
            proj_v=proj_v,
            dropout=dropout,
            bias=bias,
        )

    def project_memory(self, memory: Tensor, memory_padding_mask: Tensor | None) -> MemoryCache:
        """The memory's projected keys and values.

        Args:
            memory: (B, N, dim) encoder output, N <= max_seq_len.
            memory_padding_mask: optional bool (B, N), True at real positions.

        Raises:
            ValueError: if N exceeds max_seq_len or the mask is malformed.
        """
        check_input(memory, self.dim)
        batch, seq_len, _ = memory.shape
        check_seq_len(seq_len, self.max_seq_len)
        check_key_padding_mask(memory_padding_mask, batch, seq_len)
        if memory_padding_mask is not None:  # E's row j projects the j-th real position
            memory, memory_padding_mask = real_tokens_first(memory_padding_mask, memory)
        return MemoryCache(*self.keys_values(memory, memory_padding_mask))

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        memory_padding_mask: Tensor | None = None,
        cache: MemoryCache | None = None,
    ) -> Tensor:
        """Attends every decoder position to the projected memory.

        Args:
            x: (B, M, dim) decoder states, any M.
            memory: (B, N, dim) encoder output; may be None when `cache` is filled.
            memory_padding_mask: optional bool (B, N), True at real memory positions.
            cache: generation: filled from `memory` on the first call (in place), reused
                after, so the memory is projected once.

        Returns:
            (B, M, dim).

        Raises:
            ValueError: if there is neither a memory nor a filled cache, or the memory's
                batch is not x's.
        """
        if cache is not None and cache.keys is not None:
            projected = cache
        elif memory is None:
            raise ValueError("cross-attention needs the encoder memory (or a filled MemoryCache)")
        else:
            projected = self.project_memory(memory, memory_padding_mask)
            if cache is not None:
                vars(cache).update(vars(projected))  # filled in place: the caller holds it
        check_input(x, self.dim)
        batch, seq_len, _ = x.shape
        if projected.keys.shape[0] != batch:
            raise ValueError(
                f"the memory holds {projected.keys.shape[0]} sequences and x {batch}: "
                f"one memory per decoder sequence"
            )
        q = apply_linear(self.to_q, x).view(batch, seq_len, self.num_heads, self.head_dim)
        q = q.transpose(1, 2)
        dropout_p = self.dropout if self.training else 0.0
        out = attend(q, projected.keys, projected.values, projected.mask, dropout_p)
        return self._merge(out)  # (B, M, dim)
