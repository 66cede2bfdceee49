"""`linear_backend`'s backward of oneDNN's linear map: the convolution's backward gives the
input and weight gradients, the bias gradient is a sum of the output gradient (eager and the
compiled op alike); products up to `MATMUL_MAX_OUTPUTS` outputs take `matmul` instead; eager
double backward and torch.func transforms give `F.linear`'s results in either form."""

import pytest
import torch
import torch.nn.functional as F

from linformer_kit import linear_backend, native, precision
from linformer_kit.linear_backend import (
    MATMUL_MAX_OUTPUTS,
    linear,
    onednn_linear,
    use_linear_backend,
)


@pytest.fixture
def masks(monkeypatch):
    """The output mask of every `aten.convolution_backward` call, in order (every product
    in the convolution form)."""
    calls = []
    real = torch.ops.aten.convolution_backward

    class Recording:
        def __call__(self, *args):
            calls.append(list(args[-1]))
            return real(*args)

        def __getattr__(self, name):  # .default and the rest, as the real packet's
            return getattr(real, name)

    monkeypatch.setattr(torch.ops.aten, "convolution_backward", Recording())
    with linear_backend.use_matmul_form(False):
        yield calls


def leaves(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 300, 24, generator=gen, requires_grad=True)
    weight = torch.randn(40, 24, generator=gen, requires_grad=True)
    bias = torch.randn(40, generator=gen, requires_grad=True)
    return x, weight, bias, torch.randn(2, 300, 40, generator=gen)


def assert_linears_gradients(x, weight, bias, grad, atol=1e-3):
    """x's, the weight's and the bias's `.grad` equal float64 `F.linear`'s for `grad`."""
    as_double = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    wanted = torch.autograd.grad(F.linear(*as_double), as_double, grad.double())
    for got, want in zip((x.grad, weight.grad, bias.grad), wanted):
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=1e-4)


def test_the_ops_backward_takes_eagers_form(onednn_maps, form):
    # The compiled graphs' op picks the form when its backward runs (the convolution's
    # backward is aten's, not recorded: the record is F.conv2d's)
    x, weight, bias, grad = leaves(6)
    with use_linear_backend("onednn"):
        torch.ops.linformer_kit.onednn_linear(x, weight, bias).backward(grad)
    assert onednn_maps == (["matmul"] * 2 if form == "matmul" else [])
    assert_linears_gradients(x, weight, bias, grad)


@pytest.mark.parametrize("path", ["eager", "op"])
def test_the_bias_gradient_is_a_sum_not_onednns(path, masks):
    # oneDNN's backward-weights with the bias ran 1.04-1.10x slower than without it plus a sum
    x, weight, bias, grad = leaves()
    fn = onednn_linear if path == "eager" else torch.ops.linformer_kit.onednn_linear
    out = fn(x, weight, bias)
    out.backward(grad)
    assert masks == [[True, True, False]]
    assert_linears_gradients(x, weight, bias, grad, atol=1e-4)


def test_only_the_gradients_asked_for_are_computed(masks):
    x, weight, bias, grad = leaves()
    out = onednn_linear(x.detach(), weight, None)  # the weight's gradient only
    out.backward(grad)
    assert masks == [[False, True, False]]


