"""The library of the compiled kernels' float32 GEMMs (`native.kernel_gemm`, the `float_gemm`
op): `sgemm_` or oneDNN's brgemm micro-kernel, the machine's choice unless set, set with the
linear maps' pin (`use_linear_backend`), and read by the attention rule, which takes the
explicit kernel for float32 without dropout where its GEMMs are oneDNN's; `matmul` (the
sequence projection's products on those GEMMs) equals `a @ b` in value and gradients, on
transposed views and expanded batches. That the kernels compute the same on either library:
`test_compiled_attention.py`, `test_feedforward_kernel.py`."""

import json
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from script_helpers import BENCHMARKS
from test_kernels import CPU

from linformer_kit import native, precision
from linformer_kit.encoder import LinformerEncoderLayer
from linformer_kit.functional import project_linear
from linformer_kit.kernel_rule import choose_kernel, use_kernel
from linformer_kit.linear_backend import add_matmul_, matmul, use_linear_backend
from linformer_kit.projection import MatrixProjection

# The machine's own test, before the conftest's fixture pretends an Intel CPU in each test.
REAL_MKL_WITHOUT_AVX512 = precision.mkl_without_avx512


@pytest.fixture
def ops():
    """The compiled kernels' ops (the conftest finds their GEMM library again afterwards)."""
    ops = native.cpu_ops()
    if ops is None:
        pytest.skip("no C++ compiler here: the kernels cannot be built")
    if ops.float_gemm("onednn") != "onednn":
        pytest.skip("this libtorch has no float brgemm: the kernels keep the BLAS")
    native.set_kernel_gemm(None)
    return ops


def test_the_op_sets_and_reads_the_library_and_names_the_allowed_ones(ops):
    assert ops.float_gemm() == "blas"  # the conftest's CPU: MKL runs AVX-512
    assert ops.float_gemm("onednn") == "onednn"
    assert ops.float_gemm() == "onednn"
    with pytest.raises(RuntimeError, match="backend must be 'blas' or 'onednn'; got 'mkl'"):
        ops.float_gemm("mkl")
    assert ops.float_gemm() == "onednn"  # a refused value changes nothing
    assert ops.float_gemm("blas") == "blas"


def test_the_machine_picks_onednn_where_mkl_runs_avx2_code_unless_set(ops, monkeypatch):
    assert native.kernel_gemm() == ops.float_gemm() == "blas"
    monkeypatch.setattr(precision, "mkl_without_avx512", lambda: True)  # an AMD CPU
    assert native.kernel_gemm() == "blas"  # found when the kernels loaded, kept
    assert native.set_kernel_gemm(None) is None  # found again: as when they load there
    assert native.kernel_gemm() == ops.float_gemm() == "onednn"
    assert native.set_kernel_gemm("blas") is None
    assert native.kernel_gemm() == ops.float_gemm() == "blas"
    assert native.set_kernel_gemm(None) == "blas"
    assert native.kernel_gemm() == "onednn"
    # oneDNN switched off: the kernels' GEMMs take the BLAS (the switch stays set, for when
    # it is on again), and the rule knows
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert native.kernel_gemm() == "blas" and ops.float_gemm() == "onednn"
    a, b = torch.randn(300, 40).t(), torch.randn(300, 20)
    torch.testing.assert_close(ops.matmul(a[None], b[None])[0], a @ b, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="backend must be 'blas', 'onednn' or None; got 'mkl'"):
        native.set_kernel_gemm("mkl")


