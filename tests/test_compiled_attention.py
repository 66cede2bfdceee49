"""The compiled CPU attention kernel (csrc/attention.cpp, `kernels._fused_attention`): outputs
and gradients equal a float64 autograd reference written here (scores, masks, softmax, the
documented dropout mask, all by torch ops) on any layout, mask and block cut, its float32
GEMMs on either library (`sgemm_` or oneDNN's micro-kernel, in tiles past 256), with the
forward's weights kept for backward (with dropout) or made again there; the weights kept are
the softmax's, and kept only for a backward with dropout within `_KEEP_WEIGHTS`; the output
is laid out for the head merge; only the gradients asked for are computed; bad input is a
clear error."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import softmax_attention
from torch.nn.attention import SDPBackend, sdpa_kernel

from linformer_kit import kernels, native
from linformer_kit.dropout import dropout_bits, dropout_seed, rescaling, threshold
from linformer_kit.kernel_rule import use_kernel
from linformer_kit.kernels import dot_product_attention
from linformer_kit.linear_backend import use_linear_backend


@pytest.fixture(autouse=True)
def compiled():
    if native.cpu_ops() is None:
        pytest.skip("no C++ compiler here: the compiled kernel cannot be built")


def reference(q, k, v, allowed, causal, scale, seed, p):
    """softmax(Q K^T * scale) with the mask and the call's dropout bits, times V, float64."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) * scale
    n, m = scores.shape[-2:]
    if causal:
        scores = scores.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(), float("-inf"))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = scores.softmax(-1)
    if p > 0:
        keep = dropout_bits(weights, seed, 0, n, (m + 3) // 4) >= threshold(p)
        weights = weights * keep * rescaling(p)
    return weights @ v


def kernel_and_reference(q, k, v, allowed, causal, scale, p, rows, gemm, g, keep=True):
    """The explicit kernel's output and gradients (blocks of `rows` query rows, GEMMs on
    `gemm`, the weights kept for backward or made again there) for an output gradient drawn
    from g, and the float64 reference's."""
    with pytest.MonkeyPatch.context() as patch, use_linear_backend(gemm):
        assert native.kernel_gemm() == gemm  # (the pin reached the kernels)
        patch.setattr(kernels, "_FUSED_ROWS", rows)
        patch.setattr(kernels, "_KEEP_WEIGHTS", 1 << 40 if keep else 0)
        torch.manual_seed(3)
        out = dot_product_attention(q, k, v, allowed, p, scale, kernel="explicit", is_causal=causal)
        grad = torch.randn(out.shape, dtype=out.dtype, generator=g)
        got = torch.autograd.grad(out, (q, k, v), grad)
    torch.manual_seed(3)
    seed = dropout_seed(q.device).item() if p > 0 else 0
    expected = reference(q, k, v, allowed, causal, scale, seed, p)
    wanted = torch.autograd.grad(expected, (q, k, v), grad.double())
    return (out, got), (expected, wanted)


def heads_last(shape, dtype, g):
    """(B, H, L, D) as the model makes it: a transposed view of (B, L, H, D) memory."""
    b, h, length, d = shape
    return torch.randn(b, length, h, d, dtype=dtype, generator=g).transpose(1, 2)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    n=st.integers(1, 40),
    m=st.integers(1, 20),
    dims=st.sampled_from([(8, 8), (4, 6), (16, 3)]),
    mask=st.sampled_from([None, "keys", "general", "causal"]),
    p=st.sampled_from([0.0, 0.3]),
    rows=st.sampled_from([3, 7, 256]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    gemm=st.sampled_from(["blas", "onednn"]),
    keep=st.booleans(),
)
def test_outputs_and_gradients_equal_the_float64_reference(
    batch, heads, n, m, dims, mask, p, rows, dtype, gemm, keep
):
    g = torch.Generator().manual_seed(n * 100 + m)
    d, dv = dims
    q = heads_last((batch, heads, n, d), dtype, g).requires_grad_()
    k = heads_last((batch, heads, m, d), dtype, g).requires_grad_()
    v = heads_last((batch, heads, m, dv), dtype, g).requires_grad_()
    allowed = None
    if mask == "keys":  # (B, 1, 1, M), as `attend` passes it
        allowed = torch.rand(batch, m, generator=g) < 0.6
        allowed[:, 0] = True
        allowed = allowed[:, None, None, :]
    elif mask == "general":  # every (query, key) pair its own, each row with one allowed key
        allowed = torch.rand(batch, heads, n, m, generator=g) < 0.5
        allowed[..., torch.randint(m, (), generator=g)] = True
    (out, got), (expected, wanted) = kernel_and_reference(
        q, k, v, allowed, mask == "causal", d**-0.5, p, rows, gemm, g, keep
    )
    # fp32: rounding of the GEMMs and the kernel's exp; bf16: of the weights, the scores'
    # gradient and the results to 8 bits (a weight masked wrongly, or a row cut wrongly, is
    # off by orders of magnitude more, as is a bf16 input read as another type).
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    for a, b in zip(got, wanted):
        assert a.dtype == dtype
        grad_tol = 10 * tol if dtype != torch.bfloat16 else 3 * tol
        torch.testing.assert_close(a.double(), b.double(), atol=grad_tol, rtol=grad_tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemm", ["blas", "onednn"])
@pytest.mark.parametrize(
    ("mask", "p", "rows", "keep"),
    [(None, 0.0, 64, False), ("general", 0.2, 512, True), ("causal", 0.2, 300, False),
     ("causal", 0.2, 128, True)],
)  # fmt: skip
def test_blocks_past_the_gemm_tiles_equal_the_float64_reference(dtype, gemm, mask, p, rows, keep):
    # 300 queries and keys, head_dim 64, value_dim 40: each GEMM of a block crosses oneDNN's
    # 256-wide tiles in some dimension (rows of 300 and 512, keys as columns and as the sum);
    # in bf16 off MKL (gemm "onednn") the dot-product GEMM's 256-deep blocks of the sum and
    # the edges of its 8 x 32 tiles (csrc/bf16_gemm.h)
    g = torch.Generator().manual_seed(7)
    q = heads_last((1, 2, 300, 64), dtype, g).requires_grad_()
    k = heads_last((1, 2, 300, 64), dtype, g).requires_grad_()
    v = heads_last((1, 2, 300, 40), dtype, g).requires_grad_()
    allowed = torch.rand(1, 2, 300, 300, generator=g) < 0.7 if mask == "general" else None
    (out, got), (expected, wanted) = kernel_and_reference(
        q, k, v, allowed, mask == "causal", 0.125, p, rows, gemm, g, keep
    )
    tol, grad_tol = (1e-5, 1e-4) if dtype == torch.float32 else (1e-2, 3e-2)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    for a, b in zip(got, wanted):
        torch.testing.assert_close(a.double(), b.double(), atol=grad_tol, rtol=grad_tol)


@pytest.mark.parametrize("gemm", ["blas", "onednn"])
@pytest.mark.parametrize("layout", ["odd offset", "odd row stride"])
def test_bf16_views_at_odd_offsets_and_strides_equal_the_float64_reference(gemm, layout):
    # q, k and v as views of wider bf16 tensors. The dot-product GEMM (csrc/bf16_gemm.h)
    # reads A's pairs of elements in place as 2-byte-aligned 32-bit words where its row
    # stride is even (here: the first head starts at an odd element), and packs them where it
    # is odd (rows 129 elements apart).
    g = torch.Generator().manual_seed(11)

    def view(n):  # (1, 2, n, 64) over wider memory
        if layout == "odd offset":  # (1, n, 2, 65)[..., 1:]: offset 1, row stride 130
            return torch.randn(1, n, 2, 65, generator=g).bfloat16()[..., 1:].transpose(1, 2)
        wide = torch.randn(1, n, 129, generator=g).bfloat16()[..., 1:]  # row stride 129
        return wide.unflatten(-1, (2, 64)).transpose(1, 2)

    q, k, v = (view(n).requires_grad_() for n in (100, 40, 40))
    (out, got), (expected, wanted) = kernel_and_reference(
        q, k, v, None, False, 0.125, 0.0, 64, gemm, g
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)
    for a, b in zip(got, wanted):
        torch.testing.assert_close(a.double(), b.double(), atol=3e-2, rtol=3e-2)


BF16_CASES = [(None, False, 0.0), ("general", False, 0.3), (None, True, 0.3)]


def bf16_results(path=None):
    """The compiled kernel's bf16 outputs and gradients on fixed inputs, one per case of
    BF16_CASES (mask, causal, dropout p); saved to `path` if given (a subprocess's answer)."""
    g = torch.Generator().manual_seed(4)
    q = heads_last((2, 3, 40, 16), torch.bfloat16, g)
    k, v = (heads_last((2, 3, 24, 16), torch.bfloat16, g) for _ in range(2))
    allowed = torch.rand(2, 3, 40, 24, generator=g) < 0.5
    allowed[..., 0] = True
    grad = torch.randn(2, 3, 40, 16, generator=g).bfloat16()
    results = []
    for mask, causal, p in BF16_CASES:
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(3)
        attn_mask = allowed if mask else None
        out = dot_product_attention(*inputs, attn_mask, p, kernel="explicit", is_causal=causal)
        results.append([out, *torch.autograd.grad(out, inputs, grad)])
    if path is not None:
        torch.save([[t.detach() for t in r] for r in results], path)
    return (q, k, v, allowed, grad), results


def test_bf16_widened_to_fp32_gives_the_same_results(tmp_path):
    # csrc/blas.h: with LINFORMER_KIT_BF16_GEMM=widen (read once per process: hence a
    # subprocess) the bf16 GEMMs widen their inputs to fp32 for the fp32 GEMM (as a libtorch
    # without MKL does on a CPU without AVX-512 BF16). Both paths must give the float64
    # reference's results to bf16 rounding.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from test_compiled_attention import bf16_results; bf16_results(sys.argv[2])"
    )
    env = {**os.environ, native.BF16_GEMM_SWITCH: "widen"}
    path = tmp_path / "widened.pt"
    argv = [sys.executable, "-c", code, str(Path(__file__).parent), str(path)]
    subprocess.run(argv, env=env, check=True, timeout=300)
    widened = torch.load(path)
    inputs, direct = bf16_results()
    assert_bf16_reference(inputs, direct)
    assert_bf16_reference(inputs, widened)


def test_bf16_on_onednn_gemms_gives_the_reference():
    # Where the fp32 GEMMs are oneDNN's micro-kernel (AMD CPUs), the bf16 ones leave MKL too
    # (csrc/blas.h, off_mkl_bf16; MKL's bf16 GEMM runs generic code there): AVX-512 BF16's
    # dot products where the CPU has them, else widened to fp32. That path must give the
    # float64 reference's results to bf16 rounding.
    ops = native.cpu_ops()
    if ops is None or ops.float_gemm("onednn") != "onednn":
        pytest.skip("no compiled kernels with the float brgemm here")
    native.set_kernel_gemm("onednn")
    inputs, results = bf16_results()
    assert_bf16_reference(inputs, results)


def assert_bf16_reference(inputs, results):
    """`bf16_results`' outputs and gradients equal the float64 reference to bf16 rounding."""
    q, k, v, allowed, grad = inputs
    for (mask, causal, p), ours in zip(BF16_CASES, results):
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(3)
        seed = dropout_seed(q.device).item() if p > 0 else 0
        expected = reference(*leaves, allowed if mask else None, causal, 16**-0.5, seed, p)
        wanted = [expected, *torch.autograd.grad(expected, leaves, grad.double())]
        for a, c in zip(ours, wanted):
            assert a.dtype == torch.bfloat16
            torch.testing.assert_close(a.double(), c.detach(), atol=3e-2, rtol=3e-2)


def test_softmax_of_extreme_scores_equals_torch():
    # The kernel's own exp: scores spread over hundreds (weights down to exp(-87) and
    # below, which must come out 0, not garbage), masked keys at -inf, float32.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 64, 16, generator=g) * 8
    k = torch.randn(1, 2, 32, 16, generator=g) * 8
    eye = torch.eye(32).expand(1, 2, 32, 32)  # V = I: the output is the weight matrix
    allowed = torch.rand(1, 2, 64, 32, generator=g) < 0.7
    allowed[..., 0] = True
    weights = dot_product_attention(q, k, eye, allowed, scale=1.0, kernel="explicit")
    scores = (q @ k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    assert scores.amax(-1).sub(scores.masked_fill(~allowed, 0).amin(-1)).max() > 500
    torch.testing.assert_close(weights, scores.softmax(-1), atol=1e-6, rtol=1e-5)
    assert (weights[~allowed] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_the_weights_kept_are_the_softmax_weights(causal):
    # The forward's second output: each row's logsumexp, or with keep_weights the weights
    # (B x H, N, M), zeros on the keys a causal row does not see (blocks of 3 rows, so
    # that the first blocks compute fewer keys than M).
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for n in (10, 12, 12))
    zero = torch.zeros((), dtype=torch.int64)
    args = (causal, 0.5, zero, threshold(0.0), 1.0, 3)
    scores = (q.double() @ k.double().transpose(-1, -2)) * 0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(10, 12, dtype=torch.bool).tril(), float("-inf"))
    ops = native.cpu_ops()
    _, lse = ops.attention_forward(q, k, v, None, *args, keep_weights=False)
    _, weights = ops.attention_forward(q, k, v, None, *args, keep_weights=True)
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1).view(6, 10))
    torch.testing.assert_close(weights.double(), scores.softmax(-1).view(6, 10, 12))


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_gives_the_same_gradients_from_either_stats(p, causal):
    # attention_backward from the kept weights equals it from the logsumexps (which the
    # float64 reference checks), with and without dropout: the op takes either whatever
    # the dropout, though `kernels` keeps them with dropout only.
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for n in (10, 12, 12))
    grad = torch.randn(2, 3, 10, 8, generator=g)
    args = (causal, 0.5, torch.tensor(11), threshold(p), rescaling(p), 3)
    ops = native.cpu_ops()
    _, lse = ops.attention_forward(q, k, v, None, *args, keep_weights=False)
    _, weights = ops.attention_forward(q, k, v, None, *args, keep_weights=True)
    made = ops.attention_backward(grad, q, k, v, None, lse, *args, [True] * 3)
    kept = ops.attention_backward(grad, q, k, v, None, weights, *args, [True] * 3)
    for a, b in zip(kept, made):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_weights_are_kept_for_a_backward_with_dropout_within_the_limit_only(monkeypatch):
    # What autograd saves: the (B x H, N, M) weights where a backward will run with dropout
    # and B x H x N x M is within `_KEEP_WEIGHTS`; else each row's logsumexp.
    q, k, v = (torch.randn(2, 3, n, 8, requires_grad=True) for n in (10, 4, 4))

    def saved_shapes(no_grad=False, dropout_p=0.2):
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                dot_product_attention(q, k, v, dropout_p=dropout_p, kernel="explicit")
        return shapes

    monkeypatch.setattr(kernels, "_KEEP_WEIGHTS", 2 * 3 * 10 * 4)
    assert (6, 10, 4) in saved_shapes() and (6, 10) not in saved_shapes()
    assert saved_shapes(no_grad=True) == []
    assert (6, 10) in saved_shapes(dropout_p=0.0) and (6, 10, 4) not in saved_shapes(dropout_p=0.0)
    monkeypatch.setattr(kernels, "_KEEP_WEIGHTS", 2 * 3 * 10 * 4 - 1)
    assert (6, 10) in saved_shapes() and (6, 10, 4) not in saved_shapes()


