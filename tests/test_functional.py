import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import projected_attention, softmax_attention

from linformer_kit import LinformerSelfAttention, causal_attention, cross_attention, native
from linformer_kit.functional import (
    attend,
    attention_weights,
    exact_attention,
    linformer_attention,
    project_blocks,
    project_linear,
)
from linformer_kit.kernel_rule import use_kernel
from linformer_kit.kernels import dot_product_attention
from linformer_kit.projection import build_projection

B, H, D = 2, 3, 4


def qkv(n, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g, dtype=dtype) for _ in range(3)]


def test_identity_projection_equals_exact_attention_at_full_length():
    n = 16
    q, k, v = qkv(n)
    eye = torch.eye(n, dtype=torch.float64)
    out = linformer_attention(q, k, v, eye, eye)
    torch.testing.assert_close(out, softmax_attention(q, k, v), atol=1e-10, rtol=0)


def test_exact_attention_masks_keys_like_the_reference():
    n = 12
    q, k, v = qkv(n)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[0, 7:] = False
    out = exact_attention(q, k, v, mask)
    torch.testing.assert_close(out, softmax_attention(q, k, v, mask), atol=1e-10, rtol=0)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_linformer_attention_matches_eq7(per_head, masked):
    n, max_len, kdim = 10, 16, 5
    q, k, v = qkv(n)
    shape = (H, max_len, kdim) if per_head else (max_len, kdim)
    proj_k, proj_v = (
        torch.randn(shape, dtype=torch.float64),
        torch.randn(shape, dtype=torch.float64),
    )
    mask = None
    if masked:
        mask = torch.ones(B, n, dtype=torch.bool)
        mask[1, 4:] = False
    out = linformer_attention(q, k, v, proj_k, proj_v, mask)
    ref = projected_attention(q, k, v, proj_k, proj_v, mask)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("per_head", [False, True])
def test_gradcheck_linformer_attention(per_head):
    n, max_len, kdim = 6, 8, 3
    q, k, v = (t.requires_grad_() for t in qkv(n))
    shape = (H, max_len, kdim) if per_head else (max_len, kdim)
    proj_k = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    proj_v = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True] * n, [True] * 4 + [False] * (n - 4)])
    assert torch.autograd.gradcheck(
        lambda *t: linformer_attention(*t, key_padding_mask=mask), (q, k, v, proj_k, proj_v)
    )


def test_gradcheck_exact_attention_and_block_projection():
    q, k, v = (t.requires_grad_() for t in qkv(5))
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    assert torch.autograd.gradcheck(lambda *t: exact_attention(*t, mask), (q, k, v))
    x = torch.randn(B, 7, H, D, dtype=torch.float64, requires_grad=True)
    kernel = torch.randn(H, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    assert torch.autograd.gradcheck(lambda x, w: project_blocks(x, 3, w, mask)[0], (x, kernel))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 12),
    pad=st.integers(0, 6),
    per_head=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_padding_never_changes_real_outputs(n, pad, per_head, seed):
    torch.manual_seed(seed)
    q, k, v = qkv(n + pad, seed=seed)
    shape = (H, 18, 4) if per_head else (18, 4)
    proj_k, proj_v = (
        torch.randn(shape, dtype=torch.float64),
        torch.randn(shape, dtype=torch.float64),
    )
    mask = torch.zeros(B, n + pad, dtype=torch.bool)
    mask[:, :n] = True
    alone = linformer_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], proj_k, proj_v)
    k[:, :, n:], v[:, :, n:] = float("nan"), float("inf")  # whatever padding holds
    padded = linformer_attention(q, k, v, proj_k, proj_v, mask)[:, :, :n]
    torch.testing.assert_close(padded, alone, atol=1e-10, rtol=0)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 10), pad=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_padding_anywhere_never_changes_real_outputs_nor_cross_attention(n, pad, seed):
    # The functions projected by absolute position, so left or inner padding moved the real
    # tokens onto other rows of E and F (cross-attention's output moved by 6.6 where its
    # module, which gathers the real tokens first, moved by 0).
    g = torch.Generator().manual_seed(seed)
    q, k, v = qkv(n, seed=seed)
    proj_k, proj_v = (torch.randn(H, 18, 4, generator=g, dtype=torch.float64) for _ in "kv")
    mask = torch.zeros(B, n + pad, dtype=torch.bool)
    for row in range(B):  # the real tokens at random places, in order
        mask[row, torch.randperm(n + pad, generator=g)[:n].sort().values] = True
    padded = [torch.full((B, H, n + pad, D), float("nan"), dtype=torch.float64) for _ in "qkv"]
    for t, alone in zip(padded, (q, k, v)):
        t.transpose(1, 2)[mask] = alone.transpose(1, 2).reshape(B * n, H, D)
    out = linformer_attention(*padded, proj_k, proj_v, mask).transpose(1, 2)[mask]
    expected = linformer_attention(q, k, v, proj_k, proj_v).transpose(1, 2).reshape(B * n, H, D)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    queries = torch.randn(B, H, 3, D, generator=g, dtype=torch.float64)
    out = cross_attention(queries, *padded[1:], proj_k, proj_v, key_padding_mask=mask)
    torch.testing.assert_close(
        out, cross_attention(queries, k, v, proj_k, proj_v), atol=1e-10, rtol=0
    )