def test_only_a_non_intel_cpu_with_avx512_sends_the_kernels_to_onednn(ops, monkeypatch):
    # One library for every kernel: on a real AVX2-only AMD EPYC (Zen 3) MKL was as fast as
    # oneDNN's AVX2 code for the attention and feed-forward kernels and the layers
    # (benchmarks/kernels/zen3-avx2/gemm-ab/, gemm-rate/), so an AMD CPU without AVX-512
    # keeps MKL as an Intel one does.
    monkeypatch.setattr(precision, "mkl_without_avx512", REAL_MKL_WITHOUT_AVX512)
    cpus = [("AuthenticAMD", "AVX2", "blas"), ("AuthenticAMD", "AVX512", "onednn")]
    cpus += [("GenuineIntel", "AVX512", "blas"), ("GenuineIntel", "AVX2", "blas")]
    for vendor, capability, library in cpus:
        cpu = {"vendor": vendor, "capability": capability}
        monkeypatch.setattr(precision, "cpu_features", lambda *a, cpu=cpu, **kw: cpu)
        monkeypatch.setattr(precision, "_found", {})  # found once a process: again here
        native.set_kernel_gemm(None)
        assert (native.kernel_gemm(), ops.float_gemm()) == (library, library), cpu


def small_layer() -> tuple[LinformerEncoderLayer, torch.Tensor]:
    """A seeded encoder layer (kv sharing, no dropout, training mode) and an input for it."""
    torch.manual_seed(0)
    proj = MatrixProjection(max_seq_len=64, proj_dim=16)
    layer = LinformerEncoderLayer(
        dim=32, num_heads=4, max_seq_len=64, proj_k=proj, proj_v=proj, ffn_dim=64,
        dropout=0.0, attention_dropout=0.0,
    ).train()  # fmt: skip
    return layer, torch.randn(2, 64, 32, requires_grad=True)


def test_an_encoder_layer_computes_the_same_on_either_library(ops):
    layer, x = small_layer()
    inputs = (x, *layer.parameters())
    results = []
    for library in ("blas", "onednn"):
        assert ops.float_gemm(library) == library
        with use_kernel("explicit"):  # the attention kernel, whichever its library
            out = layer(x)[0]
        results.append((out, torch.autograd.grad(out.square().sum(), inputs)))
    (wanted, wanted_grads), *others = results
    for out, grads in others:
        torch.testing.assert_close(out, wanted, atol=1e-5, rtol=1e-5)
        for got, expected in zip(grads, wanted_grads):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_linear_maps_pin_sets_the_kernels_library_and_restores_it(ops):
    native.set_kernel_gemm("onednn")  # a setting of the user's: restored after each pin
    with use_linear_backend(None):  # the linear maps' rule: the kernels' setting kept
        assert ops.float_gemm() == "onednn"
    with use_linear_backend("blas"):
        assert ops.float_gemm() == "blas"
    assert ops.float_gemm() == "onednn"
    native.set_kernel_gemm(None)
    with use_linear_backend("onednn"):
        assert (native.kernel_gemm(), ops.float_gemm()) == ("onednn", "onednn")
        with use_linear_backend("blas"):
            assert (native.kernel_gemm(), ops.float_gemm()) == ("blas", "blas")
        assert ops.float_gemm() == "onednn"
        with pytest.raises(KeyError), use_linear_backend("blas"):
            raise KeyError
        assert ops.float_gemm() == "onednn"
    assert (native.kernel_gemm(), ops.float_gemm()) == ("blas", "blas")


def pick(dtype, *, dropout=False, backward=True, compiled=True, queries=4096):
    return choose_kernel(device=CPU, dtype=dtype, dropout=dropout, backward=backward,
                         causal=False, queries=queries, keys=256, groups=4,
                         compiled=lambda: compiled)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_dropout_the_explicit_kernel_runs_on_onednn_gemms(dtype, monkeypatch):
    # benchmarks/kernels/amd-epyc/table, table-bf16-dot: explicit on the micro-kernel (bf16
    # on AVX-512 BF16's dot products) against SDPA's sgemm_ calls (MKL's AVX2 code there)
    assert pick(dtype, backward=False) == "sdpa"  # the conftest's Intel CPU: its MKL
    monkeypatch.setattr(native, "kernel_gemm", lambda: "onednn")
    assert pick(dtype) == "explicit"
    assert pick(dtype, backward=False) == "explicit"
    assert pick(dtype, queries=64) == "explicit"
    assert pick(dtype, queries=16, backward=False) == "sdpa"  # table-queries: explicit loses
    assert pick(dtype, queries=16) == ("explicit" if dtype == torch.bfloat16 else "sdpa")
    assert pick(dtype, compiled=False) == "sdpa"  # PyTorch ops: torch's own GEMMs
    assert pick(torch.float64) == "sdpa"  # dgemm_ stays the BLAS's
    assert pick(torch.float64, dropout=True) == "explicit"


