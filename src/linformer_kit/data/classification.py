"""Sequence-classification data: JSONL files of {"text": ..., "label": int}."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .corpus import iter_jsonl, jsonl_field
from .tokenizer import TextTokenizer


@dataclass
class ClassificationData:
    """Tokenized examples: `ids[i]` starts with the start token and ends with the separator."""

    ids: list[list[int]]
    labels: list[int]
    lines: list[int]
    source: str

    def __len__(self) -> int:
        return len(self.labels)

    def check_labels(self, num_labels: int) -> None:
        """Raises a ValueError naming the file and line of the first label >= num_labels."""
        for label, number in zip(self.labels, self.lines):
            if label >= num_labels:
                raise ValueError(
                    f"{self.source}:{number}: label {label} is out of range [0, {num_labels})"
                )

    def batch(self, rows: list[int], pad_id: int) -> dict[str, Tensor]:
        """Rows padded to the longest: input_ids (B, N), key_padding_mask (B, N), labels (B,)."""
        longest = max(len(self.ids[i]) for i in rows)
        input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.bool)
        for row, i in enumerate(rows):
            input_ids[row, : len(self.ids[i])] = torch.tensor(self.ids[i])
            mask[row, : len(self.ids[i])] = True
        labels = torch.tensor([self.labels[i] for i in rows], dtype=torch.long)
        return {"input_ids": input_ids, "key_padding_mask": mask, "labels": labels}


def read_labelled(
    path: str | Path, *, text_field: str = "text", label_field: str = "label"
) -> tuple[list[str], list[int], list[int]]:
    """Reads (texts, labels, line numbers) from a JSONL file.

    Raises:
        ValueError: naming the file and line, for an empty file, bad UTF-8 or JSON, a missing
            field, a text that is not a string or a label that is not an integer >= 0.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no data file {path}")
    texts, labels, lines = [], [], []
    for number, record in iter_jsonl(path):
        text = jsonl_field(path, number, record, text_field)
        label = jsonl_field(path, number, record, label_field)
        if not isinstance(text, str):
            raise ValueError(f"{path}:{number}: {text_field!r} must be a string, got {text!r}")
        if not isinstance(label, int) or isinstance(label, bool) or label < 0:
            raise ValueError(
                f"{path}:{number}: {label_field!r} must be an integer >= 0, got {label!r}"
            )
        texts.append(text)
        labels.append(label)
        lines.append(number)
    return texts, labels, lines


def load_classification(
    path: str | Path,
    tokenizer: TextTokenizer,
    *,
    max_seq_len: int,
    num_labels: int | None = None,
    text_field: str = "text",
    label_field: str = "label",
) -> ClassificationData:
    """Reads and tokenizes a classification JSONL file, truncating texts to max_seq_len.

    Args:
        path: the JSONL file.
        tokenizer: the model's tokenizer.
        max_seq_len: longest token sequence (start and separator tokens included).
        num_labels: labels must lie in [0, num_labels); None accepts any label >= 0.
        text_field, label_field: JSONL field names.

    Raises:
        ValueError: naming the file and line, for malformed lines or a label out of range.
    """
    if max_seq_len < 3:
        raise ValueError(f"max_seq_len must be >= 3 to hold a token, got {max_seq_len}")
    texts, labels, lines = read_labelled(path, text_field=text_field, label_field=label_field)
    ids = [
        [tokenizer.cls_id, *tokens[: max_seq_len - 2], tokenizer.sep_id]
        for tokens in tokenizer.encode_batch(texts)
    ]
    data = ClassificationData(ids, labels, lines, str(path))
    if num_labels is not None:
        data.check_labels(num_labels)
    return data
