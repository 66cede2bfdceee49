"""`linear_backend`: oneDNN's form of a linear map equals `F.linear` (output and every
gradient, against float64), the rule picks oneDNN only on an AMD CPU with AVX-512 for
float32 products of enough rows, a pin overrides it, and the layers route through it
(attention, cross-attention, feed-forward) with the same results as on `F.linear`, hooks and
subclassed layers kept as they are."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from script_helpers import BENCHMARKS, load_script
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from linformer_kit import LinformerCrossAttention, native, precision
from linformer_kit.encoder import FeedForward, LinformerEncoderLayer
from linformer_kit.linear_backend import (
    MATMUL_MAX_OUTPUTS,
    ONEDNN_MIN_MACS,
    ONEDNN_MIN_ROWS,
    ONEDNN_MIN_WIDTH,
    apply_linear,
    choose_linear_backend,
    linear,
    onednn_linear,
    use_linear_backend,
)
from linformer_kit.projection import MatrixProjection

# The rule's machine check itself (the conftest stubs the module's name for every test).
MKL_WITHOUT_AVX512 = precision.mkl_without_avx512


@pytest.fixture
def two_threads():
    """Two threads, whatever the machine's default (with one the rule keeps F.linear); the
    conftest's `same_threads` restores the count."""
    torch.set_num_threads(2)


def value_and_grads(fn, x, weight, bias, grad):
    leaves = [t.detach().requires_grad_() for t in (x, weight, bias) if t is not None]
    out = fn(*leaves, *([None] if bias is None else []))
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lead=st.sampled_from([(1,), (7,), (2, 3), (2, 1, 5), (300,)]),
    sizes=st.tuples(st.integers(1, 40), st.integers(1, 40)),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_onednn_linear_is_linear_in_value_and_every_gradient(
    lead, sizes, with_bias, seed, onednn_maps, form
):
    # (the fixtures hold for every example: the form patched once, the record cleared)
    torch.manual_seed(seed)
    in_features, out_features = sizes
    x = torch.randn(*lead, in_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    grad = torch.randn(*lead, out_features)
    onednn_maps.clear()
    with use_linear_backend("onednn"):  # (the kernels' GEMMs on oneDNN's brgemm)
        got = value_and_grads(onednn_linear, x, weight, bias, grad)
    assert onednn_maps == [form]
    as_double = [t.double() if t is not None else None for t in (x, weight, bias, grad)]
    wanted = value_and_grads(F.linear, *as_double)
    assert got[0].shape == wanted[0].shape and got[0].dtype == torch.float32
    for a, b in zip(got, wanted):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_without_gradients_onednn_linear_runs_onednns_matmul(with_bias, no_grad, onednn_maps):
    # No operand needs a gradient: oneDNN's matmul on the dense tensors, not the convolution
    # (and with a gradient wanted, the convolution: the hypothesis test above).
    x, columns = torch.randn(2, 300, 24), torch.randn(300, 24).t()  # (24, 300), a view
    weight, bias = torch.randn(40, 24), torch.randn(40) if with_bias else None
    rows_weight = torch.randn(300, 40).t()
    wanted = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    with no_grad():
        got = onednn_linear(x, weight, bias)
        wide = onednn_linear(columns, rows_weight)  # (24, 300) x (40, 300)^T, both views
    assert not onednn_maps and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), wanted, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(wide, F.linear(columns, rows_weight), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "bias",
    [
        lambda: torch.randn(80)[::2],  # strided: the matmul read every other 40 wrong
        lambda: torch.tensor([0.5]).expand(40),  # expanded: it read past the storage
        lambda: torch.tensor(0.75),  # 0-d: dropped
        lambda: torch.randn(1),  # (1,) and (1, 40): oneDNN could not make a primitive
        lambda: torch.randn(1, 40),
    ],
    ids=["strided", "expanded", "0-d", "(1,)", "(1, out)"],
)
@pytest.mark.parametrize("grad", [False, True])
def test_any_bias_f_linear_takes_gives_its_result(bias, grad, two_threads):
    x, weight, bias = torch.randn(300, 24), torch.randn(40, 24, requires_grad=grad), bias()
    wanted = F.linear(x.double(), weight.double(), bias.double())
    with torch.set_grad_enabled(grad):
        got = onednn_linear(x, weight, bias)
        with use_linear_backend("onednn"):
            pinned = linear(x, weight, bias)
    assert choose_linear_backend(x, weight, bias) == "blas"
    for out in (got, pinned):
        torch.testing.assert_close(out.double(), wanted, atol=1e-4, rtol=1e-4)


