"""The spectrum of the context-mapping matrix P = softmax(Q Kᵀ / √d) (paper §3, Figure 1).

The paper measures "self-attention is low rank" with the normalised cumulative singular
values of P: curve[i] = (s_1 + ... + s_{i+1}) / (s_1 + ... + s_r), singular values sorted in
decreasing order. If a few values hold most of the mass, a rank-k approximation loses little.
`attention_spectra` captures P through `output_attentions` (no second model) and averages the
curves over sequences, per layer and head, using only each sequence's real tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..models import LinformerModel

MASS_TOLERANCE = 1e-6  # "keeps 100%" must survive float64 rounding of the tail
RECOMMENDED_MASS = 0.95  # the recommendation keeps this share of the mass in every layer


def cumulative_spectrum(matrices: Tensor) -> Tensor:
    """Normalised cumulative singular values of each matrix.

    Args:
        matrices: (..., N, M).

    Returns:
        (..., min(N, M)) float64, non-decreasing, ending at 1 (all zeros for a zero matrix).
    """
    values = torch.linalg.svdvals(matrices.double())  # (..., R), descending
    total = values.sum(-1, keepdim=True)
    return values.cumsum(-1) / torch.where(total > 0, total, torch.ones_like(total))


def mass_rank(curve: Tensor, mass: float) -> Tensor:
    """The smallest k whose top-k singular values hold `mass` of the spectral mass.

    Args:
        curve: (..., R) cumulative curves from `cumulative_spectrum`.
        mass: fraction in (0, 1].

    Returns:
        (...) int64, each in [1, R].

    Raises:
        ValueError: if mass is outside (0, 1].
    """
    if not 0 < mass <= 1:
        raise ValueError(f"mass must be a fraction in (0, 1], got {mass}")
    reached = curve >= mass - MASS_TOLERANCE  # (..., R)
    reached[..., -1] = True
    return reached.int().argmax(-1) + 1


def pad_curve(curve: Tensor, length: int) -> Tensor:
    """Extends (..., R) curves to `length` with 1.0: past the rank, all mass is kept."""
    return torch.nn.functional.pad(curve, (0, length - curve.shape[-1]), value=1.0)


def real_token_curves(attention: Tensor, key_padding_mask: Tensor, exact: bool) -> Tensor:
    """Cumulative spectra of one layer's P over real tokens only.

    Padded query rows are dropped; for exact attention, padded key columns too (they are
    zero, so this only saves time). Sequences of equal real length share one batched SVD.

    Args:
        attention: (B, H, N, M) from `output_attentions`.
        key_padding_mask: bool (B, N), True at real tokens.
        exact: whether M indexes the N positions (exact attention) or k projected rows.

    Returns:
        (B, H, R) float64 with R = min(N, M), each curve padded with 1.0 past its rank.
    """
    batch, heads, seq_len, keys = attention.shape
    length = min(seq_len, keys)
    lengths = key_padding_mask.sum(1)  # (B,)
    # Real positions first, in order, for every sequence: any padding pattern works.
    order = key_padding_mask.int().argsort(dim=1, descending=True, stable=True)  # (B, N)
    curves = attention.new_empty(batch, heads, length, dtype=torch.float64)
    for n in lengths.unique().tolist():
        group = (lengths == n).nonzero().squeeze(1)  # (G,)
        rows = order[group, :n]  # (G, n)
        p = attention[group].gather(2, rows[:, None, :, None].expand(-1, heads, -1, keys))
        if exact:
            p = p.gather(3, rows[:, None, None, :].expand(-1, heads, n, -1))  # (G, H, n, n)
        curves[group] = pad_curve(cumulative_spectrum(p), length)
    return curves


@dataclass
class Spectra:
    """Mean cumulative spectra of a model over some sequences.

    Attributes:
        curves: one (H, R_layer) float64 tensor per layer, averaged over sequences.
        seq_len: the padded sequence length N the model ran at.
        num_sequences: sequences averaged.
        real_tokens: mean real length n of those sequences.
        proj_dims: each layer's k (None for exact attention).
    """

    curves: list[Tensor]
    seq_len: int
    num_sequences: int
    real_tokens: float
    proj_dims: list[int | None]


@torch.no_grad()
def attention_spectra(
    model: LinformerModel, batches: Iterable[tuple[Tensor, Tensor]], *, total: int | None = None
) -> Spectra:
    """Runs the model on batches and averages every layer's and head's cumulative spectrum.

    Args:
        model: a backbone (eval mode is set here).
        batches: (input_ids (B, N), key_padding_mask (B, N)) pairs, all of the same N.
        total: number of batches, for the progress bar.

    Returns:
        The averaged spectra.

    Raises:
        ValueError: if there are no batches or their lengths differ.
    """
    model.eval()
    proj_dims = model.config.proj_dims
    sums: list[Tensor] | None = None
    count, tokens, seq_len = 0, 0, None
    for input_ids, mask in tqdm(batches, total=total, desc="spectrum", unit=" batch", leave=False):
        if seq_len is not None and input_ids.shape[1] != seq_len:
            raise ValueError(f"all batches need one length; got {input_ids.shape[1]} and {seq_len}")
        seq_len = input_ids.shape[1]
        attentions = model(input_ids, mask, output_attentions=True).attentions
        curves = [
            real_token_curves(p, mask, k is None).sum(0) for p, k in zip(attentions, proj_dims)
        ]  # per layer (H, R)
        sums = curves if sums is None else [s + c for s, c in zip(sums, curves)]
        count += input_ids.shape[0]
        tokens += int(mask.sum())
    if sums is None or seq_len is None:
        raise ValueError("no sequences to analyse")
    return Spectra([s / count for s in sums], seq_len, count, tokens / count, proj_dims)


def cost_ratio(proj_dim: int, seq_len: int) -> dict[str, float | str]:
    """Linformer's theoretical attention cost relative to exact attention at length n.

    Per head of width d, exact attention does Q Kᵀ and P V: 2·n²·d multiply-adds and an n×n
    matrix. Linformer projects keys and values (E K, F V: 2·k·n·d) and attends to k rows
    (Q (E K)ᵀ and P̄ (F V): 2·n·k·d): 4·n·k·d multiply-adds and an n×k matrix.
    """
    return {
        "time": 2 * proj_dim / seq_len,
        "memory": proj_dim / seq_len,
        "formula": "time 4nkd / 2n²d = 2k/n (E K, F V, Q(EK)ᵀ, P̄(FV) vs Q Kᵀ, P V); "
        "memory of the attention matrix nk / n² = k/n",
    }


def summarize(spectra: Spectra, masses: Sequence[float], index: int | None = None) -> dict:
    """The JSON report: per layer and head, the mean curve and the k for each mass; the
    recommended k; and each head's curve value at `index` (the heatmap).

    Args:
        spectra: from `attention_spectra`.
        masses: spectral-mass fractions, e.g. (0.9, 0.95, 0.99); 0.95 is always added.
        index: k at which the heatmap reads the curves (1-based; past a curve's end it reads
            1.0); None = the recommended k, so the heatmap shows what each head keeps there.

    Raises:
        ValueError: for a mass outside (0, 1] or index < 1.
    """
    if index is not None and index < 1:
        raise ValueError(f"index must be >= 1, got {index}")
    masses = sorted({*masses, RECOMMENDED_MASS})
    layers = []
    for number, (curves, k) in enumerate(zip(spectra.curves, spectra.proj_dims)):
        mean = curves.mean(0)  # (R,) averaged over heads
        ranks = {m: mass_rank(curves, m).tolist() for m in masses}
        heads = [
            {
                "head": h,
                "curve": [round(v, 6) for v in curves[h].tolist()],
                "k": {str(m): ranks[m][h] for m in masses},
            }
            for h in range(curves.shape[0])
        ]
        layers.append(
            {
                "layer": number,
                "proj_dim": k,
                "mean_curve": [round(v, 6) for v in mean.tolist()],
                "k": {str(m): int(mass_rank(mean, m)) for m in masses},
                "heads": heads,
            }
        )
    # A Linformer runs each text at its own length, so the cost compares at the real tokens'
    # mean, not the padded n (texts much shorter than the model read far too cheap at n).
    real_len = min(spectra.seq_len, max(1, round(spectra.real_tokens)))
    recommended = recommend(layers, RECOMMENDED_MASS, real_len)
    index = index or recommended["proj_dim"]
    for layer, curves in zip(layers, spectra.curves):
        padded = pad_curve(curves, max(index, curves.shape[1]))  # (H, >= index)
        layer["value_at_index"] = [round(v, 6) for v in padded[:, index - 1].tolist()]
    return {
        "seq_len": spectra.seq_len,
        "num_sequences": spectra.num_sequences,
        "mean_real_tokens": spectra.real_tokens,
        "definition": "curve[i] = (s_1 + ... + s_(i+1)) / sum(s): normalised cumulative "
        "singular values of each head's attention matrix, averaged over sequences (real "
        "tokens only): P = softmax(QKᵀ/√d), n × n, in an exact layer; P̄ = "
        "softmax(Q(EK)ᵀ/√d), n × k, in a Linformer layer (whose k then bounds the curve and "
        "the recommendation)",
        "masses": list(masses),
        "index": index,
        "layers": layers,
        "recommendation": recommended,
    }


def recommend(layers: list[dict], mass: float, seq_len: int) -> dict:
    """The k keeping `mass` in every layer (head-averaged curves) and in every single head,
    with the theoretical cost ratio of a Linformer with that k at length `seq_len` (its
    `"n"`)."""
    key = str(mass)
    per_layer = max(layer["k"][key] for layer in layers)
    per_head = max(head["k"][key] for layer in layers for head in layer["heads"])
    return {
        "mass": mass,
        "proj_dim": per_layer,
        "proj_dim_every_head": per_head,
        "cost_ratio": {"n": seq_len, **cost_ratio(per_layer, seq_len)},
    }
