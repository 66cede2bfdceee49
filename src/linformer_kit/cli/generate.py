"""`linformer generate CKPT --prompt TEXT`: continue a text with a causal-LM checkpoint."""

from __future__ import annotations

import argparse

import torch

from ..causal_lm import LinformerForCausalLM
from ..data.tokenizer import load_tokenizer
from .overrides import exit_on_user_error


@exit_on_user_error
def run(args: argparse.Namespace) -> None:
    model = LinformerForCausalLM.from_pretrained(args.checkpoint).eval()
    tokenizer = load_tokenizer(args.checkpoint)
    ids = tokenizer.encode_batch([args.prompt])[0]
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give some text")
    tokens = model.generate(
        torch.tensor([ids]),
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        generator=torch.Generator().manual_seed(args.seed),
    )
    print(tokenizer.tokenizer.decode(tokens[0].tolist()))


def register(commands: argparse._SubParsersAction) -> None:
    """Adds the `generate` subcommand."""
    parser = commands.add_parser("generate", help="continue a prompt with a causal-LM checkpoint")
    parser.add_argument("checkpoint", help="a LinformerForCausalLM directory with tokenizer.json")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to add")
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature; 0 is greedy"
    )
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.set_defaults(func=run)
