"""Checks of the tensors a model or an attention function is given: shapes, dtypes, masks
and index ranges, each named in its error before any work."""

from __future__ import annotations

import torch
from torch import Tensor

from .native import transformed


def check_seq_len(seq_len: int, max_seq_len: int) -> None:
    """Raises ValueError unless a sequence's length is in [1, max_seq_len]."""
    if not 1 <= seq_len <= max_seq_len:
        problem = "holds no token" if seq_len < 1 else f"exceeds max_seq_len {max_seq_len}"
        raise ValueError(
            f"sequence length {seq_len} {problem}; inputs may have any length from 1 to "
            f"{max_seq_len}"
        )


def check_tensor(name: str, value: object, what: str) -> None:
    """Raises TypeError, naming `name`, for a `value` that is not a tensor (a list gave
    "'list' object has no attribute 'dim'", naming no argument)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {what}, got {type(value).__name__}")


def check_token_ids(ids: Tensor, name: str = "input_ids") -> None:
    """Raises ValueError unless `ids` is a (batch >= 1, seq_len) tensor (TypeError: not a
    tensor), naming `name`."""
    check_tensor(name, ids, "of token ids")
    if ids.dim() != 2 or ids.shape[0] < 1:
        raise ValueError(f"{name} must be (batch >= 1, seq_len), got shape {tuple(ids.shape)}")


def check_device(input_ids: Tensor, weight: Tensor) -> None:
    """Raises ValueError for ids on the meta device into a model that is not (`weight`'s
    device): they gave nan outputs without a word. Other devices are torch's to name (its
    error does), or a hook's to move (accelerate's offloading: weights on meta)."""
    if input_ids.is_meta and not weight.is_meta:
        raise ValueError(
            f"input_ids are on {input_ids.device}, the model on {weight.device}: move one to "
            f"the other's device (model.to(device) or input_ids.to(device))"
        )


def check_token_type_ids(token_type_ids: Tensor | None, input_ids: Tensor) -> None:
    """Raises ValueError unless segment ids, when given, are shaped as the ids (TypeError:
    not a tensor)."""
    if token_type_ids is None:
        return
    check_tensor("token_type_ids", token_type_ids, "of segment ids")
    if token_type_ids.shape != input_ids.shape:
        raise ValueError(
            f"token_type_ids must have input_ids' shape {tuple(input_ids.shape)}, got "
            f"{tuple(token_type_ids.shape)}"
        )


def check_states(states: object, depth: int, kind: type) -> None:
    """Raises ValueError unless generation `states` are a list of `depth` `kind`s, one a
    layer, as `init_states` makes them (an empty list gave an IndexError, a list of None an
    AttributeError, two models' states one model's generation without a word); None
    passes (no generation)."""
    if states is not None and (
        not isinstance(states, (list, tuple))
        or len(states) != depth
        or not all(isinstance(state, kind) for state in states)
    ):
        got = [type(s).__name__ for s in states] if isinstance(states, (list, tuple)) else states
        raise ValueError(
            f"states must be a list of {depth} {kind.__name__}s, one a layer, as init_states "
            f"makes them; got {got!r:.200}"
        )


def check_index_range(
    values: Tensor, size: int, name: str, ignore_index: int | None = None
) -> None:
    """Raises ValueError naming `name` and the dtype of values that are not int64 or int32
    (what an embedding takes), or the range and the first value outside [0, size)
    (`ignore_index` excepted). The range is checked on CPU in eager mode outside torch.func
    only: on a GPU it would cost a host sync per call (an out-of-range index fails there in a
    device-side assert), and vmap refuses the data-dependent branch."""
    if values.dtype not in (torch.int64, torch.int32):
        # the embedding, gather and cross_entropy named neither the argument nor the dtype
        raise ValueError(f"{name} must be an int64 (or int32) tensor, got dtype {values.dtype}")
    if values.device.type != "cpu" or torch.compiler.is_compiling() or transformed(values):
        return
    bad = (values < 0) | (values >= size)
    if ignore_index is not None:
        bad &= values != ignore_index
    if bad.any():
        allowed = f"[0, {size})"
        if ignore_index is not None:
            allowed += f" or equal ignore_index {ignore_index}"
        raise ValueError(f"{name} must lie in {allowed}; got {int(values[bad][0])}")


def check_input(x: Tensor, dim: int) -> None:
    """Raises ValueError unless `x` is a (batch, seq_len, dim) tensor."""
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(
            f"the input must have shape (batch, seq_len, dim={dim}), got {tuple(x.shape)}"
        )


def check_key_padding_mask(key_padding_mask: Tensor | None, batch: int, seq_len: int) -> None:
    """Raises ValueError unless the mask is a bool tensor of shape (batch, seq_len)
    (TypeError: not a tensor)."""
    if key_padding_mask is None:
        return
    check_tensor("key_padding_mask", key_padding_mask, "of bools")
    if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (batch, seq_len):
        raise ValueError(
            f"key_padding_mask must be a bool tensor of shape (batch, seq_len) = "
            f"({batch}, {seq_len}) with True at real tokens; got dtype "
            f"{key_padding_mask.dtype} and shape {tuple(key_padding_mask.shape)}"
        )


def check_rows_hold_a_token(key_padding_mask: Tensor, what: str) -> None:
    """Raises ValueError naming the first row of a (B, N) mask with no real token, as
    `what` (a prompt, a source)."""
    held = key_padding_mask.any(1)
    if not held.all():
        raise ValueError(f"key_padding_mask: {what} {int((~held).nonzero()[0])} has no real token")


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raises ValueError unless q, k and v are floating-point (B, H, N, D) tensors of one
    dtype, batch and heads, queries and keys of one head_dim, keys and values of one length
    (a value per key); TypeError for one that is not a tensor."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, "(batch, heads, seq_len, head_dim)")
    if not q.dim() == k.dim() == v.dim() == 4:
        raise ValueError(
            f"q, k and v must be (batch, heads, seq_len, head_dim), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.is_floating_point():  # matmul named neither the input nor the dtype
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if not q.dtype == k.dtype == v.dtype:  # a matmul's "expected scalar type Float"
        raise ValueError(f"q, k and v must be of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    # (B, H) and D of the queries: SDPA's and bmm's errors named no input, and one head of q
    # was broadcast over every head of k without a word
    if (q.shape[0], q.shape[1], q.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
        raise ValueError(
            f"q and k must be of one batch, heads and head_dim: got q of shape "
            f"{tuple(q.shape)} and k of shape {tuple(k.shape)}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"keys and values must be as many, of one batch and heads: got k of shape "
            f"{tuple(k.shape)} and v of shape {tuple(v.shape)}"
        )


def check_projections(proj_k: Tensor, proj_v: Tensor, num_heads: int | None = None) -> None:
    """Raises ValueError unless the key and value projections are (max_seq_len, K) or
    (H, max_seq_len, K) and give the same k rows (and, given `num_heads`, a per-head one has
    as many heads)."""
    for name, weight in (("proj_k", proj_k), ("proj_v", proj_v)):
        if weight.dim() not in (2, 3):
            raise ValueError(
                f"{name} must be (max_seq_len, K) or (heads, max_seq_len, K), got shape "
                f"{tuple(weight.shape)}"
            )
    if proj_k.shape[-1] != proj_v.shape[-1]:
        raise ValueError(
            f"proj_k and proj_v must project to the same k: got {proj_k.shape[-1]} and "
            f"{proj_v.shape[-1]} (shapes {tuple(proj_k.shape)} and {tuple(proj_v.shape)})"
        )
    if num_heads is not None:
        check_heads(proj_k, num_heads)
        check_heads(proj_v, num_heads)


def check_heads(weight: Tensor, num_heads: int) -> None:
    """Raises ValueError if a per-head (H, max_seq_len, K) projection has not `num_heads`."""
    if weight.dim() == 3 and weight.shape[0] != num_heads:
        raise ValueError(
            f"a per-head projection of shape {tuple(weight.shape)} has {weight.shape[0]} "
            f"heads; the inputs have {num_heads}"
        )
