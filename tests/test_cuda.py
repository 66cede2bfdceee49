"""What only a GPU runs, on a GPU (skipped without one): the explicit kernel's backward cut
as the CUDA rule cuts it (`kernel_rule.choose_reduction_splits`), SDPA cut into query
chunks (`choose_splits`), and the attention layer on the rule's kernel, against float64
references computed by SDPA on the same device.

    python -m pytest tests/test_cuda.py   # on a machine with a GPU
"""

import pytest
import torch
import torch.nn.functional as F
from reference import grads

from linformer_kit.attention import LinformerSelfAttention
from linformer_kit.kernel_rule import (
    choose_reduction_splits,
    choose_splits,
    use_kernel,
    use_reduction_splits,
)
from linformer_kit.kernels import dot_product_attention
from linformer_kit.projection import MatrixProjection

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = torch.device("cuda")


def heads_split(batch, n, heads, d, dtype):
    """(B, H, n, d) as the layers pass it: a view of (B, n, H, d)."""
    return torch.randn(batch, n, heads, d, device=GPU, dtype=dtype).transpose(1, 2)


@pytest.mark.parametrize("kernel", ["explicit", "sdpa"])
def test_the_rule_s_cuts_give_sdpa_s_gradients_in_fp32(kernel):
    # B 1, H 4, n 16384, k 256, head_dim 64: the rule cuts the explicit kernel's backward
    # into 32 chunks and SDPA's queries into 32; fp32 (no TF32) against float64.
    torch.manual_seed(0)
    q = heads_split(1, 16384, 4, 64, torch.float32)
    k, v = (torch.randn(1, 4, 256, 64, device=GPU) for _ in "kv")
    shape = dict(groups=4, keys=256, head_dim=64)
    assert choose_reduction_splits(device=GPU, dtype=q.dtype, rows=16384, **shape) == 32
    call = dict(dtype=q.dtype, backward=True, causal=False, queries=16384, keys=256, groups=4)
    assert choose_splits(device=GPU, **call) == 32
    result = grads(lambda *t: dot_product_attention(*t, kernel=kernel), q, k, v)
    reference = grads(F.scaled_dot_product_attention, *(t.double() for t in (q, k, v)))
    for got, want in zip(result, reference):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("splits", [2, 8, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_pinned_cuts_of_the_explicit_backward_are_exact_in_float64(splits, causal):
    torch.manual_seed(splits)
    q = heads_split(2, 1024, 3, 32, torch.float64)
    keys = 1024 if causal else 96
    k, v = (torch.randn(2, 3, keys, 32, device=GPU, dtype=torch.float64) for _ in "kv")
    mask = None if causal else torch.rand(2, 1, 1, keys, device=GPU) < 0.7
    if mask is not None:
        mask[..., 0] = True
    call = dict(attn_mask=mask, is_causal=causal)
    with use_reduction_splits(splits):
        result = grads(lambda *t: dot_product_attention(*t, kernel="explicit", **call), q, k, v)
    reference = grads(lambda *t: F.scaled_dot_product_attention(*t, **call), q, k, v)
    for got, want in zip(result, reference):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_cut_backward_drops_the_weights_the_uncut_one_drops():
    # Dropout 0.1 under one seed: the cut changes how dK and dV are summed, not the mask.
    q = heads_split(1, 16384, 4, 64, torch.float64)
    k, v = (torch.randn(1, 4, 256, 64, device=GPU, dtype=torch.float64) for _ in "kv")

    def run(splits):
        torch.manual_seed(3)
        with use_reduction_splits(splits):
            fn = lambda *t: dot_product_attention(*t, dropout_p=0.1, kernel="explicit")  # noqa: E731
            return grads(fn, q, k, v)

    for got, want in zip(run(32), run(1)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def padded_layer():
    """The attention layer (k 256, n 16384) on the GPU, an input (2, 16384, 256) and its
    mask, the second row padded from 12000."""
    torch.manual_seed(0)
    projection = MatrixProjection(max_seq_len=16384, proj_dim=256)
    layer = LinformerSelfAttention(dim=256, num_heads=4, max_seq_len=16384, proj_k=projection)
    x = torch.randn(2, 16384, 256, device=GPU)
    mask = torch.ones(2, 16384, dtype=torch.bool, device=GPU)
    mask[1, 12000:] = False
    return layer.to(GPU), x, mask


@pytest.mark.parametrize("kernel", [None, "explicit"])
def test_the_layer_on_a_gpu_gives_its_float64_output_with_padding(kernel):
    # The attention layer (k 256) at n 16384 with padding, on the rule's kernel (SDPA cut)
    # or pinned to the explicit one (its backward cut), fp32 against the same layer in
    # float64; padded positions change nothing.
    layer, x, mask = padded_layer()
    with use_kernel(kernel):
        out, grad_x = grads(lambda t: layer(t, mask)[0], x)
    wide = layer.double()
    want, want_grad = grads(lambda t: wide(t, mask)[0], x.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad_x.double(), want_grad, rtol=1e-4, atol=1e-4)
    layer.float()
    changed = x.clone()
    changed[1, 12000:] = 7.0
    with use_kernel(kernel), torch.no_grad():
        torch.testing.assert_close(layer(changed, mask)[0][1, :12000], out[1, :12000].detach())
