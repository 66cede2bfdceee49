"""Causal Linformer: no future leak, equality with written-out references, refused kinds,
incremental generation and save/load of LinformerForCausalLM."""

import pytest
import torch
from reference import causal_block_attention

from linformer_kit import LinformerConfig, causal_attention

# Left padding, a hole and right padding; n = 11 is not a multiple of the block size.
MASK = torch.tensor(
    [[True] * 11, [False, False] + [True] * 6 + [False, True, False]], dtype=torch.bool
)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_causal_linformer_matches_a_position_by_position_reference(per_head, masked, block_size):
    torch.manual_seed(block_size)
    q, k, v = (torch.randn(2, 2, 11, 4, dtype=torch.float64) for _ in range(3))
    shape = (2, 20, 5) if per_head else (20, 5)
    proj_k, proj_v = (
        torch.randn(shape, dtype=torch.float64),
        torch.randn(shape, dtype=torch.float64),
    )
    mask = MASK if masked else None
    got = causal_attention(q, k, v, proj_k, proj_v, block_size=block_size, key_padding_mask=mask)
    want = causal_block_attention(q, k, v, proj_k, proj_v, block_size, mask)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("masked", [False, True])
def test_exact_causal_path_equals_a_masked_softmax(masked):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 4, dtype=torch.float64) for _ in range(3))
    mask = MASK[:, :9] if masked else torch.ones(2, 9, dtype=torch.bool)
    got = causal_attention(q, k, v, key_padding_mask=mask if masked else None)
    allowed = torch.ones(9, 9, dtype=torch.bool).tril() & mask[:, None, None, :]  # (B, 1, N, N)
    scores = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~allowed, float("-inf"))
    want = (scores.softmax(-1).nan_to_num() @ v) * mask[:, None, :, None]  # padded rows: 0
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(got, causal_block_attention(q, k, v, key_padding_mask=mask))


def test_config_refuses_kinds_that_cannot_be_causal_and_bad_values():
    base = dict(max_seq_len=32, proj_dim=8, causal=True)
    for projection in ("conv", "pool"):
        with pytest.raises(ValueError, match=f"causal=True cannot use projection='{projection}'"):
            LinformerConfig(**base, projection=projection)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        LinformerConfig(**base, block_size=0)
    with pytest.raises(ValueError, match="causal must be True or False"):
        LinformerConfig(**base | {"causal": 1})
