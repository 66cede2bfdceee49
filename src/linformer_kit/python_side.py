"""The Python side of the compiled CPU ops (`native`): each op's fake kernel (its outputs'
shapes and strides, so that torch.compile traces it as one node), `matmul`'s backward, and
the error a double backward through the attention or feed-forward kernel raises."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

_registered = {"done": False}
# What gives higher-order gradients through attention: SDPA's composite (math) backend, as
# a model's attention pinned to SDPA; its CPU flash kernel has no double backward either.
SDPA_DOUBLE_BACKWARD = (
    "kernel_rule.use_kernel('sdpa') inside "
    "torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)"
)


def no_double_backward(what: str, hint: str) -> str:
    """The error of a double backward through `what`, naming what gives one (`hint`)."""
    return (
        f"linformer-kit: {what}'s backward is not differentiable (no double backward); for "
        f"higher-order gradients use {hint}"
    )


def first_order_only(what: str, hint: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`once_differentiable` for a backward whose gradients are made from saved inputs:
    under `create_graph=True` (a gradient penalty) they raise when differentiated, naming
    `what` and `hint`. `once_differentiable` marks them so only where an incoming gradient
    needs grad; otherwise they carry no graph, and the second-order terms through the
    saved inputs went missing without a word. The saved inputs that need grad (and, for a
    forward that saves gradients instead, the tensors on its inputs' graphs it keeps in
    `ctx.inputs`) feed the error too: a penalty reaching a weight through them alone (`x @
    W` as the query) dropped those terms as silently."""

    def decorate(backward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(backward)
        def wrapper(ctx: Any, *grads: Any) -> Any:
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            if not torch.is_grad_enabled() or not any(ctx.needs_input_grad):
                return outputs
            message = no_double_backward(what, hint).encode()
            inputs = (*ctx.saved_tensors, *getattr(ctx, "inputs", ()))
            saved = [t for t in inputs if t is not None and t.requires_grad]
            error = torch._C._functions.DelayedError(message, len(outputs) + len(saved))
            graphed = (None if o is None else o.detach().requires_grad_() for o in outputs)
            return error(*graphed, *saved)[: len(outputs)]

        return wrapper

    return decorate


def register(env_switch: str) -> None:
    """Each op's fake kernel (its outputs' shapes and strides, so that torch.compile
    traces the op as one node), the error a double backward through the attention
    kernel raises, and `matmul`'s backward (itself on transposed views). The other forward
    ops' backward formulas are C++ (`csrc/autograd.cpp`). Once a process; `native` calls it
    when it loads the ops.

    Args:
        env_switch: the environment variable that switches the kernels off, for the
            double-backward error's hint.
    """
    if _registered["done"]:
        return
    _registered["done"] = True

    @torch.library.register_fake("linformer_kit::dropout_forward")
    def _dropout_shape(x, seed, threshold, scale):  # noqa: ANN001, ANN202, ARG001
        return torch.empty_like(x)

    @torch.library.register_fake("linformer_kit::attention_forward")
    def _attention_shape(
        q, k, v, mask, causal, scale, seed, threshold, factor, rows, keep_weights=False
    ):  # noqa: ANN001, ANN202, ARG001
        batch, heads, seq_len, _ = q.shape
        out = q.new_empty(batch, seq_len, heads, v.shape[-1]).transpose(1, 2)
        # out: (B, H, N, Dv) over (B, N, H, Dv) memory; the stats (each row's logsumexp, or
        # with keep_weights the weights) in the compute dtype (at::toOpMathType in
        # attention_forward: float32 for bf16, else q's own)
        stats_dtype = torch.float32 if q.dtype == torch.bfloat16 else q.dtype
        keys = (k.shape[-2],) if keep_weights else ()
        return out, q.new_empty(batch * heads, seq_len, *keys, dtype=stats_dtype)

    @torch.library.register_fake("linformer_kit::attention_backward")
    def _gradient_shapes(
        grad, q, k, v, mask, stats, causal, scale, seed, threshold, factor, rows, needs
    ):  # noqa: ANN001, ANN202, ARG001
        return tuple(torch.empty_like(t) if need else None for t, need in zip((q, k, v), needs))

    @torch.library.register_fake("linformer_kit::feedforward_forward")
    def _feedforward_shapes(x, w1, b1, w2, b2, activation, keep_hidden):  # noqa: ANN001, ANN202, ARG001
        kept = x.shape[0] if keep_hidden else 0  # the pre-activation, when kept for backward
        return x.new_empty(x.shape[0], w2.shape[0]), x.new_empty(kept, w1.shape[0])

    @torch.library.register_fake("linformer_kit::feedforward_backward")
    def _feedforward_gradients(grad, x, w1, w2, hidden, activation, needs, weight_sums=-1):  # noqa: ANN001, ANN202, ARG001
        weights = (w1, w1.new_empty(w1.shape[0]), w2, w2.new_empty(w2.shape[0]))
        return (torch.empty_like(x) if needs[0] else x.new_empty(0),) + tuple(
            torch.empty_like(t) if needs[1] else t.new_empty(0) for t in weights
        )

    @torch.library.register_fake("linformer_kit::matmul")
    def _matmul_shape(a, b):  # noqa: ANN001, ANN202
        return a.new_empty(a.shape[0], a.shape[1], b.shape[2])

    def _save_operands(ctx, inputs, output):  # noqa: ANN001, ANN202, ARG001
        ctx.save_for_backward(*inputs)

    def _matmul_backward(ctx, grad):  # noqa: ANN001, ANN202
        # grad b^T and a^T grad by the same op on transposed views (so differentiable again),
        # each made in its operand's layout: the transposed product for a transposed view
        # (as E^T in the sequence projection), which spares the GEMM a transposed copy of
        # the large operand and autograd one of the result
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad
        return (
            _product(grad, b.transpose(1, 2), _is_transposed(a)) if need_a else None,
            _product(a.transpose(1, 2), grad, _is_transposed(b)) if need_b else None,
        )

    def _is_transposed(t):  # noqa: ANN001, ANN202
        return t.stride(-1) != 1 and t.stride(-2) == 1

    def _product(left, right, transposed):  # noqa: ANN001, ANN202
        matmul = torch.ops.linformer_kit.matmul
        if transposed:
            return matmul(right.transpose(1, 2), left.transpose(1, 2)).transpose(1, 2)
        return matmul(left, right)

    torch.library.register_autograd(
        "linformer_kit::matmul", _matmul_backward, setup_context=_save_operands
    )

    @torch.library.register_fake("linformer_kit::matmul_add_")
    def _matmul_add_shape(out, a, b):  # noqa: ANN001, ANN202, ARG001
        return None

    hints = {"attention": SDPA_DOUBLE_BACKWARD, "feedforward": f"{env_switch}=0"}
    for kernel, hint in hints.items():
        # (kernel, hint: defaults bind each pass's values)
        def refuse(ctx, *grads, kernel=kernel, hint=hint):  # noqa: ANN001, ANN002, ANN202, ARG001
            raise RuntimeError(no_double_backward(f"the compiled {kernel} kernel", hint))

        torch.library.register_autograd(
            f"linformer_kit::{kernel}_backward",
            refuse,
            setup_context=lambda ctx, inputs, output: None,  # noqa: ARG005
        )
