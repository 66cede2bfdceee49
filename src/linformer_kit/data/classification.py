"""Sequence-classification data: JSONL lines {"text": ..., "label": ...} or a CSV file with a
header row naming the text and label columns.

Labels are class ids (integers >= 0) or class names (strings). Names are mapped to ids in
sorted order of the training set's distinct names; the mapping travels with the model as
`id2label` / `label2id` in its config, and other data is mapped through it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..checks import check_choice
from ..config import TRUNCATIONS
from .corpus import is_csv
from .records import iter_csv, iter_jsonl, jsonl_field, label_cell
from .tokenizer import TextTokenizer

# A CSV label that reads as a whole number (signed: a -1 is then refused as an id at its own
# line, not taken for a class name) is an id; CSV has no types.
WHOLE_NUMBER = re.compile(r"[+-]?[0-9]+")


@dataclass
class ClassificationData:
    """Tokenized examples: `ids[i]` starts with the start token and ends with the separator.

    Attributes:
        ids: token ids of each example.
        labels: class id of each example.
        lines: the file line of each example, for errors.
        source: the file.
        label2id: the ids of the class names, when the file's labels are names.
        full_lengths: the token count of each example before truncation (start and
            separator tokens included); None when unknown.
        truncation_rule: what a longer text kept: head, tail or head+tail (`cut_tokens`).
    """

    ids: list[list[int]]
    labels: list[int]
    lines: list[int]
    source: str
    label2id: dict[str, int] | None = None
    full_lengths: list[int] | None = None
    truncation_rule: str = "head"

    def __len__(self) -> int:
        return len(self.labels)

    def label_config(self) -> dict[str, Any]:
        """The LinformerConfig fields that record the class names (None for integer labels,
        which clears names a checkpoint may carry from an earlier fine-tuning)."""
        return {"label2id": self.label2id, "id2label": None}

    def truncation(self) -> dict[str, float]:
        """How much truncation cut: documents, cut (how many were longer than kept),
        cut_share, and tokens_lost_mean / tokens_lost_max over the cut documents."""
        full = self.full_lengths or [len(row) for row in self.ids]
        lost = [length - len(row) for length, row in zip(full, self.ids) if length > len(row)]
        return {
            "documents": len(self.ids),
            "cut": len(lost),
            "cut_share": len(lost) / len(self.ids),
            "tokens_lost_mean": sum(lost) / len(lost) if lost else 0.0,
            "tokens_lost_max": max(lost, default=0),
        }

    def describe_truncation(self, max_seq_len: int) -> str:
        """One line for the log: how many documents `max_seq_len` cut and by how much."""
        cut = self.truncation()
        if not cut["cut"]:
            return f"{self.source}: no document longer than {max_seq_len} tokens"
        return (
            f"{self.source}: {cut['cut']} of {cut['documents']} documents "
            f"({cut['cut_share']:.0%}) cut to {max_seq_len} tokens ({self.truncation_rule} "
            f"kept); tokens lost per cut document: mean {cut['tokens_lost_mean']:.0f}, max "
            f"{cut['tokens_lost_max']}"
        )

    def check_labels(self, num_labels: int) -> None:
        """Raises a ValueError naming the file and line of the first label >= num_labels."""
        names = {i: name for name, i in (self.label2id or {}).items()}
        for label, number in zip(self.labels, self.lines):
            if label >= num_labels:
                shown = f"{names[label]!r} (id {label})" if names else str(label)
                raise ValueError(
                    f"{self.source}:{number}: label {shown} is out of range [0, {num_labels})"
                )

    def batch(self, rows: list[int], pad_id: int) -> dict[str, Tensor]:
        """Rows padded to the longest: input_ids (B, N), key_padding_mask (B, N), labels (B,)."""
        input_ids, mask = pad_sequences([self.ids[i] for i in rows], pad_id)
        labels = torch.tensor([self.labels[i] for i in rows], dtype=torch.long)
        return {"input_ids": input_ids, "key_padding_mask": mask, "labels": labels}


def pad_sequences(sequences: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token id lists right-padded to the longest: ids (B, N) and key_padding_mask (B, N),
    True at real tokens."""
    longest = max(map(len, sequences))
    input_ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.bool)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = True
    return input_ids, mask


def cut_tokens(row: list[int], keep: int, truncation: str = "head") -> list[int]:
    """The `keep` tokens of a longer `row` that `truncation` keeps, in order: `head` its
    first, `tail` its last, `head+tail` its first keep // 4 and its last keep - keep // 4
    (Sun et al. 2019 found 128 + 382 of BERT's 510 best on long reviews). A row no longer
    than `keep` is kept whole.

    Raises:
        ValueError: for an unknown truncation.
    """
    check_choice("truncation", truncation, TRUNCATIONS)
    if len(row) <= keep or truncation == "head":
        return row[:keep]
    head = keep // 4 if truncation == "head+tail" else 0
    return row[:head] + row[len(row) - (keep - head) :]


def encode_documents(
    tokenizer: TextTokenizer, texts: list[str], max_seq_len: int, truncation: str = "head"
) -> tuple[list[list[int]], list[int]]:
    """Each text as [start] ... [separator], cut by `cut_tokens` to fit max_seq_len; and each
    text's token count before the cut (special tokens included)."""
    encoded = tokenizer.encode_batch(texts)
    tokens = [
        [tokenizer.cls_id, *cut_tokens(row, max_seq_len - 2, truncation), tokenizer.sep_id]
        for row in encoded
    ]
    return tokens, [len(row) + 2 for row in encoded]