def test_an_encoder_layer_pinned_to_onednn_runs_the_explicit_kernel(ops, explicit_calls):
    layer, x = small_layer()
    wanted = layer(x)[0]
    assert not explicit_calls  # SDPA on the BLAS
    with use_linear_backend("onednn"):
        got = layer(x)[0]
    assert explicit_calls == ["explicit"]
    torch.testing.assert_close(got, wanted, atol=1e-5, rtol=1e-5)


def operands(shape_a, shape_b, transpose_a, transpose_b, batch_stride_0, dtype, seed):
    """a (.., M, K) and b (.., K, N), each contiguous or a transposed view; a's batch
    optionally an expanded single matrix (stride 0), as the shared projection passes it."""
    g = torch.Generator().manual_seed(seed)

    def make(shape, transpose):
        if transpose:
            return torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=dtype, generator=g).mT
        return torch.randn(shape, dtype=dtype, generator=g)

    a, b = make(shape_a, transpose_a), make(shape_b, transpose_b)
    if batch_stride_0 and a.dim() == 3:
        a = a[:1].expand_as(a)
    return a.requires_grad_(), b.requires_grad_()  # (a non-leaf view when expanded)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.sampled_from([None, 1, 3]),
    m=st.integers(1, 300),
    k=st.integers(0, 70),
    n=st.integers(1, 300),
    transposes=st.tuples(st.booleans(), st.booleans()),
    batch_stride_0=st.booleans(),
    gemm=st.sampled_from(["blas", "onednn"]),
)
def test_matmul_is_a_at_b_in_value_and_gradients(batch, m, k, n, transposes, batch_stride_0, gemm):
    ops = native.cpu_ops()
    if ops is None:
        pytest.skip("no C++ compiler here: the kernels cannot be built")
    lead = () if batch is None else (batch,)
    a, b = operands((*lead, m, k), (*lead, k, n), *transposes, batch_stride_0, torch.float32, m)
    grad = torch.randn(*lead, m, n)
    with use_linear_backend(gemm), mock.patch.object(ops, "matmul", wraps=ops.matmul) as spy:
        out = matmul(a, b)
        got = torch.autograd.grad(out, (a, b), grad)
    assert spy.call_count == (3 if gemm == "onednn" else 0)  # forward and both gradients
    wanted_out = a.double() @ b.double()
    wanted = torch.autograd.grad(wanted_out, (a, b), grad.double())
    torch.testing.assert_close(out.double(), wanted_out, atol=1e-4, rtol=1e-4)
    for x, y in zip(got, wanted):
        torch.testing.assert_close(x.double(), y.double(), atol=1e-4, rtol=1e-4)


def test_matmul_takes_the_op_only_on_onednn_gemms_for_float32(ops, monkeypatch):
    calls = []
    real = ops.matmul
    monkeypatch.setattr(ops, "matmul", lambda *t: calls.append(1) or real(*t))
    a, b = torch.randn(300, 40), torch.randn(40, 20)
    matmul(a, b)
    assert not calls  # the BLAS's GEMMs (the conftest's CPU): torch's matmul
    with use_linear_backend("onednn"):
        torch.testing.assert_close(matmul(a, b), a @ b)
        assert calls == [1]
        matmul(a.double(), b.double())  # dgemm_ is the BLAS's either way
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert matmul(a, b).dtype == torch.bfloat16  # autocast's own matmul
        _, tangent = torch.func.jvp(lambda x: matmul(x, b), (a,), (a,))  # no forward rule
        torch.testing.assert_close(tangent, a @ b)
    assert calls == [1]


