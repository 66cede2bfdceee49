"""Reference attention written independently of the library: plain float64 formulas, and
`grads`, a function's output with its inputs' gradients, to compare two computations by."""

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


def causal_block_attention(q, k, v, proj_k=None, proj_v=None, block_size=1, key_padding_mask=None):
    """Causal (block) attention built position by position: the real token i, the r-th real
    one, attends to the real tokens of its own block (real indices b*bs .. r) and, from the
    second block on, to the summaries E[:L]^T K[:L] / sqrt(L) of the L = b*bs real tokens
    before, E's row j projecting the j-th real token. No projection: every real key <= i.
    Padded positions output 0."""
    batch, heads, n, d = q.shape
    out = torch.zeros_like(q)
    for b in range(batch):
        real = [j for j in range(n) if key_padding_mask is None or key_padding_mask[b, j]]
        for h in range(heads):
            e = None if proj_k is None else (proj_k[h] if proj_k.dim() == 3 else proj_k)
            f = None if proj_v is None else (proj_v[h] if proj_v.dim() == 3 else proj_v)
            for r, i in enumerate(real):
                first = 0 if e is None else r // block_size * block_size
                keys = [k[b, h, real[j]] for j in range(first, r + 1)]
                values = [v[b, h, real[j]] for j in range(first, r + 1)]
                if first:
                    seen = real[:first]
                    keys = list(e[:first].T @ k[b, h, seen] / math.sqrt(first)) + keys
                    values = list(f[:first].T @ v[b, h, seen] / math.sqrt(first)) + values
                scores = torch.stack(keys) @ q[b, h, i] / math.sqrt(d)
                out[b, h, i] = scores.softmax(0) @ torch.stack(values)
    return out


def grads(fn, *inputs, seed=1):
    """fn's output and the gradients of its inputs for one fixed random output gradient (drawn
    in float64, then cast: the same values whatever the output's dtype and device)."""
    inputs = [t.detach().requires_grad_() for t in inputs]
    out = fn(*inputs)
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64).to(out)
    return (out, *torch.autograd.grad(out, inputs, grad))
