"""`linear_cross_entropy`: a language model's head and loss computed in chunks of rows, so
that the (rows, vocab_size) logits are not held at once (on CPU; a GPU's chunks are larger).

A causal LM scores every position against the whole vocabulary: at the demo's size (4 x 1024
positions, vocabulary 4096) the logits, their log-softmax and its gradient are three 64 MiB
tensors, written and read back by separate ops. Here each chunk's logits are made, turned
into the loss and into their own gradient (softmax minus one-hot, in place) and consumed by
the two gradient GEMMs while they are still in cache; the backward pass only scales the
gradients the forward pass summed (Liger-Kernel's fused linear cross-entropy does the same
on GPUs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import is_integer
from .input_checks import check_index_range, check_tensor
from .linear_backend import add_matmul_, linear, matmul
from .native import transformed
from .python_side import first_order_only

# Rows per chunk on CPU (`benchmarks/lm_loss/ab.json`, 2 threads, the head and loss alone,
# forward + backward): at vocabulary 4096, dim 128, 4096 rows, 256-512 rows a chunk took
# 81-83 ms against 94-101 at 64-128 rows, 95 at 1024, 108 as one chunk and 174 for the full
# logits and F.cross_entropy; at vocabulary 50257, dim 768, 1024 rows, 512-1024 rows took
# 1134-1173 ms against 1291 for the full logits, 256 rows 1267 and 64 rows 1669: each chunk's
# weight-gradient GEMM reads and writes the whole (vocab_size, dim) gradient, which a chunk's
# rows must amortise. On a GPU at least this many rows and 2^26 logits (256 MiB), for few
# large launches: at these two sizes one chunk of all rows, on an H200
# (`benchmarks/kernels/cuda/lm-loss/ab.json`) 1.2 / 6.1 ms against the full logits' 0.6 /
# 5.4, smaller chunks slower (1024 rows 1.9 ms, 64 rows 14.9 at vocabulary 4096): on a
# GPU the chunks save memory (7-30 % of a step's peak), not time.
CPU_CHUNK_ROWS = 512
GPU_CHUNK_ELEMENTS = 1 << 26


def chunk_rows(rows: int, vocab_size: int, device: torch.device) -> int:
    """Rows per chunk of `linear_cross_entropy` for `rows` rows of `vocab_size` logits."""
    most = CPU_CHUNK_ROWS
    if device.type != "cpu":
        most = max(CPU_CHUNK_ROWS, GPU_CHUNK_ELEMENTS // max(1, vocab_size))
    return max(1, min(rows, most))


@torch.library.custom_op("linformer_kit::linear_cross_entropy_sums", mutates_args=())
def _loss_sums(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    ignore_index: int,
    needs: list[bool],
    dtype: torch.dtype,
    rows_per_chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The summed loss of the scored rows, their count and, where `needs` asks, the
    gradients of that sum (empty where not), chunk by chunk (`rows_per_chunk`, 0: the
    device's `chunk_rows`). One graph node under torch.compile: the loop over chunks runs
    inside it, whatever the row count (dynamo would specialise a loop over a symbolic one)."""
    rows = hidden.shape[0]
    step = rows_per_chunk or chunk_rows(rows, weight.shape[0], hidden.device)
    acc = torch.promote_types(dtype, torch.float32)  # the softmax's dtype
    scored = targets != ignore_index
    index = targets.masked_fill(~scored, 0).unsqueeze(1)  # (R, 1)
    keep = scored.to(acc).unsqueeze(1)  # (R, 1): 1 on scored rows, 0 on the others
    need_hidden, need_weight, need_bias = needs
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    grad_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    grad_weight = weight.new_zeros(weight.shape if need_weight else (0,), dtype=acc)
    grad_bias = weight.new_zeros(weight.shape[0] if need_bias else 0, dtype=acc)
    lse = torch.empty((rows, 1), dtype=acc, device=hidden.device)  # log-sum-exp per row
    picked = torch.empty_like(lse)  # the target's logit per row

    def chunk(part: slice) -> None:
        h = hidden[part].to(dtype)
        logits = linear(h, w, b).to(acc)  # (C, V), fresh: worked on in place
        picked[part] = logits.gather(1, index[part])
        top = logits.amax(1, keepdim=True)
        probs = logits.sub_(top).exp_()  # (C, V) unnormalised
        sums = probs.sum(1, keepdim=True)
        lse[part] = top + sums.log()
        if not any(needs):
            return
        probs.mul_(keep[part] / sums)  # softmax on scored rows, zeros on the others
        probs.scatter_add_(1, index[part], -keep[part])  # d(loss sum) / d(logits)
        grad_logits = probs.to(dtype)
        if need_hidden:
            grad_hidden[part] = matmul(grad_logits, w)
        if need_weight and dtype == acc:
            add_matmul_(grad_weight, grad_logits.t(), h)  # no (V, dim) temporary
        elif need_weight:
            grad_weight.add_(grad_logits.t() @ h)
        if need_bias:
            grad_bias.add_(probs.sum(0))

    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, rows, step):
            chunk(slice(start, start + step))
    total = torch.where(keep > 0, lse - picked, 0).sum()  # (an unscored inf: not nan)
    return total, scored.sum(), grad_hidden, grad_weight, grad_bias