def test_the_op_has_exact_first_and_second_derivatives_and_its_fake_kernel(ops):
    a, b = operands((2, 5, 4), (2, 4, 3), True, False, False, torch.float64, 0)
    # double: dgemm_, on the same formulas and layouts (transposed products included)
    assert torch.autograd.gradcheck(ops.matmul, (a, b))
    assert torch.autograd.gradgradcheck(ops.matmul, (a, b))
    x, y = torch.randn(2, 5, 4), torch.randn(2, 4, 3).mT.contiguous().mT
    torch.library.opcheck(ops.matmul.default, (x, y))
    for gemm in ("blas", "onednn"):  # no sum at all: zeros, and nothing added
        native.set_kernel_gemm(gemm)
        empty_a, empty_b = torch.randn(2, 5, 0), torch.randn(2, 0, 3)
        assert torch.equal(ops.matmul(empty_a, empty_b), torch.zeros(2, 5, 3))
        out = torch.ones(2, 5, 3)
        ops.matmul_add_(out, empty_a, empty_b)
        assert torch.equal(out, torch.ones(2, 5, 3))
    with pytest.raises(RuntimeError, match=r"must be CPU tensors \(B, M, K\) and \(B, K, N\)"):
        ops.matmul(torch.randn(2, 5, 4), torch.randn(2, 3, 3))


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_sequence_projection_on_the_op_equals_it_on_torch(ops, per_head, batch, monkeypatch):
    torch.manual_seed(batch)
    weight = torch.randn(*((4,) if per_head else ()), 300, 40, requires_grad=True)
    x = torch.randn(batch, 290, 4, 16, requires_grad=True)
    mask = torch.ones(batch, 290, dtype=torch.bool)
    mask[-1, 200:] = False

    def run():
        out = project_linear(x, weight, mask)
        return [out, *torch.autograd.grad(out, (x, weight), torch.ones_like(out))]

    wanted = run()
    calls = []
    real = ops.matmul
    monkeypatch.setattr(ops, "matmul", lambda *t: calls.append(1) or real(*t))
    with use_linear_backend("onednn"):
        got = run()
    assert len(calls) == 3  # the projection and both its gradients
    for a, b in zip(got, wanted):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("gemm", ["blas", "onednn"])
def test_add_matmul_adds_the_product_in_place(ops, gemm):
    # out a view with a row stride past its width; a a transposed view (the loss's dY^T)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(300, 40, generator=g).t(), torch.randn(300, 20, generator=g)
    storage = torch.randn(40, 32, generator=g)
    out, beyond = storage[:, :20], storage[:, 20:].clone()
    wanted = (out.double() + a.double() @ b.double()).float()
    with use_linear_backend(gemm):
        assert add_matmul_(out, a, b) is out
    torch.testing.assert_close(out, wanted, atol=1e-4, rtol=1e-4)
    assert torch.equal(storage[:, 20:], beyond)  # the row stride kept, nothing past the width
    columns = torch.zeros(20, 40).t()  # not row-major: torch's addmm_
    with use_linear_backend("onednn"):
        add_matmul_(columns, a, b)
    torch.testing.assert_close(columns, a @ b, atol=1e-4, rtol=1e-4)


AMD = BENCHMARKS / "kernels" / "amd-epyc"


@pytest.mark.parametrize("table", ["table-queries", "table-causal"])
def test_on_onednn_gemms_the_rule_is_never_the_slower_kernel(table, monkeypatch):
    # benchmarks/kernels.py on the AMD EPYC: few queries (1-256 over k 64 / 256) and exact
    # causal attention (n 1024, 4096), fp32 and bf16 without dropout, training and
    # inference. The rule's pick is at most 10 % slower than the other kernel in every row
    # (few queries: SDPA below 64, where the explicit kernel's per-call K^T lost), but bf16
    # below 64 queries: there the rows are mixed (explicit 0.72-1.97x; no query count
    # splits them), the rule's pick (explicit in training, SDPA in inference) within 25 %.
    monkeypatch.setattr(native, "kernel_gemm", lambda: "onednn")
    rows = [r for r in json.loads((AMD / table / "table.json").read_text())["rows"]]
    plain = [r for r in rows if r["mode"] != "train dropout 0.1"]
    assert len(plain) == 2 * (16 if table == "table-queries" else 4)
    assert {r["dtype"] for r in plain} == {"float32", "bfloat16"}
    for row in plain:
        causal = row["k"] == "n"
        picked = choose_kernel(
            device=CPU, dtype=getattr(torch, row["dtype"]), dropout=False,
            backward=row["mode"] == "train", causal=causal, queries=row["n"],
            keys=row["n"] if causal else row["k"], groups=4, compiled=lambda: True,
        )  # fmt: skip
        other = "sdpa" if picked == "explicit" else "explicit"
        bound = 1.25 if row["dtype"] == "bfloat16" and row["n"] < 64 else 1.1
        assert row[f"{picked}_ms"] <= bound * row[f"{other}_ms"], (row, picked)


