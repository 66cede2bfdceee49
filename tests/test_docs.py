"""The documentation's links: every relative link in the README, docs/ and the benchmarks'
notes names a file that exists and, for a Markdown file, a heading it has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *(ROOT / "benchmarks").rglob("*.md")])


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings (outside fenced code)."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.add(heading_anchor(line.lstrip("#")))
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` whose file or heading is missing."""
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no such heading")
    return broken


def test_heading_anchors_follow_github():
    heading = "AMD CPUs: the GEMMs through oneDNN (`linear_backend`, `native.kernel_gemm`)"
    assert (
        heading_anchor(heading)
        == "amd-cpus-the-gemms-through-onednn-linear_backend-nativekernel_gemm"
    )
    assert heading_anchor(" Encoder–decoder: `x` and y ") == "encoderdecoder-x-and-y"


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Kept heading\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[a](other.md#kept-heading) [b](other.md#not-a-heading) [c](gone.md) "
        "[d](#here) [e](https://example.com/x)\n## Here\n"
    )
    assert broken_links(page) == [
        "other.md#not-a-heading: no such heading",
        "gone.md: no such file",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []
