"""LinformerForCausalLM: a causal backbone with a tied LM head, its loss and `generate`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import CausalState
from .checks import check_finite_non_negative, check_non_negative, check_positive
from .config import LinformerConfig
from .input_checks import check_key_padding_mask, check_rows_hold_a_token, check_tensor
from .losses import check_labels, lm_head_loss
from .models import LinformerModel, LinformerPreTrainedModel

# One generator for the batch (its rows share the stream: a row's samples depend on the
# others), or one per row (each row's samples are those of its prompt alone with that
# generator).
Generators = torch.Generator | Sequence[torch.Generator] | None


@dataclass
class CausalLMOutput:
    """Causal-LM output: `loss` (when labels were given), `logits` (B, N, vocab_size), None
    with `return_logits=False`; the logits at position i predict the token at i + 1."""

    loss: Tensor | None
    logits: Tensor | None
    last_hidden_state: Tensor
    hidden_states: tuple[Tensor, ...] | None = None


torch.export.register_dataclass(CausalLMOutput)


def next_token_targets(labels: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """(B, N): the label at i + 1 for position i, -100 where nothing is scored (the last
    position, label -100, and pairs where either position is padding)."""
    # Labels shifted left instead of logits shifted right: slicing the (B, N, V) logits
    # would copy them (and zero-fill a gradient as large) every step.
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    if key_padding_mask is not None:
        real = F.pad(key_padding_mask[:, 1:] & key_padding_mask[:, :-1], (0, 1))
        targets = targets.masked_fill(~real, -100)
    return targets


class LinformerForCausalLM(LinformerPreTrainedModel):
    """Causal backbone + LM head tied to the token embeddings (logits = h E_tok^T).

    Args:
        config: the architecture; must have `causal=True` (`proj_dim=None` gives the exact
            causal Transformer).

    Raises:
        ValueError: if the config is not causal.
    """

    def __init__(self, config: LinformerConfig) -> None:
        if not config.causal:
            raise ValueError("LinformerForCausalLM needs a config with causal=True")
        super().__init__(config)
        self.linformer = LinformerModel(config, pooled=False)

    def forward(
        self,
        input_ids: Tensor,
        key_padding_mask: Tensor | None = None,
        labels: Tensor | None = None,
        output_hidden_states: bool = False,
        states: list[CausalState] | None = None,
        return_logits: bool = True,
    ) -> CausalLMOutput:
        """Next-token logits and, given labels, the shifted loss.

        Args:
            input_ids: (B, N) int64.
            key_padding_mask: optional bool (B, N), True at real tokens; padding may be on
                either side.
            labels: optional (B, N), usually `input_ids`: position i is scored on labels
                at i + 1, skipping label -100 and pairs where either position is padding.
            output_hidden_states: also return the embeddings and every layer's output.
            states: generation states to continue (see `init_states`), updated in place.
            return_logits: False (the trainers' choice; needs labels): the loss from the
                head in chunks of rows (`losses.linear_cross_entropy`), without the
                (B, N, vocab_size) logits, which come back as None. The same loss and
                gradients in less memory and time (`benchmarks/lm_loss.py`, CPU, fp32, 2
                threads, the demo's size: a training step 1.26x faster for the Linformer,
                1.15x for the exact Transformer).

        Returns:
            A `CausalLMOutput`.

        Raises:
            ValueError: for labels not shaped as input_ids, or `return_logits=False`
                without labels.
        """
        check_labels(labels, input_ids, return_logits=return_logits)
        out = self.linformer(
            input_ids, key_padding_mask, output_hidden_states=output_hidden_states, states=states
        )
        hidden, weight = out.last_hidden_state, self.linformer.embeddings.tokens.weight
        targets = None if labels is None else next_token_targets(labels, key_padding_mask)
        loss, logits = lm_head_loss(hidden, weight, targets, return_logits=return_logits)
        return CausalLMOutput(loss, logits, hidden, out.hidden_states)

    def init_states(self) -> list[CausalState]:
        """Empty generation states, one per layer, for `forward(..., states=...)`."""
        return [CausalState() for _ in range(self.config.depth)]

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: Generators = None,
        eos_token_id: int | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """Continues each prompt token by token, carrying the layers' states.

        The prompt is encoded in one pass; each new token then costs O((k + block_size) D)
        attention per head and layer, whatever the length generated. Call `eval()` first
        to turn dropout off. Prompts of different lengths come padded, with
        `key_padding_mask`: the rows of each real length are generated together (a state
        holds one length), each as if alone: greedily, or sampling with one generator per
        row. It runs the backbone and the tied head itself (the head on each pass's last
        position only), not `forward`: an override of `forward` or a hook on the model is
        not called.

        Args:
            input_ids: (B, N) prompts, N >= 1.
            max_new_tokens: tokens to add; a prompt's real length + max_new_tokens must not
                exceed max_seq_len.
            temperature: softmax temperature; 0 picks the most likely token (greedy).
            top_k: sample from the k most likely tokens only (None: all).
            generator: random generator for reproducible sampling, or one per row (B of
                them: a row's samples then do not depend on the other rows).
            eos_token_id: the token that ends a text (pretraining puts the tokenizer's
                `sep_id` after every document): a row that has produced it is filled with
                `pad_token_id` after it, and generation stops once every row has. None:
                always max_new_tokens tokens.
            key_padding_mask: optional bool (B, N), True at the prompts' real tokens (padding
                anywhere; left padding keeps each returned text contiguous).

        Returns:
            (B, N + T), T <= max_new_tokens: the prompts as given (padding included)
            followed by the new tokens; a row that ended before the others is filled with
            `pad_token_id`.

        Raises:
            ValueError: for prompts not shaped (B, N >= 1), a malformed mask or a prompt
                without a real token, a count that is not an integer >= 0, a temperature
                that is not finite and >= 0, top_k < 1, a list of generators not one per
                row, an eos_token_id out of the vocabulary, or a total length over
                max_seq_len.
        """
        check_tensor("input_ids", input_ids, "of token ids")
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(
                f"input_ids must be (batch >= 1, N >= 1) token ids, got shape "
                f"{tuple(input_ids.shape)}"
            )
        check_key_padding_mask(key_padding_mask, *input_ids.shape)
        check_non_negative("max_new_tokens", max_new_tokens)
        check_finite_non_negative("temperature", temperature)
        check_top_k(top_k)
        check_generators(generator, input_ids.shape[0])
        vocab = self.config.vocab_size
        if eos_token_id is not None and not 0 <= eos_token_id < vocab:  # it never ended one
            raise ValueError(f"eos_token_id must be in [0, {vocab - 1}], got {eos_token_id}")
        lengths = input_ids.new_full((input_ids.shape[0],), input_ids.shape[1])
        if key_padding_mask is not None:
            check_rows_hold_a_token(key_padding_mask, "prompt")
            lengths = key_padding_mask.sum(1)
        longest = int(lengths.max())  # real tokens: padding takes no place in a state
        if longest + max_new_tokens > self.config.max_seq_len:
            raise ValueError(
                f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) = "
                f"{longest + max_new_tokens} exceeds max_seq_len {self.config.max_seq_len}"
            )
        sampling = (max_new_tokens, temperature, top_k)
        if key_padding_mask is None or key_padding_mask.all():
            return self._generate(input_ids, *sampling, generator, eos_token_id)
        new_tokens = []
        for length in lengths.unique().tolist():  # ascending: the order of the draws is fixed
            rows = (lengths == length).nonzero()[:, 0]
            prompts = input_ids[rows][key_padding_mask[rows]].view(len(rows), length)
            mine = generator
            if generator is not None and not isinstance(generator, torch.Generator):
                mine = [generator[row] for row in rows.tolist()]
            out = self._generate(prompts, *sampling, mine, eos_token_id)
            new_tokens.append((rows, out[:, length:]))
        width = max(new.shape[1] for _, new in new_tokens)
        tokens = F.pad(input_ids, (0, width), value=self.config.pad_token_id)
        for rows, new in new_tokens:
            tokens[rows, input_ids.shape[1] : input_ids.shape[1] + new.shape[1]] = new
        return tokens

    def _generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        generator: Generators,
        eos_token_id: int | None,
    ) -> Tensor:
        """`generate` for checked prompts of one length without padding."""
        total = input_ids.shape[1] + max_new_tokens
        states = self.init_states()
        tokens = input_ids.new_empty(input_ids.shape[0], total)  # filled in place: no regrowth
        tokens[:, : input_ids.shape[1]] = input_ids
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        new, end = input_ids, total
        for position in range(input_ids.shape[1], total):
            # the head on the last position alone: the prompt's (B, N, vocab_size) logits
            # were 0.5 GB a row for 4096 tokens of a 30k vocabulary
            last = self.linformer(new, states=states).last_hidden_state[:, -1]
            _, logits = lm_head_loss(last, self.linformer.embeddings.tokens.weight, None)
            new = self.sample(logits.float(), temperature, top_k, generator)  # (B,)
            new = new.masked_fill(done, self.config.pad_token_id)[:, None]  # (B, 1)
            tokens[:, position : position + 1] = new
            if eos_token_id is not None:
                done |= new[:, 0] == eos_token_id
                if done.all():
                    end = position + 1
                    break
        return tokens[:, :end]

    @staticmethod
    def sample(
        logits: Tensor,
        temperature: float,
        top_k: int | None,
        generator: Generators = None,
    ) -> Tensor:
        """Picks one token per row from (B, vocab_size) logits: argmax at temperature 0;
        otherwise drawn with `generator`, or row i with `generator[i]`.

        Raises:
            ValueError: for top_k < 1, or a list of generators not one per row.
        """
        check_top_k(top_k)
        if temperature == 0:
            return logits.argmax(-1)
        if top_k is not None:
            kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        # The row's maximum first: a tiny temperature then sends the others to -inf and the
        # maximum to 0 (greedy), where dividing first overflows to inf and the softmax to nan;
        # in float64, where a temperature > 0 is never 0 (below 7e-46 it is in float32: 0 / 0)
        top = logits.amax(-1, keepdim=True)  # (B, 1)
        probs = ((logits - top).double() / temperature).softmax(-1)
        if generator is None or isinstance(generator, torch.Generator):
            return torch.multinomial(probs, 1, generator=generator)[:, 0]
        check_generators(generator, len(probs))
        return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generator)])


def check_generators(generator: Generators, batch: int) -> None:
    """Raises ValueError for a sequence of generators that is not one per row."""
    if generator is None or isinstance(generator, torch.Generator):
        return
    if not isinstance(generator, Sequence) or isinstance(generator, str):
        raise ValueError(
            f"generator must be a torch.Generator or one per row ({batch}); got a "
            f"{type(generator).__name__}"
        )
    if len(generator) != batch or not all(isinstance(g, torch.Generator) for g in generator):
        raise ValueError(
            f"generator must be a torch.Generator or one per row ({batch}); got "
            f"{len(generator)} items of types {sorted({type(g).__name__ for g in generator})}"
        )


def check_top_k(top_k: int | None) -> None:
    """Raises ValueError unless `top_k` is None (every token) or an integer >= 1."""
    if top_k is not None:
        check_positive("top_k", top_k)
