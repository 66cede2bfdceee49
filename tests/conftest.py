"""Shared fixtures."""

import os

import pytest
import torch
import torch.nn.functional as F

from linformer_kit import kernels, linear_backend, native, precision


@pytest.fixture
def bf16_is(monkeypatch):
    """Makes the bf16 probe report native (True) or emulated (False) bf16, whatever this
    machine has, so a test's path and duration do not depend on the CPU it runs on."""

    def pretend(native: bool) -> precision.Bf16Support:
        support = precision.Bf16Support(
            device="cpu",
            native=native,
            slowdown=0.5 if native else 80.0,
            capability="AVX512" if native else "AVX2",
        )
        monkeypatch.setattr(precision, "bf16_support", lambda device="cpu": support)
        monkeypatch.setattr(precision, "_warned", set())
        return support

    return pretend


@pytest.fixture(autouse=True)
def mkl_runs_avx512(monkeypatch):
    """Every test sees a CPU where MKL runs its AVX-512 code (an Intel one), so the layers'
    linear maps stay on `F.linear` and the feed-forward kernel runs, on an AMD CPU too
    (`linear_backend`'s rule would send them to oneDNN there, and `kernel_rule` would choose
    by the kernels' oneDNN GEMMs): a test's path does not depend
    on the CPU it runs on (in this process: a subprocess a test starts reads the real CPU).
    Tests of the rule set it themselves; `use_linear_backend` pins oneDNN on any CPU.
    Afterwards the kernels' GEMM library is found again under this CPU (`native.kernel_gemm`
    keeps what it found), so a test that set it, or found it on another CPU, leaves no trace.
    """
    monkeypatch.setattr(precision, "mkl_without_avx512", lambda: False)
    yield
    monkeypatch.setattr(precision, "mkl_without_avx512", lambda: False)
    native.set_kernel_gemm(None)


@pytest.fixture(autouse=True)
def same_threads():
    """Restores torch's thread count after each test: a script run with `--threads 1` in one
    test must not leave the next on one thread (the linear-map rule reads it)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def fresh_inductor_cache(tmp_path_factory):
    """A compile cache of this test run's own. Inductor's shared cache (/tmp/torchinductor_$USER)
    does not key its CPU kernels on `ATEN_CPU_CAPABILITY`: kernels built under one ISA setting
    (say, the AVX2 emulation used to check this suite on every CPU) crash or fail a later run
    under another (measured: a segfault in test_export_compile)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))


@pytest.fixture
def explicit_calls(monkeypatch):
    """A list that gets "explicit" each time the explicit attention kernel runs (compiled or
    by PyTorch ops), which then runs as it would."""
    calls = []
    real = kernels._fused_attention, kernels._ExplicitAttention.apply
    for owner, name, call in zip((kernels, kernels._ExplicitAttention),
                                 ("_fused_attention", "apply"), real):  # fmt: skip
        monkeypatch.setattr(owner, name, lambda *a, call=call: calls.append("explicit") or call(*a))
    return calls


@pytest.fixture
def onednn_maps(monkeypatch):
    """A list that gets an entry each time a linear map runs in one of oneDNN's forms with
    gradients: "convolution" or "matmul" (oneDNN's brgemm through the kernels' GEMMs)."""
    calls = []

    def recording(real, form):
        def record(*args, **kwargs):
            calls.append(form)
            return real(*args, **kwargs)

        return record

    for module, name, form in ((F, "conv2d", "convolution"), (linear_backend, "matmul", "matmul")):
        monkeypatch.setattr(module, name, recording(getattr(module, name), form))
    return calls


@pytest.fixture(params=["convolution", "matmul"])
def form(request):
    """oneDNN's form for the products that need gradients: the convolution (the matmul form
    off) or, where the kernels' GEMMs can be oneDNN's, `matmul` up to its limit."""
    if request.param == "convolution":
        with linear_backend.use_matmul_form(False):
            yield request.param
        return
    native.cpu_ops()  # (built first, so that kernel_gemm reads what they took)
    with linear_backend.use_linear_backend("onednn"):
        if native.kernel_gemm() != "onednn":
            pytest.skip("the kernels' GEMMs cannot be oneDNN's here (no compiler or brgemm)")
    yield request.param