def test_output_is_laid_out_for_the_head_merge():
    # (B, H, N, Dv) over (B, N, H, Dv) memory: the merge's transpose + reshape is a view.
    q = torch.randn(2, 3, 10, 4)
    out = dot_product_attention(q, q, q, kernel="explicit")
    merged = out.transpose(1, 2).reshape(2, 10, 12)
    assert merged.data_ptr() == out.data_ptr()
    expected = dot_product_attention(q, q, q, kernel="sdpa").transpose(1, 2).reshape(2, 10, 12)
    torch.testing.assert_close(merged, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("keys", [1, 5])
def test_the_kernel_leaves_its_inputs_as_they_were(dtype, keys):
    # only the outputs are written: one key's K^T ((B, H, 1, D) transposed) is already
    # contiguous, K's own memory, so a copy made of it must not be changed in place
    g = torch.Generator().manual_seed(keys)
    q, k, v = (heads_last((1, 2, n, 8), dtype, g) for n in (6, keys, keys))
    before = [t.clone() for t in (q, k, v)]
    inputs = [t.requires_grad_() for t in (q, k, v)]
    out = dot_product_attention(*inputs, scale=0.3, kernel="explicit")
    torch.autograd.grad(out.sum(), inputs)
    for t, kept in zip((q, k, v), before):
        assert torch.equal(t, kept)


@pytest.mark.parametrize("lead", [(6,), (2, 3), (1, 2, 3)])
def test_any_leading_dimensions_as_sdpa(lead):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*lead, n, 5, generator=g) for n in (9, 4, 4))
    out = dot_product_attention(q, k, v, kernel="explicit")
    torch.testing.assert_close(out, dot_product_attention(q, k, v, kernel="sdpa"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_no_key_gives_a_row_of_zeros_as_sdpa(dtype, p):
    # 1 / (a sum of no weights) scaled the output GEMM's zeros to nan
    q = torch.randn(1, 2, 4, 8, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 2, 0, 8, dtype=dtype, requires_grad=True) for _ in "kv")
    out = dot_product_attention(q, k, v, dropout_p=p, kernel="explicit")
    assert torch.equal(out, torch.zeros_like(out))
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(grad, torch.zeros_like(q))


@pytest.mark.parametrize("wanted", ["q", "k", "v", "qk", "kv", "qv"])
def test_backward_computes_only_the_gradients_asked_for(wanted):
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(2, 2, 9, 4, generator=g) for _ in range(3)]
    grads = []
    for subset in ("qkv", wanted):  # all three, then only those wanted, under one seed
        inputs = [t.clone().requires_grad_(name in subset) for name, t in zip("qkv", tensors)]
        torch.manual_seed(0)
        out = dot_product_attention(*inputs, dropout_p=0.3, kernel="explicit")
        asked = [inputs["qkv".index(name)] for name in wanted]
        grads.append(torch.autograd.grad(out.square().sum(), asked))
    for some, full in zip(*grads[::-1]):
        torch.testing.assert_close(some, full, rtol=0, atol=0)


