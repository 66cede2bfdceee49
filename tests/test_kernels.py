"""The attention kernels: SDPA and the explicit path agree with a float64 reference and with
each other, dropout is applied exactly once, and gradients pass gradcheck (which kernel a
call runs: test_kernel_rule.py)."""

import itertools
import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import causal_block_attention, softmax_attention

from linformer_kit import kernel_rule, kernels, native
from linformer_kit.causal import causal_attention
from linformer_kit.functional import attend, attendable, attention_weights, linformer_attention
from linformer_kit.kernels import dot_product_attention

B, H, N, M, D = 2, 3, 7, 5, 4
CPU = torch.device("cpu")


def qkv(dtype=torch.float64, seed=0, n=N, m=M):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, D, generator=g, dtype=dtype)
    return (
        q,
        torch.randn(B, H, m, D, generator=g, dtype=dtype),
        torch.randn(B, H, m, D, generator=g, dtype=dtype),
    )


@pytest.fixture(params=["one block", "blocks of 3 rows"])
def blocks(request, monkeypatch):
    """The explicit kernel in one block of query rows, or in blocks of 3 (N = 7: 3 + 3 + 1),
    compiled or not."""
    if request.param != "one block":
        monkeypatch.setattr(kernels, "_BLOCK_ROWS", (3, 3))
        monkeypatch.setattr(kernels, "_FUSED_ROWS", 3)


@pytest.fixture(params=["compiled", "torch ops"])
def mask_path(request, monkeypatch):
    """The explicit kernel compiled (csrc/attention.cpp: weights and dropout mask made in
    C++) or by PyTorch ops (the same mask; what runs without a compiler)."""
    if request.param == "torch ops":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    elif native.cpu_ops() is None:
        pytest.skip("no C++ compiler here: the compiled kernel cannot be built")


def kv_mask(empty_row: bool) -> torch.Tensor:
    mask = torch.ones(B, M, dtype=torch.bool)
    mask[0, 3:] = False
    if empty_row:
        mask[1] = False  # batch row 1 has no key at all: its output must be 0, not NaN
    return mask


@pytest.mark.parametrize("kernel", ["sdpa", "explicit"])
@pytest.mark.parametrize("masked", [None, "partial", "empty"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_both_kernels_equal_the_float64_reference(kernel, masked, dtype, blocks):
    q, k, v = qkv()
    mask = None if masked is None else kv_mask(masked == "empty")
    if mask is not None:  # attend's contract: masked-out keys already hold zero values
        k, v = k * mask[:, None, :, None], v * mask[:, None, :, None]
    out = attend(q.to(dtype), k.to(dtype), v.to(dtype), mask, kernel=kernel)
    reference = softmax_attention(q, k, v, None if mask is None else attendable(mask))
    if masked == "empty":
        reference[1] = 0.0
    assert not out.isnan().any()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), reference, atol=tol, rtol=tol)


def test_explicit_equals_sdpa_with_a_general_mask_and_float32(blocks):
    q, k, v = qkv(torch.float32, n=8, m=8)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()  # causal, broadcast over (B, H)
    sdpa = dot_product_attention(q, k, v, mask, scale=0.3, kernel="sdpa")
    explicit = dot_product_attention(q, k, v, mask, scale=0.3, kernel="explicit")
    torch.testing.assert_close(explicit, sdpa, atol=1e-6, rtol=1e-5)
    # a mask of the keys alone, (M,): the explicit kernel took it, SDPA an IndexError
    keys = torch.tensor([True, False] * 4)
    sdpa = dot_product_attention(q, k, v, keys, kernel="sdpa")
    explicit = dot_product_attention(q, k, v, keys, kernel="explicit")
    torch.testing.assert_close(explicit, sdpa, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sdpa, dot_product_attention(q, k, v, keys.expand(8, 8)))


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_dot_product_attention_keeps_sdpas_contract_on_every_kernel(dropout_p, mask_path):
    # The explicit kernels gave NaN at a row with no allowed key (SDPA: 0), and all of its
    # (batch, head)'s dK and dV NaN; a k / v batch of 1 failed on the PyTorch-ops one; a
    # float mask ran on SDPA and failed, differently, once dropout took the explicit kernel.
    q, k, v = (t.requires_grad_() for t in qkv())
    k1, v1 = k[:1].detach().requires_grad_(), v[:1].detach().requires_grad_()
    mask = torch.rand(B, 1, N, M, generator=torch.Generator().manual_seed(0)) < 0.6
    mask[0, 0, 2] = False  # query 2 of batch 0 sees no key
    results = []
    for kernel in ("sdpa", "explicit"):
        torch.manual_seed(0)
        out = dot_product_attention(q, k1, v1, mask, kernel=kernel)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k1, v1))))
    for got, want in zip(*results):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want)
    assert results[1][0][0, :, 2].abs().max() == 0
    torch.manual_seed(0)
    with_dropout = dot_product_attention(q, k1, v1, mask, dropout_p=dropout_p, kernel="explicit")
    assert not with_dropout.isnan().any() and with_dropout[0, :, 2].abs().max() == 0
    additive = torch.zeros(B, 1, N, M).masked_fill(~mask, float("-inf"))
    for kernel in ("sdpa", "explicit"):
        with pytest.raises(ValueError, match="attn_mask must be bool .* got torch.float32"):
            dot_product_attention(q, k, v, additive, dropout_p=dropout_p, kernel=kernel)


