"""Is a fused CPU attention sub-layer worth building? Two checks, interleaved per n.

1. The attention sub-layer (LayerNorm, `LinformerSelfAttention` with kv sharing on the
   explicit kernel, residual; dim 256, 4 heads, k 256, fwd+bwd) as the module runs it
   (autograd over some 40 ops) against the same math as one autograd function with a
   hand-written backward (`OneBackward`: the same GEMMs and kernel calls, the bias and
   projection gradients summed straight into their GEMMs, no autograd graph in between).
   If the graph and the small ops cost much, the second is faster.
2. The explicit attention kernel alone (`csrc/attention.cpp`) against its own GEMMs: the
   forward's 2 and the backward's 5 per block of rows, run by `torch.bmm` over all blocks
   at once into buffers made beforehand. If the kernel's softmax, mask, loops and fresh
   memory cost much, the GEMMs are faster.

Writes OUT/table.json (default benchmarks/kernels/sublayer/).

    PYTHONPATH=src python benchmarks/kernels_sublayer.py
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from kernels_fused import compiled_ops, write_table
from torch import Tensor, nn

from linformer_kit import native
from linformer_kit.attention import LinformerSelfAttention
from linformer_kit.bench.timing import time_interleaved
from linformer_kit.kernel_rule import use_kernel
from linformer_kit.projection import MatrixProjection
from linformer_kit.training.compare import machine

OUT = Path(__file__).parent / "kernels" / "sublayer"
DIM, HEADS, KEYS, ROWS = 256, 4, 256, 256  # ROWS: the explicit kernel's block of queries
NO_DROPOUT = -32768  # the kernel's dropout threshold that keeps every weight


class OneBackward(torch.autograd.Function):
    """The attention sub-layer's attention (q, kv-shared projection E, explicit kernel,
    output layer) with its backward written out: h (B, N, dim) -> (B, N, dim), E (N, k)."""

    @staticmethod
    def forward(ctx, h, wq, bq, wk, bk, wv, bv, wo, bo, e):  # noqa: ANN001, ANN205
        ops, (batch, n, dim) = native.cpu_ops(), h.shape
        head = dim // HEADS
        q = torch.addmm(bq, h.reshape(-1, dim), wq.t()).view(batch, n, HEADS, head)
        p = torch.matmul(e.t(), h)  # (B, K, dim)
        ones = e.sum(0)  # E 1: the rows' weights of the key / value biases
        k = torch.addmm(torch.outer(ones, bk).repeat(batch, 1), p.reshape(-1, dim), wk.t())
        v = torch.addmm(torch.outer(ones, bv).repeat(batch, 1), p.reshape(-1, dim), wv.t())
        args = (False, 1 / math.sqrt(head), h.new_zeros((), dtype=torch.int64), NO_DROPOUT)
        qkv = [t.view(batch, -1, HEADS, head).transpose(1, 2) for t in (q, k, v)]
        out, lse = ops.attention_forward(*qkv, None, *args, 1.0, ROWS)
        ctx.save_for_backward(h, wq, wk, bk, wv, bv, wo, e, *qkv, out, lse, p, ones)
        ctx.args = args
        return torch.addmm(bo, out.transpose(1, 2).reshape(-1, dim), wo.t()).view_as(h)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        h, wq, wk, bk, wv, bv, wo, e, q, k, v, out, lse, p, ones = ctx.saved_tensors
        batch, n, dim = h.shape
        grad, flat = grad.reshape(-1, dim), h.reshape(-1, dim)
        go = (grad @ wo).view(batch, n, HEADS, -1).transpose(1, 2)
        args = (*ctx.args, 1.0, ROWS, [True, True, True])
        gq, gk, gv = native.cpu_ops().attention_backward(go, q, k, v, None, lse, *args)
        gq, gk, gv = (t.transpose(1, 2).reshape(-1, dim) for t in (gq, gk, gv))
        gp = torch.addmm(gk @ wk, gv, wv).view(batch, -1, dim)
        gh = torch.baddbmm((gq @ wq).view_as(h), e.expand(batch, *e.shape), gp)
        gk_sum, gv_sum = gk.view(batch, -1, dim).sum(0), gv.view(batch, -1, dim).sum(0)
        ge = torch.einsum("bnc,bkc->nk", h, gp) + (gk_sum @ bk + gv_sum @ bv)
        p = p.reshape(-1, dim)
        out = out.transpose(1, 2).reshape(-1, dim)
        return (gh, gq.t() @ flat, gq.sum(0), gk.t() @ p, ones @ gk_sum, gv.t() @ p,
                ones @ gv_sum, grad.t() @ out, grad.sum(0), ge)  # fmt: skip


def sublayer(n: int) -> tuple[Tensor, nn.LayerNorm, LinformerSelfAttention, list[Tensor]]:
    """A (1, n, dim) input, the LayerNorm and attention (kv sharing) of the sub-layer, and
    the weights `OneBackward` takes, in its order."""
    torch.manual_seed(0)
    proj = MatrixProjection(max_seq_len=n, proj_dim=KEYS)
    attn = LinformerSelfAttention(dim=DIM, num_heads=HEADS, max_seq_len=n, proj_k=proj)
    layers = (attn.to_q, attn.to_k, attn.to_v, attn.to_out)
    weights = [t for layer in layers for t in (layer.weight, layer.bias)] + [proj.weight]
    return torch.randn(1, n, DIM, requires_grad=True), nn.LayerNorm(DIM), attn, weights


def sublayer_steps(n: int) -> dict[str, Callable[[], None]]:
    """The sub-layer's fwd+bwd by the module and by `OneBackward`, same weights."""
    x, norm, attn, weights = sublayer(n)

    def module() -> None:
        with use_kernel("explicit"):
            (x + attn(norm(x))[0]).sum().backward()

    def one_backward() -> None:
        (x + OneBackward.apply(norm(x), *weights)).sum().backward()

    return {"module": module, "one backward": one_backward}