def test_bad_input_is_a_clear_error():
    ops = native.cpu_ops()
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 3, 4)
    args = (False, 0.5, torch.tensor(0), threshold(0.0), 1.0, 256)
    with pytest.raises(RuntimeError, match=r"q, k, v shapes .* do not match"):
        ops.attention_forward(q, torch.randn(1, 2, 3, 5), k, None, *args)
    with pytest.raises(RuntimeError, match="unit stride in the last dimension"):
        ops.attention_forward(q.transpose(-1, -2), k, k, None, *args)
    with pytest.raises(RuntimeError, match="the mask must be bool"):
        ops.attention_forward(q, k, k, torch.ones(1, 2, 5, 3), *args)
    with pytest.raises(RuntimeError, match="block_rows must be >= 1; got 0"):
        ops.attention_forward(q, k, k, None, *args[:-1], 0)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_that_share_a_matrix_add_its_key_gradients_once(threads, monkeypatch):
    # One (batch, head) matrix in 14 blocks of 3 rows: with several threads each takes a
    # run of blocks of the same matrix and adds its dK, dV sums into it under a lock; a
    # lost or doubled sum would break the agreement with the reference.
    monkeypatch.setattr(kernels, "_FUSED_ROWS", 3)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, n, 8, generator=g, requires_grad=True) for n in (40, 6, 6))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(1)
        out = dot_product_attention(q, k, v, dropout_p=0.2, kernel="explicit")
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    finally:
        torch.set_num_threads(previous)
    torch.manual_seed(1)
    seed = dropout_seed(q.device).item()
    expected = reference(q, k, v, None, False, 8**-0.5, seed, 0.2)
    for got, wanted in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v))):
        torch.testing.assert_close(got.double(), wanted.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("native_kernels", [True, False])
def test_double_backward_is_a_clear_error_not_a_wrong_answer(native_kernels):
    # A gradient penalty through the PyTorch-ops kernel (LINFORMER_KIT_NATIVE=0) got a
    # dL/dk off by 1.01 (largest true entry 1.40), silently: `once_differentiable` looks at
    # the incoming gradient only, and a constant one made the gradients graph-free.
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    weight = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    off = contextlib.nullcontext() if native_kernels else native.kernels_off()
    with off:
        for dropout_p in (0.0, 0.1):
            out = dot_product_attention(q, k, v, dropout_p=dropout_p, kernel="explicit")
            (grad,) = torch.autograd.grad((out * weight).sum(), q, create_graph=True)
            with pytest.raises(RuntimeError, match="backward is not differentiable .*SDPBackend"):
                grad.square().sum().backward()

    def penalised(attention):
        out = attention(q, k, v)
        (grad,) = torch.autograd.grad((out * weight).sum(), q, create_graph=True)
        return torch.autograd.grad((out * weight).sum() + grad.square().sum(), (k, v))

    # A penalty that reaches a weight through the query alone got a wrong answer from the
    # PyTorch-ops kernel (the error node hung from the incoming gradients only)
    x = torch.randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    with contextlib.nullcontext() if native_kernels else native.kernels_off():
        out = dot_product_attention(x @ w, x, x, kernel="explicit")
        (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="backward is not differentiable"):
            torch.autograd.grad(grad.square().sum(), w)

    # the way the message names gives the float64 reference's second-order gradients
    with use_kernel("sdpa"), sdpa_kernel(SDPBackend.MATH):
        got = penalised(dot_product_attention)
    for g, w in zip(got, penalised(lambda *t: softmax_attention(*t))):
        torch.testing.assert_close(g, w)
