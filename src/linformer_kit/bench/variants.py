"""The benchmarked variants: ours per sharing mode, exact attention through SDPA, the naive
exact attention of 2020 (materialised n x n scores, the paper's baseline) and the published
Linformer packages, each as one attention layer or one full encoder layer of the same shape.

Every builder returns a module mapping x (B, N, dim) to a tensor (B, N, dim).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..attention import LinformerSelfAttention
from ..checks import check_choice
from ..config import LinformerConfig
from ..encoder import LinformerEncoderLayer
from ..functional import attention_weights
from ..kernel_rule import use_kernel
from ..projection import build_sharing_plan
from ..training.settings import compiled
from .flops import Shape, exact_attention_flops, linformer_attention_flops, total_flops

SCOPES = ("attention", "layer")
SHARINGS = ("none", "headwise", "kv", "layerwise")
# Import name of each peer package (PyPI: linformer==0.2.3, linformer-pytorch==0.19.3).
PEERS = {"lucidrains": "linformer", "linformer-pytorch": "linformer_pytorch"}


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One benchmarked implementation.

    Attributes:
        name: label in tables and plots.
        kind: ours, sdpa, naive, or a key of PEERS.
        sharing: projection sharing for ours; the peers run `headwise` (their default: E and
            F shared by the heads of a layer, E != F).
        attention_dropout: dropout on the attention weights in training (ours and exact
            SDPA). The peers run without dropout whatever this is (lucidrains' default;
            linformer-pytorch's 0.1 and 0.15 set to 0): their fastest setting, which the
            rows with dropout are compared against too.
        kernel: ours only: the attention kernel it runs on (`kernel_rule.use_kernel`), None
            for the rule's choice.
        compile: run under `torch.compile` (`training.settings.compiled`), one of its
            COMPILES: "inductor" (its default), "reduce-overhead" (Inductor with CUDA graphs)
            or "aot_eager" (no code generation), each also with "+autograd" (the backward
            under compiled autograd, `timing.module_step`); None: eager.
    """

    name: str
    kind: str
    sharing: str | None = None
    attention_dropout: float = 0.0
    kernel: str | None = None
    compile: str | None = None

    @property
    def exact(self) -> bool:
        """Whether it computes exact attention (independent of proj_dim)."""
        return self.kind in ("sdpa", "naive")


def default_variants(
    *,
    sharings: tuple[str, ...],
    peers: bool,
    attention_dropouts: tuple[float, ...] = (0.0,),
    kernels: tuple[str | None, ...] = (None,),
    compiles: tuple[str | None, ...] = (None,),
) -> list[Variant]:
    """Ours in each sharing mode on each kernel (None: the rule's) and exact SDPA (each at
    every attention dropout), naive exact and (optionally) the peers; all of them eager
    (None in `compiles`) and under each torch.compile setting there (see `Variant`)."""
    variants = []
    for p in attention_dropouts:
        suffix = f" attn-dropout {p:g}" if p else ""
        variants += [
            Variant(
                name=f"linformer {s}{f' [{kernel}]' if kernel else ''}{suffix}",
                kind="ours",
                sharing=s,
                attention_dropout=p,
                kernel=kernel,
            )
            for kernel in kernels
            for s in sharings
        ]
        variants.append(Variant(name=f"exact sdpa{suffix}", kind="sdpa", attention_dropout=p))
    variants.append(Variant(name="exact naive", kind="naive"))
    if peers:
        variants += [Variant(name=name, kind=name, sharing="headwise") for name in PEERS]
    return [
        dataclasses.replace(v, name=f"{v.name} [compiled {c}]" if c else v.name, compile=c)
        for c in compiles
        for v in variants
    ]


def peer_available(kind: str) -> bool:
    """Whether a peer package is installed."""
    return importlib.util.find_spec(PEERS[kind]) is not None


class NaiveAttention(nn.Module):
    """Exact attention as written in 2020: softmax(Q K^T / sqrt(d)) V with the n x n scores
    materialised (the paper's Transformer baseline). Same layers as `LinformerSelfAttention`.

    Args:
        dim: model width.
        num_heads: attention heads.
    """

    def __init__(self, *, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(
        self, x: Tensor, key_padding_mask: Tensor | None = None, return_attention: bool = False
    ) -> tuple[Tensor, None]:
        """(B, N, dim) -> (B, N, dim); the signature of `LinformerSelfAttention`."""
        batch, seq_len, dim = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.to_q(x)), heads(self.to_k(x)), heads(self.to_v(x))  # (B, H, N, D)
        out = attention_weights(q, k, key_padding_mask) @ v  # (B, H, N, D)
        return self.to_out(out.transpose(1, 2).reshape(batch, seq_len, dim)), None


class FirstOutput(nn.Module):
    """Keeps the first output of a module that returns (output, extra), its attention run
    on `kernel` (None: the rule's choice)."""

    def __init__(self, module: nn.Module, kernel: str | None = None) -> None:
        super().__init__()
        self.module, self.kernel = module, kernel

    def forward(self, x: Tensor) -> Tensor:
        with use_kernel(self.kernel):
            return self.module(x)[0]


