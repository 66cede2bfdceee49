"""Text from a checkpoint: a causal LM's continuation of each prompt, or a seq2seq model's
target for each source, with the checkpoint's own tokenizer (`linformer generate`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .. import hub
from ..causal_lm import LinformerForCausalLM
from ..checks import check_seed
from ..data.tokenizer import TOKENIZER_NAME, load_tokenizer
from ..seq2seq import LinformerForSeq2SeqLM

DEFAULT_NEW_TOKENS = 64

logger = logging.getLogger(__name__)


def generate_texts(
    checkpoint: str | os.PathLike,
    prompts: list[str],
    *,
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
) -> list[str]:
    """Each prompt and its continuation (causal LM), or the target decoded for it (seq2seq),
    up to the end token. The prompts run as one left-padded batch, each generated as if
    alone: sampled with a generator of its own seeded with `seed`.

    Args:
        checkpoint: a causal-LM or seq2seq checkpoint directory with tokenizer.json.
        prompts: the texts to continue, or the seq2seq sources.
        max_new_tokens: tokens to add; None: DEFAULT_NEW_TOKENS, or as many as the model's
            max_seq_len leaves after the longest prompt.
        temperature: sampling temperature; 0 is greedy.
        top_k: sample among the k likeliest (None: all).
        seed: the seed of each prompt's generator.

    Raises:
        ValueError: for a checkpoint of another kind or without a tokenizer, no prompt, a
            prompt that encodes to no token, one that leaves no room for a new token, or a
            seed out of [-2**63, 2**64 - 1].
    """
    check_seed("seed", seed)  # before the model loads
    # a live run's `last` followed once: config, weights and tokenizer of one save
    checkpoint = hub.pinned(checkpoint)
    architecture = hub.read_config(checkpoint)["architecture"]
    seq2seq = architecture == LinformerForSeq2SeqLM.__name__
    if not seq2seq and architecture != LinformerForCausalLM.__name__:
        raise ValueError(
            f"{checkpoint} is a {architecture}: generate continues text with a causal LM "
            f"(`linformer pretrain --objective clm`) or decodes with a seq2seq model "
            f"(`linformer seq2seq train`)"
        )
    model = (LinformerForSeq2SeqLM if seq2seq else LinformerForCausalLM).from_pretrained(checkpoint)
    if seq2seq and not (Path(checkpoint) / TOKENIZER_NAME).is_file():
        raise ValueError(
            f"{checkpoint} has no {TOKENIZER_NAME}: a model of a synthetic task (copy, "
            f"reverse) reads symbol ids, not text; `linformer seq2seq evaluate` scores it"
        )
    vocab_size = model.config.encoder.vocab_size if seq2seq else model.config.vocab_size
    tokenizer = load_tokenizer(checkpoint, model_vocab_size=vocab_size)
    encoded = tokenizer.encode_batch(prompts)
    if not encoded:
        raise ValueError("no prompt given")
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {prompts[i]!r} encodes to no tokens; give some text")
    generation = dict(
        temperature=temperature,
        top_k=top_k,
        # one per prompt, each seeded alike: a prompt's sample is that of it alone
        generator=[torch.Generator().manual_seed(seed) for _ in encoded],
    )
    if not seq2seq:  # a text ends where pretraining put the separator after each document
        generation["eos_token_id"] = tokenizer.sep_id
    # prompts of different lengths in one batch, left-padded (each continuation follows its
    # prompt in the rows the model returns); the model generates each as if alone
    width = max(map(len, encoded))
    if max_new_tokens is None and not seq2seq:  # up to DEFAULT_NEW_TOKENS, as many as fit
        room = model.config.max_seq_len - width
        if room < 1:
            raise ValueError(
                f"the longest prompt has {width} tokens, which leaves no room for a new one: "
                f"the model's max_seq_len is {model.config.max_seq_len}"
            )
        max_new_tokens = min(DEFAULT_NEW_TOKENS, room)
    elif max_new_tokens is None:  # the target's length, start token included
        max_new_tokens = min(DEFAULT_NEW_TOKENS, model.config.decoder.max_seq_len - 1)
    mask = torch.tensor([[False] * (width - len(ids)) + [True] * len(ids) for ids in encoded])
    input_ids = torch.tensor([[tokenizer.pad_id] * (width - len(ids)) + ids for ids in encoded])
    rows = model.generate(input_ids, max_new_tokens, key_padding_mask=mask, **generation).tolist()
    # seq2seq gives the target alone (after the start token), a causal LM the prompt and its
    # continuation; either up to the end token, which decoding would drop without a trace.
    eos = model.config.eos_token_id if seq2seq else tokenizer.sep_id
    texts = []
    for i, (ids, tokens) in enumerate(zip(encoded, rows, strict=True)):
        new = tokens[1:] if seq2seq else tokens[width:]
        new = new[: new.index(eos)] if eos in new else new
        if unknown := sum(token >= tokenizer.vocab_size for token in new):  # decode drops them
            logger.warning(
                "prompt %d: %d generated token(s) have ids the tokenizer does not know (>= %d; "
                "the model's vocabulary is %d): left out of the text",
                i + 1,
                unknown,
                tokenizer.vocab_size,
                vocab_size,
            )
        texts.append(tokenizer.tokenizer.decode(new if seq2seq else ids + new))
    return texts