def test_an_expanded_mask_reaches_the_compiled_kernel_as_a_view(monkeypatch):
    # Looking for rows without a key, the explicit path made `mask | empty`: an 8 KiB mask
    # expanded to (4, 8, 2048, 2048) became 128 MiB, saved for backward.
    if native.cpu_ops() is None:
        pytest.skip("no C++ compiler here: the compiled kernel cannot be built")
    seen, real = [], kernels._fused_attention
    monkeypatch.setattr(
        kernels, "_fused_attention", lambda q, k, v, m, *a: seen.append(m) or real(q, k, v, m, *a)
    )
    q, k, v = qkv(torch.float32, n=64, m=48)
    mask = (torch.arange(48) < 40).expand(B, H, 64, 48)  # (M,) storage, every row attends
    dot_product_attention(q, k, v, mask, kernel="explicit")
    assert seen[0].untyped_storage().nbytes() == 48


def test_the_pytorch_ops_kernel_makes_bf16_scores_in_float32(monkeypatch):
    # Rounded to bf16 before the softmax, the weights' error grew with the logits: at logits
    # of std 36 the output was off by 0.086 (relative, max) where SDPA's was 0.003.
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, generator=g) for _ in "qkv")
    q, k = q * 6.0, k * 6.0  # logits of std 36 at scale 1/8
    q, k, v = (t.bfloat16() for t in (q, k, v))
    # against the bf16 inputs' own attention: against the float32 ones, the inputs' rounding
    # (0.064 for SDPA too) hid the kernel's (0.0037, 0.086 with bf16 scores)
    want = softmax_attention(q.double(), k.double(), v.double())
    errors = {}
    for kernel in ("sdpa", "explicit"):
        got = dot_product_attention(q, k, v, kernel=kernel)
        errors[kernel] = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert errors["explicit"] < 2 * errors["sdpa"] + 1e-3, errors


