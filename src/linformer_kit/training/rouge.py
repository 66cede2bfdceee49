"""ROUGE-L (Lin 2004): the longest common subsequence of a candidate and a reference, as an F1
of its precision (LCS / candidate length) and recall (LCS / reference length)."""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence

WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words, the tokenization of Google's `rouge-score`."""
    return WORD.findall(text.lower())


def lcs_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common subsequence (dynamic programming, O(len(a) len(b)))."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(candidate: Sequence[Hashable], reference: Sequence[Hashable]) -> float:
    """ROUGE-L F1 of two token sequences; 0 when either is empty."""
    common = lcs_length(candidate, reference)
    if common == 0:
        return 0.0
    precision, recall = common / len(candidate), common / len(reference)
    return 2 * precision * recall / (precision + recall)