def kernel_steps(n: int) -> dict[str, Callable[[], None]]:
    """The explicit kernel's forward and backward, and their GEMMs by `torch.bmm`."""
    ops, head, blocks = native.cpu_ops(), DIM // HEADS, HEADS * math.ceil(n / ROWS)
    q, k, v = (torch.randn(1, m, HEADS, head).transpose(1, 2) for m in (n, KEYS, KEYS))
    args = (False, 1 / math.sqrt(head), torch.zeros((), dtype=torch.int64), NO_DROPOUT, 1.0)
    out, lse = ops.attention_forward(q, k, v, None, *args, ROWS)
    grad = torch.randn_like(out)
    rows, keys = torch.randn(blocks, ROWS, head), torch.randn(blocks, KEYS, head)
    scores = torch.randn(blocks, ROWS, KEYS)
    # the products into buffers made once: fresh 16 MiB outputs would time page faults too
    into_scores, into_rows, into_keys = (
        torch.empty_like(scores),
        torch.empty_like(rows),
        torch.empty_like(keys),
    )

    def gemms(count: int) -> Callable[[], None]:
        products = [
            lambda: torch.bmm(rows, keys.transpose(1, 2), out=into_scores),  # S = Q K^T, dP
            lambda: torch.bmm(scores, keys, out=into_rows),  # O = P V, and dQ = dS K
            lambda: torch.bmm(scores.transpose(1, 2), rows, out=into_keys),  # dK, dV
        ]
        order = [0, 1] if count == 2 else [0, 0, 1, 2, 2]
        return lambda: [products[i]() for i in order]

    return {
        "kernel forward": lambda: ops.attention_forward(q, k, v, None, *args, ROWS),
        "its 2 GEMMs": gemms(2),
        "kernel backward": lambda: ops.attention_backward(
            grad, q, k, v, None, lse, *args, ROWS, [True] * 3
        ),
        "its 5 GEMMs": gemms(5),
    }


def main(argv: list[str] | None = None) -> None:
    """Times both checks at each n and writes table.json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", default="1024,4096", help="comma-separated sequence lengths")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=OUT, help="writes table.json there")
    args = parser.parse_args(argv)
    compiled_ops(args.threads)
    before, rows = machine(), []
    for n in (int(part) for part in args.n.split(",")):
        row: dict[str, object] = {"n": n}
        for check in (sublayer_steps, kernel_steps):
            times = time_interleaved(check(n), warmup=2, repeats=args.repeats, device="cpu")
            row |= {name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()}
        row["one backward / module"] = round(row["one backward"] / row["module"], 3)
        row["GEMMs / kernel, fwd"] = round(row["its 2 GEMMs"] / row["kernel forward"], 3)
        row["GEMMs / kernel, bwd"] = round(row["its 5 GEMMs"] / row["kernel backward"], 3)
        rows.append(row)
        print(row, flush=True)
    write_table(args.out, "kernels_sublayer.py", argv, before, {"rows": rows})


if __name__ == "__main__":
    main()
