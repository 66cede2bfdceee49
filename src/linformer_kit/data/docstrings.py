"""A real offline seq2seq task: Python function bodies -> their docstring summaries, extracted
with `ast` from the running Python's standard library (present on every machine).

Every function or method with a docstring gives one pair: the source is its code with the
docstring removed (signature and body, dedented), the target the docstring's first
paragraph on one line. The split is by file (a module's functions all land in one split,
so near-duplicate neighbours never straddle train and test), shuffled by a seed.
"""

from __future__ import annotations

import ast
import json
import logging
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..files import atomic_write
from .cache import cache_key, default_cache_dir
from .corpus import STDLIB, fingerprint, list_files, stdlib_root
from .records import read_text

logger = logging.getLogger(__name__)

MIN_SUMMARY_WORDS = 3  # "Return x." and shorter say too little to score


@dataclass(frozen=True)
class CodeDoc:
    """One function: where it is (`path:line`), its code without the docstring, the summary."""

    where: str
    code: str
    summary: str


def summary_of(docstring: str) -> str:
    """The first paragraph of a (cleaned) docstring, its lines joined by single spaces."""
    return " ".join(docstring.strip().split("\n\n")[0].split())


def function_pairs(text: str, where: str) -> list[CodeDoc]:
    """The (code, summary) pairs of every documented function in one module's source.

    Functions whose body is only the docstring (and `pass` / `...`) are left out: there is
    nothing to describe; so are those whose docstring shares a line with code (`def f(x):
    'Doc.'; return x`), whose code cannot be cut from it by lines. A file that does not
    parse gives none. Pairs come in `ast.walk`'s order: breadth-first, a module's functions
    before its classes' methods.
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        docstring = ast.get_docstring(node)
        rest = node.body[1:]
        if docstring is None or all(
            isinstance(s, ast.Pass)
            or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
            for s in rest
        ):
            continue
        summary = summary_of(docstring)
        if len(summary.split()) < MIN_SUMMARY_WORDS:
            continue
        doc = node.body[0]
        if doc.lineno == node.lineno or rest[0].lineno == doc.end_lineno:
            continue
        kept = lines[node.lineno - 1 : doc.lineno - 1] + lines[doc.end_lineno : node.end_lineno]
        code = textwrap.dedent("\n".join(kept)).strip()
        pairs.append(CodeDoc(f"{where}:{node.lineno}", code, summary))
    return pairs


def extract_stdlib_pairs(cache_dir: str | Path | None = None) -> list[CodeDoc]:
    """Every documented function of the standard library, in file order; cached as
    JSONL (keyed by the stdlib files' paths, sizes and times), so later runs skip parsing."""
    key = cache_key("docstrings", fingerprint([STDLIB], "", ""), MIN_SUMMARY_WORDS)
    path = Path(cache_dir or default_cache_dir()) / f"docstrings-{key}.jsonl"
    if path.is_file():
        return [CodeDoc(**json.loads(line)) for line in path.read_text().splitlines()]
    root = stdlib_root()
    pairs = []
    for file in tqdm(list_files(STDLIB, ""), desc="parsing the stdlib", leave=False):
        try:
            text = read_text(file)
        except ValueError:  # the stdlib's few empty or non-UTF-8 files
            continue
        pairs += function_pairs(text, str(file.relative_to(root)))
    text = "".join(json.dumps(vars(p)) + "\n" for p in pairs)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    logger.info("extracted %d documented functions from %s", len(pairs), root)
    return pairs


def check_split_fractions(val_fraction: float, test_fraction: float) -> None:
    """Raises ValueError unless both shares are > 0 and leave files for training."""
    if not (0 < val_fraction and 0 < test_fraction and val_fraction + test_fraction < 1):
        raise ValueError(
            f"need val_fraction > 0, test_fraction > 0 and their sum < 1; got {val_fraction} "
            f"and {test_fraction}"
        )


def split_by_file(
    pairs: list[CodeDoc], seed: int, val_fraction: float, test_fraction: float
) -> dict[str, list[CodeDoc]]:
    """Train / val / test: the files shuffled by `seed`, then cut by the share of files.

    Raises:
        ValueError: if the fractions, rounded to whole files, leave a split without a file.
    """
    check_split_fractions(val_fraction, test_fraction)
    files = sorted({p.where.rsplit(":", 1)[0] for p in pairs})
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed)).tolist()
    num_val, num_test = round(len(files) * val_fraction), round(len(files) * test_fraction)
    counts = {"val": num_val, "test": num_test, "train": len(files) - num_val - num_test}
    empty = [name for name, count in counts.items() if count < 1]
    if empty:  # an empty val split scored a loss of 0 and chose `best` by it
        raise ValueError(
            f"val_fraction {val_fraction} and test_fraction {test_fraction} of {len(files)} "
            f"files leave {' and '.join(empty)} without a file (val {num_val}, test "
            f"{num_test}, train {counts['train']}); each share must hold at least 1 / "
            f"{len(files)} of them and leave as much for training"
        )
    split_of = {}
    for rank, index in enumerate(order):
        split_of[files[index]] = (
            "val" if rank < num_val else "test" if rank < num_val + num_test else "train"
        )
    splits: dict[str, list[CodeDoc]] = {"train": [], "val": [], "test": []}
    for pair in pairs:
        splits[split_of[pair.where.rsplit(":", 1)[0]]].append(pair)
    return splits
