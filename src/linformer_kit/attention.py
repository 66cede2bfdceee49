"""LinformerSelfAttention: multi-head self-attention over sequence-projected keys and values."""

from __future__ import annotations

from torch import Tensor, nn

from .functional import attend, attention_weights, check_key_padding_mask, check_seq_len
from .projection import ExactProjection, SequenceProjection


class LinformerSelfAttention(nn.Module):
    """Multi-head self-attention whose keys and values are projected along the sequence.

    When the projection is shared across heads, E (X W + b) = (E X) W + (E 1) b: projecting
    the input first and applying the key/value weights to k rows instead of n is exactly
    equal and far cheaper. The order is chosen per call by multiply-add count.

    Args:
        dim: model width.
        num_heads: attention heads; must divide dim.
        max_seq_len: longest input accepted.
        proj_k: the key projection (E).
        proj_v: the value projection (F); pass `proj_k` again to share them.
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
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.max_seq_len = max_seq_len
        self.dropout = dropout
        self.to_q = nn.Linear(dim, dim, bias=bias)
        self.to_k = nn.Linear(dim, dim, bias=bias)
        self.to_v = nn.Linear(dim, dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)
        self.proj_k = proj_k if proj_k is not None else ExactProjection()
        self.proj_v = proj_v if proj_v is not None else self.proj_k

    def projects_input_first(self, seq_len: int) -> bool:
        """Whether projecting the input before the key/value layers costs fewer multiply-adds."""
        if self.proj_k.per_head or self.proj_v.per_head:
            return False
        rows = self.proj_k.output_len(seq_len)
        times = 1 if self.proj_k is self.proj_v else 2
        first = times * self.proj_k.flops(seq_len, self.dim) + 2 * rows * self.dim**2
        after = 2 * seq_len * self.dim**2 + 2 * self.proj_k.flops(seq_len, self.dim)
        return first < after

    def forward(
        self, x: Tensor, key_padding_mask: Tensor | None = None, return_attention: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Attends every position to the projected keys and values.

        Args:
            x: (B, N, dim) with N <= max_seq_len.
            key_padding_mask: optional bool (B, N), True at real tokens.
            return_attention: also return the context-mapping matrix P (materialised
                separately; the output itself always comes from SDPA).

        Returns:
            The output (B, N, dim), and P of shape (B, H, N, M) when asked for, else None
            (M = k for Linformer, N for exact attention).

        Raises:
            ValueError: if N exceeds max_seq_len or the mask is malformed.
        """
        batch, seq_len, _ = x.shape
        check_seq_len(seq_len, self.max_seq_len)
        check_key_padding_mask(key_padding_mask, batch, seq_len)
        heads, head_dim = self.num_heads, self.head_dim
        q = self.to_q(x).view(batch, seq_len, heads, head_dim).transpose(1, 2)  # (B, H, N, D)
        if self.projects_input_first(seq_len):
            k, v, kv_mask = self._project_then_map(x, key_padding_mask)
        else:
            k = self.to_k(x).view(batch, seq_len, heads, head_dim)  # (B, N, H, D)
            v = self.to_v(x).view(batch, seq_len, heads, head_dim)
            k, kv_mask = self.proj_k(k, key_padding_mask)  # (B, M, H, D)
            v, _ = self.proj_v(v, key_padding_mask)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, H, M, D)
        dropout_p = self.dropout if self.training else 0.0
        out = attend(q, k, v, kv_mask, dropout_p)  # (B, H, N, D)
        out = self.to_out(out.transpose(1, 2).reshape(batch, seq_len, self.dim))
        return out, (attention_weights(q, k, kv_mask) if return_attention else None)

    def _project_then_map(
        self, x: Tensor, key_padding_mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Keys and values as (E X) W_k + (E 1) b_k and (F X) W_v + (F 1) b_v: (B, M, H, D)."""
        batch, seq_len, _ = x.shape
        x = x.view(batch, seq_len, 1, self.dim)  # (B, N, 1, dim)
        ones = x.new_ones(batch, seq_len, 1, 1)
        k_in, kv_mask = self.proj_k(x, key_padding_mask)  # (B, M, 1, dim)
        k_ones = self.proj_k(ones, key_padding_mask)[0]  # (B, M, 1, 1)
        if self.proj_v is self.proj_k:
            v_in, v_ones = k_in, k_ones
        else:
            v_in = self.proj_v(x, key_padding_mask)[0]
            v_ones = self.proj_v(ones, key_padding_mask)[0]
        return self._map(k_in, k_ones, self.to_k), self._map(v_in, v_ones, self.to_v), kv_mask

    def _map(self, projected: Tensor, projected_ones: Tensor, linear: nn.Linear) -> Tensor:
        """Applies a key/value layer to projected rows: (B, M, 1, dim) -> (B, M, H, D)."""
        out = nn.functional.linear(projected, linear.weight)
        if linear.bias is not None:
            out = out + projected_ones * linear.bias
        return out.view(out.shape[0], -1, self.num_heads, self.head_dim)