@pytest.mark.parametrize("shape", [(16, 16), (33, 50), (64, 300), (300, 17)])
def test_transposed_operands_are_copied_exactly(ops, shape):
    # Times the identity, a transposed view's product is its copy (every other term an
    # exact zero): whole 16 x 16 tiles (the AVX-512 transpose where the CPU has it) and the
    # edges alike.
    native.set_kernel_gemm("onednn")
    rows, cols = shape
    a = torch.randn(3, cols, rows).mT  # (3, rows, cols), a transposed view
    assert torch.equal(ops.matmul(a, torch.eye(cols).expand(3, -1, -1)), a)
    b = torch.randn(3, rows, cols).mT  # B transposed: (3, cols, rows)
    assert torch.equal(ops.matmul(torch.eye(cols).expand(3, -1, -1), b), b)
    # ... and one transposed matrix shared by the batch (stride 0), laid out once
    shared = torch.randn(cols, rows).mT.expand(3, -1, -1)
    assert torch.equal(ops.matmul(shared, torch.eye(cols).expand(3, -1, -1)), shared)
    shared = torch.randn(rows, cols).mT.expand(3, -1, -1)  # (3, cols, rows)
    assert torch.equal(ops.matmul(torch.eye(cols).expand(3, -1, -1), shared), shared)


@pytest.mark.parametrize("threads", [2, 3, 12])
@pytest.mark.parametrize("shape", [(1, 1, 2048), (17, 40, 2049), (256, 256, 4096), (40, 300, 2600)])
def test_a_split_reduction_equals_a_at_b_and_repeats_its_bits(ops, shape, threads):
    # A transposed (a weight gradient's X^T dY) with k >= 2048 and 8x the longer side: each
    # thread sums its own 256-deep blocks (12 threads: some have none; k 2049 and 2600: a
    # short last block), the sums added into C; B as is and transposed, and added to C
    m, n, k = shape
    g = torch.Generator().manual_seed(k)
    a = torch.randn(1, k, m, generator=g).mT
    before = torch.get_num_threads()
    native.set_kernel_gemm("onednn")
    torch.set_num_threads(threads)
    try:
        assert ops.split_reduction() is True  # on by default
        for b in (torch.randn(1, k, n, generator=g), torch.randn(1, n, k, generator=g).mT):
            wanted = a.double() @ b.double()
            split = ops.matmul(a, b)
            torch.testing.assert_close(split.double(), wanted, atol=1e-4, rtol=1e-4)
            assert torch.equal(ops.matmul(a, b), split)  # the same bits every call
            assert ops.split_reduction(False) is False
            tiled = ops.matmul(a, b)  # the output tiled over a transposed copy of A
            assert ops.split_reduction(True) is True
            torch.testing.assert_close(tiled, split, atol=1e-4, rtol=1e-4)
            if k >= 4096:  # another order of sums: other bits (so the split ran)
                assert not torch.equal(tiled, split)
            storage = torch.randn(1, m, n + 3, generator=g)
            out, beyond = storage[..., :n], storage[..., n:].clone()
            total = out.double() + wanted
            ops.matmul_add_(out, a, b)
            torch.testing.assert_close(out.double(), total, atol=1e-4, rtol=1e-4)
            assert torch.equal(storage[..., n:], beyond)  # nothing written past the width
    finally:
        torch.set_num_threads(before)
        ops.split_reduction(True)
