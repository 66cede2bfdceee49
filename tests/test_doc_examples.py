"""The documentation's Python examples run as written: every ```python block of the README and
docs/ is executed, with only the inputs it leaves to the reader (token ids, masks, a model)
supplied, so an example that drifts from the API fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from linformer_kit import LinformerConfig, LinformerForMaskedLM

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


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
    padding, attention tensors, a saved masked-LM checkpoint and a model."""
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
    }


def test_every_page_with_examples_is_found():
    pages = {example_id.split(":")[0] for example_id, _ in examples()}
    assert {"README.md", "docs/performance.md"} <= pages


@pytest.mark.parametrize(("example_id", "code"), examples(), ids=[e[0] for e in examples()])
def test_the_example_runs_as_written(example_id, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = reader_inputs(tmp_path)
    exec(compile(code, example_id, "exec"), namespace)
