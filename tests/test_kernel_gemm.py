"""The library of the compiled kernels' float32 GEMMs (`native.kernel_gemm`, the `float_gemm`
op): `sgemm_` or oneDNN's brgemm micro-kernel, the machine's choice unless set, set with the
linear maps' pin (`use_linear_backend`), and read by the attention rule, which takes the
explicit kernel for float32 without dropout where its GEMMs are oneDNN's. That the kernels
compute the same on either library: `test_compiled_attention.py`,
`test_feedforward_kernel.py`."""

import pytest
import torch
from test_kernels import CPU

from linformer_kit import native, precision
from linformer_kit.encoder import LinformerEncoderLayer
from linformer_kit.kernel_rule import choose_kernel
from linformer_kit.linear_backend import use_linear_backend
from linformer_kit.projection import MatrixProjection


@pytest.fixture
def ops():
    ops = native.cpu_ops()
    if ops is None:
        pytest.skip("no C++ compiler here: the kernels cannot be built")
    yield ops
    native.set_kernel_gemm(None)


def test_the_op_sets_and_reads_the_library_and_names_the_allowed_ones(ops):
    assert ops.float_gemm() == "blas"  # the conftest's CPU: MKL runs AVX-512
    assert ops.float_gemm("onednn") == "onednn"
    assert ops.float_gemm() == "onednn"
    with pytest.raises(RuntimeError, match="backend must be 'blas' or 'onednn'; got 'mkl'"):
        ops.float_gemm("mkl")
    assert ops.float_gemm() == "onednn"  # a refused value changes nothing
    assert ops.float_gemm("blas") == "blas"


def test_the_machine_picks_onednn_where_mkl_runs_avx2_code_unless_set(monkeypatch):
    assert native.kernel_gemm() == "blas"
    monkeypatch.setattr(precision, "mkl_without_avx512", lambda: True)  # an AMD CPU
    assert native.kernel_gemm() == "onednn"
    native.set_kernel_gemm("blas")
    try:
        assert native.kernel_gemm() == "blas"
    finally:
        native.set_kernel_gemm(None)
    assert native.kernel_gemm() == "onednn"
    with pytest.raises(ValueError, match="backend must be 'blas', 'onednn' or None; got 'mkl'"):
        native.set_kernel_gemm("mkl")


def test_the_linear_maps_pin_sets_the_kernels_library_and_restores_it(ops):
    with use_linear_backend("onednn"):
        assert (native.kernel_gemm(), ops.float_gemm()) == ("onednn", "onednn")
        with use_linear_backend("blas"):
            assert (native.kernel_gemm(), ops.float_gemm()) == ("blas", "blas")
        assert ops.float_gemm() == "onednn"
        with pytest.raises(KeyError), use_linear_backend("blas"):
            raise KeyError
        assert ops.float_gemm() == "onednn"
    assert (native.kernel_gemm(), ops.float_gemm()) == ("blas", "blas")


def pick(dtype, *, dropout=False, backward=True, compiled=True):
    return choose_kernel(device=CPU, dtype=dtype, dropout=dropout, backward=backward,
                         causal=False, queries=4096, keys=256, groups=4,
                         compiled=lambda: compiled)  # fmt: skip


def test_float32_without_dropout_takes_the_explicit_kernel_on_onednn_gemms(monkeypatch):
    # benchmarks/kernels/amd-epyc/table: explicit on the micro-kernel against SDPA's
    # sgemm_ calls (MKL's AVX2 code there)
    assert pick(torch.float32) == "sdpa" and pick(torch.float32, backward=False) == "sdpa"
    monkeypatch.setattr(native, "kernel_gemm", lambda: "onednn")
    assert pick(torch.float32) == "explicit"
    assert pick(torch.float32, backward=False) == "explicit"
    assert pick(torch.float32, compiled=False) == "sdpa"  # PyTorch ops: torch's own GEMMs
    assert pick(torch.float64) == "sdpa"  # dgemm_ stays the BLAS's
    assert pick(torch.float64, dropout=True) == "explicit"


def test_an_encoder_layer_pinned_to_onednn_runs_the_explicit_kernel(ops, explicit_calls):
    torch.manual_seed(0)
    proj = MatrixProjection(max_seq_len=64, proj_dim=16)
    layer = LinformerEncoderLayer(
        dim=32, num_heads=4, max_seq_len=64, proj_k=proj, proj_v=proj, ffn_dim=64,
        dropout=0.0, attention_dropout=0.0,
    ).train()  # fmt: skip
    x = torch.randn(2, 64, 32, requires_grad=True)
    wanted = layer(x)[0]
    assert not explicit_calls  # SDPA on the BLAS
    with use_linear_backend("onednn"):
        got = layer(x)[0]
    assert explicit_calls == ["explicit"]
    torch.testing.assert_close(got, wanted, atol=1e-5, rtol=1e-5)
