"""Feed-forward block, encoder layer and the encoder stack (sharing plan, k schedule,
activation checkpointing)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from . import native
from .attention import CausalState, LinformerSelfAttention
from .config import LinformerConfig
from .dropout import Dropout, native_ops
from .kernel_rule import checkpointed
from .linear_backend import apply_linear, hooked
from .native import transformed
from .projection import SequenceProjection, build_sharing_plan

ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}
# Under CPU bf16 autocast the kernel takes inputs of at least this many rows (where its bf16
# GEMMs are AVX-512 BF16's dot products, `native.bf16_feedforward()`). Its GEMMs run at about
# oneDNN's bf16 rate (the modules'), so it gains by the passes it fuses and the memory it
# never writes, which pay from about here: fwd+bwd, dim 256, hidden 1024, 2 threads, AMD
# EPYC (`benchmarks/kernels_feedforward.py --dtype bfloat16`, `benchmarks/kernels/amd-epyc/
# feedforward-bf16/`), the block 0.75 / 1.04 / 1.17 / 1.07 / 1.31x the modules' speed at
# 1024 / 2048 / 4096 / 8192 / 16384 rows, an encoder layer (attention on SDPA) 0.87 / 1.02
# / 1.11 / 1.11 / 1.11x.
BF16_KERNEL_MIN_ROWS = 4096


class FeedForward(nn.Module):
    """Position-wise two-layer MLP: Linear -> activation -> Linear.

    On CPU in float32 / float64 without autocast it runs the compiled kernel
    (`csrc/feedforward.cpp`, eager or under torch.compile as one graph node): blocks of rows
    whose hidden activations stay in the thread's cache (backward keeps them for every row
    where rows are few for the threads and width, for the weight gradients' GEMMs); with GELU
    only the pre-activation is kept for backward (PyTorch's modules keep it and the
    activation). The same results to float rounding. Under CPU bf16 autocast, from
    `BF16_KERNEL_MIN_ROWS` rows where the kernels' bf16 GEMMs are AVX-512 BF16's dot
    products (AMD CPUs with AVX-512; `csrc/feedforward_bf16.cpp`), its bf16 form, rounding
    where autocast's modules round. Elsewhere the three modules run in turn: a GPU, bf16
    weights, other autocast, torch.export, functorch transforms and forward-mode AD,
    submodules replaced or hooked (pruning, quantization), and where the kernels cannot be
    built. Where MKL runs its AVX2 code (AMD CPUs with AVX-512) the kernel's GEMMs are
    oneDNN's micro-kernel (`native.kernel_gemm`); it beat the modules on oneDNN
    (`linear_backend`) 1.37-1.74x there (fwd+bwd, dim 256, hidden 1024, 1024-16384 rows,
    2 threads, AMD EPYC, `benchmarks/kernels/amd-epyc/feedforward/`), where its MKL GEMMs
    had lost to them.

    Args:
        dim: model width.
        hidden_dim: inner width.
        activation: gelu or relu.
    """

    def __init__(self, *, dim: int, hidden_dim: int, activation: str = "gelu") -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden_dim)
        self.act = ACTIVATIONS[activation]()
        self.down = nn.Linear(hidden_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        """(B, N, dim) -> (B, N, dim)."""
        kernel = self._kernel(x)
        if kernel is None:
            return apply_linear(self.down, self.act(apply_linear(self.up, x)))
        ops, code = kernel
        rows = x.reshape(-1, x.shape[-1])
        rows = (rows.to(torch.bfloat16) if torch.is_autocast_enabled("cpu") else rows).contiguous()
        weights = (self.up.weight, self.up.bias, self.down.weight, self.down.bias)
        weights = tuple(w.contiguous() for w in weights)
        out, _ = ops.feedforward_forward(rows, *weights, code, False)
        return out.view(*x.shape[:-1], out.shape[-1])

    def _kernel(self, x: Tensor) -> tuple[object, int] | None:
        """The compiled kernels and the activation's code for them (0 GELU, 1 ReLU) where
        they compute what the three modules would for x (to float rounding), else None."""
        autocast = torch.is_autocast_enabled("cpu")
        if autocast:  # bf16 rows, float32 weights: where the kernels multiply bf16 fast
            dtypes, weight_dtype = (torch.float32, torch.bfloat16), torch.float32
        else:
            dtypes, weight_dtype = (torch.float32, torch.float64), x.dtype
        if not (
            x.device.type == "cpu"
            and x.dtype in dtypes
            and x.dim() > 0
            and x.numel() > 0
            and (not autocast or torch.get_autocast_dtype("cpu") == torch.bfloat16)
            and (not autocast or x.numel() // x.shape[-1] >= BF16_KERNEL_MIN_ROWS)
            and not torch.compiler.is_exporting()  # exported graphs stay plain aten
            and type(self.up) is nn.Linear
            and type(self.down) is nn.Linear
            and self.up.bias is not None
            and self.down.bias is not None
            and all(p.dtype == weight_dtype and p.device == x.device for p in self.parameters())
            and not any(hooked(m) for m in (self.up, self.act, self.down))
            and not transformed(x, *self.parameters())
        ):
            return None
        if type(self.act) is nn.GELU and self.act.approximate == "none":
            code = 0
        elif type(self.act) is nn.ReLU:
            code = 1
        else:
            return None
        ops = native_ops(x)
        if ops is None or (autocast and not native.bf16_feedforward()):
            return None
        return ops, code


class LinformerEncoderLayer(nn.Module):
    """Attention and feed-forward sub-layers with residuals, pre-LN or post-LN.

    Dropout is applied once per sub-layer output; attention-weight dropout lives in the
    attention module.

    Args:
        dim, num_heads, max_seq_len: as in `LinformerSelfAttention`.
        proj_k, proj_v: this layer's sequence projections.
        ffn_dim: feed-forward inner width.
        activation: gelu or relu.
        norm_first: pre-LN (True) or post-LN (False).
        dropout: dropout on each sub-layer's output.
        attention_dropout: dropout on the attention weights.
        layer_norm_eps: LayerNorm epsilon.
        checkpoint_attention: recompute the attention sub-layer in backward to save memory.
        causal, block_size: causal attention (see `LinformerSelfAttention`).
    """

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        max_seq_len: int,
        proj_k: SequenceProjection | None,
        proj_v: SequenceProjection | None,
        ffn_dim: int,
        activation: str = "gelu",
        norm_first: bool = True,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        layer_norm_eps: float = 1e-5,
        checkpoint_attention: bool = False,
        causal: bool = False,
        block_size: int = 64,
    ) -> None:
        super().__init__()
        self.attn = LinformerSelfAttention(
            dim=dim,
            num_heads=num_heads,
            max_seq_len=max_seq_len,
            proj_k=proj_k,
            proj_v=proj_v,
            dropout=attention_dropout,
            causal=causal,
            block_size=block_size,
        )
        self.ffn = FeedForward(dim=dim, hidden_dim=ffn_dim, activation=activation)
        self.attn_norm = nn.LayerNorm(dim, eps=layer_norm_eps)
        self.ffn_norm = nn.LayerNorm(dim, eps=layer_norm_eps)
        self.dropout = Dropout(dropout)
        self.norm_first = norm_first
        self.checkpoint_attention = checkpoint_attention

    def _attention(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None,
        return_attention: bool,
        state: CausalState | None,
        right_padded: bool,
    ) -> tuple[Tensor, Tensor | None]:
        # `state` only when given, `right_padded` only to ours: drop-in attention modules (the
        # bench's baselines) keep the (x, key_padding_mask, return_attention) signature.
        extra = {} if state is None else {"state": state}
        if right_padded and isinstance(self.attn, LinformerSelfAttention):
            extra["right_padded"] = True
        if self.checkpoint_attention and self.training and torch.is_grad_enabled():
            return checkpointed(self.attn, x, key_padding_mask, return_attention, **extra)
        return self.attn(x, key_padding_mask, return_attention, **extra)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        return_attention: bool = False,
        state: CausalState | None = None,
        right_padded: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """(B, N, dim) -> (B, N, dim), and the attention matrix when asked for; `state`
        continues causal generation (updated in place); `right_padded` as for
        `LinformerSelfAttention`."""
        if self.norm_first:
            attended, weights = self._attention(
                self.attn_norm(x), key_padding_mask, return_attention, state, right_padded
            )
            x = x + self.dropout(attended)
            return x + self.dropout(self.ffn(self.ffn_norm(x))), weights
        attended, weights = self._attention(
            x, key_padding_mask, return_attention, state, right_padded
        )
        x = self.attn_norm(x + self.dropout(attended))
        return self.ffn_norm(x + self.dropout(self.ffn(x))), weights


def layer_arguments(config: LinformerConfig) -> dict[str, Any]:
    """The constructor arguments every layer of a stack takes from its config (all but the
    projections, which the sharing plan hands out)."""
    return {
        "dim": config.dim,
        "num_heads": config.num_heads,
        "max_seq_len": config.max_seq_len,
        "ffn_dim": config.hidden_ffn_dim,
        "activation": config.activation,
        "norm_first": config.norm_first,
        "dropout": config.dropout,
        "attention_dropout": config.attention_dropout,
        "layer_norm_eps": config.layer_norm_eps,
        "block_size": config.block_size,
        "checkpoint_attention": config.checkpointing == "attention",
    }


class LinformerEncoder(nn.Module):
    """A stack of encoder layers whose projections follow the config's sharing plan.

    Pre-LN stacks end with a final LayerNorm; post-LN stacks (BERT) normalise inside layers.

    Args:
        config: the model config (depth, k per layer, sharing, checkpointing, ...).
    """

    def __init__(self, config: LinformerConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            LinformerEncoderLayer(
                **layer_arguments(config), proj_k=proj_k, proj_v=proj_v, causal=config.causal
            )
            for proj_k, proj_v in build_sharing_plan(config)
        )
        self.norm = (
            nn.LayerNorm(config.dim, eps=config.layer_norm_eps) if config.norm_first else None
        )

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        states: list[CausalState] | None = None,
        right_padded: bool = False,
    ) -> tuple[Tensor, tuple[Tensor, ...] | None, tuple[Tensor, ...] | None]:
        """Runs every layer.

        Args:
            x: (B, N, dim) embeddings.
            key_padding_mask: optional bool (B, N), True at real tokens.
            output_hidden_states: also return the input and every layer's output.
            output_attentions: also return every layer's attention matrix (B, H, N, M).
            states: causal generation: one state per layer to continue (updated in place).
            right_padded: every row's real tokens come first (as `LinformerModel` passes
                them); False: each layer gathers them first (`LinformerSelfAttention`).

        Returns:
            The last hidden state (B, N, dim) (after the final norm for pre-LN); the depth + 1
            hidden states and the depth attention matrices when asked for, else None.
        """
        hidden = [x] if output_hidden_states else None
        attentions = [] if output_attentions else None
        recompute = (
            self.config.checkpointing == "layer" and self.training and torch.is_grad_enabled()
        )
        for i, layer in enumerate(self.layers):
            state = states[i] if states is not None else None
            args = (x, key_padding_mask, output_attentions, state, right_padded)
            x, weights = checkpointed(layer, *args) if recompute else layer(*args)
            if hidden is not None:
                hidden.append(x)
            if attentions is not None:
                attentions.append(weights)
        if self.norm is not None:
            x = self.norm(x)
            if hidden is not None:
                hidden[-1] = x
        return (
            x,
            tuple(hidden) if hidden is not None else None,
            tuple(attentions) if attentions is not None else None,
        )