@pytest.mark.parametrize(
    "attention",
    [
        lambda q, k, v, proj, mask: linformer_attention(q, k, v, proj, proj, mask),
        lambda q, k, v, proj, mask: exact_attention(q, k, v, mask),
        lambda q, k, v, proj, mask: causal_attention(q, k, v, proj, key_padding_mask=mask),
        lambda q, k, v, proj, mask: causal_attention(q, k, v, key_padding_mask=mask),
        lambda q, k, v, proj, mask: cross_attention(q[:, :, :3], k, v, proj, key_padding_mask=mask),
    ],
    ids=["linformer", "exact", "causal", "exact-causal", "cross"],
)
def test_nan_and_inf_in_padded_keys_and_values_never_reach_real_outputs(attention):
    # A mask multiplied in would give 0 * nan = nan: padded rows must be filled with zeros.
    q, k, v = qkv(9)
    proj = torch.randn(12, 4, dtype=torch.float64)
    mask = torch.ones(B, 9, dtype=torch.bool)
    mask[1, 6:] = False
    clean = attention(q, k, v, proj, mask)
    k[1, :, 6:], v[1, :, 6:] = float("nan"), float("-inf")
    torch.testing.assert_close(attention(q, k, v, proj, mask), clean, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kernel", [None, torch.full((3,), 1 / 3, dtype=torch.float64)])
def test_block_projections_never_let_padded_nan_through(kernel):
    x = torch.randn(B, 7, H, D, dtype=torch.float64)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    clean = project_blocks(x, 3, kernel, mask)[0]
    x[1, 4:] = float("nan")
    torch.testing.assert_close(project_blocks(x, 3, kernel, mask)[0], clean)


def test_too_long_sequence_names_both_numbers():
    q, k, v = qkv(20)
    proj = torch.randn(16, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"20.*max_seq_len 16"):
        linformer_attention(q, k, v, proj, proj)


@pytest.mark.parametrize(
    "mask", [torch.ones(B, 5, dtype=torch.int64), torch.ones(B, 4, dtype=torch.bool)]
)
def test_malformed_mask_is_rejected(mask):
    q, k, v = qkv(5)
    proj = torch.randn(8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="key_padding_mask must be a bool tensor"):
        linformer_attention(q, k, v, proj, proj, mask)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3),
    n=st.integers(1, 9),
    per_head=st.booleans(),
    strided=st.booleans(),
    seed=st.integers(0, 99),
)
def test_projection_matches_einsum_with_gradients(batch, n, per_head, strided, seed):
    # shared: batch 1 and batch > 1 take different GEMMs (mm, bmm over the expanded weight)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, H, n, D, generator=g, dtype=torch.float64)
    x = (x.transpose(1, 2) if strided else x.reshape(batch, n, H, D)).requires_grad_()
    shape = (H, 12, 5) if per_head else (12, 5)
    weight = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(batch, 5, H, D, generator=g, dtype=torch.float64)
    out = project_linear(x, weight)
    rows = weight[..., :n, :]
    ref = torch.einsum(("hnk" if per_head else "nk") + ",bnhd->bkhd", rows, x)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    got = torch.autograd.grad(out, (x, weight), grad)
    expected = torch.autograd.grad(ref, (x, weight), grad)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("autocast", [False, True])
def test_per_head_projection_gradient_comes_in_the_weights_layout(autocast):
    # a gradient in another layout is copied into the weight's by AccumulateGrad: for the
    # (H, n, k) weight of `sharing="none"` under bf16 autocast, a transposed copy that cost
    # 13.5 ms a call at n 8192 (E^T X as the product: its gradient came as (H, k, n))
    weight = torch.randn(H, 64, 8, requires_grad=True)
    arrived = []
    weight.register_hook(lambda grad: arrived.append(grad))
    x = torch.randn(2, 64, H, D)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = project_linear(x, weight)
    out.float().sum().backward()
    assert arrived[0].shape == weight.shape and arrived[0].is_contiguous()


def test_per_head_projection_needs_matching_heads():
    x = torch.randn(B, 5, H, D)
    with pytest.raises(ValueError, match="has 2 heads; the inputs have 3"):
        project_linear(x, torch.randn(2, 8, 4))