def read_labelled(
    path: str | Path,
    *,
    text_field: str = "text",
    label_field: str = "label",
    csv_names: bool = False,
) -> tuple[list[str], list[int] | list[str], list[int]]:
    """Reads (texts, labels, line numbers) from a JSONL or CSV file. Labels are all ids
    (integers >= 0) or all names (strings); in a CSV file, whose cells have no type, labels
    are ids when the first is a whole number, unless `csv_names` (a model that names its
    classes reads them: "01" stays "01").

    Raises:
        ValueError: naming the file and line, for an empty file, bad UTF-8, JSON or CSV, a
            missing field, a text that is not a string, or a label that is neither an
            integer >= 0 nor a string, or not of the same kind as the first label.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no data file {path}")
    if is_csv(path):
        records = iter_csv(path, (text_field, label_field))
    else:
        example = f'{{"{text_field}": "a fine film", "{label_field}": "positive"}}'
        expected = f"JSONL, one object per line such as {example}, or a .csv file with a header"
        records = iter_jsonl(path, expected=expected)
    texts, labels, lines = [], [], []
    for number, record in records:
        text = jsonl_field(path, number, record, text_field)
        if not isinstance(text, str):
            raise ValueError(f"{path}:{number}: {text_field!r} must be a string, got {text!r}")
        label = jsonl_field(path, number, record, label_field)
        if is_csv(path):  # a CSV's cells are text: " 1" is the id 1, "" no label
            label = label_cell(path, number, label, label_field)
        texts.append(text)
        labels.append(label)
        lines.append(number)
    if not labels:
        raise ValueError(f"{path}: no examples")
    if is_csv(path) and not csv_names and WHOLE_NUMBER.fullmatch(labels[0]):  # no types
        for label, number in zip(labels, lines):
            if not WHOLE_NUMBER.fullmatch(label):
                raise ValueError(
                    f"{path}:{number}: {label_field!r} must be a whole number like the label "
                    f"on line {lines[0]}, got {label!r} (a file's labels are all ids or all "
                    "names)"
                )
        labels = [int(label) for label in labels]
    kinds = [_kind(label) for label in labels]
    for label, kind, number in zip(labels, kinds, lines):
        if kind is None:
            raise ValueError(
                f"{path}:{number}: {label_field!r} must be an integer >= 0 or a string, "
                f"got {label!r}"
            )
        if kind != kinds[0]:
            raise ValueError(
                f"{path}:{number}: {label_field!r} must be {kinds[0]} like the label on line "
                f"{lines[0]}, got {label!r} (a file's labels are all ids or all names)"
            )
    return texts, labels, lines


def _kind(label: object) -> str | None:
    if isinstance(label, str):
        return "a string"
    if isinstance(label, int) and not isinstance(label, bool) and label >= 0:
        return "an integer >= 0"
    return None


def _label_ids(
    path: Path, labels: list[int] | list[str], lines: list[int], label2id: dict[str, int] | None
) -> tuple[list[int], dict[str, int] | None]:
    """Class ids of `labels`, and the name mapping used (None for integer labels).

    Args:
        path: the file, for errors.
        labels: ids or names, as `read_labelled` returns them.
        lines: the line of each label.
        label2id: the model's mapping of names to ids (empty for a model trained on ids);
            None maps the names of this (training) file in sorted order.

    Raises:
        ValueError: naming the file, line and the known labels, for a name the mapping lacks,
            or for ids given to a model whose labels are names.
    """
    if not isinstance(labels[0], str):
        if label2id:
            raise ValueError(
                f"{path}:{lines[0]}: label {labels[0]} is an id, but the model's labels are "
                f"names: {', '.join(label2id)}"
            )
        return list(labels), None
    if label2id is None:
        label2id = {name: i for i, name in enumerate(sorted(set(labels)))}
    known = ", ".join(label2id) or "none, the model was trained on integer ids"
    for label, number in zip(labels, lines):
        if label not in label2id:
            raise ValueError(f"{path}:{number}: unknown label {label!r}; known labels: {known}")
    return [label2id[label] for label in labels], label2id


def load_classification(
    path: str | Path,
    tokenizer: TextTokenizer,
    *,
    max_seq_len: int,
    num_labels: int | None = None,
    label2id: dict[str, int] | None = None,
    text_field: str = "text",
    label_field: str = "label",
    truncation: str = "head",
) -> ClassificationData:
    """Reads and tokenizes a classification JSONL or CSV file, truncating texts to max_seq_len.

    Args:
        path: the JSONL or CSV file.
        tokenizer: the model's tokenizer.
        max_seq_len: longest token sequence (start and separator tokens included).
        num_labels: labels must lie in [0, num_labels); None accepts any label >= 0.
        label2id: the model's class names (its config's `label2id`, or {} when it has none);
            None for training data, whose names (if any) are mapped in sorted order.
        text_field, label_field: field (JSONL) or column (CSV) names.
        truncation: what a longer text keeps: head, tail or head+tail (`cut_tokens`).

    Raises:
        ValueError: naming the file and line, for malformed lines, a label out of range or a
            label name the model does not know.
    """
    if max_seq_len < 3:
        raise ValueError(f"max_seq_len must be >= 3 to hold a token, got {max_seq_len}")
    texts, labels, lines = read_labelled(
        path, text_field=text_field, label_field=label_field, csv_names=bool(label2id)
    )  # a CSV's whole numbers may name a model's classes: "0", "01"
    ids, names = _label_ids(Path(path), labels, lines, label2id)
    tokens, full_lengths = encode_documents(tokenizer, texts, max_seq_len, truncation)
    data = ClassificationData(tokens, ids, lines, str(path), names, full_lengths, truncation)
    if num_labels is not None:
        data.check_labels(num_labels)
    return data
