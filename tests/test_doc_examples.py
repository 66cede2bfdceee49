"""The documentation's examples hold: every ```python block of the README and docs/ runs as
written, with only the inputs it leaves to the reader (token ids, masks, a model) supplied, and
every `linformer` command line in the README, docs/ and the benchmarks' notes uses flags its
subcommand has. An example that drifts from the API or the CLI fails here."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import torch

from linformer_kit import LinformerConfig, LinformerForMaskedLM
from linformer_kit.cli import build_parser
from linformer_kit.data.tokenizer import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# `linformer WORD ...` up to the end of the line, a backquote or a pipe; `\` continues it
COMMAND = re.compile(r"linformer ([a-z][a-z0-9-]*)((?:[ \t]+(?:\\\n\s*)?[^\s`|]+)*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def examples() -> list[tuple[str, str]]:
    """(id, code) of every Python block in the documentation pages."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return found


def reader_inputs(tmp_path: Path) -> dict[str, object]:
    """What the examples take as given: ids within an 8000-token vocabulary, masks with
    padding, attention tensors, a saved masked-LM checkpoint, a model and a tokenizer."""
    torch.manual_seed(0)
    mask = torch.ones(2, 48, dtype=torch.bool)
    mask[1, 30:] = False
    heads, n, head_dim, k = 4, 48, 16, 16
    tiny = LinformerConfig(
        vocab_size=8000, max_seq_len=64, dim=32, depth=1, num_heads=2, proj_dim=16
    )
    LinformerForMaskedLM(tiny).save_pretrained(tmp_path / "mlm_ckpt")
    proj = torch.randn(n, k) / k**0.5
    return {
        "input_ids": torch.randint(3, 8000, (2, 48)),
        "mask": mask,
        "prompt_ids": torch.randint(3, 8000, (1, 8)),
        "src_ids": torch.randint(3, 8000, (2, 40)),
        "src_mask": mask[:, :40],
        "tgt_ids": torch.randint(3, 8000, (2, 12)),
        "tgt_mask": mask[:, :12].flip(0),
        "q": torch.randn(2, heads, n, head_dim),
        "k": torch.randn(2, heads, n, head_dim),
        "v": torch.randn(2, heads, n, head_dim),
        "proj_k": proj,
        "proj_v": proj,
        "model": LinformerForMaskedLM(tiny),
        "tokenizer": train_tokenizer(["def main():\n    return 0\n"] * 20, 300),
    }


def test_every_page_with_examples_is_found():
    pages = {example_id.split(":")[0] for example_id, _ in examples()}
    assert {"README.md", "docs/performance.md"} <= pages


@pytest.mark.parametrize(("example_id", "code"), examples(), ids=[e[0] for e in examples()])
def test_the_example_runs_as_written(example_id, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = reader_inputs(tmp_path)
    exec(compile(code, example_id, "exec"), namespace)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommands by name (empty when it has none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def unknown_flags(text: str, parser: argparse.ArgumentParser) -> list[str]:
    """`linformer SUB [SUBSUB] ... --flag` of `text` whose flag the (sub)command lacks."""
    unknown = []
    for match in COMMAND.finditer(text):
        words = [match.group(1), *match.group(2).split()]
        command, name = parser, "linformer"
        while words and words[0] in subcommands(command):
            name += " " + words[0]
            command = subcommands(command)[words.pop(0)]
        if command is parser:
            continue  # prose ("linformer is ..."), not a command line
        for flag in FLAG.findall(" ".join(words)):
            if flag not in command._option_string_actions:
                line = text[: match.start()].count("\n") + 1
                unknown.append(f"line {line}: {name} {flag}")
    return unknown


def test_an_unknown_flag_is_found():
    text = (
        "run `linformer bench --peers --no-such-flag`, then\n"
        "linformer seq2seq train --task copy \\\n    --max-len 8 --bogus 1\n"
        "linformer is a command; so is linformer evaluate --help | less\n"
    )
    assert unknown_flags(text, build_parser()) == [
        "line 1: linformer bench --no-such-flag",
        "line 2: linformer seq2seq train --bogus",
    ]


@pytest.mark.parametrize(
    "page",
    [*PAGES, *sorted((ROOT / "benchmarks").rglob("*.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_command_line_uses_flags_the_command_has(page):
    assert unknown_flags(page.read_text(), build_parser()) == []


def test_every_command_line_in_the_help_uses_flags_the_command_has():
    parser, unknown = build_parser(), []
    pending = [parser]
    while pending:
        command = pending.pop()
        unknown += unknown_flags(command.format_help(), parser)
        pending += subcommands(command).values()
    assert unknown == []
