"""Dropout masks by position: 16 SplitMix64 bits per element, a pure function of a seed
drawn from torch's generator and the element's row, made on CPU by the compiled kernels
(`csrc/`, via `native.cpu_ops`) in the pass that applies them and made again in backward
instead of being stored.

Two users: the explicit attention kernel (`kernels`), which drops the attention weights
and folds the rescaling into its next GEMM, and `Dropout`, the `nn.Dropout` of the models'
embeddings, sub-layer outputs and heads. Where the compiled kernels do not apply (a GPU,
fp16, no compiler) the attention kernel makes the same mask with PyTorch ops and
`Dropout` is `nn.Dropout`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import native
from .native import transformed

# Dropout probabilities are rounded to a multiple of 2^-16 (|error| <= 7.6e-6): the mask
# compares 16 uniform random bits with a threshold. The rescaling uses the rounded value,
# so the expectation of the output is exactly the undropped one.
_LEVELS = 1 << 16
# SplitMix64's constants as the int64 values of their bits (`splitmix64`, csrc/bits.h).
GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX = (0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64))
# The dtypes of the compiled kernels (bf16 computed in float, rounded once).
NATIVE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _shift_right(words: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 words (torch's `>>` on int64 copies the sign bit)."""
    return (words >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(states: Tensor) -> Tensor:
    """SplitMix64's output function (Steele et al. 2014; Java's SplittableRandom) on int64
    states, wrapping as uint64 arithmetic: output i of the generator seeded with s is
    `splitmix64(s + i * GOLDEN)`; `dropout_bits` seeds it with seed * GOLDEN."""
    states = (states ^ _shift_right(states, 30)) * _MIX[0]
    states = (states ^ _shift_right(states, 27)) * _MIX[1]
    return states ^ _shift_right(states, 31)


def dropout_seed(device: torch.device) -> Tensor:
    """One draw of torch's default generator (a 0-d int64 on `device`): the seed of one
    call's dropout bits, so `torch.manual_seed` and saved RNG states repeat the masks.
    Out of place (randint, not random_): torch.compile traces it without a graph break."""
    return torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64, device=device)


def dropout_bits(
    weights: Tensor,
    seed: Tensor | int,
    row_first: int = 0,
    seq_len: int | None = None,
    words_per_row: int | None = None,
) -> Tensor:
    """16 uniform random bits (int16) per weight of a block (..., rows, keys), the draw
    `drop` compares with p: a pure function of the seed and each weight's position.

    Row r of all the call's (..., seq_len) rows owns outputs r * words_per_row + 1 onwards
    of the SplitMix64 generator seeded with seed * GOLDEN; the four 16-bit lanes of each
    64-bit word serve four consecutive weights. So a weight's bits do not depend on how the
    rows are cut into blocks, nor on how many of its row's keys a causal block computes, and
    the compiled CPU kernels (`csrc/bits.h`) make the same bits without storing them.

    Output i is splitmix64((seed + i) * GOLDEN), the seed added before the product: so
    torch.compile does not see `arange * GOLDEN`, a product of positions alone, which
    Inductor (torch 2.11) turned into an index expression and printed in the Triton
    kernel's 32-bit index type, where the 64-bit constant does not fit ("Scalar
    -7046029254386353131 is out of range for type int32", at n = 16384 on a GPU;
    pytorch/pytorch#183901; torch 2.13's Inductor computes such values in their own dtype,
    `value_expr`).

    Args:
        weights: the block, (..., rows, keys); only its shape and device are read.
        seed: `dropout_seed`'s draw (or its int value).
        row_first: index of the block's first row among the seq_len.
        seq_len: rows per (..., ) matrix in the call; default the block's rows.
        words_per_row: 64-bit words per row, at least ceil(keys / 4); default that.
    """
    *lead, rows, keys = weights.shape
    seq_len = rows if seq_len is None else seq_len
    words = (keys + 3) // 4
    words_per_row = words if words_per_row is None else words_per_row
    device = weights.device
    row = torch.arange(row_first, row_first + rows, device=device)
    row = torch.arange(math.prod(lead), device=device)[:, None] * seq_len + row  # (G, rows)
    counters = (row * words_per_row + 1)[..., None] + torch.arange(words, device=device)
    states = splitmix64(counters.add_(seed).mul_(GOLDEN))  # (G, rows, words)
    return states.view(torch.int16)[..., :keys].reshape(weights.shape)


def drop(weights: Tensor, bits: Tensor, dropout_p: float) -> Tensor:
    """The weights with a fraction `dropout_p` set to 0 (a new tensor, not rescaled): those
    whose `dropout_bits` fall under p's `threshold`; the caller applies `rescaling`.

    The comparison writes float 0/1 straight into the output, multiplied in place by the
    weights: a bool mask would cost a conversion pass, and `masked_fill` is slower still.
    """
    kept = torch.ge(bits, threshold(dropout_p), out=torch.empty_like(weights))  # 1 - p
    return kept.mul_(weights)


def threshold(dropout_p: float) -> int:
    """The int16 bits at or above which a weight is kept: P = 1 - p rounded to 2^-16."""
    return round(dropout_p * _LEVELS) - _LEVELS // 2


def rescaling(dropout_p: float) -> float:
    """1 / (1 - p) for the rounded p; 0 if every weight is dropped."""
    dropped = round(dropout_p * _LEVELS)
    return 0.0 if dropped == _LEVELS else _LEVELS / (_LEVELS - dropped)


def native_ops(x: Tensor, dtype: torch.dtype | None = None) -> object | None:
    """The compiled kernels where they apply to `x`, or to x cast to `dtype` (CPU, fp32 /
    fp64 / bf16; eager or under torch.compile, which traces each op as one node; not inside
    a torch.func transform) and could be built; None otherwise."""
    if x.device.type != "cpu" or (dtype or x.dtype) not in NATIVE_DTYPES:
        return None
    if transformed(x):
        return None  # torch.func: the compiled kernels have no batching rules
    return native.cpu_ops()


class Dropout(nn.Dropout):
    """`nn.Dropout` (same arguments, same state, `isinstance` of it) whose training pass on
    CPU in fp32 / fp64 / bf16 runs the compiled kernel: the mask is made, applied and
    rescaled in one pass, and made again in backward from its seed instead of being saved.
    Elsewhere, and with `inplace=True`, it is `nn.Dropout` itself.

    Why: on CPU `nn.Dropout` draws its mask with `bernoulli_` from torch's serial mt19937
    and keeps it for backward; on a (1, 4096, 256) activation (2 threads, idle) its forward
    and backward took 6.5 ms, this module's 0.85 ms, a plain `x * 1.0` 0.65 ms (AVX-512
    Xeon; 10.2 vs 3.8 ms on an AVX2 EPYC, with the kernel's forward then unvectorised
    there), and an encoder layer has two of them.
    """

    def forward(self, x: Tensor) -> Tensor:
        """x with a fraction p of its elements zeroed and the rest scaled by 1 / (1 - p)
        (training), or x (eval)."""
        applies = self.training and not self.inplace and self.p > 0.0  # (p = 0: no build)
        ops = native_ops(x) if applies and x.dim() > 0 and x.numel() > 0 else None
        if ops is None:
            return super().forward(x)
        # Rows of the last dimension; backward applies the same mask, made again from the
        # seed (`native`), so no mask is saved.
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        seed = dropout_seed(x.device)
        return ops.dropout_forward(rows, seed, threshold(self.p), rescaling(self.p)).view(x.shape)
