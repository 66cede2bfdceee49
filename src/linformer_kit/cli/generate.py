"""`linformer generate CKPT --prompt TEXT [--prompt TEXT ...]`: continue texts with a
causal-LM checkpoint, or decode a target for each (the source) with a seq2seq checkpoint."""

from __future__ import annotations

import argparse

from ..training.generate import DEFAULT_NEW_TOKENS, generate_texts
from .overrides import exit_on_user_error


@exit_on_user_error
def run(args: argparse.Namespace) -> None:
    """Prints each prompt's text, after a '==> prompt N <==' line when there are several."""
    texts = generate_texts(
        args.checkpoint,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    for i, text in enumerate(texts):
        if len(texts) > 1:  # named as `head` names each of several files
            print(("\n" if i else "") + f"==> prompt {i + 1} <==")
        print(text)


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