def test_onednn_linear_takes_non_contiguous_input_and_weight():
    x = torch.randn(6, 300, 8).transpose(0, 1)  # (300, 6, 8), not contiguous
    weight = torch.randn(8, 5).t()  # (5, 8), not contiguous
    torch.testing.assert_close(onednn_linear(x, weight), F.linear(x, weight))


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_the_rule_sends_float32_rows_to_onednn_only_where_mkl_runs_avx2(monkeypatch, two_threads):
    # (256, 256) at 128 rows: the multiply-add threshold just met; (128, 128) needs 512
    # rows; (768, 768) 16, the fewest rows; width 64 never
    weight, narrow, wide = torch.randn(256, 256), torch.randn(128, 128), torch.randn(768, 768)
    many, few = torch.randn(2, 64, 256), torch.randn(127, 256)
    assert 128 * weight.numel() == ONEDNN_MIN_MACS
    assert choose_linear_backend(many, weight) == "blas"  # the fixture's Intel CPU
    monkeypatch.setattr(precision, "mkl_without_avx512", lambda: True)
    assert choose_linear_backend(many, weight) == "onednn"
    assert choose_linear_backend(few, weight) == "blas"
    assert choose_linear_backend(torch.randn(512, 128), narrow) == "onednn"
    assert choose_linear_backend(torch.randn(511, 128), narrow) == "blas"
    assert choose_linear_backend(torch.randn(ONEDNN_MIN_ROWS, 768), wide) == "onednn"
    assert choose_linear_backend(torch.randn(ONEDNN_MIN_ROWS - 1, 768), wide) == "blas"
    assert choose_linear_backend(torch.randn(8192, 256), torch.randn(64, 256)) == "blas"
    assert ONEDNN_MIN_WIDTH == 128
    assert choose_linear_backend(many.double(), weight.double()) == "blas"
    assert choose_linear_backend(many.bfloat16(), weight.bfloat16()) == "blas"
    assert choose_linear_backend(many[:, :0], weight) == "blas"
    # One thread, training: oneDNN's brgemm through the kernels' matmul at any size where the
    # kernels' GEMMs are oneDNN's, else F.linear (a tie with the convolution there);
    # inference: oneDNN's matmul
    torch.set_num_threads(1)
    trained, bias = weight.detach().requires_grad_(), torch.zeros(256, requires_grad=True)
    monkeypatch.setattr(native, "kernel_gemm", lambda: "blas")
    assert choose_linear_backend(many, trained) == "blas"
    assert choose_linear_backend(many, weight) == "onednn"
    assert choose_linear_backend(many, weight, bias) == "blas"
    with torch.no_grad():
        assert choose_linear_backend(many, trained) == "onednn"
    monkeypatch.setattr(native, "kernel_gemm", lambda: "onednn")
    assert choose_linear_backend(many, trained) == "onednn"
    assert choose_linear_backend(many, weight, bias) == "onednn"
    most = torch.randn(MATMUL_MAX_OUTPUTS // 256, 256)
    assert choose_linear_backend(most, trained) == "onednn"
    assert choose_linear_backend(torch.cat([most, most[:1]]), trained) == "onednn"
    torch.set_num_threads(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert choose_linear_backend(many, weight) == "blas"
    with use_linear_backend("blas"):
        assert choose_linear_backend(many, weight) == "blas"
    with torch.backends.mkldnn.flags(enabled=False):
        assert choose_linear_backend(many, weight) == "blas"
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    with use_linear_backend("onednn"):
        assert choose_linear_backend(many, weight) == "blas"


def test_mkl_without_avx512_reads_the_vendor_and_torchs_dispatch(monkeypatch):
    def cpu(vendor, capability):
        features = {"model": "x", "vendor": vendor, "capability": capability, "flags": []}
        monkeypatch.setattr(precision, "cpu_features", lambda: features)
        monkeypatch.setattr(precision, "_found", {})

    cpu("AuthenticAMD", "AVX512")
    built_in = torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()
    assert MKL_WITHOUT_AVX512() == built_in
    cpu("AuthenticAMD", "AVX2")
    assert not MKL_WITHOUT_AVX512()
    cpu("HygonGenuine", "AVX512")  # any non-Intel vendor: MKL's generic path
    assert MKL_WITHOUT_AVX512() == built_in
    for vendor in ("GenuineIntel", ""):  # "": no /proc/cpuinfo, nothing known
        cpu(vendor, "AVX512")
        assert not MKL_WITHOUT_AVX512()
    cpu("AuthenticAMD", "AVX512")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not MKL_WITHOUT_AVX512() and not precision._found  # no read traced in a graph


def test_cpu_features_names_the_vendor():
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    vendors = [line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")]
    assert precision.cpu_features()["vendor"] == (vendors[0] if vendors else "")


def test_a_pin_overrides_the_rule_and_is_checked(onednn_maps, form):
    x, weight = torch.randn(3, 8), torch.randn(4, 8, requires_grad=True)
    with use_linear_backend("onednn"):
        out = linear(x, weight)
        with use_linear_backend(None):  # the rule again: blas on the fixture's CPU
            linear(x, weight)
        linear(x.double(), weight.double())  # oneDNN cannot take it: F.linear
    assert onednn_maps == [form]
    torch.testing.assert_close(out, F.linear(x, weight))
    with pytest.raises(ValueError, match="backend must be one of blas, onednn or None; got 'mkl'"):
        with use_linear_backend("mkl"):
            pass


@pytest.mark.parametrize("backend", ["blas", "onednn"])
def test_apply_linear_calls_the_module_where_more_than_its_forward_runs(backend, onednn_maps, form):
    layer = nn.Linear(8, 4)
    x = torch.randn(5, 8, requires_grad=True)
    with use_linear_backend(backend):
        torch.testing.assert_close(apply_linear(layer, x), layer(x))
        assert onednn_maps == ([form] if backend == "onednn" else [])
        onednn_maps.clear()
        seen = []
        registers = {
            "forward": layer.register_forward_hook,
            "pre": layer.register_forward_pre_hook,
            "backward": layer.register_full_backward_hook,
            "backward pre": layer.register_full_backward_pre_hook,
        }
        for name, register in registers.items():
            hook = register(lambda *a, name=name: seen.append(name))
            apply_linear(layer, x).sum().backward()
            hook.remove()
        global_hook = nn.modules.module.register_module_full_backward_hook(
            lambda *a: seen.append("global backward")
        )
        apply_linear(layer, x).sum().backward()
        global_hook.remove()
        layer.forward = lambda t: seen.append("instance forward") or nn.Linear.forward(layer, t)
        apply_linear(layer, x)
        del layer.forward
        lazy = nn.LazyLinear(4)
        apply_linear(lazy, x)  # a subclass: its own forward (here: it materialises)
    assert seen == [
        "forward", "pre", "backward", "backward pre", "global backward", "instance forward"
    ]  # fmt: skip
    assert not onednn_maps and lazy.weight.shape == (4, 8)


def test_onednn_linear_keeps_f_linears_empty_results_and_errors():
    weight = torch.randn(4, 8)
    assert onednn_linear(torch.randn(2, 0, 8), weight).shape == (2, 0, 4)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        onednn_linear(torch.randn(3, 7), weight)


def test_traced_graphs_keep_plain_linear(onednn_maps):
    layer = nn.Linear(8, 4)
    with use_linear_backend("onednn"):
        traced = torch.jit.trace(layer, torch.randn(300, 8))
    assert not onednn_maps and "aten::linear" in str(traced.inlined_graph)


def layer_outputs_and_grads(layer, x, key_padding_mask):
    torch.manual_seed(0)  # the same dropout draws on both paths
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out, _ = layer(x, key_padding_mask)
    out.backward(torch.ones_like(out))
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("sharing", ["kv", "none", "exact"])
def test_an_encoder_layer_on_onednn_equals_it_on_blas(sharing, onednn_maps, form):
    torch.manual_seed(0)
    n, dim = 64, 32
    if sharing == "exact":
        proj_k = proj_v = None
    else:
        proj_k = MatrixProjection(max_seq_len=n, proj_dim=16)
        proj_v = proj_k if sharing == "kv" else MatrixProjection(max_seq_len=n, proj_dim=16)
    layer = LinformerEncoderLayer(
        dim=dim, num_heads=4, max_seq_len=n, proj_k=proj_k, proj_v=proj_v, ffn_dim=64,
        dropout=0.1, attention_dropout=0.1,
    ).train()  # fmt: skip
    x = torch.randn(3, n, dim)
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[1, 40:] = False
    wanted = layer_outputs_and_grads(layer, x, mask)
    assert not onednn_maps
    with use_linear_backend("onednn"):
        got = layer_outputs_and_grads(layer, x, mask)
    # q, k and v (on the projected rows or all n), out; the feed-forward block runs its
    # kernel (its GEMMs on oneDNN's micro-kernel), or its two layers where none is built
    assert onednn_maps == [form] * (4 if native.cpu_ops() is not None else 6)
    for a, b in zip(got, wanted):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_feed_forward_runs_its_kernel_on_onednn(onednn_maps, monkeypatch, two_threads):
    if native.cpu_ops() is None:
        pytest.skip("no C++ compiler here: the feed-forward kernel cannot be built")
    ffn = FeedForward(dim=128, hidden_dim=512)  # 256 rows: 2^24 multiply-adds a layer
    x = torch.randn(2, 128, 128)
    wanted = ffn(x)
    monkeypatch.setattr(precision, "mkl_without_avx512", lambda: True)  # an AMD CPU
    torch.testing.assert_close(ffn(x), wanted, atol=1e-5, rtol=1e-5)
    with use_linear_backend("onednn"):
        assert native.cpu_ops().float_gemm() == "onednn"  # the kernel's GEMMs
        torch.testing.assert_close(ffn(x), wanted, atol=1e-5, rtol=1e-5)
    assert not onednn_maps  # the kernel both times, not its two modules on oneDNN


def test_cross_attention_queries_on_onednn(onednn_maps, form):
    torch.manual_seed(0)
    attn = LinformerCrossAttention(
        dim=16, num_heads=2, max_seq_len=32, proj_k=MatrixProjection(max_seq_len=32, proj_dim=8)
    )
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 32, 16)
    wanted = attn(x, memory)
    with use_linear_backend("onednn"):
        got = attn(x, memory)
    assert onednn_maps == [form] * 4  # q, k and v on the projected memory, out
    torch.testing.assert_close(got, wanted, atol=1e-5, rtol=1e-5)


def test_the_benchmark_times_both_backends(tmp_path, onednn_maps, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports benchmarks/lm_loss.py
    script = load_script(BENCHMARKS / "linear_backend.py")
    # (--no-keep-freed-memory: process-wide, the test process stays untouched)
    script.main(["--tiny", "--threads", "1", "--no-keep-freed-memory", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "ab.json").read_text())
    assert [(r["mode"], r["rows"]) for r in result["gemm"]] == [
        ("train", 16), ("inference", 16), ("train", 256), ("inference", 256)
    ]  # fmt: skip
    assert [(r["scope"], r["n"]) for r in result["layer"]] == [("layer", 256), ("attention", 256)]
    assert [r["model"] for r in result["model"]] == ["tiny causal", "tiny masked"]
    for row in result["gemm"] + result["layer"] + result["model"]:
        assert row["onednn_speedup"] == round(row["blas_ms"] / row["onednn_ms"], 3)
        assert row["matmul_speedup"] == round(row["convolution_ms"] / row["onednn_ms"], 3)
        assert row["any_size_speedup"] == round(row["onednn_ms"] / row["matmul_ms"], 3)
    # the onednn rows ran oneDNN's forms on any CPU: the convolution, and the matmul one
    # where the kernels build
    assert "convolution" in onednn_maps
    assert "matmul" in onednn_maps or native.cpu_ops() is None
    assert (tmp_path / "ab.png").stat().st_size > 0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_layers_run_the_onednn_op_with_eager_results(backend):
    # Under torch.compile the product is one custom op with its backward (Inductor's own
    # lowering of the convolution fails on a dynamic row count): no graph break, the eager
    # outputs and gradients at three lengths, one recompile at most (to dynamic shapes).
    torch._dynamo.reset()
    torch.manual_seed(0)
    proj = MatrixProjection(max_seq_len=64, proj_dim=16)
    layer = LinformerEncoderLayer(
        dim=32, num_heads=4, max_seq_len=64, proj_k=proj, proj_v=proj, ffn_dim=64
    ).train()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(layer, backend=counter)
    with use_linear_backend("onednn"):
        explained = torch._dynamo.explain(layer)(torch.randn(2, 64, 32))
        assert explained.graph_break_count == 0
        ops = {str(node.target) for graph in explained.graphs for node in graph.graph.nodes}
        assert "linformer_kit.onednn_linear" in ops
        for n in (64, 48, 40):
            x = torch.randn(2, n, 32)
            mask = torch.ones(2, n, dtype=torch.bool)
            mask[0, n // 2 :] = False
            got = layer_outputs_and_grads(compiled, x, mask)
            wanted = layer_outputs_and_grads(layer, x, mask)
            for a, b in zip(got, wanted):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert counter.frame_count <= 2


def test_exported_graphs_keep_plain_linear_even_when_pinned():
    layer = FeedForward(dim=8, hidden_dim=16)
    x = torch.randn(2, 300, 8)
    with use_linear_backend("onednn"):
        program = torch.export.export(layer, (x,))
    targets = {str(node.target) for node in program.graph.nodes}
    assert "aten.linear.default" in targets
    assert not any("onednn" in t or "convolution" in t for t in targets)
    torch.testing.assert_close(program.module()(x), layer(x))


def test_compiled_layers_take_the_op_by_the_rule_without_a_graph_break(monkeypatch, two_threads):
    # Unpinned, on a machine where the rule picks oneDNN: the thread count is read in eager
    # mode only (Dynamo cannot trace it), so the graph holds the op and no break.
    monkeypatch.setattr(precision, "mkl_without_avx512", lambda: True)
    torch._dynamo.reset()
    up, down = nn.Linear(128, 512), nn.Linear(512, 128)
    layer = lambda x: apply_linear(down, apply_linear(up, x))  # noqa: E731
    explained = torch._dynamo.explain(layer)(torch.randn(1, 256, 128))
    assert explained.graph_break_count == 0
    ops = [str(node.target) for graph in explained.graphs for node in graph.graph.nodes]
    assert ops.count("linformer_kit.onednn_linear") == 2


def test_forward_mode_and_vmap_through_onednn_give_linears_results():
    # No operand needs a gradient, but a forward-AD level or a functorch transform is open:
    # oneDNN's matmul has neither rule, so the convolution (which has both) runs.
    x, weight, tangent = torch.randn(300, 16), torch.randn(8, 16), torch.randn(300, 16)
    with use_linear_backend("onednn"):
        _, got = torch.func.jvp(lambda a: linear(a, weight), (x,), (tangent,))
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(x, tangent)
            dual_tangent = torch.autograd.forward_ad.unpack_dual(linear(dual, weight)).tangent
        batched = torch.func.vmap(lambda a: linear(a, weight))(torch.stack([x, tangent]))
    for t in (got, dual_tangent):
        torch.testing.assert_close(t, F.linear(tangent, weight), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched[1], F.linear(tangent, weight), atol=1e-5, rtol=1e-5)