@pytest.mark.parametrize("threads", [2, 1])
def test_a_product_takes_matmul_up_to_its_limit_then_the_convolution(threads, onednn_maps, form):
    # With one thread (the convolution then on ATen's MKL path) there is no limit.
    torch.set_num_threads(threads)  # (the conftest restores the count)
    gen = torch.Generator().manual_seed(4)
    width = 4096  # (wide, so that the weight gradient sums few rows: 4096 at the limit)
    weight = torch.randn(width, 8, generator=gen, requires_grad=True)
    bias = torch.randn(width, generator=gen, requires_grad=True)
    for rows in (MATMUL_MAX_OUTPUTS // width, MATMUL_MAX_OUTPUTS // width + 1):
        x = torch.randn(rows, 8, generator=gen, requires_grad=True)
        grad = torch.randn(rows, width, generator=gen)
        with use_linear_backend("onednn"):  # (the kernels' GEMMs on oneDNN's brgemm)
            onednn_linear(x, weight, bias).backward(grad)
        assert_linears_gradients(x, weight, bias, grad)
        weight.grad = bias.grad = None
    assert onednn_maps == [form, "convolution" if threads > 1 else form]


@pytest.mark.parametrize(
    "make_x",
    [
        lambda: torch.randn(24),  # one row, no leading dims
        lambda: torch.randn(24, 300).t(),  # transposed
        lambda: torch.randn(1, 24).expand(300, 24),  # every row the same storage
        lambda: torch.randn(2, 24, 5, 30).permute(0, 2, 3, 1),  # 4-D, not contiguous
    ],
    ids=["vector", "transposed", "expanded", "permuted"],
)
def test_either_form_takes_any_layout_of_x(make_x, onednn_maps, form):
    torch.manual_seed(5)
    x, weight, bias = make_x(), torch.randn(40, 24), torch.randn(40)
    grad = torch.randn(*x.shape[:-1], 40)
    inputs = [t.requires_grad_() for t in (x, weight, bias)]
    with use_linear_backend("onednn"):
        out = onednn_linear(*inputs)
    out.backward(grad)
    assert onednn_maps == [form] and out.shape == (*x.shape[:-1], 40)
    wanted = F.linear(*(t.detach().double() for t in (x, weight, bias)))
    torch.testing.assert_close(out.double(), wanted, atol=1e-4, rtol=1e-4)
    assert_linears_gradients(x, weight, bias, grad)


def test_eager_double_backward_gives_linears_second_derivatives(onednn_maps, form):
    x, weight, bias, grad = leaves(1)
    results = []
    for fn in (onednn_linear, F.linear):
        with use_linear_backend("onednn"):
            grad_x, grad_weight, grad_bias = torch.autograd.grad(
                fn(x, weight, bias), (x, weight, bias), grad, create_graph=True
            )
        penalty = grad_x.square().sum() + grad_weight.square().sum() + grad_bias.sum()
        results.append(torch.autograd.grad(penalty, (x, weight)))
    assert onednn_maps == [form]
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_torch_func_grad_gives_linears_gradient(form):
    x, weight, bias, _ = leaves(2)
    loss = lambda fn: lambda w: fn(x.detach(), w, bias.detach()).square().sum()  # noqa: E731
    with use_linear_backend("onednn"):
        got = torch.func.grad(loss(onednn_linear))(weight.detach())
    torch.testing.assert_close(got, torch.func.grad(loss(F.linear))(weight.detach()),
                               atol=1e-3, rtol=1e-4)  # fmt: skip


def test_plain_operands_inside_a_transform_of_something_else(form):
    # torch.func transforms z; x, the weight and the bias are plain tensors, the weight
    # wanting a gradient from autograd: no autograd Function (nor the kernels' matmul, whose
    # backward is one) may run there (it would raise).
    x, weight, bias, _ = leaves(3)
    scale = torch.randn(40)
    loss = lambda fn: lambda s: (fn(x, weight, bias) * s).sum()  # noqa: E731
    with use_linear_backend("onednn"):
        got = torch.func.grad(loss(onednn_linear))(scale)
        batched = torch.func.vmap(lambda s: onednn_linear(x, weight, bias) * s)(scale[:3, None])
    torch.testing.assert_close(got, torch.func.grad(loss(F.linear))(scale), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(batched[1], F.linear(x, weight, bias) * scale[1])


def test_the_onednn_op_gives_only_the_gradients_asked_for(form):
    x, weight, bias = torch.randn(5, 8), torch.randn(4, 8, requires_grad=True), torch.randn(4)
    with use_linear_backend("onednn"):
        out = torch.ops.linformer_kit.onednn_linear(x, weight, bias)
        (grad_weight,) = torch.autograd.grad(out.sum(), weight)
        torch.library.opcheck(torch.ops.linformer_kit.onednn_linear.default, (x, weight, bias))
    torch.testing.assert_close(out, F.linear(x, weight, bias))
    torch.testing.assert_close(grad_weight, torch.ones(5, 4).t() @ x)


def test_the_ops_backward_has_no_double_backward():
    x, weight = torch.randn(5, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    out = torch.ops.linformer_kit.onednn_linear(x, weight, None)
    (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="no double backward"):
        grad_x.sum().backward()


def test_one_thread_keeps_f_linear_inside_a_transform(monkeypatch, onednn_maps):
    # With one thread the convolution runs on ATen's MKL path (a tie with F.linear), and
    # inside torch.func the matmul form cannot run: so F.linear, as before the matmul form.
    monkeypatch.setattr(precision, "mkl_without_avx512", lambda: True)  # an AMD CPU
    monkeypatch.setattr(native, "kernel_gemm", lambda: "onednn")
    torch.set_num_threads(1)  # (the conftest restores the count)
    x, weight = torch.randn(256, 256), torch.randn(256, 256)
    got = torch.func.grad(lambda w: linear(x, w).square().sum())(weight)
    assert not onednn_maps
    wanted = torch.func.grad(lambda w: F.linear(x, w).square().sum())(weight)
    torch.testing.assert_close(got, wanted, atol=1e-3, rtol=1e-4)
    linear(x, weight.requires_grad_()).sum().backward()  # outside: the matmul form
    assert onednn_maps == ["matmul"] or native.cpu_ops() is None