def test_linformer_attention_names_malformed_inputs_and_takes_an_empty_batch():
    q = torch.randn(1, 3, 10, 4)
    e = torch.randn(16, 5)
    # keys and values of different lengths were projected by different rows: no error
    with pytest.raises(ValueError, match=r"keys and values must be as many.* \(1, 3, 7, 4\)"):
        linformer_attention(q, q, q[:, :, :7], e, e)
    # a list: "'list' object has no attribute 'dim'", naming no input
    with pytest.raises(TypeError, match=r"^v must be a torch.Tensor \(batch, heads, .* got list"):
        linformer_attention(q, q, q.tolist(), e, e)
    # integer inputs: "expected m1 and m2 to have the same dtype" from a matmul
    with pytest.raises(
        ValueError, match=r"^k must be a floating-point tensor, got dtype torch.int64"
    ):
        linformer_attention(q, q.long(), q, e, e)
    # the projection's heads were named on its slice to n, as if it needed them
    with pytest.raises(ValueError, match=r"shape \(4, 16, 5\) has 4 heads; the inputs have 3"):
        linformer_attention(q, q, q, torch.randn(4, 16, 5), torch.randn(4, 16, 5))
    # 3-D inputs: "not enough values to unpack"; a 1-D projection: IndexError
    with pytest.raises(ValueError, match=r"must be \(batch, heads, seq_len, head_dim\), got"):
        linformer_attention(q[0], q[0], q[0], e, e)
    with pytest.raises(ValueError, match=r"proj_k must be \(max_seq_len, K\) or"):
        linformer_attention(q, q, q, e[:, 0], e)
    with pytest.raises(ValueError, match=r"must be \(batch, heads, seq_len, head_dim\), got"):
        exact_attention(q[0], q[0], q[0], torch.ones(1, 10, dtype=torch.bool))
    # an empty batch failed in a reshape ("the unspecified dimension size -1 ... ambiguous")
    empty = torch.randn(0, 3, 10, 4)
    assert linformer_attention(empty, empty, empty, e, e).shape == (0, 3, 10, 4)
    per_head = torch.randn(3, 16, 5)
    assert linformer_attention(empty, empty, empty, per_head, per_head).shape == (0, 3, 10, 4)
    for heads in (None, 2):  # shared, per head
        kv = build_projection(projection="linear", max_seq_len=16, proj_dim=5, num_heads=heads)
        module = LinformerSelfAttention(dim=8, num_heads=2, max_seq_len=16, proj_k=kv, proj_v=kv)
        for n in (10, 16):  # the keys and values projected after their maps, and before
            assert module(torch.randn(0, n, 8))[0].shape == (0, n, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["sdpa", "explicit", "explicit, PyTorch ops"])
def test_fully_masked_row_gives_zeros_not_nan(dtype, kernel):
    # on every kernel: the rule's pick alone was tested (SDPA here), and the explicit kernel
    # without the empty-row guard gave nan in float32 and bf16 unseen
    q, k, v = qkv(6, dtype=dtype)
    mask = torch.ones(B, 6, dtype=torch.bool)
    mask[1] = False
    proj = torch.randn(8, 4, dtype=dtype)
    ops = native.kernels_off() if kernel.endswith("ops") else contextlib.nullcontext()
    with use_kernel(kernel.split(",")[0]), ops:
        outs = (linformer_attention(q, k, v, proj, proj, mask), exact_attention(q, k, v, mask))
    for out in outs:
        assert not out.isnan().any()
        assert out[1].abs().max() == 0


def test_pool_blocks_average_real_positions_only():
    x = torch.arange(1.0, 8.0).view(1, 7, 1, 1)  # values 1..7
    out, mask = project_blocks(x, 3, None, torch.tensor([[True] * 5 + [False] * 2]))
    # blocks [1,2,3], [4,5,(6 pad)], [(7 pad)]
    assert out.flatten().tolist() == [2.0, 4.5, 0.0]
    assert mask.tolist() == [[True, True, False]]
    out, mask = project_blocks(x, 3)  # no mask: the short last block is the mean of what it has
    assert out.flatten().tolist() == [2.0, 5.0, 7.0] and mask is None


def test_conv_blocks_equal_strided_conv1d_on_full_blocks():
    x = torch.randn(2, 12, 1, 5, dtype=torch.float64)
    kernel = torch.randn(4, dtype=torch.float64)
    out, _ = project_blocks(x, 4, kernel)
    ref = torch.nn.functional.conv1d(
        x[:, :, 0].transpose(1, 2).reshape(10, 1, 12), kernel.view(1, 1, 4), stride=4
    )  # (B * C, 1, 3)
    torch.testing.assert_close(out[:, :, 0], ref.view(2, 5, 3).transpose(1, 2))