def _ours(variant: Variant, shape: Shape, scope: str) -> nn.Module:
    proj_dim = None if variant.kind in ("sdpa", "naive") else shape.proj_dim
    config = LinformerConfig(
        max_seq_len=shape.seq_len,
        dim=shape.dim,
        depth=1,
        num_heads=shape.num_heads,
        ffn_dim=shape.ffn_dim,
        proj_dim=proj_dim,
        sharing=variant.sharing or "layerwise",
        dropout=0.0,
        attention_dropout=0.0,
    )
    proj_k, proj_v = build_sharing_plan(config)[0]
    if scope == "attention":
        attention = LinformerSelfAttention(
            dim=shape.dim,
            num_heads=shape.num_heads,
            max_seq_len=shape.seq_len,
            proj_k=proj_k,
            proj_v=proj_v,
            dropout=variant.attention_dropout,
        )
        if variant.kind == "naive":
            attention = NaiveAttention(dim=shape.dim, num_heads=shape.num_heads)
        return FirstOutput(attention, variant.kernel)
    layer = LinformerEncoderLayer(
        dim=shape.dim,
        num_heads=shape.num_heads,
        max_seq_len=shape.seq_len,
        proj_k=proj_k,
        proj_v=proj_v,
        ffn_dim=shape.ffn_dim,
        attention_dropout=variant.attention_dropout,
    )
    if variant.kind == "naive":
        layer.attn = NaiveAttention(dim=shape.dim, num_heads=shape.num_heads)
    return FirstOutput(layer, variant.kernel)


def _lucidrains(shape: Shape, scope: str) -> nn.Module:
    import linformer

    n, d, k, h = shape.seq_len, shape.dim, shape.proj_dim, shape.num_heads
    if scope == "attention":
        return linformer.LinformerSelfAttention(d, n, k=k, heads=h)
    return linformer.Linformer(d, n, 1, k=k, heads=h)  # feed-forward width 4 x dim


def _linformer_pytorch(shape: Shape, scope: str) -> nn.Module:
    from linformer_pytorch import linformer_pytorch as lp

    n, d, k, h = shape.seq_len, shape.dim, shape.proj_dim, shape.num_heads
    if scope == "attention":
        return lp.MHAttention(n, d // h, d, k, h, 0.0, "C0", "headwise", None, None, False, None)
    return lp.Linformer(
        input_size=n,
        channels=d,
        dim_k=k,
        dim_ff=shape.ffn_dim,
        nhead=h,
        depth=1,
        dropout=0.0,
        dropout_ff=0.0,
        parameter_sharing="headwise",
    )


def build_variant(variant: Variant, shape: Shape, scope: str) -> nn.Module:
    """One attention layer (`scope="attention"`) or encoder layer (`"layer"`) of a variant,
    under `torch.compile` where the variant says (compiled on its first call; ours inside
    the kernel pin, which `FirstOutput` sets around the compiled module).

    Raises:
        ValueError: for an unknown scope or kind.
    """
    check_choice("scope", scope, SCOPES)
    if variant.kind in ("ours", "sdpa", "naive"):
        module = _ours(variant, shape, scope)
        if variant.compile:
            module.module = compiled(module.module, variant.compile)
        return module
    if variant.kind == "lucidrains":
        module = _lucidrains(shape, scope)
    elif variant.kind == "linformer-pytorch":
        module = _linformer_pytorch(shape, scope)
    else:
        raise ValueError(f"unknown variant kind {variant.kind!r}")
    return compiled(module, variant.compile) if variant.compile else module


def compile_limits() -> contextlib.AbstractContextManager:
    """Dynamo's settings for a sweep of compiled variants: every module of a class shares
    one cache of compiled code per method (`LinformerSelfAttention.forward` gets an entry
    per sharing, kernel pin, dtype, scope and setting), and past `recompile_limit` (8) dynamo
    would run the rest eagerly under their "compiled" names. So the limits are raised and
    a hit raises instead (`run_bench` also resets dynamo after each n)."""
    limits = {
        "recompile_limit": 1024,
        "accumulated_recompile_limit": 4096,
        "fail_on_recompile_limit_hit": True,
    }
    config = torch._dynamo.config
    return config.patch(**{name: value for name, value in limits.items() if hasattr(config, name)})


def variant_flops(variant: Variant, shape: Shape, scope: str, *, backward: bool) -> int:
    """FLOPs of one call, in the order the variant computes (see `flops`)."""
    if variant.exact:
        attention = exact_attention_flops(shape)
    elif variant.kind == "ours":
        eager = dataclasses.replace(variant, compile=None)
        with torch.device("meta"):  # only the order is wanted: allocate nothing
            module = build_variant(eager, shape, "attention").module
        attention = linformer_attention_flops(
            shape,
            input_first=module.projects_input_first(shape.seq_len),
            shared_kv=module.proj_k is module.proj_v,
        )
    else:  # the peers map keys and values on all n rows, then project them
        attention = linformer_attention_flops(shape, input_first=False, shared_kv=False)
    return total_flops(attention, shape, layer=scope == "layer", backward=backward)


def estimate_bytes(variant: Variant, shape: Shape, scope: str, *, backward: bool) -> int:
    """A rough upper estimate of a call's peak memory, to skip what would not fit.

    Counts float32 activations: about 16 (B, N, dim) tensors (+ 3 of the feed-forward width
    for a layer), 3 (B, H, N, M) score tensors for the naive and peer variants that
    materialise them (M = n or k), and the n x k projections; x2 with backward.
    """
    b, n, d, h = shape.batch_size, shape.seq_len, shape.dim, shape.num_heads
    k = shape.proj_dim or n
    floats = 16 * b * n * d + (3 * b * n * shape.ffn_dim if scope == "layer" else 0)
    if variant.kind == "naive":
        floats += 3 * b * h * n * n
    elif not variant.exact:
        floats += 3 * b * h * n * k + 2 * n * k
    return 4 * floats * (2 if backward else 1)
