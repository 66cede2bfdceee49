"""ListOps (Nangia & Bowman 2018, as in Long Range Arena): nested prefix expressions such as
`[MAX 4 3 [MIN 2 3 ] 1 0 ]` over the digits 0-9; the label is the expression's value (0-9).

Operators: MIN, MAX, MED (median, rounded down between the two middle values) and SM (sum
modulo 10). Each operator takes 2 to `max_args` arguments; operators nest at most `max_depth`
levels. Lengths count tokens (operators, digits and closing brackets).

The generator is written from that description. Instead of sampling trees and rejecting the
ones whose length falls outside [min_length, max_length] (most of them), it draws a target
length first and grows a tree of exactly that many tokens, splitting each operator's token
budget among its arguments, so no work is thrown away.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .common import LRASplit, LRATask, check_range, generated_task

OPERATORS = ("MIN", "MAX", "MED", "SM")
PAD = "<pad>"
CLOSE = "]"
TOKENS = (PAD, *map(str, range(10)), *(f"[{op}" for op in OPERATORS), CLOSE)
TOKEN_IDS = {token: i for i, token in enumerate(TOKENS)}
PAD_ID = 0
DIGIT_BASE = 1  # digit d has id d + 1
OPERATOR_BASE = DIGIT_BASE + 10  # operator i has id i + 11
CLOSE_ID = TOKEN_IDS[CLOSE]
MAX_DEPTH = 10
MAX_ARGS = 10
VERSION = 1  # part of the cache key: raise it whenever the same seed draws other expressions
SIZES = {"train": 96_000, "val": 2_000, "test": 2_000}  # LRA's


def apply_operator(operator: str, args: Sequence[int]) -> int:
    """The value of `operator` on digits `args`.

    Raises:
        ValueError: for an unknown operator or no arguments.
    """
    if not args:
        raise ValueError(f"[{operator} has no arguments")
    if operator == "MIN":
        return min(args)
    if operator == "MAX":
        return max(args)
    if operator == "MED":
        ordered = sorted(args)
        middle = len(ordered) // 2
        # An even count takes the mean of the two middle values, rounded down.
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) // 2
    if operator == "SM":
        return sum(args) % 10
    raise ValueError(f"unknown operator {operator!r}; known: {', '.join(OPERATORS)}")


def evaluate(expression: str | Sequence[str]) -> int:
    """The value of a ListOps expression (a string of space-separated tokens, or the tokens).

    Raises:
        ValueError: for an unknown token, unbalanced brackets or more than one top-level value.
    """
    tokens = expression.split() if isinstance(expression, str) else list(expression)
    stack: list[tuple[str, list[int]]] = [("", [])]  # the bottom frame holds the result
    for token in tokens:
        if token.isdigit() and len(token) == 1:
            stack[-1][1].append(int(token))
        elif token.startswith("[") and token[1:] in OPERATORS:
            stack.append((token[1:], []))
        elif token == CLOSE and len(stack) > 1:
            operator, args = stack.pop()
            stack[-1][1].append(apply_operator(operator, args))
        else:
            raise ValueError(f"unexpected token {token!r} in {' '.join(tokens)!r}")
    if len(stack) != 1 or len(stack[0][1]) != 1:
        raise ValueError(f"not one complete expression: {' '.join(tokens)!r}")
    return stack[0][1][0]


def encode(expression: str) -> np.ndarray:
    """Token ids (uint8) of a space-separated expression.

    Raises:
        ValueError: for an unknown token.
    """
    try:
        return np.asarray([TOKEN_IDS[t] for t in expression.split()], dtype=np.uint8)
    except KeyError as err:
        raise ValueError(f"unknown ListOps token {err.args[0]!r}; known: {TOKENS[1:]}") from None


def decode(ids: Sequence[int] | np.ndarray) -> str:
    """The expression of token ids (padding dropped)."""
    return " ".join(TOKENS[int(i)] for i in ids if int(i) != PAD_ID)


def capacity(depth: int, max_args: int) -> int:
    """The most tokens an expression with `depth` operator levels can hold."""
    tokens = 1
    for _ in range(depth):
        tokens = 2 + max_args * tokens
    return tokens


def _argument_sizes(rng: random.Random, budget: int, child_cap: int, max_args: int) -> list[int]:
    """Token counts of an operator's arguments: each 1 (a digit) or in [4, child_cap] (a nested
    operator, whose smallest form `[OP d d ]` has 4 tokens), 2 to max_args of them, summing
    to `budget`."""
    options = []  # (arguments, least nested, most nested) that can fill the budget exactly
    for count in range(2, max_args + 1):
        if child_cap < 4:  # only digits fit below
            if count == budget:
                options.append((count, 0, 0))
            continue
        # count digits plus 3 more tokens per nested operator (4 at least, child_cap at most)
        least = max(0, -(-(budget - count) // (child_cap - 1)))
        most = min(count, (budget - count) // 3)
        if least <= most:
            options.append((count, least, most))
    count, least, most = rng.choice(options)
    nested = rng.randint(least, most)
    extra = budget - (count - nested) - 4 * nested
    sizes = [4] * nested
    room = child_cap - 4
    while extra:  # spread the remaining tokens at random, none past child_cap
        open_ = [i for i, size in enumerate(sizes) if size - 4 < room]
        weights = [rng.random() for _ in open_]
        total = sum(weights)
        for i, weight in zip(open_, weights):
            share = min(extra, room - (sizes[i] - 4), max(1, int(extra * weight / total)))
            sizes[i] += share
            extra -= share
            if not extra:
                break
    sizes += [1] * (count - nested)
    rng.shuffle(sizes)
    return sizes


def _grow(rng: random.Random, budget: int, depth: int, max_args: int, out: list[int]) -> int:
    """Appends an expression of exactly `budget` tokens and at most `depth` operator levels to
    `out` (as token ids); returns its value."""
    if budget == 1:
        value = rng.randrange(10)
        out.append(DIGIT_BASE + value)
        return value
    operator = rng.randrange(len(OPERATORS))
    out.append(OPERATOR_BASE + operator)
    child_cap = capacity(depth - 1, max_args)
    args = [
        _grow(rng, size, depth - 1, max_args, out)
        for size in _argument_sizes(rng, budget - 2, child_cap, max_args)
    ]
    out.append(CLOSE_ID)
    return apply_operator(OPERATORS[operator], args)


def generate_listops(
    num: int,
    *,
    min_length: int = 500,
    max_length: int = 2000,
    max_depth: int = MAX_DEPTH,
    max_args: int = MAX_ARGS,
    seed: int | str = 0,
) -> LRASplit:
    """`num` random expressions with lengths uniform in [min_length, max_length].

    Args:
        num: expressions.
        min_length, max_length: token counts, 4 <= min_length <= max_length <= the capacity
            of max_depth levels.
        max_depth: operator nesting, in [1, 10].
        max_args: arguments per operator, in [4, 10] (with at most 3 many lengths have no
            tree: with 3, no operator holds exactly 6 tokens; LRA uses 10).
        seed: the random seed (the same seed gives the same expressions).

    Returns:
        The expressions as a split (uint8 ids padded to max_length with PAD_ID).

    Raises:
        ValueError: for a knob out of its range.
    """
    check_range("num", num, 1)
    check_range("max_depth", max_depth, 1, MAX_DEPTH)
    check_range("max_args", max_args, 4, MAX_ARGS)
    longest = capacity(max_depth, max_args)
    check_range("max_length", max_length, 4, longest)
    check_range("min_length", min_length, 4, max_length)
    rng = random.Random(f"listops/{seed}")
    inputs = np.full((num, max_length), PAD_ID, dtype=np.uint8)
    lengths = np.empty(num, dtype=np.int32)
    labels = np.empty(num, dtype=np.int8)
    for row in tqdm(range(num), desc="listops", unit=" expr", leave=False):
        tokens: list[int] = []
        labels[row] = _grow(rng, rng.randint(min_length, max_length), max_depth, max_args, tokens)
        lengths[row] = len(tokens)
        inputs[row, : len(tokens)] = tokens
    return LRASplit(inputs, lengths, labels, f"listops(seed={seed})")


def load_listops(
    *,
    num_train: int = SIZES["train"],
    num_val: int = SIZES["val"],
    num_test: int = SIZES["test"],
    min_length: int = 500,
    max_length: int = 2000,
    max_depth: int = MAX_DEPTH,
    max_args: int = MAX_ARGS,
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> LRATask:
    """The ListOps task (LRA's sizes by default), generated once and cached.

    Args:
        num_train, num_val, num_test: expressions per split.
        min_length, max_length, max_depth, max_args: as `generate_listops`.
        seed: the data seed; each split draws from its own stream.
        cache_dir: the cache root (None: the project's default).

    Returns:
        The task: 16 token ids (padding, ten digits, four operators, `]`), 10 labels.

    Raises:
        ValueError: for a knob out of its range.
    """
    sizes = {"train": num_train, "val": num_val, "test": num_test}
    shape = {
        "min_length": min_length,
        "max_length": max_length,
        "max_depth": max_depth,
        "max_args": max_args,
    }
    return generated_task(
        "listops",
        generate_listops,
        sizes,
        shape,
        seed=seed,
        version=VERSION,
        cache_dir=cache_dir,
        row_bytes=max_length,
        vocab_size=len(TOKENS),
        num_labels=10,
        pad_id=PAD_ID,
    )
