"""LinformerSelfAttention: multi-head self-attention over sequence-projected keys and values."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .causal import block_projections, causal_attention, summary_scale
from .checks import check_positive, check_probability
from .functional import attend, attention_weights, real_tokens_first
from .input_checks import check_input, check_key_padding_mask, check_seq_len
from .linear_backend import apply_linear, linear
from .projection import ExactProjection, MatrixProjection, SequenceProjection


@dataclass
class CausalState:
    """What one causal attention layer keeps between generation steps.

    Its size is O((k + block_size) D) per head for causal Linformer, whatever the length
    generated; exact attention keeps every key and value (a plain KV cache).

    Attributes:
        length: positions consumed so far.
        key_sums, value_sums: (B, H, K, D) unscaled E[:L]^T K[:L] and F[:L]^T V[:L] of the L
            positions of the completed blocks; None until the first block completes.
        keys, values: (B, H, T, D) the open block's keys and values (exact: all of them).
    """

    length: int = 0
    key_sums: Tensor | None = None
    value_sums: Tensor | None = None
    keys: Tensor | None = None
    values: Tensor | None = None


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
        causal: position i attends to positions <= i only (see `causal_attention`).
        block_size: causal Linformer's block of exactly attended positions.

    Raises:
        ValueError: if dropout is outside [0, 1) or block_size < 1; if the key and value
            projections give different k (or one is exact and the other not); if causal is
            asked of a projection that is not a matrix (conv, pool).
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
        causal: bool = False,
        block_size: int = 64,
    ) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("num_heads", num_heads), ("max_seq_len", max_seq_len)):
            check_positive(name, value)
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        check_probability("dropout", dropout)
        check_positive("block_size", block_size)
        for name, proj in (("proj_k", proj_k), ("proj_v", proj_v)):
            if proj is not None and not isinstance(proj, SequenceProjection):
                raise TypeError(  # a kind's name ("linear") failed in an attribute lookup
                    f"{name} must be a SequenceProjection (projection.build_projection makes "
                    f"one of a kind) or None (exact attention), got {type(proj).__name__}"
                )
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.max_seq_len = max_seq_len
        self.dropout = dropout
        self.to_q = nn.Linear(dim, dim, bias=bias)
        self.to_k = nn.Linear(dim, dim, bias=bias)
        self.to_v = nn.Linear(dim, dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)
        self.proj_k = proj_k if proj_k is not None else ExactProjection()
        self.proj_v = proj_v if proj_v is not None else self.proj_k
        self.causal, self.block_size = causal, block_size
        self.projected = not isinstance(self.proj_k, ExactProjection)
        kinds = f"{type(self.proj_k).__name__} and {type(self.proj_v).__name__}"
        if self.projected == isinstance(self.proj_v, ExactProjection):
            raise ValueError(f"proj_k and proj_v must both project or both be exact; got {kinds}")
        rows = [proj.output_len(max_seq_len) for proj in (self.proj_k, self.proj_v)]
        if rows[0] != rows[1]:
            raise ValueError(
                f"proj_k and proj_v must project to as many rows: {kinds} give {rows[0]} and "
                f"{rows[1]} at max_seq_len {max_seq_len}"
            )
        if causal and self.projected:
            for proj in (self.proj_k, self.proj_v):
                if not isinstance(proj, MatrixProjection):
                    raise ValueError(
                        f"causal attention needs a matrix projection (linear or random), got "
                        f"{type(proj).__name__}: its windows would mix in later positions"
                    )

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
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        return_attention: bool = False,
        state: CausalState | None = None,
        right_padded: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attends every position to the projected keys and values.

        Args:
            x: (B, N, dim) with N <= max_seq_len; with `state`, the N positions that follow
                the state's.
            key_padding_mask: optional bool (B, N), True at real tokens.
            return_attention: also return the context-mapping matrix P (materialised
                separately; the output itself comes from `attend`'s kernel).
            state: causal only: the generation state to continue, updated in place.
            right_padded: every row's real tokens come first (as `LinformerModel` passes
                them): positions are projected as they are. False gathers the real tokens
                first (one copy of x), so that row j of E and F projects the j-th real token
                wherever the padding is.

        Returns:
            The output (B, N, dim), and P of shape (B, H, N, M) when asked for, else None
            (M = k for Linformer, N for exact attention, lower-triangular when causal).

        Raises:
            ValueError: if N exceeds max_seq_len or the mask is malformed; for
                `return_attention` with causal Linformer attention or a `state`, a padded
                `state`, and a `state` without causal attention.
        """
        check_input(x, self.dim)
        batch, seq_len, _ = x.shape
        check_seq_len(seq_len, self.max_seq_len)
        check_key_padding_mask(key_padding_mask, batch, seq_len)
        heads, head_dim = self.num_heads, self.head_dim
        q = apply_linear(self.to_q, x).view(batch, seq_len, heads, head_dim)
        q = q.transpose(1, 2)  # (B, H, N, D)
        dropout_p = self.dropout if self.training else 0.0
        if self.causal:
            if return_attention and (self.projected or state is not None):
                raise ValueError(
                    "return_attention is not available with causal Linformer attention (its "
                    "weights are per block: own keys and prefix summaries, not one N x M "
                    "matrix) nor with a generation state"
                )
            out = self._merge(self._causal(x, q, key_padding_mask, state, dropout_p))
            if not return_attention:
                return out, None
            k = apply_linear(self.to_k, x).view(batch, seq_len, heads, head_dim).transpose(1, 2)
            return out, attention_weights(q, k, key_padding_mask, causal=True)  # (B, H, N, N)
        if state is not None:
            raise ValueError("a generation state needs causal attention (causal=True)")
        kv_x = x
        if key_padding_mask is not None and self.projected and not right_padded:
            # left or inner padding took rows of E and F (the queries stay where they are)
            kv_x, key_padding_mask = real_tokens_first(key_padding_mask, x)
        k, v, kv_mask = self.keys_values(kv_x, key_padding_mask)
        out = attend(q, k, v, kv_mask, dropout_p)  # (B, H, N, D)
        return self._merge(out), (attention_weights(q, k, kv_mask) if return_attention else None)

    def keys_values(
        self, x: Tensor, key_padding_mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The projected keys and values of `x` (B, N, dim), each (B, H, M, D), and the mask
        of the M rows that may be attended to (None when all may); `key_padding_mask`'s
        padding on the right (`functional.real_first`)."""
        batch, seq_len, _ = x.shape
        if self.projects_input_first(seq_len):
            k, v, kv_mask = self._project_then_map(x, key_padding_mask)
        else:
            shape = (batch, seq_len, self.num_heads, self.head_dim)
            k = apply_linear(self.to_k, x).view(shape)  # (B, N, H, D)
            v = apply_linear(self.to_v, x).view(shape)
            k, kv_mask = self.proj_k(k, key_padding_mask)  # (B, M, H, D)
            v, _ = self.proj_v(v, key_padding_mask)
        return k.transpose(1, 2), v.transpose(1, 2), kv_mask  # (B, H, M, D)

    def _merge(self, out: Tensor) -> Tensor:
        """Joins the heads and applies the output layer: (B, H, N, D) -> (B, N, dim)."""
        batch, _, seq_len, _ = out.shape
        return apply_linear(self.to_out, out.transpose(1, 2).reshape(batch, seq_len, self.dim))

    def _causal(
        self,
        x: Tensor,
        q: Tensor,
        key_padding_mask: Tensor | None,
        state: CausalState | None,
        dropout_p: float,
    ) -> Tensor:
        """Causal attention of a whole sequence, or of the positions continuing `state`."""
        batch, seq_len, _ = x.shape
        shape = (batch, seq_len, self.num_heads, self.head_dim)
        k = apply_linear(self.to_k, x).view(shape).transpose(1, 2)  # (B, H, N, D)
        v = apply_linear(self.to_v, x).view(shape).transpose(1, 2)
        weights = (self.proj_k.weight, self.proj_v.weight) if self.projected else (None, None)
        if state is not None and key_padding_mask is not None:
            raise ValueError("generation with a state takes unpadded input_ids (no mask)")
        if state is None or state.length == 0:
            out = causal_attention(
                q,
                k,
                v,
                *weights,
                block_size=self.block_size,
                key_padding_mask=key_padding_mask,
                dropout_p=dropout_p,
            )
            if state is not None:
                self._start(state, k, v)
            return out
        check_seq_len(state.length + seq_len, self.max_seq_len)
        if state.keys.shape[0] != batch:  # (B, H, T, D), set by the first chunk
            raise ValueError(
                f"the generation state holds a batch of {state.keys.shape[0]}, the input {batch}: "
                "continue a state with the rows it started with"
            )
        steps = [
            self._step(state, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], dropout_p)
            for t in range(seq_len)
        ]
        return torch.cat(steps, 2)  # (B, H, N, D)

    def _start(self, state: CausalState, k: Tensor, v: Tensor) -> None:
        """Fills an empty state from a first chunk's keys and values, (B, H, N, D)."""
        seq_len = k.shape[2]
        done = seq_len // self.block_size * self.block_size if self.projected else 0
        if done:
            self._fold(state, k[:, :, :done], v[:, :, :done], 0)
        state.keys, state.values = k[:, :, done:], v[:, :, done:]
        state.length = seq_len

    def _fold(self, state: CausalState, keys: Tensor, values: Tensor, start: int) -> None:
        """Adds the projections of complete blocks, keys and values (B, H, T, D) at
        positions start .. start + T - 1, to the state's prefix sums."""
        rows = slice(start, start + keys.shape[2])
        new_k, new_v = (
            block_projections(x, proj.weight[..., rows, :], self.block_size).sum(2)  # (B, H, K, D)
            for x, proj in ((keys, self.proj_k), (values, self.proj_v))
        )
        if state.key_sums is None:
            state.key_sums, state.value_sums = new_k, new_v
        else:
            state.key_sums, state.value_sums = state.key_sums + new_k, state.value_sums + new_v

    def _step(
        self, state: CausalState, q: Tensor, k: Tensor, v: Tensor, dropout_p: float
    ) -> Tensor:
        """Attends one new position (B, H, 1, D) to the prefix summaries and the open block,
        then folds the block into the summaries once it is complete."""
        state.keys = torch.cat([state.keys, k], 2)  # (B, H, T, D)
        state.values = torch.cat([state.values, v], 2)
        keys, values = state.keys, state.values
        if state.key_sums is not None:
            prefix_len = torch.tensor(state.length - keys.shape[2] + 1, device=k.device)
            scale = summary_scale(prefix_len).to(k.dtype)
            keys = torch.cat([state.key_sums * scale, keys], 2)  # (B, H, K + T, D)
            values = torch.cat([state.value_sums * scale, values], 2)
        out = attend(q, keys, values, None, dropout_p)  # (B, H, 1, D)
        state.length += 1
        if self.projected and state.length % self.block_size == 0:
            self._fold(state, state.keys, state.values, state.length - self.block_size)
            state.keys, state.values = k[:, :, :0], v[:, :, :0]
        return out

    def _project_then_map(
        self, x: Tensor, key_padding_mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Keys and values as (E X) W_k + (E 1) b_k and (F X) W_v + (F 1) b_v: (B, M, H, D)."""
        batch, seq_len, _ = x.shape
        x = x.view(batch, seq_len, 1, self.dim)  # (B, N, 1, dim)
        k_in, kv_mask = self.proj_k(x, key_padding_mask)  # (B, M, 1, dim)
        k_ones = self.proj_k.project_ones(x, key_padding_mask)  # (B, M, 1, 1)
        if self.proj_v is self.proj_k:
            v_in, v_ones = k_in, k_ones
        else:
            v_in = self.proj_v(x, key_padding_mask)[0]
            v_ones = self.proj_v.project_ones(x, key_padding_mask)
        return self._map(k_in, k_ones, self.to_k), self._map(v_in, v_ones, self.to_v), kv_mask

    def _map(self, projected: Tensor, projected_ones: Tensor, layer: nn.Linear) -> Tensor:
        """Applies a key/value layer to projected rows: (B, M, 1, dim) -> (B, M, H, D)."""
        out = linear(projected, layer.weight)
        if layer.bias is not None:
            out = out + projected_ones * layer.bias
        return out.view(*out.shape[:2], self.num_heads, self.head_dim)  # batch may be 0
