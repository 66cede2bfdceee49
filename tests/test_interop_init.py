"""Projection inits of converted models, on a tiny post-LN model (fast) as the teacher."""

import pytest
import torch

from linformer_kit import LinformerModel, linformer_tiny
from linformer_kit.functional import project_blocks
from linformer_kit.interop import init_projections, mean_pooling_matrix, projection_init
from linformer_kit.interop.projection_init import (
    balanced_bounds,
    block_matrix,
    received_attention,
    top_eigenvectors,
)

N = 32


def tiny(**overrides):
    config = linformer_tiny(**{"max_seq_len": N, "proj_dim": 8, "norm_first": False, **overrides})
    return LinformerModel(config).eval()


@pytest.fixture
def teacher():
    torch.manual_seed(0)
    return tiny(proj_dim=None)


def calibration():
    return torch.randint(1, 1000, (4, N), generator=torch.Generator().manual_seed(0))


def test_mean_init_is_mean_pooling_at_full_length():
    x = torch.randn(2, N, 1, 5)
    weight = mean_pooling_matrix(N, 8)
    pooled, _ = project_blocks(x, N // 8)
    assert torch.allclose(weight.T @ x.view(2, N, 5), pooled.view(2, 8, 5), atol=1e-6)
    uneven = mean_pooling_matrix(10, 3)
    assert torch.allclose(uneven.sum(0), torch.ones(3)) and (uneven > 0).sum() == 10


@pytest.mark.parametrize("sharing", ["layerwise", "kv", "headwise", "none"])
@pytest.mark.parametrize("init", ["xavier", "mean", "svd", "attention"])
def test_every_init_sets_every_projection(teacher, sharing, init):
    model = tiny(sharing=sharing)
    model.load_state_dict(teacher.state_dict(), strict=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".proj_" in name:
                p.fill_(float("nan"))
    init_projections(model, init, teacher=teacher, calibration_ids=calibration())
    out = model(calibration()).last_hidden_state
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("sharing", ["none", "headwise", "kv", "layerwise"])
def test_attention_init_pools_by_the_attention_each_projection_serves(
    teacher, sharing, monkeypatch
):
    # Layerwise (one projection for every layer) hid a per-layer projection set from every
    # layer's attention; the default with calibration text is this init (mean without). The
    # tiny teacher's attention is near uniform (its blocks those of mean pooling): each
    # layer and head here receives its own sink.
    model, ids = tiny(sharing=sharing), calibration()
    depth, heads = len(model.encoder.layers), model.config.num_heads
    mass = torch.ones(depth, heads, N)
    for layer in range(depth):
        for head in range(heads):
            mass[layer, head, (7 * layer + 3 * head + 5) % N] = 50.0
    monkeypatch.setattr(projection_init, "received_attention", lambda teacher, ids: mass)
    init_projections(model, None, teacher=teacher, calibration_ids=ids)
    for index, layer in enumerate(model.encoder.layers):
        served = mass.sum(0) if sharing == "layerwise" else mass[index]
        weight = layer.attn.proj_k.weight
        per_head = served if weight.dim() == 3 else served.sum(0, keepdim=True)
        want = torch.stack([block_matrix(balanced_bounds(m, 8), N) for m in per_head])
        torch.testing.assert_close(weight, want.view_as(weight), atol=0, rtol=0)
    init_projections(model, None, teacher=teacher)  # no calibration text: mean pooling
    weight = model.encoder.layers[0].attn.proj_k.weight
    torch.testing.assert_close(weight, mean_pooling_matrix(N, 8).expand_as(weight))


def test_xavier_init_draws_within_glorot_s_bound():
    model = tiny()
    init_projections(model, "xavier")
    bound = (6.0 / (N + 8)) ** 0.5
    weight = model.encoder.layers[0].attn.proj_k.weight
    assert 0.9 * bound < weight.abs().max() <= bound


def test_data_driven_columns_average_real_rows(teacher):
    model = tiny()
    init_projections(model, "svd", teacher=teacher, calibration_ids=calibration())
    weight = model.encoder.layers[0].attn.proj_k.weight
    assert torch.allclose(weight.abs().sum(0), torch.ones(8), atol=1e-5)
    assert (weight.sum(0) >= 0).all()


def test_top_eigenvectors_find_the_dominant_direction():
    direction = torch.zeros(N, dtype=torch.float64)
    direction[:4] = -1.0
    gram = 10 * torch.outer(direction, direction) + torch.eye(N, dtype=torch.float64) * 1e-3
    top = top_eigenvectors(gram, 2)
    assert torch.allclose(top[:4, 0], torch.full((4,), 0.25, dtype=torch.float64))
    assert top[4:, 0].abs().max() < 1e-6


def test_balanced_blocks_give_a_sink_its_own_block():
    mass = torch.ones(N)
    mass[0] = 100.0
    bounds = balanced_bounds(mass, 8)
    assert bounds[:2].tolist() == [0, 1] and len(bounds) == 8
    assert (bounds.diff() > 0).all() and bounds[-1] < N
    assert torch.equal(balanced_bounds(torch.ones(N), 8), torch.arange(0, N, 4))
    # half the share uniform by default: a tail that receives no attention keeps blocks
    tail = torch.tensor([1.0] * 4 + [0.0] * 12)
    assert balanced_bounds(tail, 4).tolist() == [0, 2, 3, 7]
    weight = block_matrix(bounds, N)
    assert torch.allclose(weight.sum(0), torch.ones(8)) and weight[0, 0] == 1.0


def test_balanced_blocks_stay_non_empty_when_mass_is_at_the_end():
    mass = torch.zeros(N)
    mass[-1] = 1.0
    bounds = balanced_bounds(mass, 8, uniform=0.0)
    assert (bounds.diff() > 0).all() and bounds[-1] <= N - 1


def test_received_attention_sums_to_the_number_of_queries(teacher):
    mass = received_attention(teacher, calibration())
    assert mass.shape == (2, 4, N)
    assert torch.allclose(mass.sum(-1), torch.full((2, 4), 4.0 * N, dtype=torch.float64))


def test_bad_init_requests_are_refused(teacher):
    with pytest.raises(ValueError, match="init must be one of"):
        init_projections(tiny(), "orthogonal")
    with pytest.raises(ValueError, match="needs the exact teacher"):
        init_projections(tiny(), "svd")
    with pytest.raises(ValueError, match="max_seq_len=32"):
        init_projections(tiny(), "attention", teacher=teacher, calibration_ids=calibration()[:, :9])
    with pytest.raises(ValueError, match="applies to projection='linear' only"):
        init_projections(tiny(projection="pool"), "mean")
