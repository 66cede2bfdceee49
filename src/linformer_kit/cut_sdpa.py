"""SDPA with its queries cut into chunks (`sdpa`), which a GPU's SDPA backward needs in
training with Linformer's few keys; `kernels.dot_product_attention` runs it, cut as
`kernel_rule.choose_splits` says."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    is_causal: bool = False,
    splits: int = 1,
) -> Tensor:
    """`F.scaled_dot_product_attention` with its N queries cut into `splits` chunks of
    consecutive rows that run as more batch entries over the same keys.

    A GPU's SDPA backward gives each block of keys of each (batch, head) to one thread
    block, which loops over all N queries: with Linformer's few keys (M = k), B x H x M / 64
    such blocks leave most SMs idle at small batches (B 1, H 4, k 256: 16 blocks on an
    H200's 132 SMs; at n = 4096 1.0 ms of the 1.8 ms of GPU time in an encoder layer's
    training step, `benchmarks/kernels/cuda/profile/`). Chunks multiply the blocks
    by `splits`; autograd sums the chunks' key and value gradients. Softmax rows are
    independent, so the output is the same to float rounding (with dropout, another draw of
    the same distribution). The forward's work, already one block per 64 queries, is
    unchanged; the cut costs copies of the keys and values (and of a mask) per chunk where
    the batch is over 1, of a mask with an N dimension always (an (N, M) mask becomes
    B x N x M), and the sums of their gradients.

    Args:
        q: (B, H, N, D).
        k, v: (B, H, M, D) and (B, H, M, Dv).
        attn_mask, dropout_p, scale, is_causal: as for SDPA (`dot_product_attention`).
        splits: chunks, dividing N; 1 (and any causal or non-4-D call) is one SDPA call.

    Returns:
        (B, H, N, Dv).

    Raises:
        ValueError: if `splits` is not a positive divisor of N.
    """
    seq_len = q.shape[-2]
    if splits < 1 or seq_len % splits:
        raise ValueError(f"splits must be a positive divisor of N = {seq_len}; got {splits}")
    if splits == 1 or is_causal or q.dim() != 4:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )
    batch = max(t.shape[0] for t in (q, k, v))  # SDPA broadcasts a batch of 1
    q, k, v = (t.expand(batch, *t.shape[1:]) for t in (q, k, v))

    def chunked(t: Tensor) -> Tensor:  # (B, H, N, D) -> (B * splits, H, N / splits, D)
        return t.unflatten(2, (splits, -1)).transpose(1, 2).flatten(0, 1)

    def repeated(t: Tensor) -> Tensor:  # (B, H, M, D) -> (B * splits, H, M, D)
        return t.unsqueeze(1).expand(batch, splits, *t.shape[1:]).flatten(0, 1)

    if attn_mask is not None:
        mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + attn_mask.shape)
        mask = mask.expand(batch, -1, -1, -1)  # (B, H or 1, N or 1, M)
        attn_mask = repeated(mask) if mask.shape[2] == 1 else chunked(mask)
    out = F.scaled_dot_product_attention(
        chunked(q), repeated(k), repeated(v), attn_mask=attn_mask, dropout_p=dropout_p,
        scale=scale,
    )  # fmt: skip
    return out.unflatten(0, (batch, splits)).transpose(1, 2).flatten(2, 3)
