"""The spectrum measurement: known ranks, curve shape, padding, the report's numbers."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linformer_kit import LinformerConfig, LinformerModel
from linformer_kit.analysis.spectrum import (
    Spectra,
    attention_spectra,
    cost_ratio,
    cumulative_spectrum,
    mass_rank,
    summarize,
)


def low_rank_attention(n: int, rank: int, seed: int = 0) -> torch.Tensor:
    """A row-stochastic n x n matrix of rank `rank`: (n, r) @ (r, n), both row-stochastic."""
    generator = torch.Generator().manual_seed(seed)
    left = torch.randn(n, rank, generator=generator, dtype=torch.float64).mul(3).softmax(-1)
    right = torch.randn(rank, n, generator=generator, dtype=torch.float64).mul(3).softmax(-1)
    return left @ right


def block_attention(n: int, rank: int) -> torch.Tensor:
    """Row i attends uniformly to block i mod r of n / r keys: r equal singular values."""
    blocks = torch.arange(n) % rank
    return (blocks[:, None] == blocks[None, :]).double() / (n // rank)


@pytest.mark.parametrize("rank", [1, 3, 7, 16])
def test_rank_r_matrix_needs_exactly_r_for_all_the_mass(rank: int) -> None:
    p = low_rank_attention(48, rank)
    assert torch.allclose(p.sum(-1), torch.ones(48, dtype=torch.float64))
    curve = cumulative_spectrum(p)
    assert int(mass_rank(curve, 1.0)) == rank
    assert int(mass_rank(curve, 0.99)) <= rank


@pytest.mark.parametrize("rank", [2, 4, 8])
def test_equal_singular_values_need_r_for_99_percent(rank: int) -> None:
    curve = cumulative_spectrum(block_attention(32, rank).float())
    assert int(mass_rank(curve, 0.99)) == rank
    assert int(mass_rank(curve, 0.9)) == math.ceil(0.9 * rank - 1e-9)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    rows=st.integers(1, 12),
    cols=st.integers(1, 12),
    seed=st.integers(0, 1000),
)
def test_curve_is_monotone_and_ends_at_one(batch: int, rows: int, cols: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    p = torch.randn(batch, rows, cols, generator=generator).softmax(-1)
    curve = cumulative_spectrum(p)
    assert curve.shape == (batch, min(rows, cols))
    assert (curve.diff(dim=-1) >= -1e-12).all()
    assert torch.allclose(curve[..., -1], torch.ones(batch, dtype=torch.float64))
    ranks = mass_rank(curve, 0.95)
    assert ((ranks >= 1) & (ranks <= min(rows, cols))).all()


@pytest.mark.parametrize("mass", [0.0, -0.1, 1.5])
def test_mass_outside_unit_interval_is_rejected(mass: float) -> None:
    with pytest.raises(ValueError, match="mass must be a fraction"):
        mass_rank(torch.ones(3), mass)


@pytest.mark.parametrize("proj_dim", [None, 8])
def test_padding_never_changes_the_spectrum(proj_dim: int | None) -> None:
    torch.manual_seed(0)
    config = LinformerConfig(
        vocab_size=50, max_seq_len=24, dim=16, depth=2, num_heads=2, proj_dim=proj_dim
    )
    model = LinformerModel(config).eval()
    ids = torch.randint(0, 50, (1, 24))
    padded_mask = torch.arange(24)[None, :] < 15  # 15 real tokens, 9 padding
    padded = attention_spectra(model, [(ids, padded_mask)])
    alone = attention_spectra(model, [(ids[:, :15], torch.ones(1, 15, dtype=torch.bool))])
    assert padded.real_tokens == alone.real_tokens == 15
    for with_padding, without in zip(padded.curves, alone.curves):
        rank = without.shape[1]
        assert torch.allclose(with_padding[:, :rank], without, atol=1e-6)
        assert torch.all(with_padding[:, rank:] == 1.0)  # past the rank all mass is kept


def test_exact_attention_curves_run_to_n_and_linformer_to_k() -> None:
    config = LinformerConfig(
        vocab_size=50, max_seq_len=16, dim=16, depth=2, num_heads=4, proj_dim=None
    )
    batches = [(torch.randint(0, 50, (2, 16)), torch.ones(2, 16, dtype=torch.bool))]
    exact = attention_spectra(LinformerModel(config.replace(proj_dim=None)), batches)
    linformer = attention_spectra(LinformerModel(config.replace(proj_dim=4)), batches)
    assert [tuple(c.shape) for c in exact.curves] == [(4, 16)] * 2
    assert [tuple(c.shape) for c in linformer.curves] == [(4, 4)] * 2
    assert exact.num_sequences == 2


def test_summary_recommends_the_k_that_every_layer_needs() -> None:
    steps = torch.linspace(0.5, 1.0, 8, dtype=torch.float64)  # reaches 0.95 at index 8
    fast = torch.tensor([0.5, 0.96, 1, 1, 1, 1, 1, 1], dtype=torch.float64)  # at index 2
    spectra = Spectra(
        curves=[torch.stack([fast, fast]), torch.stack([fast, steps])],
        seq_len=8,
        num_sequences=1,
        real_tokens=8.0,
        proj_dims=[None, None],
    )
    report = summarize(spectra, [0.9], index=2)
    assert report["masses"] == [0.9, 0.95]
    assert [layer["k"]["0.95"] for layer in report["layers"]] == [2, 7]
    assert report["layers"][1]["heads"][1]["k"]["0.95"] == 8
    assert report["layers"][0]["value_at_index"] == [0.96, 0.96]
    best = report["recommendation"]
    assert (best["proj_dim"], best["proj_dim_every_head"]) == (7, 8)
    assert best["cost_ratio"]["time"] == pytest.approx(2 * 7 / 8)
    assert best["cost_ratio"]["n"] == 8
    # Texts shorter than the model: a Linformer runs them at their own length, so the cost
    # compares there (7 of 8 keys kept at a mean of 7.4 real tokens is no saving at all).
    short = summarize(dataclasses.replace(spectra, real_tokens=7.4), [0.9])["recommendation"]
    assert short["cost_ratio"]["n"] == 7
    assert short["cost_ratio"]["time"] == pytest.approx(2 * 7 / 7)
    assert summarize(spectra, [0.9])["index"] == 7  # default: the recommended k
    assert summarize(spectra, [0.9], index=20)["layers"][1]["value_at_index"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="index must be >= 1"):
        summarize(spectra, [0.9], index=0)


def test_cost_ratio_formula() -> None:
    ratio = cost_ratio(64, 512)
    assert ratio["time"] == pytest.approx(0.25)
    assert ratio["memory"] == pytest.approx(0.125)
    assert "2k/n" in ratio["formula"]
