"""Initial values of the sequence projections of a converted model.

- `xavier`: Xavier-uniform on each n x k matrix, the paper authors' advice for training from
  scratch. A pretrained model never saw such mixtures, so its outputs move far at first.
- `mean`: block means (position i goes to block floor(i k / n)): at full length this is
  exactly mean pooling of keys and values over k consecutive blocks (the `pool` kind), a
  coarse version of what the teacher attends to.
- `svd`: data-driven. Over a calibration batch at full length, the teacher's keys and values
  (of the layers and heads a projection serves) give a position Gram matrix
  G = sum_b X_b X_b^T (n x n); E is its top-k eigenvectors, the k position mixtures that keep
  most of the key/value energy. Each column is sign-fixed and scaled to unit L1 norm. Its
  signed mixtures are not key-like, so it keeps little before distillation.
- `attention`: data-driven. Contiguous blocks (like `mean`) whose sizes follow the attention
  mass the teacher's keys receive on the calibration batch (blended half and half with a
  uniform share): attention sinks such as [CLS] get a block of their own. The default.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..checks import check_choice
from ..models import LinformerModel
from ..projection import MatrixProjection

INITS = ("xavier", "mean", "svd", "attention")
# Chosen by `linformer convert --report` (benchmarks/convert/): best cosine at every k.
DEFAULT_INIT = "attention"
FALLBACK_INIT = "mean"  # the default when no calibration text is given


def mean_pooling_matrix(max_seq_len: int, proj_dim: int) -> Tensor:
    """The (max_seq_len, proj_dim) matrix that averages k consecutive blocks of positions."""
    block = torch.arange(max_seq_len) * proj_dim // max_seq_len  # (n,)
    weight = (block[:, None] == torch.arange(proj_dim)[None, :]).float()  # (n, k)
    return weight / weight.sum(0, keepdim=True)


def block_matrix(bounds: Tensor, max_seq_len: int) -> Tensor:
    """(max_seq_len, k) block means for block starts `bounds` (k,), bounds[0] == 0."""
    block = torch.searchsorted(bounds, torch.arange(max_seq_len), right=True) - 1  # (n,)
    weight = (block[:, None] == torch.arange(len(bounds))[None, :]).float()  # (n, k)
    return weight / weight.sum(0, keepdim=True)


def balanced_bounds(mass: Tensor, proj_dim: int, uniform: float = 0.5) -> Tensor:
    """Starts of k contiguous, non-empty blocks holding equal shares of `mass` (n,), blended
    with a uniform share so that text between attention sinks is not pooled too coarsely.

    Greedy from the left: each block takes the remaining mass over the remaining blocks, so
    a sink that alone holds several shares does not leave the blocks after it too small.
    """
    n = mass.shape[0]
    share = ((1 - uniform) * mass / mass.sum() + uniform / n).tolist()
    bounds, start, left = [], 0, sum(share)
    for j in range(proj_dim):
        blocks_left = proj_dim - j
        target, end, held = left / blocks_left, start + 1, share[start]
        while end < n - (blocks_left - 1) and held + share[end] / 2 < target:
            held += share[end]
            end += 1
        bounds.append(start)
        start, left = end, left - held
    return torch.tensor(bounds)


def _projections(model: LinformerModel) -> Iterator[tuple[MatrixProjection, list[tuple[int, str]]]]:
    """Each distinct learned matrix projection with the (layer, 'k' | 'v') slots it serves."""
    users: dict[int, tuple[MatrixProjection, list[tuple[int, str]]]] = {}
    for index, layer in enumerate(model.encoder.layers):
        for slot in ("k", "v"):
            module = getattr(layer.attn, f"proj_{slot}")
            if isinstance(module, MatrixProjection):
                users.setdefault(id(module), (module, []))[1].append((index, slot))
    yield from users.values()


@torch.no_grad()
def sequence_gram_matrices(
    teacher: LinformerModel,
    calibration_ids: Tensor,
    slots: dict[int, list[tuple[int, str]]],
    per_head: dict[int, bool],
    batch_size: int = 4,
) -> dict[int, Tensor]:
    """Position Gram matrices of the teacher's keys/values for groups of (layer, slot).

    Args:
        teacher: the exact model.
        calibration_ids: (B, N) token ids without padding.
        slots: group id -> the (layer index, 'k' | 'v') whose outputs it sums.
        per_head: group id -> keep one Gram matrix per head.
        batch_size: calibration sequences per forward pass.

    Returns:
        Group id -> (N, N), or (H, N, N) for a per-head group.
    """
    heads = teacher.config.num_heads
    captured: dict[tuple[int, str], Tensor] = {}
    hooks = []
    for index, layer in enumerate(teacher.encoder.layers):
        for slot in ("k", "v"):

            def keep(_module: nn.Module, _inputs: tuple, out: Tensor, key=(index, slot)) -> None:
                captured[key] = out.view(out.shape[0], out.shape[1], heads, -1)  # (B, N, H, D)

            hooks.append(getattr(layer.attn, f"to_{slot}").register_forward_hook(keep))
    grams: dict[int, Tensor] = {}
    try:
        for ids in tqdm(calibration_ids.split(batch_size), desc="calibrating (svd)", leave=False):
            teacher(ids)
            for group, users in slots.items():
                equation = "bnhd,bmhd->hnm" if per_head[group] else "bnhd,bmhd->nm"
                total = sum(torch.einsum(equation, captured[u], captured[u]) for u in users)
                grams[group] = grams.get(group, 0) + total.double()
    finally:
        for hook in hooks:
            hook.remove()
    return grams


@torch.no_grad()
def received_attention(
    teacher: LinformerModel, calibration_ids: Tensor, batch_size: int | None = None
) -> Tensor:
    """Attention mass each key position receives, summed over queries and calibration
    sequences: (depth, H, N). `batch_size` None: 4 sequences at n = 512, fewer at longer n
    (each holds depth x H x N x N attention weights)."""
    if batch_size is None:
        batch_size = max(1, 4 * 512**2 // calibration_ids.shape[1] ** 2)
    total = 0
    for ids in tqdm(calibration_ids.split(batch_size), desc="calibrating (attention)", leave=False):
        attentions = teacher(ids, output_attentions=True).attentions  # depth x (B, H, N, N)
        total = total + torch.stack([p.sum((0, 2)) for p in attentions]).double()
    return total


def top_eigenvectors(gram: Tensor, proj_dim: int) -> Tensor:
    """(..., n, n) symmetric -> (..., n, k): top-k eigenvectors, each sign-fixed to a
    positive sum and scaled so its entries sum to 1."""
    _, vectors = torch.linalg.eigh(gram)  # ascending eigenvalues
    top = vectors[..., :, -proj_dim:].flip(-1)  # (..., n, k)
    sums = top.sum(-2, keepdim=True)
    top = top * torch.where(sums < 0, -1.0, 1.0)
    return top / top.abs().sum(-2, keepdim=True).clamp(min=1e-12)


def init_projections(
    model: LinformerModel,
    init: str | None,
    *,
    teacher: LinformerModel | None = None,
    calibration_ids: Tensor | None = None,
) -> None:
    """Sets every learned linear projection of `model` in place.

    Args:
        model: a converted LinformerModel (projection='linear' for any init).
        init: xavier, mean, svd or attention; None picks DEFAULT_INIT (attention) when
            calibration ids are given, else mean, for `linear` projections, and leaves the
            other kinds as built (conv starts as mean pooling already).
        teacher: the exact model (needed by svd).
        calibration_ids: (B, max_seq_len) token ids (needed by svd).

    Raises:
        ValueError: for an unknown init, an init on a non-linear projection, or svd without
            a teacher and calibration ids of full length.
    """
    if init is not None:
        check_choice("init", init, INITS)
    config = model.config
    if config.projection != "linear":
        if init is not None:
            raise ValueError(
                f"init={init!r} applies to projection='linear' only; got projection="
                f"{config.projection!r} (conv starts as mean pooling, pool and random are fixed)"
            )
        return
    if init is None:
        init = DEFAULT_INIT if calibration_ids is not None else FALLBACK_INIT
    projections = list(_projections(model))
    if init in ("svd", "attention"):
        _check_calibration(init, teacher, calibration_ids, config.max_seq_len)
    if init == "svd":
        grams = sequence_gram_matrices(
            teacher,
            calibration_ids,
            {id(p): users for p, users in projections},
            {id(p): p.per_head for p, _ in projections},
        )
    if init == "attention":
        mass = received_attention(teacher, calibration_ids)  # (depth, H, N)
    with torch.no_grad():
        for module, users in projections:
            weight = module.weight  # (n, k) or (H, n, k)
            n, k = weight.shape[-2:]
            if init == "xavier":
                bound = math.sqrt(6.0 / (n + k))
                weight.uniform_(-bound, bound)
            elif init == "mean":
                weight.copy_(mean_pooling_matrix(n, k).expand_as(weight))
            elif init == "svd":
                weight.copy_(top_eigenvectors(grams[id(module)], k).to(weight.dtype))
            else:
                layers = sorted({index for index, _ in users})
                served = mass[layers].sum(0)  # (H, N)
                per_head = served if module.per_head else served.sum(0, keepdim=True)
                blocks = [block_matrix(balanced_bounds(m, k), n) for m in per_head]
                weight.copy_(torch.stack(blocks).view_as(weight))


def _check_calibration(
    init: str, teacher: LinformerModel | None, calibration_ids: Tensor | None, max_seq_len: int
) -> None:
    if teacher is None or calibration_ids is None:
        raise ValueError(
            f"init={init!r} needs the exact teacher and calibration_ids (B, max_seq_len)"
        )
    if calibration_ids.dim() != 2 or calibration_ids.shape[1] != max_seq_len:
        raise ValueError(
            f"init={init!r} needs calibration_ids of shape (batch, max_seq_len={max_seq_len}) so "
            f"every projection row is seen; got {tuple(calibration_ids.shape)}"
        )