@_loss_sums.register_fake
def _(hidden, weight, bias, targets, ignore_index, needs, dtype, rows_per_chunk):  # noqa: ANN001, ANN202
    acc = torch.promote_types(dtype, torch.float32)
    return (
        hidden.new_empty((), dtype=acc),
        targets.new_empty((), dtype=torch.int64),
        torch.empty_like(hidden) if needs[0] else hidden.new_empty(0),
        weight.new_empty(weight.shape if needs[1] else (0,), dtype=acc),
        weight.new_empty(weight.shape[0] if needs[2] else 0, dtype=acc),
    )


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward: the mean loss of the scored rows, the gradients of their sum made and saved
    where `needs` asks (`_loss_sums`); backward: those gradients times grad_output / count."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, ignore_index, needs, dtype, rows_per_chunk, anchors
    ):  # noqa: ANN001, ANN205
        total, count, *grads = _loss_sums(
            hidden, weight, bias, targets, ignore_index, list(needs), dtype, rows_per_chunk
        )
        ctx.save_for_backward(*grads, count)
        ctx.inputs = anchors  # first_order_only's error hangs from them
        ctx.needs = needs
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total / count  # nan when nothing is scored, as F.cross_entropy

    @staticmethod
    @first_order_only("linear_cross_entropy", "the logits' F.cross_entropy (return_logits=True)")
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        *grads, count = ctx.saved_tensors
        scale = grad_output / count.clamp(min=1)  # nothing scored: zero gradients
        scaled = [
            (g * scale).to(t) if need else None for g, t, need in zip(grads, ctx.dtypes, ctx.needs)
        ]
        return (*scaled, None, None, None, None, None, None)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    rows_per_chunk: int | None = None,
    name: str = "targets",
) -> Tensor:
    """Mean cross-entropy of the logits `hidden @ weight.T + bias` against `targets`,
    holding one chunk of rows' logits at a time (`chunk_rows`).

    Equal, to float rounding, to `F.cross_entropy` of `F.linear(hidden, weight, bias)` cast up
    to float32 (float64 stays float64), gradients included: the GEMMs run in the inputs'
    dtype (under autocast, in its dtype), the softmax in float32 (float64 for float64). When
    grad mode is on and an input requires grad, the forward pass also computes the
    gradients, chunk by chunk; backward then only scales them (no double backward). Inside
    a torch.func transform it is that `F.cross_entropy` itself, all logits at once.

    Args:
        hidden: (..., dim) the head's input.
        weight: (vocab_size, dim) the output layer's weight (an LM's tied embeddings).
        targets: (...) int64 class indices, hidden's leading shape; `ignore_index` is skipped.
        bias: optional (vocab_size,).
        ignore_index: the target value that scores nothing.
        rows_per_chunk: rows of logits made at a time; None: `chunk_rows`' choice for the
            device and vocabulary. Under torch.compile too: the chunks are one graph node.
        name: what an out-of-range error calls the targets (the models: "labels").

    Returns:
        The mean over the scored rows, a float32 scalar (float64 for float64 inputs); nan
        when no row is scored, as `F.cross_entropy`.

    Raises:
        ValueError: if the shapes disagree, a target is outside [0, vocab_size) and is not
            `ignore_index` (checked on CPU outside torch.compile and torch.func),
            rows_per_chunk is no integer >= 1 or ignore_index no integer.
    """
    vocab_size, dim = weight.shape
    if hidden.shape[-1:] != (dim,) or targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"hidden (..., {dim}) and targets of its leading shape expected for weight "
            f"{tuple(weight.shape)}; got hidden {tuple(hidden.shape)}, targets "
            f"{tuple(targets.shape)}"
        )
    if bias is not None and bias.shape != (vocab_size,):
        raise ValueError(f"bias must have shape ({vocab_size},), got {tuple(bias.shape)}")
    # 2.5 or "64" reached torch's op schema; a numpy integer is one
    if rows_per_chunk is not None and (not is_integer(rows_per_chunk) or rows_per_chunk < 1):
        raise ValueError(f"rows_per_chunk must be an integer >= 1, got {rows_per_chunk!r}")
    if not is_integer(ignore_index):
        raise ValueError(f"ignore_index must be an integer, got {ignore_index!r}")
    if transformed(hidden, weight, bias, targets):
        # torch.func: the chunked loss is an autograd Function, which cannot run there (and
        # the range check below is data-dependent, which vmap refuses; cross_entropy checks)
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
        bias = None if bias is None else bias.to(dtype)
        logits = F.linear(hidden.to(dtype), weight.to(dtype), bias).flatten(0, -2)
        logits = at_least_float32(logits)
        return F.cross_entropy(logits, targets.reshape(-1).long(), ignore_index=ignore_index)
    device = hidden.device.type
    check_index_range(targets, vocab_size, name, ignore_index)
    rows = targets.numel()
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    if torch.is_autocast_enabled(device) and dtype == torch.float32:
        dtype = torch.get_autocast_dtype(device)
    grad = torch.is_grad_enabled()
    needs = tuple(grad and t is not None and t.requires_grad for t in (hidden, weight, bias))
    # 0-d tensors on the graph of each input that needs grad, holding none of its memory
    # (an empty slice's sum): a second-order gradient reaching a weight through the inputs
    # alone raises on them (`first_order_only`), where its terms went missing
    anchors = []
    if not torch.compiler.is_compiling():
        inputs = (hidden, weight, bias)
        anchors = [t.narrow(0, 0, 0).sum() for t, need in zip(inputs, needs) if need]
    return _LinearCrossEntropy.apply(
        hidden.reshape(rows, dim),
        weight,
        bias,
        targets.reshape(-1),
        ignore_index,
        needs,
        dtype,
        rows_per_chunk or 0,
        anchors,
    )


