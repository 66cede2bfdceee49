"""LinformerForMaskedLM: the backbone with a RoBERTa-style LM head, for masked-LM
pretraining; its head can run at the scored positions alone (`scored_only`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .config import LinformerConfig
from .embeddings import init_weights
from .losses import check_labels, lm_head_loss
from .models import LinformerModel, LinformerPreTrainedModel


@dataclass
class MaskedLMOutput:
    """Masked-LM output: `loss` (when labels were given), `logits` (B, N, vocab_size), or
    (S, vocab_size) for the S scored positions with `scored_only`, or None with
    `return_logits=False`."""

    loss: Tensor | None
    logits: Tensor | None
    last_hidden_state: Tensor
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


torch.export.register_dataclass(MaskedLMOutput)  # a pytree node, as the other outputs


# With `scored_only` the masked LM's head runs on the scored positions and, after them, on
# unscored ones (label -100: no loss) up to a multiple of this many rows: a few recurring
# shapes, which the CPU allocator reuses. A new row count every step fragmented glibc's heap
# (`benchmarks/mlm_head.py`: the demo's exact Transformer went from 546 MiB resident after 5
# steps to 676 after 30, against 537 and 549 so; the head at every position: 693, 697).
SCORED_ROWS_MULTIPLE = 64


# The rows' count depends on the labels, so a compiled model's graph breaks here anyway:
# disabled, it breaks without dynamo's warning. torch's lazy form of
# `torch.compiler.disable`: that one imports Dynamo with the package, 1.4 s of every
# process's start (AMD EPYC Zen 3), a CLI command's or a spawned worker's.
@torch._disable_dynamo
def scored_rows(labels: Tensor) -> tuple[Tensor, int]:
    """Flat (B x N) indices of the labelled positions in order, then of unlabelled ones up to
    a multiple of `SCORED_ROWS_MULTIPLE` rows (or all), and how many are labelled."""
    labelled = labels.flatten() != -100
    count = int(labelled.sum())
    total = min(labelled.numel(), -(-count // SCORED_ROWS_MULTIPLE) * SCORED_ROWS_MULTIPLE)
    return torch.argsort(~labelled, stable=True)[:total], count  # labelled first, in order


class LinformerForMaskedLM(LinformerPreTrainedModel):
    """Backbone + RoBERTa-style LM head (dense, GELU, LayerNorm, decoder tied to the
    token embeddings). The loss ignores label -100."""

    def __init__(self, config: LinformerConfig) -> None:
        super().__init__(config)
        self.linformer = LinformerModel(config, pooled=False)
        self.head = nn.Sequential(
            nn.Linear(config.dim, config.dim),
            nn.GELU(),
            nn.LayerNorm(config.dim, eps=config.layer_norm_eps),
        )
        self.decoder_bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.head.apply(lambda m: init_weights(m, config.init_std))

    def forward(
        self,
        input_ids: Tensor,
        key_padding_mask: Tensor | None = None,
        labels: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        scored_only: bool = False,
        return_logits: bool = True,
    ) -> MaskedLMOutput:
        """Token logits and, given labels (B, N) with -100 at unscored positions, the loss.

        With `scored_only` (the trainers' choice) the LM head runs at the scored positions
        alone (and at as few others as round their count up to `SCORED_ROWS_MULTIPLE`), as
        fairseq's masked LM does: the same loss, `logits` (S, vocab_size) for the S scored
        positions in (batch, position) order, and at 15 % masking most of the head's work
        and logits skipped (`benchmarks/mlm_head.py`). With `return_logits=False` (also the
        trainers'; needs labels) the decoder and the loss run in chunks of rows
        (`losses.linear_cross_entropy`) and `logits` is None.

        Raises:
            ValueError: for `scored_only` or `return_logits=False` without labels, or labels
                not shaped as input_ids.
        """
        if labels is None and scored_only:
            raise ValueError("scored_only=True needs labels: the head runs where label != -100")
        check_labels(labels, input_ids, return_logits=return_logits)
        out = self.linformer(
            input_ids, key_padding_mask, token_type_ids, output_hidden_states, output_attentions
        )
        hidden = out.last_hidden_state  # (B, N, dim)
        if scored_only:  # S scored rows, then unscored ones up to a multiple of 64
            rows, scored = scored_rows(labels)
            hidden, labels = hidden.flatten(0, 1)[rows], labels.flatten()[rows]
        weight = self.linformer.embeddings.tokens.weight
        loss, logits = lm_head_loss(
            self.head(hidden), weight, labels, self.decoder_bias, return_logits=return_logits
        )  # logits (B, N, V), (rows, V) or None
        if scored_only and logits is not None:
            logits = logits[:scored]  # (S, vocab_size)
        return MaskedLMOutput(
            loss, logits, out.last_hidden_state, out.hidden_states, out.attentions
        )
