"""Given the same weights, our attention equals an implementation nobody on this team wrote:
lucidrains' `linformer` (PyPI 0.2.3, the `bench` and `dev` extras)."""

import pytest
import torch

from linformer_kit import LinformerSelfAttention
from linformer_kit.projection import build_projection

peer = pytest.importorskip("linformer")

DIM, HEADS, MAX_LEN, K = 32, 4, 48, 12


def twins(seed: int = 0) -> tuple[torch.nn.Module, LinformerSelfAttention]:
    """lucidrains' layer (random init) and ours holding the same weights, in float64.

    lucidrains shares one E and one F across the heads of a layer (our `headwise`) and has no
    biases on the query/key/value layers, so ours gets zero biases there.
    """
    torch.manual_seed(seed)
    theirs = peer.LinformerSelfAttention(DIM, MAX_LEN, k=K, heads=HEADS).double().eval()

    def projection():
        return build_projection(projection="linear", max_seq_len=MAX_LEN, proj_dim=K)

    ours = LinformerSelfAttention(
        dim=DIM, num_heads=HEADS, max_seq_len=MAX_LEN, proj_k=projection(), proj_v=projection()
    )
    ours = ours.double().eval()
    with torch.no_grad():
        for name in ("to_q", "to_k", "to_v"):
            getattr(ours, name).weight.copy_(getattr(theirs, name).weight)
            getattr(ours, name).bias.zero_()
        ours.to_out.weight.copy_(theirs.to_out.weight)
        ours.to_out.bias.copy_(theirs.to_out.bias)
        ours.proj_k.weight.copy_(theirs.proj_k)
        ours.proj_v.weight.copy_(theirs.proj_v)
    return theirs, ours


@pytest.mark.parametrize("seq_len", [MAX_LEN, 30, 5])
def test_same_weights_give_the_same_output_as_lucidrains(seq_len):
    theirs, ours = twins()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, seq_len, DIM, dtype=torch.float64, generator=generator)
    # Both slice the projection to its first n rows for a shorter input.
    torch.testing.assert_close(ours(x)[0], theirs(x), rtol=0, atol=1e-12)


def test_same_gradients_as_lucidrains():
    theirs, ours = twins(seed=2)
    x = torch.randn(2, 40, DIM, dtype=torch.float64)
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    theirs(x_theirs).square().sum().backward()
    ours(x_ours)[0].square().sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(ours.proj_k.weight.grad, theirs.proj_k.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(ours.to_q.weight.grad, theirs.to_q.weight.grad, rtol=0, atol=1e-10)


def test_padding_is_where_lucidrains_goes_wrong():
    """lucidrains has no mask: padding changes its outputs at real positions; ours does not."""
    theirs, ours = twins(seed=3)
    x = torch.randn(1, 20, DIM, dtype=torch.float64)
    padded = torch.cat([x, torch.randn(1, 10, DIM, dtype=torch.float64)], dim=1)
    mask = torch.arange(30)[None] < 20
    alone = ours(x)[0]
    torch.testing.assert_close(ours(padded, mask)[0][:, :20], alone, rtol=0, atol=1e-12)
    assert not torch.allclose(theirs(padded)[:, :20], theirs(x), atol=1e-3)
