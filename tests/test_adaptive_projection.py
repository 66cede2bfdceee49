"""The `adaptive` projection: blocks sized to each sequence's real length, its first token a
block of its own, exact attention for inputs of <= k tokens, and padding that changes nothing."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linformer_kit import LinformerConfig, LinformerModel
from linformer_kit.projection import (
    AdaptivePoolProjection,
    MatrixProjection,
    adaptive_block_index,
)


def tiny(**changes):
    base = dict(
        vocab_size=50,
        max_seq_len=40,
        dim=16,
        depth=2,
        num_heads=2,
        proj_dim=6,
        projection="adaptive",
        dropout=0.0,
        attention_dropout=0.0,
    )
    return LinformerConfig(**{**base, **changes})


masks = st.lists(st.lists(st.booleans(), min_size=1, max_size=30), min_size=1, max_size=4).map(
    lambda rows: [row + [False] * (30 - len(row)) for row in rows]
)


@settings(max_examples=100, deadline=None)
@given(rows=masks, proj_dim=st.integers(1, 12))
def test_blocks_are_contiguous_balanced_and_start_with_the_first_token_alone(rows, proj_dim):
    real = torch.tensor(rows)
    block = adaptive_block_index(real, proj_dim)
    assert ((block < 0) == ~real).all()
    for row_real, row_block in zip(real, block):
        blocks = row_block[row_real].tolist()  # the real tokens' blocks, in order
        length = len(blocks)
        if length <= proj_dim:
            assert blocks == list(range(length))  # one token per block: exact attention
            continue
        assert sorted(blocks) == blocks and set(blocks) == set(range(proj_dim))
        if proj_dim > 1:
            assert blocks.count(0) == 1  # the first token alone
            sizes = [blocks.count(b) for b in range(1, proj_dim)]
            assert max(sizes) - min(sizes) <= 1


@settings(max_examples=50, deadline=None)
@given(rows=masks, proj_dim=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_projection_is_the_mean_of_each_block_computed_by_hand(rows, proj_dim, seed):
    real = torch.tensor(rows)
    x = torch.randn(*real.shape, 2, 3, generator=torch.Generator().manual_seed(seed)).double()
    out, mask = AdaptivePoolProjection(proj_dim)(x, real)
    block = adaptive_block_index(real, proj_dim)
    assert out.shape == (len(rows), min(proj_dim, real.shape[1]), 2, 3)
    for b in range(len(rows)):
        for j in range(out.shape[1]):
            members = [i for i in range(real.shape[1]) if block[b, i] == j]
            assert bool(mask[b, j]) == bool(members)
            want = sum(x[b, i] for i in members) / len(members) if members else 0 * x[b, 0]
            torch.testing.assert_close(out[b, j], want, atol=1e-12, rtol=0)


def test_without_a_mask_every_block_is_real():
    out, mask = AdaptivePoolProjection(4)(torch.randn(2, 9, 1, 5))
    assert mask is None and out.shape == (2, 4, 1, 5)


def test_inputs_of_at_most_k_tokens_are_attended_exactly():
    torch.manual_seed(0)
    adaptive = LinformerModel(tiny(proj_dim=12)).double().eval()
    exact = LinformerModel(tiny(proj_dim=None, projection="linear")).double().eval()
    exact.load_state_dict(adaptive.state_dict())  # no projection parameters to differ
    ids = torch.randint(0, 50, (3, 20))
    mask = torch.arange(20)[None, :] < torch.tensor([12, 7, 1])[:, None]
    got = adaptive(ids, mask).last_hidden_state
    want = exact(ids, mask).last_hidden_state
    torch.testing.assert_close(got[mask], want[mask], atol=1e-10, rtol=0)
    longer = torch.randint(0, 50, (1, 30))  # 30 > k: now it is an approximation
    assert not torch.allclose(adaptive(longer).last_hidden_state, exact(longer).last_hidden_state)


def test_a_short_input_keeps_its_tokens_where_a_fixed_pooling_averages_them():
    """The reason for the kind: at n = 40, k = 8 a 10-token input gets 8 blocks, not 2."""
    real = torch.ones(1, 10, dtype=torch.bool)
    fixed = LinformerModel(tiny(proj_dim=8, projection="pool")).encoder.layers[0].attn.proj_k
    assert fixed(torch.randn(1, 10, 1, 4), real)[0].shape[1] == 2
    assert AdaptivePoolProjection(8)(torch.randn(1, 10, 1, 4), real)[0].shape[1] == 8


def test_the_projection_runs_where_float64_is_the_default_dtype():
    # Its block counts were made in the default dtype and scattered float32 into them.
    x = torch.randn(2, 10, 1, 8, dtype=torch.float64)
    mask = torch.arange(10) < torch.tensor([[10], [6]])
    expected, _ = AdaptivePoolProjection(4)(x, mask)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out, kept = AdaptivePoolProjection(4)(x, mask)
    finally:
        torch.set_default_dtype(before)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert kept.all()


def test_the_projection_classes_check_their_k_as_build_projection_does():
    # MatrixProjection(proj_dim=0) made 0 rows and AdaptivePoolProjection(0) failed in torch.
    with pytest.raises(ValueError, match=r"proj_dim must be an integer in \[1, max_seq_len=16\]"):
        MatrixProjection(max_seq_len=16, proj_dim=0)
    for bad in (0, -2, 2.5):
        with pytest.raises(ValueError, match="proj_dim must be"):
            AdaptivePoolProjection(bad)
