"""Reference attention written independently of the library: plain float64 formulas."""

import math

import torch


def softmax_attention(q, k, v, key_padding_mask=None):
    """softmax(Q K^T / sqrt(d)) V over (B, H, N, D) with masked keys at -inf."""
    scores = torch.einsum("bhnd,bhmd->bhnm", q, k) / math.sqrt(q.shape[-1])
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
    return torch.einsum("bhnm,bhmd->bhnd", scores.softmax(-1), v)


def projected_attention(q, k, v, proj_k, proj_v, key_padding_mask=None):
    """Paper eq. 7 written out head by head: softmax(Q (E K)^T / sqrt(d)) F V, with E = proj^T
    restricted to the first n rows and padded keys/values zeroed."""
    n = k.shape[2]
    if key_padding_mask is not None:
        keep = key_padding_mask[:, None, :, None].to(k.dtype)
        k, v = k * keep, v * keep
    heads = []
    for h in range(q.shape[1]):
        e = (proj_k[h] if proj_k.dim() == 3 else proj_k)[:n].T  # (K, N)
        f = (proj_v[h] if proj_v.dim() == 3 else proj_v)[:n].T
        heads.append(softmax_attention(q[:, h : h + 1], e @ k[:, h : h + 1], f @ v[:, h : h + 1]))
    return torch.cat(heads, dim=1)