def test_attention_weights_are_what_the_explicit_kernel_applies():
    q, k, v = qkv()
    mask = kv_mask(empty_row=False)
    out = attend(q, k, v, mask, kernel="explicit")
    torch.testing.assert_close(out, attention_weights(q, k, mask) @ v, atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_weights_are_zero_at_rows_with_no_key_and_exact_elsewhere(causal):
    # Left padding under causal attention: query i's keys j <= i are all padding (NaN before).
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 3, 6, 4, dtype=torch.float64).unbind(0)
    mask = torch.tensor([[False, False, True, True, False, True], [False] * 6])
    weights = attention_weights(q, k, mask, causal=causal)
    allowed = mask[:, None, :].expand(2, 6, 6)  # (batch, query, key)
    if causal:
        allowed = allowed & torch.ones(6, 6, dtype=torch.bool).tril()
    for b, i in itertools.product(range(2), range(6)):
        keys = allowed[b, i].nonzero().flatten()
        expected = torch.zeros(3, 6, dtype=torch.float64)
        if len(keys):
            scores = torch.einsum("hd,hmd->hm", q[b, :, i], k[b][:, keys]) / 2.0
            expected[:, keys] = scores.exp() / scores.exp().sum(-1, keepdim=True)
        torch.testing.assert_close(weights[b, :, i], expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_explicit_dropout_drops_each_weight_once_and_rescales_once(p, blocks, mask_path):
    # With V = I the output is the dropped weight matrix itself: every entry must be either
    # 0 or the undropped weight / (1 - p), and the dropped fraction must be p. Dropout
    # applied twice would give weight / (1 - p)^2 and a fraction 1 - (1 - p)^2.
    n, m = 512, 64
    q = torch.randn(1, 2, n, m, dtype=torch.float64)
    k = torch.randn(1, 2, m, m, dtype=torch.float64)
    eye = torch.eye(m, dtype=torch.float64).expand(1, 2, m, m)
    weights = attention_weights(q, k)
    out = dot_product_attention(q, k, eye, dropout_p=p, kernel="explicit")
    dropped = out == 0
    rounded = round(p * 2**16) / 2**16  # the kernel's documented rounding of p
    torch.testing.assert_close(out[~dropped], weights[~dropped] / (1 - rounded), atol=1e-12, rtol=0)
    count = dropped.numel()
    sd = (p * (1 - p) / count) ** 0.5
    assert abs(dropped.double().mean().item() - p) < 5 * sd  # 5 sd ~ 0.007 at p = 0.5
    # One 64-bit draw serves four consecutive weights (m = 64 keeps rows and blocks on draw
    # boundaries): each 16-bit lane must drop at rate p. A draw whose sign bit is always 0
    # (random_ on int64) would leave one lane in four never dropped.
    for lane in range(4):
        assert abs(dropped[..., lane::4].double().mean().item() - p) < 10 * sd


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 23),
    m=st.integers(1, 13),
    p=st.sampled_from([0.1, 0.5, 0.95]),
    rows=st.sampled_from([3, 4, 512]),
    causal=st.booleans(),
    double=st.booleans(),
)
def test_compiled_and_torch_ops_kernels_give_the_same_outputs_and_gradients(
    n, m, p, rows, causal, double
):
    # The same seed, two implementations of one mask: the outputs and gradients must agree
    # to rounding (the compiled kernel's own exp, and its weights made again in backward),
    # which a single weight dropped by one and kept by the other would break (p = 0.95:
    # the kept weights are scaled by 20). Rows per block 3 and 4 cut the rows (and 64-bit
    # words) unevenly.
    if native.cpu_ops() is None:
        pytest.skip("no C++ compiler here: the compiled kernel cannot be built")
    dtype = torch.float64 if double else torch.float32
    q, k, v = (t.requires_grad_() for t in qkv(dtype, n=n, m=m))
    mask = None if causal else attendable(torch.rand(B, m) < 0.7)[:, None, None, :]
    results = []
    with (
        mock.patch.object(kernels, "_BLOCK_ROWS", (rows, rows)),
        mock.patch.object(kernels, "_FUSED_ROWS", rows),
    ):
        for switch in ("1", "0"):
            with mock.patch.dict(os.environ, {native.ENV_SWITCH: switch}):
                out = seeded(5, explicit, q, k, v, mask, p, 0.7, is_causal=causal)
                grads = torch.autograd.grad(out.mul(torch.arange(D)).sum(), (q, k, v))
            results.append((out, *grads))
    # fp32 rounding, times up to 1 / (1 - p) = 20; one weight masked differently would
    # differ by about that weight times 20, far above it.
    tol = 1e-10 if double else 2e-4
    for compiled, reference in zip(*results):
        torch.testing.assert_close(compiled, reference, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_expanded_over_the_queries_or_a_gradient_summed_over_them_are_read_right(
    dtype, mask_path
):
    # A row expanded over a dimension has row stride 0, as has the gradient of a sum over
    # the query axis; the compiled kernel handed such matrices to the BLAS, which raised
    # the leading dimension to the row length and read past them: the outputs were off by
    # 1.5, the gradients by 1e27 (the torch-ops path was right).
    q, k, v = qkv(dtype, n=6, m=6)
    q, v = q[:, :, :1].expand_as(q), v[:, :, :1].expand_as(v)
    want = softmax_attention(q, k, v)
    for pair in ((q, k, v), (q.contiguous(), k, v.contiguous())):
        torch.testing.assert_close(explicit(*pair), want)
    leaves = [t.contiguous().requires_grad_() for t in qkv(dtype, n=6, m=6)]
    refs = [t.detach().clone().requires_grad_() for t in leaves]
    seeded(1, explicit, *leaves, dropout_p=0.3).sum(2).pow(2).sum().backward()
    with mock.patch.dict(os.environ, {native.ENV_SWITCH: "0"}):  # the torch-ops kernel
        seeded(1, explicit, *refs, dropout_p=0.3).sum(2).pow(2).sum().backward()
    for leaf, ref in zip(leaves, refs, strict=True):
        torch.testing.assert_close(leaf.grad, ref.grad)


def test_backward_applies_the_mask_its_forward_chose_whatever_the_switch_says_then(blocks):
    # The switch is read once, in forward: a backward run after it flips (e.g. under
    # another context manager) still makes the compiled kernel's mask, not no mask at all.
    if native.cpu_ops() is None:
        pytest.skip("no C++ compiler here: the compiled dropout kernel cannot be built")
    q, k, v = (t.requires_grad_() for t in qkv())
    results = []
    for switch_in_backward in ("1", "0"):
        out = seeded(5, explicit, q, k, v, dropout_p=0.4)
        with mock.patch.dict(os.environ, {native.ENV_SWITCH: switch_in_backward}):
            results.append(torch.autograd.grad(out.mul(torch.arange(D)).sum(), (q, k, v)))
    for grad, expected in zip(*results):
        torch.testing.assert_close(grad, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_what_each_path_saves_for_backward(dropout_p, mask_path, blocks):
    # Compiled: q, k, v, the mask, the seed and one logsumexp per row, or with dropout the
    # (B x H, N, M) weights, this call being within `_KEEP_WEIGHTS` (beyond, the logsumexp:
    # test_compiled_attention); the dropout mask made again in backward. PyTorch ops: q, k,
    # v, the weights (one tensor per block) and, with dropout, one int16 tensor of bits per
    # block.
    q, k, v = (t.requires_grad_() for t in qkv())
    mask = attendable(kv_mask(empty_row=False))[:, None, None, :]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        explicit(q, k, v, mask, dropout_p=dropout_p)
    if os.environ.get(native.ENV_SWITCH) != "0":  # the mask, the seed, the stats
        stats = (B * H, N, M) if dropout_p > 0 else (B * H, N)
        assert [tuple(t.shape) for t in saved[3:]] == [(B, H, N, M), (), stats]
        assert saved[3].stride()[:3] == (M, 0, 0)  # the mask is a broadcast view, not a copy
        return
    num_blocks = len(kernels._blocks(N, kernels.block_rows(B * H, M), M, False))
    with_bits = dropout_p > 0
    assert len(saved) == 3 + num_blocks * (2 if with_bits else 1)
    assert sum(t.dtype == torch.int16 for t in saved) == (num_blocks if with_bits else 0)


def test_block_rows_keep_gemms_large_and_blocks_bounded():
    assert kernels.block_rows(1, 256) == 512  # capped: larger blocks measured slower
    assert kernels.block_rows(64, 256) == 256  # 2^22 weights per block
    assert kernels.block_rows(4096, 256) == 64  # floored: GEMMs of fewer rows lose speed
    assert kernels.block_rows(4, 0) == 512  # no keys: any block works
    # Under a causal mask a block computes only the keys its last query sees.
    assert kernels._blocks(7, 3, 5, causal=True) == [
        (slice(0, 3), 3),
        (slice(3, 6), 5),
        (slice(6, 9), 5),
    ]
    assert kernels._blocks(7, 3, 5, causal=False) == [(slice(s, s + 3), 5) for s in (0, 3, 6)]
    assert kernels._blocks(2, 3, 5, causal=True) == [(slice(0, 3), 2)]  # N < M: 2 keys seen
    assert kernels._blocks(7, None, 5, causal=True) == [(slice(None), 5)]  # one block


@pytest.mark.parametrize(("device", "rows"), [("cpu", 512), ("meta", None)])
def test_the_explicit_kernel_works_in_blocks_on_cpu_only(device, rows, monkeypatch):
    # Blocks pay on CPU (cache, reused pages); on a GPU each block costs kernel launches.
    # The meta device stands in for a GPU: shapes only, no data. (The PyTorch-ops kernel:
    # the compiled one always works in blocks.)
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    seen, original = [], kernels._blocks
    monkeypatch.setattr(kernels, "_blocks", lambda n, r, *a: seen.append(r) or original(n, r, *a))
    q = torch.zeros(1, 4, 2000, 8, device=device, requires_grad=True)
    k = torch.zeros(1, 4, 16, 8, device=device, requires_grad=True)
    dot_product_attention(q, k, k, dropout_p=0.1, kernel="explicit").sum().backward()
    assert seen == [rows, rows] and q.grad.shape == q.shape  # forward and backward


def test_explicit_dropout_expectation_is_the_undropped_output():
    # E[out] over independent masks equals the output without dropout; the tolerance (6
    # standard errors of the mean) is far below the >= 10 % bias a missing or doubled
    # rescale gives. The samples are 4000 copies along the batch: one call, fresh masks.
    q, k, v = (t[:1] for t in qkv(seed=1))
    v = v.abs() + 1.0  # positive values: a rescaling error cannot cancel out
    exact = attend(q, k, v, kernel="explicit")
    copies = [t.expand(4000, -1, -1, -1) for t in (q, k, v)]
    samples = attend(*copies, dropout_p=0.1, kernel="explicit")
    error = (samples.mean(0) - exact[0]).abs()
    assert (error < 6 * samples.std(0) / 4000**0.5).all()


def explicit(*args, **kwargs):
    return dot_product_attention(*args, **kwargs, kernel="explicit")


def seeded(seed, fn, *args, **kwargs):
    torch.manual_seed(seed)
    return fn(*args, **kwargs)


def test_dropout_is_repeatable_under_a_seed_and_different_without(mask_path):
    q, k, v = qkv()
    first = seeded(3, explicit, q, k, v, dropout_p=0.2)
    again = seeded(3, explicit, q, k, v, dropout_p=0.2)
    other = explicit(q, k, v, dropout_p=0.2)
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_padding_invariance_with_dropout_on(blocks, mask_path):
    # One head, one sequence: a weight's dropout bits are numbered by its row (B x H x N
    # rows), so under one seed the real queries of the padded call get the same mask rows
    # as the unpadded call.
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 10, D) for _ in range(3))
    proj = torch.randn(16, 3)
    padded = [torch.cat([t, torch.randn(1, 1, 4, D)], 2) for t in (q, k, v)]
    mask = torch.tensor([[True] * 10 + [False] * 4])
    out = seeded(1, linformer_attention, q, k, v, proj, proj, dropout_p=0.3)
    out_padded = seeded(1, linformer_attention, *padded, proj, proj, mask, dropout_p=0.3)
    torch.testing.assert_close(out_padded[:, :, :10], out, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("masked", ["keys", "causal"])
def test_explicit_kernel_gradcheck(dropout_p, masked, blocks, mask_path):
    q, k, v = (t[:, :1, :4, :3].clone().requires_grad_() for t in qkv())  # (2, 1, 4, 3)
    q = q.detach().repeat(1, 1, 2, 1).requires_grad_()  # N = 8 queries over M = 4 keys
    mask = attendable(kv_mask(empty_row=True)[:, :4])[:, None, None, :]
    causal = masked == "causal"

    def fn(q, k, v):
        torch.manual_seed(0)  # the same dropout mask at every evaluation
        return explicit(q, k, v, None if causal else mask, dropout_p, 0.7, is_causal=causal)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_explicit_gradients_equal_sdpa_gradients(blocks):
    q, k, v = (t.float().requires_grad_() for t in qkv())
    mask = attendable(kv_mask(empty_row=True))[:, None, None, :]
    grads = []
    for kernel in ("sdpa", "explicit"):
        out = dot_product_attention(q, k, v, mask, kernel=kernel)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for explicit, sdpa in zip(*grads[::-1]):
        torch.testing.assert_close(explicit, sdpa, atol=1e-5, rtol=1e-4)


# GEMMs per block of the backward pass: grad V; grad of the weights (for Q or K); grad Q; grad K.
GEMMS = {"q": 2, "k": 2, "v": 1, "qk": 3, "kv": 3, "qkv": 4}


@pytest.mark.parametrize("wanted", ["q", "k", "v", "qk", "kv"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_explicit_backward_computes_only_the_gradients_asked_for(
    wanted, dropout_p, blocks, monkeypatch
):
    # The PyTorch-ops kernel, whose GEMMs can be counted (the compiled one: below).
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    tensors, grads, calls = qkv(), [], []
    gemm = kernels._bmm
    monkeypatch.setattr(kernels, "_bmm", lambda *args: calls.append(1) or gemm(*args))
    for subset in ("qkv", wanted):  # all three, then only those wanted, under one seed
        inputs = [t.clone().requires_grad_(name in subset) for name, t in zip("qkv", tensors)]
        out = seeded(0, explicit, *inputs, None, dropout_p, 0.7)
        asked = [t for name, t in zip("qkv", inputs) if name in wanted]
        calls.clear()
        grads.append(torch.autograd.grad(out.square().sum(), asked))
        num_blocks = len(kernels._blocks(N, kernels.block_rows(B * H, M), M, False))
        assert len(calls) == GEMMS[subset] * num_blocks
    for some, full in zip(*grads[::-1]):
        torch.testing.assert_close(some, full, rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_explicit_kernel_takes_no_queries_as_sdpa_does(causal, blocks):
    q, k, v = (t.requires_grad_() for t in qkv(n=0))
    out = explicit(q, k, v, None, 0.3, 0.7, is_causal=causal)
    expected = dot_product_attention(q, k, v, is_causal=causal, kernel="sdpa")
    assert out.shape == expected.shape == (B, H, 0, D)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert [g.abs().sum().item() for g in grads] == [0.0, 0.0, 0.0]


def test_causal_linformer_through_the_explicit_kernel_equals_the_reference(monkeypatch):
    monkeypatch.setattr(kernels, "choose_kernel", lambda **_: "explicit")
    q, k, v = qkv(n=11, m=11)
    proj = torch.randn(12, 3, dtype=torch.float64)
    mask = torch.ones(B, 11, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    out = causal_attention(q, k, v, proj, proj, block_size=4, key_padding_mask=mask)
    reference = causal_block_attention(q, k, v, proj, proj, 4, mask)
    torch.testing.assert_close(out, reference, atol=1e-10, rtol=0)


@pytest.mark.parametrize("kernel", kernel_rule.KERNELS)
def test_exact_causal_attention_through_either_kernel_sees_no_future(
    kernel, monkeypatch, blocks, mask_path
):
    monkeypatch.setattr(kernels, "choose_kernel", lambda **_: kernel)
    q, k, v = qkv(n=N, m=N)
    # The reference: query i attends to the prefix 0..i alone, one query at a time.
    prefixes = [
        softmax_attention(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1]) for i in range(N)
    ]
    torch.testing.assert_close(
        causal_attention(q, k, v), torch.cat(prefixes, 2), atol=1e-12, rtol=0
    )
    # Dropout on (the explicit kernel's reason to exist on CPU): still nothing from the future.
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = causal_attention(q, k, v, dropout_p=0.5)
    grad_k, grad_v = torch.autograd.grad(out[:, :, 2].sum(), (k, v))
    assert grad_k[:, :, 3:].abs().max() == 0 and grad_v[:, :, 3:].abs().max() == 0
    assert grad_v[:, :, :3].abs().max() > 0
    with pytest.raises(ValueError, match="is_causal=True builds its own mask"):
        dot_product_attention(q, k, v, torch.ones(N, N, dtype=torch.bool), is_causal=True)


@pytest.mark.parametrize(("n", "m"), [(7, 5), (5, 7)])
def test_causal_masks_of_both_kernels_align_the_same_way_when_n_is_not_m(n, m, blocks):
    q, k, v = (t.requires_grad_() for t in qkv(n=n, m=m))
    outs = [dot_product_attention(q, k, v, is_causal=True, kernel=kr) for kr in kernel_rule.KERNELS]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-12, rtol=0)
    grads = [torch.autograd.grad(out.square().sum(), (q, k, v)) for out in outs]
    for sdpa, explicit in zip(*grads):
        torch.testing.assert_close(sdpa, explicit, atol=1e-12, rtol=0)


@pytest.mark.parametrize("switch", ["1", "0"])
def test_exact_causal_attention_with_dropout_on_cpu_takes_the_explicit_kernel(switch, monkeypatch):
    # Compiled where it can be built, else by PyTorch ops: (q, k, v, mask, p, scale, causal...)
    monkeypatch.setenv(native.ENV_SWITCH, switch)
    seen = []
    spy = {kind: lambda *a, kind=kind: seen.append((kind, a)) or a[2] for kind in ("ops", "c")}
    monkeypatch.setattr(kernels._ExplicitAttention, "apply", spy["ops"])
    monkeypatch.setattr(kernels, "_fused_attention", spy["c"])
    q, k, v = qkv(dtype=torch.float32, n=N, m=N)
    causal_attention(q, k, v, dropout_p=0.1)
    assert len(seen) == 1
    kind, (_, _, _, mask, dropout_p, _, causal, *_) = seen[0]
    compiled = switch == "1" and native.cpu_ops() is not None
    assert kind == ("c" if compiled else "ops")
    assert mask is None and dropout_p == 0.1 and causal