def check_labels(labels: Tensor | None, input_ids: Tensor | None, *, return_logits: bool) -> None:
    """Raises a ValueError for labels not shaped as the ids they score, or for
    `return_logits=False` without labels; the language models check both before running
    their backbone (that call returns only the loss)."""
    if labels is not None:
        check_tensor("labels", labels, "of token ids (-100: not scored)")
    if labels is not None and input_ids is not None and labels.shape != input_ids.shape:
        raise ValueError(
            f"labels must have the scored ids' shape {tuple(input_ids.shape)}, got "
            f"{tuple(labels.shape)}"
        )
    if not return_logits and labels is None:
        raise ValueError("return_logits=False needs labels: it returns only the loss")


def lm_head_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor | None,
    bias: Tensor | None = None,
    *,
    return_logits: bool = True,
) -> tuple[Tensor | None, Tensor | None]:
    """A language model's output layer and loss: the logits `hidden @ weight.T + bias`
    (..., vocab_size) and, given targets (-100: unscored), their mean cross-entropy in float32
    (float64 stays float64); with `return_logits=False` (targets needed) the loss alone,
    from `linear_cross_entropy`, and None for the logits.

    Returns:
        (loss, logits), each None where not computed.
    """
    if not return_logits:
        return linear_cross_entropy(hidden, weight, targets, bias, name="labels"), None
    logits = linear(hidden, weight, bias)
    if targets is None:
        return None, logits
    check_index_range(targets, weight.shape[0], "labels", -100)
    flat = at_least_float32(logits.reshape(-1, logits.shape[-1]))
    return F.cross_entropy(flat, targets.reshape(-1).long(), ignore_index=-100), logits


def at_least_float32(t: Tensor) -> Tensor:
    """`t` cast up to float32 for a loss (bf16 / fp16 up, float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
