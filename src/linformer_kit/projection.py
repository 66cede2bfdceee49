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
| `adaptive`| mean over k blocks sized to each sequence's length| none              |
| `exact`  | identity: exact attention (proj_dim=None)         | none              |
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .checks import check_choice, check_positive
from .config import LinformerConfig, check_proj_dim
from .functional import leading_rows, project_blocks, project_linear, zero_padding
from .input_checks import check_seq_len


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

    def project_ones(self, like: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """The projection of an all-ones sequence as long as `like` (B, N, ...): (B, M, 1, 1),
        the E 1 that multiplies a key/value layer's bias when the input is projected first."""
        batch, seq_len = like.shape[:2]
        return self(like.new_ones(batch, seq_len, 1, 1), key_padding_mask)[0]


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
        check_proj_dim(proj_dim, max_seq_len)
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

    def project_ones(self, like: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Without padding, E[:N]^T 1 is the sum of E's first N rows: a reduction whose
        backward is an expand, where the GEMM with a column of ones costs an outer-product
        GEMM and a second N x k gradient of E to add in backward."""
        if key_padding_mask is not None or self.per_head:
            return super().project_ones(like, key_padding_mask)
        batch, seq_len = like.shape[:2]
        sums = leading_rows(self.weight, seq_len).sum(0)  # (K,)
        return sums.view(1, -1, 1, 1).expand(batch, -1, 1, 1)


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
        check_positive("proj_dim", proj_dim)
        if max_seq_len % proj_dim:
            raise ValueError(
                f"block projections need proj_dim ({proj_dim}) to divide max_seq_len "
                f"({max_seq_len})"
            )
        self.block_size, self.max_seq_len = max_seq_len // proj_dim, max_seq_len
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
        check_seq_len(x.shape[1], self.max_seq_len)
        return project_blocks(x, self.block_size, self.weight, key_padding_mask)

    def output_len(self, seq_len: int) -> int:
        return math.ceil(seq_len / self.block_size)

    def flops(self, seq_len: int, width: int) -> int:
        return seq_len * width


def adaptive_block_index(real: Tensor, proj_dim: int) -> Tensor:
    """The block of every position under adaptive pooling.

    A sequence of L <= k real tokens keeps one block per token (exact attention). A longer
    one gives its first real token a block of its own (the attention sink of BERT's [CLS]
    or a BOS token: pooled with its neighbours, a converted model's attention loses it)
    and splits the other L - 1 into k - 1 contiguous blocks: the j-th of them (j = 0 ..
    L - 2) goes to block 1 + floor(j (k - 1) / (L - 1)), so sizes differ by at most one.
    Blocks follow each sequence's own real tokens, so padding changes nothing.

    Args:
        real: bool (B, N), True at real tokens.
        proj_dim: k, the most blocks.

    Returns:
        int64 (B, N): the block in [0, min(k, N)) of each real token, -1 at padding.
    """
    rank = real.long().cumsum(1) - 1  # (B, N) index among the row's real tokens
    length = real.sum(1, keepdim=True)  # (B, 1)
    blocks = min(proj_dim, real.shape[1])
    if blocks == 1:
        block = torch.zeros_like(rank)
    else:
        inner = 1 + (rank - 1).clamp(min=0) * (blocks - 1) // (length - 1).clamp(min=1)
        block = torch.where((length <= blocks) | (rank == 0), rank, inner)
    return torch.where(real, block, -1)


class AdaptivePoolProjection(SequenceProjection):
    """Mean pooling over at most k blocks sized to each sequence's own length (`adaptive`).

    Fixed projections waste their k rows on short inputs: a 2048 x 128 block pooling gives a
    400-token review 25 blocks of 16 tokens and 103 empty ones. Here the same review gets 128
    blocks of about 3 tokens and an input of <= k tokens is attended exactly; the cost stays
    O(N k) per layer. No parameters; not causal (a block's extent depends on the length).

    Args:
        proj_dim: k, the most blocks per sequence.
    """

    def __init__(self, proj_dim: int) -> None:
        super().__init__()
        check_positive("proj_dim", proj_dim)
        self.proj_dim = proj_dim

    def forward(
        self, x: Tensor, key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """(B, N, G, C) -> (B, min(k, N), G, C) block means, and the mask of non-empty blocks
        (None when no key_padding_mask was given: then every block is non-empty)."""
        batch, seq_len, groups, width = x.shape
        real = x.new_ones(batch, seq_len, dtype=torch.bool)
        if key_padding_mask is not None:
            real = key_padding_mask
        block = adaptive_block_index(real, self.proj_dim)
        blocks = self.output_len(seq_len)
        slot = torch.where(block < 0, blocks, block)  # padding goes to a spare row, dropped
        counts = torch.zeros(batch, blocks + 1, device=x.device, dtype=torch.float32)
        counts = counts.scatter_add_(1, slot, real.float())[:, :blocks]  # (B, M)
        flat = x.reshape(batch, seq_len, groups * width)
        sums = flat.new_zeros(batch, blocks + 1, groups * width)
        sums = sums.scatter_add(1, slot[:, :, None].expand_as(flat), flat)[:, :blocks]
        out = sums / counts.clamp(min=1)[:, :, None].to(x.dtype)
        mask = counts > 0 if key_padding_mask is not None else None
        return out.view(batch, blocks, groups, width), mask

    def output_len(self, seq_len: int) -> int:
        return min(self.proj_dim, seq_len)

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
        projection: linear, random, conv, pool or adaptive.
        max_seq_len: longest input n.
        proj_dim: k, or None for exact attention.
        num_heads: one projection per head when set; shared across heads when None.

    Raises:
        ValueError: for an unknown kind, or proj_dim outside [1, max_seq_len].
    """
    if proj_dim is None:
        return ExactProjection()
    check_proj_dim(proj_dim, max_seq_len)
    kinds = {
        "linear": (MatrixProjection, True),
        "random": (MatrixProjection, False),
        "conv": (BlockProjection, True),
        "pool": (BlockProjection, False),
    }
    check_choice("projection", projection, (*kinds, "adaptive"))
    if projection == "adaptive":
        return AdaptivePoolProjection(proj_dim)
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
