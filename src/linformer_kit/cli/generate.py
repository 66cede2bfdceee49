"""`linformer generate CKPT --prompt TEXT [--prompt TEXT ...]`: continue texts with a
causal-LM checkpoint, or decode a target for each (the source) with a seq2seq checkpoint."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from .. import hub
from ..causal_lm import LinformerForCausalLM
from ..data.tokenizer import TOKENIZER_NAME, load_tokenizer
from ..seq2seq import LinformerForSeq2SeqLM
from .overrides import exit_on_user_error

DEFAULT_NEW_TOKENS = 64

logger = logging.getLogger(__name__)


@exit_on_user_error
def run(args: argparse.Namespace) -> None:
    architecture = hub.read_config(args.checkpoint)["architecture"]
    seq2seq = architecture == LinformerForSeq2SeqLM.__name__
    if not seq2seq and architecture != LinformerForCausalLM.__name__:
        raise ValueError(
            f"{args.checkpoint} is a {architecture}: generate continues text with a causal LM "
            f"(`linformer pretrain --objective clm`) or decodes with a seq2seq model "
            f"(`linformer seq2seq train`)"
        )
    model = (LinformerForSeq2SeqLM if seq2seq else LinformerForCausalLM).from_pretrained(
        args.checkpoint
    )
    if seq2seq and not (Path(args.checkpoint) / TOKENIZER_NAME).is_file():
        raise ValueError(
            f"{args.checkpoint} has no {TOKENIZER_NAME}: a model of a synthetic task (copy, "
            f"reverse) reads symbol ids, not text; `linformer seq2seq evaluate` scores it"
        )
    vocab_size = model.config.encoder.vocab_size if seq2seq else model.config.vocab_size
    tokenizer = load_tokenizer(args.checkpoint, model_vocab_size=vocab_size)
    prompts = tokenizer.encode_batch(args.prompt)
    for i, ids in enumerate(prompts):
        if not ids:
            raise ValueError(f"--prompt {args.prompt[i]!r} encodes to no tokens; give some text")
    generation = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        # one per prompt, each seeded alike: a prompt's sample is that of it alone
        generator=[torch.Generator().manual_seed(args.seed) for _ in prompts],
    )
    if not seq2seq:  # a text ends where pretraining put the separator after each document
        generation["eos_token_id"] = tokenizer.sep_id
    # prompts of different lengths in one batch, left-padded (each continuation follows its
    # prompt in the rows the model returns); the model generates each as if alone
    width = max(map(len, prompts))
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None and not seq2seq:  # up to DEFAULT_NEW_TOKENS, as many as fit
        room = model.config.max_seq_len - width
        if room < 1:
            raise ValueError(
                f"the longest --prompt has {width} tokens, which leaves no room for a new one: "
                f"the model's max_seq_len is {model.config.max_seq_len}"
            )
        max_new_tokens = min(DEFAULT_NEW_TOKENS, room)
    elif max_new_tokens is None:  # the target's length, start token included
        max_new_tokens = min(DEFAULT_NEW_TOKENS, model.config.decoder.max_seq_len - 1)
    mask = torch.tensor([[False] * (width - len(ids)) + [True] * len(ids) for ids in prompts])
    input_ids = torch.tensor([[tokenizer.pad_id] * (width - len(ids)) + ids for ids in prompts])
    rows = model.generate(input_ids, max_new_tokens, key_padding_mask=mask, **generation).tolist()
    # seq2seq prints the target alone (after the start token), a causal LM the prompt and its
    # continuation; either up to the end token, which decoding would drop without a trace.
    eos = model.config.eos_token_id if seq2seq else tokenizer.sep_id
    for i, (ids, tokens) in enumerate(zip(prompts, rows, strict=True)):
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
        if len(prompts) > 1:  # named as `head` names each of several files
            print(("\n" if i else "") + f"==> prompt {i + 1} <==")
        print(tokenizer.tokenizer.decode(new if seq2seq else ids + new))


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `generate` subcommand."""
    parser = commands.add_parser(
        "generate", help="continue a prompt (causal LM) or decode a target for it (seq2seq)"
    )
    parser.add_argument(
        "checkpoint", help="a causal-LM or seq2seq checkpoint directory with tokenizer.json"
    )
    parser.add_argument(
        "--prompt",
        required=True,
        action="append",
        help="the text to continue, or the seq2seq source; repeat for several (one batch, "
        "each printed after a '==> prompt N <==' line, as if alone: sampled with its own "
        "generator seeded with --seed)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"tokens to add (default: {DEFAULT_NEW_TOKENS}, or as many as the model's "
        "max_seq_len leaves after the longest prompt)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature; 0 is greedy (default: 1.0)",
    )
    parser.add_argument(
        "--top-k", type=int, default=None, help="sample among the k likeliest (default: all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: 0)")
    parser.set_defaults(func=run)
