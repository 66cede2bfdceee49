"""Which library multiplies a layer's linear maps on CPU: torch's BLAS (`F.linear`) or oneDNN.

PyTorch's CPU build sends a float32 `F.linear` / `torch.mm` to MKL, which runs its AVX2 code on
AMD CPUs, AVX-512 or not (`MKL_VERBOSE`: the generic "Intel(R) Architecture processors" path),
while oneDNN, which the build carries for convolutions, runs AVX-512 there. So on an AMD CPU
with AVX-512 the layers' linear maps go through oneDNN, in one of three forms: without
gradients, its matmul on the dense tensors; with them, up to `MATMUL_MAX_OUTPUTS` (2^24) outputs
(rows x out features; with one thread at any size) the compiled kernels' `matmul` (oneDNN's
brgemm micro-kernel, where the kernels' GEMMs are oneDNN's, `native.kernel_gemm`) with the bias
added, beyond that its 1 x 1 convolution over a channels-last view of the rows (no copy; its
backward the convolution's for the input and weight, a sum for the bias). The result is
`F.linear`'s to float32 rounding.

The rule (`choose_linear_backend`), from `benchmarks/linear_backend.py` (`ab.json`, `narrow/`,
`threads1/` in `benchmarks/linear_backend/`; AMD EPYC, figures in docs/performance.md's "AMD
CPUs"): a product goes to oneDNN from `ONEDNN_MIN_MACS` (2^23) multiply-adds, `ONEDNN_MIN_ROWS`
(16) rows and a width (in and out) of `ONEDNN_MIN_WIDTH` (128) (1.12-1.22x with its backward at
2^23, 0.89-0.97x at 2^22, 0.37-0.84x at width 64). The matmul form beat the convolution inside
the layers (the attention layer 1.02-1.14x at n 1024-8192) and, since its weight gradient splits
its reduction between the threads (`csrc/blas.h`), up to 2^24 outputs too (1.00-1.05x a map,
`gemm-split/`); with one thread ATen runs the convolution on its MKL path, and the matmul form
wins at every size. Everything else stays on `F.linear`: Intel CPUs (MKL runs AVX-512 there),
AVX2-only CPUs (`precision.mkl_without_avx512`; on a real AMD one, Zen 3, every GEMM on MKL
tied with the attention kernel's and `matmul` on oneDNN's AVX2 code, `zen3-avx2/gemm-ab/`),
other dtypes (bf16 already goes to oneDNN), autocast, torch.export and
torch.jit.trace (their graphs keep plain `linear`), and builds without MKL or oneDNN. Under
torch.compile the product is one custom op with its backward (`linformer_kit::onednn_linear`,
the backward's form picked by the same rule when it runs; Inductor's lowering of the convolution
fails on a dynamic row count, torch 2.13), taken whatever the thread count, which Dynamo cannot
read.

Products that are not a linear map of rows (the sequence projection E^T X, the language models'
loss's gradient GEMMs) go through `matmul` and `add_matmul_`: on the compiled kernels' GEMMs
where those are oneDNN's micro-kernel (`native.kernel_gemm`; the same machines), else
torch's. `use_linear_backend` pins both kinds.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import native, precision
from .native import transformed

LINEAR_BACKENDS = ("blas", "onednn")
# Rows (the product of x's leading dimensions), in and out features, and multiply-adds
# (rows x in x out) from which oneDNN pays where the rule allows it.
ONEDNN_MIN_ROWS, ONEDNN_MIN_WIDTH, ONEDNN_MIN_MACS = 16, 128, 2**23
# Outputs (rows x out features) up to which a product that needs gradients runs on the
# kernels' GEMMs (`matmul`) rather than oneDNN's convolution, with two threads or more (with
# one, where the convolution runs on ATen's MKL path, at any size; module docstring): the
# largest measured (2^21 before the weight gradients split their reduction).
MATMUL_MAX_OUTPUTS = 2**24
HOOK_KINDS = ("forward_hooks", "forward_pre_hooks", "backward_hooks", "backward_pre_hooks")
# The backend `use_linear_backend` pins for the products oneDNN can compute (None: the rule).
_pinned: str | None = None
# False inside `use_matmul_form(False)`: oneDNN's products with gradients as the convolution.
_matmul_form_on = True


@contextlib.contextmanager
def use_linear_backend(backend: str | None) -> Iterator[None]:
    """Runs the layers' float32 CPU linear maps inside on `backend` instead of the rule's
    choice, and the compiled kernels' float32 GEMMs (`native.set_kernel_gemm`) too
    (process-wide, for the block). Products oneDNN cannot take (other dtypes and devices,
    autocast, torch.export, torch.jit.trace) stay on `F.linear` whatever is pinned.

    Args:
        backend: "blas" (`F.linear`) or "onednn"; None follows the rule.

    Raises:
        ValueError: for an unknown backend.
    """
    global _pinned
    if backend is not None and backend not in LINEAR_BACKENDS:
        raise ValueError(
            f"backend must be one of {', '.join(LINEAR_BACKENDS)} or None; got {backend!r}"
        )
    before, _pinned = _pinned, backend
    kernels_before = native.set_kernel_gemm(backend) if backend is not None else None
    try:
        yield
    finally:
        _pinned = before
        if backend is not None:
            native.set_kernel_gemm(kernels_before)


@contextlib.contextmanager
def use_matmul_form(enabled: bool) -> Iterator[None]:
    """Turns the matmul form of oneDNN's products that need gradients on or off inside (off:
    the convolution at any size; process-wide, for `benchmarks/linear_backend.py`).

    Args:
        enabled: whether products small enough take `matmul` (the default) or none does.
    """
    global _matmul_form_on
    before, _matmul_form_on = _matmul_form_on, enabled
    try:
        yield
    finally:
        _matmul_form_on = before


def choose_linear_backend(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> str:
    """The library for `F.linear(x, weight, bias)`, by the rule in the module docstring.

    Args:
        x: the input, (..., in_features).
        weight: (out_features, in_features).
        bias: (out_features,) or None (any other, F.linear's broadcast, is "blas").

    Returns:
        "blas" or "onednn".
    """
    if not (
        _plain_float32_cpu(x, weight)
        and x.dim() > 0
        and x.numel() > 0
        and weight.dim() == 2
        and _dense_bias(weight, bias)
        and torch.backends.mkldnn.enabled
    ):
        return "blas"
    if _pinned is not None:
        return _pinned
    # The machine first: elsewhere torch.compile gets no guard on the row count. The thread
    # count is read in eager mode only (Dynamo cannot trace it): a compiled graph runs the op,
    # whose forward with one thread is oneDNN's matmul and whose backward is on MKL's path.
    if not precision.mkl_without_avx512():
        return "blas"
    one_thread = not torch.compiler.is_compiling() and torch.get_num_threads() == 1
    in_transform = one_thread and transformed(x, weight, bias)
    if one_thread and _needs_grad(x, weight, bias) and not _matmul_form(x, weight, in_transform):
        return "blas"
    rows = _rows(x)
    big = rows >= ONEDNN_MIN_ROWS and rows * weight.numel() >= ONEDNN_MIN_MACS
    return "onednn" if big and min(weight.shape) >= ONEDNN_MIN_WIDTH else "blas"


def _dense_bias(weight: Tensor, bias: Tensor | None) -> bool:
    """Whether `bias` is None or the dense (out_features,) vector oneDNN's matmul reads (not a
    0-d, (1,) or (1, out) one F.linear broadcasts, nor a strided or expanded view)."""
    return bias is None or (
        bias.dim() == 1 and bias.shape[0] == weight.shape[0] and bias.is_contiguous()
    )


def _plain_float32_cpu(*tensors: Tensor) -> bool:
    """float32 CPU tensors outside autocast, torch.export and torch.jit.trace (whose graphs
    keep torch's own ops): what oneDNN's forms need."""
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_exporting()
        and not torch.jit.is_tracing()
    )


def _rows(x: Tensor) -> int:
    """The number of rows of a product's input (..., in_features)."""
    return x.numel() // x.shape[-1]


def _matmul_form(x: Tensor, weight: Tensor, in_transform: bool) -> bool:
    """Whether oneDNN's form of a product that needs gradients is `matmul` (the kernels'
    GEMMs, where those are oneDNN's) rather than the convolution: up to `MATMUL_MAX_OUTPUTS`
    outputs (any with one thread), outside torch.func transforms (`in_transform`, the
    caller's `transformed`) and `use_matmul_form(False)` (read when the custom op's backward
    runs, not while torch.compile traces)."""
    most = math.inf if torch.get_num_threads() == 1 else MATMUL_MAX_OUTPUTS
    return (
        _matmul_form_on
        and _rows(x) * weight.shape[0] <= most
        and native.kernel_gemm() == "onednn"
        and not in_transform
    )


def _needs_grad(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether autograd will want a gradient of any operand of the product."""
    operands = (x, weight) if bias is None else (x, weight, bias)
    return torch.is_grad_enabled() and any(t.requires_grad for t in operands)


def _as_image(x: Tensor, features: int) -> Tensor:
    """x's rows (..., features) as a (1, features, R, 1) image with channels-last strides."""
    return x.reshape(1, -1, 1, features).permute(0, 3, 1, 2)


def _as_rows(image: Tensor, lead: torch.Size) -> Tensor:
    """The inverse of `_as_image`: (1, features, R, 1) -> (*lead, features)."""
    return image.permute(0, 2, 3, 1).reshape(*lead, image.shape[1])


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` on oneDNN: without gradients, its matmul on the dense
    tensors (`mkldnn::_linear_pointwise`, the op Inductor's CPU fusions call); with them, up
    to `MATMUL_MAX_OUTPUTS` outputs (any with one thread) `matmul` (its brgemm micro-kernel,
    differentiable) and the bias added, beyond its 1 x 1 convolution over a channels-last
    view of x's rows (no copy where x is contiguous), differentiable in every argument
    (`_pointwise_conv_backward`: the bias's gradient a sum). Under torch.compile, one graph
    node (`linformer_kit::onednn_linear`, with its backward: in the same form, picked when it
    runs)."""
    if x.numel() == 0 or x.shape[-1] != weight.shape[-1] or not _dense_bias(weight, bias):
        return F.linear(x, weight, bias)  # its empty result, its error, or its broadcast
    if torch.compiler.is_compiling():
        return torch.ops.linformer_kit.onednn_linear(x, weight, bias)
    in_transform = transformed(x, weight, bias)
    if not _needs_grad(x, weight, bias) and not in_transform:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    out_features, in_features = weight.shape
    if _matmul_form(x, weight, in_transform):
        # 3-D: the bias in place on the op's own output (out of place kept a second output
        # alive; in place on a 2-D view, autograd's as_strided backward: 1.09-1.13x slower)
        out = matmul(x.reshape(1, -1, in_features), weight.t().unsqueeze(0))
        out = out if bias is None else out.add_(bias)
        return out.view(*x.shape[:-1], out_features)
    kernel = weight.reshape(out_features, in_features, 1, 1)
    image = _as_image(x, in_features)
    if in_transform:  # torch.func: conv2d has the batching rules
        return _as_rows(F.conv2d(image, kernel, bias), x.shape[:-1])
    return _as_rows(_PointwiseConv.apply(image, kernel, bias), x.shape[:-1])


def _pointwise_conv_backward(
    grad: Tensor, image: Tensor, kernel: Tensor, needs: tuple[bool, bool, bool]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of `F.conv2d(image, kernel, bias)` for a 1 x 1 kernel (None where not
    needed): oneDNN's backward for the image and kernel, the bias's a plain sum of `grad`
    (oneDNN's with the bias ran 1.04-1.10x slower; docs/performance.md, "AMD CPUs")."""
    grad_image, grad_kernel, _ = torch.ops.aten.convolution_backward(
        grad, image, kernel, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
        [needs[0], needs[1], False],
    )  # fmt: skip
    return grad_image, grad_kernel, grad.sum((0, 2, 3)) if needs[2] else None


class _PointwiseConv(torch.autograd.Function):
    """`F.conv2d` by a 1 x 1 kernel whose backward is `_pointwise_conv_backward` (made of
    differentiable ops: double backward works)."""

    @staticmethod
    def forward(ctx: Any, image: Tensor, kernel: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(image, kernel)
        return F.conv2d(image, kernel, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        image, kernel = ctx.saved_tensors
        return _pointwise_conv_backward(grad, image, kernel, ctx.needs_input_grad)


@torch.library.custom_op("linformer_kit::onednn_linear", mutates_args=())
def _onednn_linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    with torch.no_grad():  # the op's own backward (below) gives the gradients
        return onednn_linear(x, weight, bias)


@_onednn_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("linformer_kit::onednn_linear_backward", mutates_args=())
def _onednn_linear_backward_op(
    grad: Tensor, x: Tensor, weight: Tensor, needs_x: bool, needs_weight: bool, needs_bias: bool
) -> tuple[Tensor, Tensor, Tensor]:
    out_features, in_features = weight.shape
    # eager's form, picked when the op runs (no guard)
    if _matmul_form(x, weight, transformed(x, weight)):
        rows, grad_rows = x.reshape(-1, in_features), grad.reshape(-1, out_features)
        return (
            matmul(grad_rows, weight).view(x.shape) if needs_x else x.new_empty(0),
            matmul(grad_rows.t(), rows) if needs_weight else x.new_empty(0),
            grad_rows.sum(0) if needs_bias else x.new_empty(0),
        )
    grads = _pointwise_conv_backward(
        _as_image(grad, out_features), _as_image(x, in_features),
        weight.reshape(out_features, in_features, 1, 1), (needs_x, needs_weight, needs_bias),
    )  # fmt: skip
    grad_x = _as_rows(grads[0], x.shape[:-1]) if needs_x else x.new_empty(0)
    grad_weight = grads[1].reshape(weight.shape) if needs_weight else x.new_empty(0)
    return grad_x, grad_weight, grads[2] if needs_bias else x.new_empty(0)


@_onednn_linear_backward_op.register_fake
def _(
    grad: Tensor, x: Tensor, weight: Tensor, needs_x: bool, needs_weight: bool, needs_bias: bool
) -> tuple[Tensor, Tensor, Tensor]:
    return (
        x.new_empty(x.shape if needs_x else (0,)),
        x.new_empty(weight.shape if needs_weight else (0,)),
        x.new_empty((weight.shape[0],) if needs_bias else (0,)),
    )


def _save_inputs(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor | None], output: Tensor) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    x, weight = ctx.saved_tensors
    needs = ctx.needs_input_grad
    grads = torch.ops.linformer_kit.onednn_linear_backward(grad, x, weight, *needs)
    return tuple(g if need else None for g, need in zip(grads, needs))


def _no_double_backward(ctx: Any, *grads: Tensor) -> None:
    raise RuntimeError(
        "linformer-kit: linformer_kit::onednn_linear's backward is not differentiable (no "
        "double backward); for higher-order gradients pin use_linear_backend('blas')"
    )


_onednn_linear_op.register_autograd(_backward, setup_context=_save_inputs)
_onednn_linear_backward_op.register_autograd(
    _no_double_backward, setup_context=lambda ctx, inputs, output: None
)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` on the library `choose_linear_backend` picks."""
    if choose_linear_backend(x, weight, bias) == "onednn":
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """`a @ b` for (M, K) @ (K, N) or (B, M, K) @ (B, K, N): on the compiled kernels' GEMMs
    (`linformer_kit::matmul`, oneDNN's brgemm micro-kernel; transposed views read in place,
    differentiable) where those are oneDNN's (`native.kernel_gemm`) and the operands float32
    CPU tensors, else torch's matmul (MKL's AVX2 code on an AMD CPU). For the sequence
    projection E^T X, whose products `linear` cannot take (X's rows are its columns)."""
    ops = native.cpu_ops() if _kernel_matmul(a, b) else None
    if ops is None:
        return a @ b
    if a.dim() == 3:
        return ops.matmul(a, b)
    return ops.matmul(a.unsqueeze(0), b.unsqueeze(0)).squeeze(0)


def add_matmul_(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """`out.addmm_(a, b)` for 2-D float32 CPU matrices, on the kernels' GEMMs where `matmul`
    would take them (`linformer_kit::matmul_add_`, no temporary for a @ b); returns `out`.
    Not differentiable: for gradient sums made under no_grad, as `losses`' weight gradient."""
    row_major = out.dtype == a.dtype and out.stride(-1) == 1 and out.stride(0) >= out.shape[1]
    ops = native.cpu_ops() if a.dim() == 2 and row_major and _kernel_matmul(a, b) else None
    if ops is None:
        return out.addmm_(a, b)
    ops.matmul_add_(out.unsqueeze(0), a.unsqueeze(0), b.unsqueeze(0))
    return out


def _kernel_matmul(a: Tensor, b: Tensor) -> bool:
    """Whether `matmul` can and should take the kernels' GEMMs for a @ b."""
    return (
        _plain_float32_cpu(a, b)
        and a.dim() == b.dim()
        and a.dim() in (2, 3)
        and native.kernel_gemm() == "onednn"
        and not transformed(a, b)
    )


def hooked(module: nn.Module) -> bool:
    """Whether calling `module` would do more than its class's `forward`: forward or backward
    hooks (the module's or global ones), or a `forward` set on the instance (as offloading
    wrappers do)."""
    hooks = nn.modules.module
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or "forward" in vars(module)
        or any(getattr(hooks, f"_global_{kind}", None) for kind in HOOK_KINDS)
    )


def apply_linear(module: nn.Module, x: Tensor) -> Tensor:
    """`module(x)`, but a plain `nn.Linear` (no subclass, hook or instance `forward`) through
    `onednn_linear` where the rule picks oneDNN."""
    if (
        type(module) is nn.Linear
        and not hooked(module)
        and choose_linear_backend(x, module.weight, module.bias) == "onednn"
    ):
        return onednn_linear(x, module.weight, module.bias)
    return module(x)


# Found at import, so that a graph compiled before any eager call reads the machine too.
precision.mkl_without_avx512()
