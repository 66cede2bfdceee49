"""Encoder-decoder Linformer: decoder layers (causal self-attention, cross-attention over the
projected encoder memory, feed-forward), the decoder stack and LinformerForSeq2SeqLM.

The source (length n) and the target (length m) are independent: each side accepts any
length up to its own max_seq_len, with its own padding and, optionally, its own vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .attention import CausalState
from .causal_lm import (
    Generators,
    LinformerForCausalLM,
    check_generators,
    check_top_k,
    next_token_targets,
)
from .checks import check_finite_non_negative, check_non_negative
from .cross_attention import LinformerCrossAttention, MemoryCache
from .embeddings import LinformerEmbeddings, causal_position_ids, init_weights
from .encoder import LinformerEncoderLayer, layer_arguments
from .input_checks import (
    check_key_padding_mask,
    check_rows_hold_a_token,
    check_seq_len,
    check_states,
    check_token_ids,
)
from .kernel_rule import checkpointed
from .losses import check_labels, lm_head_loss
from .memory import check_weights_fit
from .models import LinformerModel, LinformerPreTrainedModel
from .projection import SequenceProjection, build_sharing_plan
from .seq2seq_config import Seq2SeqConfig


@dataclass
class DecoderLayerState:
    """What one decoder layer keeps between generation steps: its causal self-attention
    state and the projected memory (filled by the first step, then reused)."""

    self_attention: CausalState = field(default_factory=CausalState)
    memory: MemoryCache = field(default_factory=MemoryCache)


@dataclass
class Seq2SeqLMOutput:
    """Seq2seq output: `loss` (when labels were given), `logits` (B, M, vocab_size) where
    position i predicts target token i + 1 (None with `return_logits=False`), the decoder's
    and the encoder's last states."""

    loss: Tensor | None
    logits: Tensor | None
    last_hidden_state: Tensor
    encoder_last_hidden_state: Tensor | None


torch.export.register_dataclass(Seq2SeqLMOutput)


class LinformerDecoderLayer(LinformerEncoderLayer):
    """Causal self-attention, cross-attention and feed-forward sub-layers with residuals,
    pre-LN or post-LN; dropout once per sub-layer output.

    Args:
        dim, num_heads: as in `LinformerSelfAttention`.
        max_seq_len: longest target m.
        memory_len: longest memory n (the encoder's max_seq_len).
        proj_k, proj_v: the causal self-attention's projections (None: exact).
        cross_proj_k, cross_proj_v: the memory's projections (None: exact).
        ffn_dim: feed-forward inner width.
        activation: gelu or relu.
        norm_first: pre-LN (True) or post-LN (False).
        dropout: dropout on each sub-layer's output.
        attention_dropout: dropout on the attention weights.
        layer_norm_eps: LayerNorm epsilon.
        block_size: causal Linformer's block of exactly attended positions.
        checkpoint_attention: recompute both attention sub-layers in backward.
    """

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        max_seq_len: int,
        memory_len: int,
        proj_k: SequenceProjection | None,
        proj_v: SequenceProjection | None,
        cross_proj_k: SequenceProjection | None,
        cross_proj_v: SequenceProjection | None,
        ffn_dim: int,
        activation: str = "gelu",
        norm_first: bool = True,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        layer_norm_eps: float = 1e-5,
        block_size: int = 64,
        checkpoint_attention: bool = False,
    ) -> None:
        super().__init__(
            dim=dim,
            num_heads=num_heads,
            max_seq_len=max_seq_len,
            proj_k=proj_k,
            proj_v=proj_v,
            ffn_dim=ffn_dim,
            activation=activation,
            norm_first=norm_first,
            dropout=dropout,
            attention_dropout=attention_dropout,
            layer_norm_eps=layer_norm_eps,
            checkpoint_attention=checkpoint_attention,
            causal=True,
            block_size=block_size,
        )  # the causal self-attention and feed-forward sub-layers, their norms and dropout
        self.cross_attn = LinformerCrossAttention(
            dim=dim,
            num_heads=num_heads,
            max_seq_len=memory_len,
            proj_k=cross_proj_k,
            proj_v=cross_proj_v,
            dropout=attention_dropout,
        )
        self.cross_norm = nn.LayerNorm(dim, eps=layer_norm_eps)

    def _run(self, module: nn.Module, *args: object) -> Tensor:
        if self.checkpoint_attention and self.training and torch.is_grad_enabled():
            return checkpointed(module, *args)
        return module(*args)

    def _residual(self, x: Tensor, norm: nn.LayerNorm, sublayer: Callable) -> Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(norm(x)))
        return norm(x + self.dropout(sublayer(x)))

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        key_padding_mask: Tensor | None = None,
        memory_padding_mask: Tensor | None = None,
        state: DecoderLayerState | None = None,
    ) -> Tensor:
        """(B, M, dim) -> (B, M, dim).

        Args:
            x: decoder states (B, M, dim).
            memory: encoder output (B, N, dim); None when `state` holds its projection.
            key_padding_mask: optional bool (B, M), True at real target tokens.
            memory_padding_mask: optional bool (B, N), True at real source tokens.
            state: generation state to continue (updated in place).
        """
        own, cache = (state.self_attention, state.memory) if state is not None else (None, None)
        x = self._residual(
            x, self.attn_norm, lambda h: self._run(self.attn, h, key_padding_mask, False, own)[0]
        )
        x = self._residual(
            x,
            self.cross_norm,
            lambda h: self._run(self.cross_attn, h, memory, memory_padding_mask, cache),
        )
        return self._residual(x, self.ffn_norm, self.ffn)


