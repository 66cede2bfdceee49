"""Sequence projections (paper sec. 4 and its "other options") and the sharing plan.

Every projection maps keys or values of shape (B, N, G, C) to (B, M, G, C) along the sequence
axis and returns a mask of the M rows that hold real content (or None when all do). G is the
number of heads for a per-head projection and 1 (or anything) for one shared across heads.

| kind     | what E is                                        | parameters        |
|----------|--------------------------------------------------|-------------------|
| `linear` | learned max_seq_len x k matrix, Xavier init       | trained           |
| `random` | fixed Gaussian N(0, 1/k) (Johnson-Lindenstrauss)  | buffer, not trained|
| `conv`   | strided 1-D conv, kernel = stride = max_seq_len/k | trained kernel    |
| `pool`   | mean over blocks of max_seq_len/k positions       | none              |
| `exact`  | identity: exact attention (proj_dim=None)         | none              |
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .config import LinformerConfig, check_choice
from .functional import project_blocks, project_linear, zero_padding


class SequenceProjection(nn.Module):
    """Interface of the interchangeable projection kinds.

    Attributes:
        per_head: whether it holds one projection per head (then G must equal num_heads).
        num_matrices: distinct projection matrices it holds (the paper's count).
    """

    per_head: bool = False
    num_matrices: int = 0

    def output_len(self, seq_len: int) -> int:
        """Rows M that a sequence of length `seq_len` is projected to."""
        raise NotImplementedError

    def flops(self, seq_len: int, width: int) -> int:
        """Multiply-adds to project a (seq_len, width) sequence: picks the cheaper order."""
        raise NotImplementedError


class MatrixProjection(SequenceProjection):
    """A dense max_seq_len x k projection: learned (`linear`) or fixed random (`random`).

    Args:
        max_seq_len: longest input n; a shorter input uses the first n rows.
        proj_dim: k, the projected length.
        num_heads: give one matrix per head when set; shared across heads when None.
        learned: Xavier-initialised Parameter (True) or fixed N(0, 1/k) buffer (False).
    """

    def __init__(
        self, *, max_seq_len: int, proj_dim: int, num_heads: int | None = None, learned: bool = True
    ) -> None:
        super().__init__()
        shape = (max_seq_len, proj_dim) if num_heads is None else (num_heads, max_seq_len, proj_dim)
        self.per_head = num_heads is not None
        self.num_matrices = num_heads or 1
        self.proj_dim = proj_dim
        if learned:
            # Xavier-uniform on each n x k matrix, as the authors advised implementers.
            bound = math.sqrt(6.0 / (max_seq_len + proj_dim))
            self.weight = nn.Parameter(torch.empty(shape).uniform_(-bound, bound))
        else:
            self.register_buffer("weight", torch.randn(shape) / math.sqrt(proj_dim))

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> tuple[Tensor, None]:
        """(B, N, G, C) -> (B, k, G, C); every projected row mixes real tokens only."""
        return project_linear(x, self.weight, key_padding_mask), None

    def output_len(self, seq_len: int) -> int:
        return self.proj_dim

    def flops(self, seq_len: int, width: int) -> int:
        return seq_len * self.proj_dim * width


class BlockProjection(SequenceProjection):
    """Kernel = stride = max_seq_len / k: a learned strided conv (`conv`) or mean pooling (`pool`).

    Args:
        max_seq_len: longest input n; must be a multiple of proj_dim.
        proj_dim: k, the number of blocks at full length.
        num_heads: one kernel per head when set; shared across heads when None.
        learned: learned kernel initialised to the block mean (True) or plain mean pooling.
    """

    def __init__(
        self, *, max_seq_len: int, proj_dim: int, num_heads: int | None = None, learned: bool = True
    ) -> None:
        super().__init__()
        if max_seq_len % proj_dim:
            raise ValueError(
                f"block projections need proj_dim ({proj_dim}) to divide max_seq_len "
                f"({max_seq_len})"
            )
        self.block_size = max_seq_len // proj_dim
        self.per_head = num_heads is not None and learned
        self.num_matrices = (num_heads or 1) if learned else 0
        if learned:
            shape = (self.block_size,) if num_heads is None else (num_heads, self.block_size)
            self.weight = nn.Parameter(torch.full(shape, 1.0 / self.block_size))
        else:
            self.weight = None

    def forward(
        self, x: Tensor, key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """(B, N, G, C) -> (B, ceil(N / block), G, C) and the mask of non-empty blocks."""
        return project_blocks(x, self.block_size, self.weight, key_padding_mask)

    def output_len(self, seq_len: int) -> int:
        return math.ceil(seq_len / self.block_size)

    def flops(self, seq_len: int, width: int) -> int:
        return seq_len * width


class ExactProjection(SequenceProjection):
    """Identity: keeps all N keys, so attention is exact (proj_dim=None)."""

    def forward(
        self, x: Tensor, key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Zeroes padded rows and passes the mask on to the attention."""
        return zero_padding(x, key_padding_mask), key_padding_mask

    def output_len(self, seq_len: int) -> int:
        return seq_len

    def flops(self, seq_len: int, width: int) -> int:
        return 0


def build_projection(
    *, projection: str, max_seq_len: int, proj_dim: int | None, num_heads: int | None = None
) -> SequenceProjection:
    """Builds one projection of the given kind (`ExactProjection` when proj_dim is None).

    Args:
        projection: linear, random, conv or pool.
        max_seq_len: longest input n.
        proj_dim: k, or None for exact attention.
        num_heads: one projection per head when set; shared across heads when None.

    Raises:
        ValueError: for an unknown kind.
    """
    if proj_dim is None:
        return ExactProjection()
    kinds = {
        "linear": (MatrixProjection, True),
        "random": (MatrixProjection, False),
        "conv": (BlockProjection, True),
        "pool": (BlockProjection, False),
    }
    check_choice("projection", projection, tuple(kinds))
    cls, learned = kinds[projection]
    return cls(max_seq_len=max_seq_len, proj_dim=proj_dim, num_heads=num_heads, learned=learned)


def build_sharing_plan(
    config: LinformerConfig,
) -> list[tuple[SequenceProjection, SequenceProjection]]:
    """The (key, value) projections of every layer under the config's sharing mode.

    Paper sec. 4: `headwise` shares E and F across the heads of a layer; `kv` also sets
    E = F; `layerwise` uses one E = F for all layers and heads; `none` gives every head of
    every layer its own E and F. Shared projections are the same module object, so a
    shared matrix is one Parameter.
    """

    def make(proj_dim: int | None, per_head: bool = False) -> SequenceProjection:
        return build_projection(
            projection=config.projection,
            max_seq_len=config.max_seq_len,
            proj_dim=proj_dim,
            num_heads=config.num_heads if per_head else None,
        )

    if config.sharing == "layerwise":
        shared = make(config.proj_dims[0])
        return [(shared, shared) for _ in range(config.depth)]
    plan = []
    for proj_dim in config.proj_dims:
        if config.sharing == "kv":
            kv = make(proj_dim)
            plan.append((kv, kv))
        else:
            per_head = config.sharing == "none"
            plan.append((make(proj_dim, per_head), make(proj_dim, per_head)))
    return plan


def count_projection_matrices(model: nn.Module) -> int:
    """Distinct sequence-projection matrices in a model (paper's count: 288/24/12/1 for
    none/headwise/kv/layerwise at 12 layers x 12 heads); parameter-free kinds count 0."""
    seen = {id(m): m for m in model.modules() if isinstance(m, SequenceProjection)}
    return sum(m.num_matrices for m in seen.values())