def test_inconsistent_arguments_are_named():
    q, k, v = qkv(9)
    proj = torch.randn(12, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"same k: got 4 and 5"):
        linformer_attention(q, k, v, proj, torch.randn(12, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got -0.5"):
        exact_attention(q, k, v, dropout_p=-0.5)
    with pytest.raises(ValueError, match=r"keys and values must be as many: .* 9 against 8"):
        dot_product_attention(q, k, v[:, :, :8])


def test_queries_that_do_not_match_the_keys_are_named():
    q = torch.randn(2, 4, 8, 16)
    e = torch.randn(32, 4)
    # SDPA's and bmm's errors named no input; one head of q was broadcast over k's four
    for other in (torch.randn(3, 4, 8, 16), torch.randn(2, 1, 8, 16), torch.randn(2, 4, 8, 8)):
        with pytest.raises(ValueError, match=r"^q and k must be of one batch, heads and head_dim"):
            linformer_attention(other, q, q, e, e)
        with pytest.raises(ValueError, match=r"^q and k must be of one batch, heads and head_dim"):
            exact_attention(other, q, q)
    with pytest.raises(ValueError, match=r"^q, k and v must be of one dtype, got torch.float64"):
        linformer_attention(q.double(), q, q, e, e)
    # cross_attention ran exact attention without a word when given proj_v alone
    with pytest.raises(ValueError, match=r"^proj_v needs proj_k"):
        cross_attention(q, q, q, None, e)


def test_conv_blocks_partly_padded_or_short_are_rescaled_to_full_blocks():
    # A block with r of its bs positions real is the strided convolution of its zero-filled
    # block times bs / r, as if full: without the rescale it shrank with the padding.
    x = torch.randn(1, 7, 1, 2, dtype=torch.float64)
    kernel = torch.randn(3, dtype=torch.float64)
    mask = torch.tensor([[True] * 5 + [False] * 2])
    real = x * mask[:, :, None, None]
    padded = torch.nn.functional.pad(real[:, :, 0].transpose(1, 2), (0, 2)).reshape(2, 1, 9)
    conv = torch.nn.functional.conv1d(padded, kernel.view(1, 1, 3), stride=3).view(2, 3)
    want = conv.T * torch.tensor([3 / 3, 3 / 2, 0.0], dtype=torch.float64)[:, None]
    out, blocks = project_blocks(x, 3, kernel, mask)
    torch.testing.assert_close(out[0, :, 0], want)
    assert blocks.tolist() == [[True, True, False]]
    unmasked = torch.nn.functional.pad(x[:, :, 0].transpose(1, 2), (0, 2)).reshape(2, 1, 9)
    conv = torch.nn.functional.conv1d(unmasked, kernel.view(1, 1, 3), stride=3).view(2, 3)
    short = torch.tensor([1.0, 1.0, 3.0], dtype=torch.float64)  # the last block: 1 of 3
    torch.testing.assert_close(project_blocks(x, 3, kernel)[0][0, :, 0], conv.T * short[:, None])


def test_attention_weights_of_a_row_with_no_key_are_zero():
    # A padded sequence's rows (and, causal, a left-padded query's) are 0, not uniform 1 / M.
    q, k, _ = qkv(5)
    mask = torch.tensor([[True] * 5, [False] * 5])
    weights = attention_weights(q, k, mask)
    assert weights[1].abs().max() == 0
    torch.testing.assert_close(weights[0].sum(-1), torch.ones(H, 5, dtype=torch.float64))
    left = torch.tensor([[False, False, True, True, True]] * B)
    causal_weights = attention_weights(q, k, left, causal=True)
    assert causal_weights[:, :, :2].abs().max() == 0  # queries 0, 1 see keys 0, 1: padding
    torch.testing.assert_close(causal_weights[:, :, 2:].sum(-1), torch.ones(B, H, 3).double())


@pytest.mark.parametrize("per_head", [False, True])
def test_linformer_attention_applies_its_dropout_p_as_attend_does(per_head):
    # dropout_p was a public argument: taken and dropped, the output would not change.
    q, k, v = qkv(6, dtype=torch.float32)
    shape = (H, 8, 4) if per_head else (8, 4)
    proj_k, proj_v = torch.randn(shape), torch.randn(shape)
    plain = linformer_attention(q, k, v, proj_k, proj_v)
    torch.manual_seed(0)
    dropped = linformer_attention(q, k, v, proj_k, proj_v, dropout_p=0.5)
    assert not torch.allclose(dropped, plain)
    pk = project_linear(k.transpose(1, 2), proj_k).transpose(1, 2)
    pv = project_linear(v.transpose(1, 2), proj_v).transpose(1, 2)
    torch.manual_seed(0)
    torch.testing.assert_close(dropped, attend(q, pk, pv, None, 0.5))