class LinformerDecoder(nn.Module):
    """Decoder embeddings and layers: self-attention projections from the decoder config's
    sharing plan, memory projections from the encoder's (`Seq2SeqConfig.cross_attention`).

    Args:
        config: the seq2seq architecture.
    """

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        decoder = config.decoder
        check_weights_fit(decoder)
        self.config = decoder
        self.embeddings = LinformerEmbeddings(decoder)
        plans = zip(build_sharing_plan(decoder), build_sharing_plan(config.cross_attention))
        self.layers = nn.ModuleList(
            LinformerDecoderLayer(
                **layer_arguments(decoder),
                memory_len=config.encoder.max_seq_len,
                proj_k=proj_k,
                proj_v=proj_v,
                cross_proj_k=cross_k,
                cross_proj_v=cross_v,
            )
            for (proj_k, proj_v), (cross_k, cross_v) in plans
        )
        self.norm = (
            nn.LayerNorm(decoder.dim, eps=decoder.layer_norm_eps) if decoder.norm_first else None
        )
        self.apply(lambda m: init_weights(m, decoder.init_std))

    def forward(
        self,
        input_ids: Tensor,
        memory: Tensor | None,
        key_padding_mask: Tensor | None = None,
        memory_padding_mask: Tensor | None = None,
        states: list[DecoderLayerState] | None = None,
    ) -> Tensor:
        """Decodes target ids (B, M) against the memory; returns (B, M, dim) (after the final
        norm for pre-LN). With `states`, `input_ids` continue them (updated in place).

        Raises:
            ValueError: if the target is longer than max_seq_len, or the target, memory and
                masks disagree in shape.
        """
        check_token_ids(input_ids, "decoder_input_ids")
        check_states(states, len(self.layers), DecoderLayerState)
        start = states[0].self_attention.length if states else 0
        check_seq_len(start + input_ids.shape[1], self.config.max_seq_len)
        check_key_padding_mask(key_padding_mask, *input_ids.shape)
        if memory is not None:
            if memory.shape[0] != input_ids.shape[0]:  # SDPA broadcast a memory of batch 1
                raise ValueError(
                    f"the source batch ({memory.shape[0]}) and the target batch "
                    f"({input_ids.shape[0]}) differ: give one source per target"
                )
            check_key_padding_mask(memory_padding_mask, *memory.shape[:2])
        x = self.embeddings(
            input_ids, position_ids=causal_position_ids(input_ids, key_padding_mask, start)
        )
        recompute = (
            self.config.checkpointing == "layer" and self.training and torch.is_grad_enabled()
        )
        for i, layer in enumerate(self.layers):
            args = (x, memory, key_padding_mask, memory_padding_mask, states and states[i])
            x = checkpointed(layer, *args) if recompute else layer(*args)
        return self.norm(x) if self.norm is not None else x


class LinformerForSeq2SeqLM(LinformerPreTrainedModel):
    """Encoder (`LinformerModel`) + causal decoder with cross-attention in every layer + LM
    head tied to the decoder's token embeddings.

    Args:
        config: a Seq2SeqConfig; `proj_dim=None` on a side makes that side exact.

    Raises:
        ValueError: if the config is not a Seq2SeqConfig.
    """

    base_model_prefix = "encoder"

    def __init__(self, config: Seq2SeqConfig) -> None:
        if not isinstance(config, Seq2SeqConfig):
            raise ValueError(
                f"LinformerForSeq2SeqLM needs a Seq2SeqConfig, got {type(config).__name__}"
            )
        super().__init__(config)
        self.encoder = LinformerModel(config.encoder)
        self.decoder = LinformerDecoder(config)
        if config.share_embeddings:
            self.decoder.embeddings.tokens = self.encoder.embeddings.tokens

    def encode(self, input_ids: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """The encoder memory (B, N, dim) of source ids (B, N)."""
        return self.encoder(input_ids, key_padding_mask).last_hidden_state

    def forward(
        self,
        input_ids: Tensor | None,
        decoder_input_ids: Tensor,
        key_padding_mask: Tensor | None = None,
        decoder_padding_mask: Tensor | None = None,
        labels: Tensor | None = None,
        memory: Tensor | None = None,
        states: list[DecoderLayerState] | None = None,
        return_logits: bool = True,
    ) -> Seq2SeqLMOutput:
        """Next-token logits of the target given the source and, given labels, the loss.

        Args:
            input_ids: (B, N) source ids; None when `memory` (or filled `states`) is given.
            decoder_input_ids: (B, M) target ids, starting with the decoder start token.
            key_padding_mask: optional bool (B, N), True at real source tokens.
            decoder_padding_mask: optional bool (B, M), True at real target tokens.
            labels: optional (B, M), usually `decoder_input_ids`: position i is scored on
                the label at i + 1, skipping -100 and pairs touching padding.
            memory: the encoder output (B, N, dim), to skip the encoder.
            states: generation states (see `init_states`), updated in place.
            return_logits: False (the trainer's choice; needs labels): the loss in chunks of
                rows without the logits (`losses.linear_cross_entropy`, as
                `LinformerForCausalLM`'s), which come back as None.

        Returns:
            A `Seq2SeqLMOutput`.

        Raises:
            ValueError: if neither a source, a memory nor filled states are given, for
                labels not shaped as decoder_input_ids, or `return_logits=False` without
                labels.
        """
        check_labels(labels, decoder_input_ids, return_logits=return_logits)
        if memory is None and input_ids is not None:
            memory = self.encode(input_ids, key_padding_mask)
        if memory is None and not (states and states[0].memory.keys is not None):
            raise ValueError("give the source input_ids, its memory, or states that hold it")
        hidden = self.decoder(
            decoder_input_ids, memory, decoder_padding_mask, key_padding_mask, states
        )
        weight = self.decoder.embeddings.tokens.weight
        targets = None if labels is None else next_token_targets(labels, decoder_padding_mask)
        loss, logits = lm_head_loss(hidden, weight, targets, return_logits=return_logits)
        return Seq2SeqLMOutput(loss, logits, hidden, memory)  # logits (B, M, vocab) or None

    def init_states(self) -> list[DecoderLayerState]:
        """Empty generation states, one per decoder layer."""
        return [DecoderLayerState() for _ in self.decoder.layers]

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        key_padding_mask: Tensor | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: Generators = None,
        stop_at_eos: bool = True,
    ) -> Tensor:
        """Decodes a target for each source token by token: the encoder runs once, every
        layer projects the memory once, and each new token continues the decoder's states.

        With `stop_at_eos`, a row that has produced `eos_token_id` is filled with the
        decoder's pad token after it, and generation stops once every row has. Call `eval()`
        first.

        Args:
            input_ids: (B, N) source ids (padded where `key_padding_mask` is False).
            max_new_tokens: tokens to generate after the start token; at most the decoder's
                max_seq_len - 1.
            key_padding_mask: optional bool (B, N), True at real source tokens.
            temperature: softmax temperature; 0 picks the most likely token (greedy).
            top_k: sample from the k most likely tokens only (None: all).
            generator: random generator for reproducible sampling, or one per row (B of
                them: a row's samples then do not depend on the other rows; with one, they
                share its stream).
            stop_at_eos: end rows at the end token (False: always max_new_tokens tokens).

        Returns:
            (B, 1 + T), T <= max_new_tokens: the start token, then the generated tokens.

        Raises:
            ValueError: for a count that is not an integer in [0, the decoder's max_seq_len
                - 1], a temperature that is not finite and >= 0, top_k < 1, a list of
                generators not one per row, or a source without a real token.
        """
        check_non_negative("max_new_tokens", max_new_tokens)
        limit = self.config.decoder.max_seq_len - 1
        if max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens must be at most {limit} (the decoder's max_seq_len - 1, the "
                f"start token taking one place); got {max_new_tokens}"
            )
        check_finite_non_negative("temperature", temperature)
        check_top_k(top_k)
        check_token_ids(input_ids)  # before its rows are counted
        check_generators(generator, input_ids.shape[0])
        if key_padding_mask is not None:
            check_key_padding_mask(key_padding_mask, *input_ids.shape)
            check_rows_hold_a_token(key_padding_mask, "source")
        memory = self.encode(input_ids, key_padding_mask)
        states = self.init_states()
        batch = input_ids.shape[0]
        tokens = input_ids.new_full((batch, 1), self.config.decoder_start_token_id)
        done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        new = tokens
        for _ in range(max_new_tokens):
            logits = self(None, new, key_padding_mask, memory=memory, states=states).logits
            new = LinformerForCausalLM.sample(logits[:, -1].float(), temperature, top_k, generator)
            new = new.masked_fill(done, self.config.decoder.pad_token_id)[:, None]  # (B, 1)
            tokens = torch.cat([tokens, new], 1)
            done |= stop_at_eos & (new[:, 0] == self.config.eos_token_id)
            if done.all():
                break
        return tokens
