"""Reading the files users hand over, byte by byte checked: UTF-8 text (a byte-order mark is
not text; NUL bytes, invalid UTF-8 and gzip are named with file and line), JSONL records and
CSV rows, each error naming the file and line."""

from __future__ import annotations

import codecs
import csv
import io
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

JSONL_EXAMPLE = 'JSONL, one object per line such as {"text": "a document"}'


def _line_of(data: bytes, offset: int) -> int:
    """The line of byte `offset`, lines ended by \\n, \\r\\n or a lone \\r."""
    ends = data.count(b"\n", 0, offset) + data.count(b"\r", 0, offset)
    return ends - data.count(b"\r\n", 0, offset) + 1


def _read_bytes(path: Path) -> bytes:
    """A file's bytes without the UTF-8 byte-order mark Windows editors write first.

    Raises:
        ValueError: if the file holds nothing but whitespace.
    """
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    if not data.strip():
        raise ValueError(f"{path}: file is empty")
    return data


def read_text(path: Path) -> str:
    """Reads a UTF-8 text file (a leading byte-order mark is not text).

    Raises:
        ValueError: if the file is empty, not valid UTF-8 or holds a NUL byte (UTF-16 without
            a byte-order mark is valid UTF-8 with a NUL after each ASCII character), naming
            the file and line.
    """
    data = _read_bytes(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        gzip = " (gzip-compressed: gunzip it first)" if data[:2] == b"\x1f\x8b" else ""
        raise ValueError(
            f"{path}:{_line_of(data, err.start)}: not valid UTF-8 (byte "
            f"{data[err.start]:#04x} at offset {err.start}){gzip}"
        ) from err
    if (nul := data.find(b"\0")) >= 0:
        raise ValueError(
            f"{path}:{_line_of(data, nul)}: a NUL byte at offset {nul}: not UTF-8 text "
            f"(UTF-16, or a binary file?)"
        )
    return text


def iter_jsonl(path: Path, *, expected: str = JSONL_EXAMPLE) -> Iterator[tuple[int, dict]]:
    """Yields (line number, object) for each non-blank line of a JSONL file.

    Args:
        path: the file.
        expected: what the file should hold, told when a line is not JSON (a CSV or plain
            text file given where JSONL is expected).

    Raises:
        ValueError: naming the file and line, if the file is empty, a line is not valid UTF-8
            or JSON, or a line holds something other than an object.
    """
    data = _read_bytes(path)
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid UTF-8 ({err.reason})") from err
        except (json.JSONDecodeError, RecursionError) as err:
            reason = getattr(err, "msg", "nested too deep")
            raise ValueError(
                f"{path}:{number}: not valid JSON ({reason}); expected {expected}"
            ) from err
        if _SURROGATE.search(raw) and _holds_a_lone_surrogate(record):
            raise ValueError(
                f"{path}:{number}: a \\u escape of half a character (an unpaired UTF-16 "
                f"surrogate, as a cut emoji leaves): not text"
            )
        if not isinstance(record, dict):
            raise ValueError(
                f"{path}:{number}: expected a JSON object, got {type(record).__name__}"
            )
        yield number, record


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # the escape of a UTF-16 surrogate


def _holds_a_lone_surrogate(record: dict) -> bool:
    """Whether a string in a JSON record holds an unpaired surrogate, which no tokenizer
    encodes (JSON lets them through; a pair is decoded to its one character)."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def jsonl_field(path: Path, number: int, record: dict, field: str) -> object:
    """Returns `record[field]`, or raises a ValueError naming the file, line and keys."""
    if field not in record:
        raise ValueError(
            f"{path}:{number}: no field {field!r} (fields: {', '.join(sorted(record)) or 'none'})"
        )
    return record[field]


_CSV_LIMIT = threading.Lock()  # csv's cell limit is process-wide


def label_cell(path: Path, number: int, cell: str, column: str = "label") -> str:
    """A CSV row's label: its cell without surrounding blanks (" 1" is the label 1).

    Raises:
        ValueError: naming the file, line and column, for an empty cell (it was taken for a
            class named '').
    """
    label = cell.strip()
    if not label:
        raise ValueError(f"{path}:{number}: the {column!r} cell is empty")
    return label


def csv_rows(path: Path, text: str) -> Iterator[tuple[int, list[str]]]:
    """Yields (the line it starts on, its cells) for each row of `text`, the CSV file `path`
    holds; a blank line is a row of no cells. A cell may be as long as the file (the csv
    module's process-wide limit, 128 Ki characters by default, holds only while no row is
    read here): a long document's whole text is one cell.

    Raises:
        ValueError: naming the file and line, for malformed CSV.
    """
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)  # '"a" b' lost its quotes
    while True:
        start = reader.line_num + 1
        with _CSV_LIMIT:  # threads reading at once: each restores what it found
            limit = csv.field_size_limit(max(csv.field_size_limit(), len(text)))
            try:
                row = next(reader, None)
            except csv.Error as err:
                raise ValueError(f"{path}:{start}: not valid CSV ({err})") from err
            finally:
                csv.field_size_limit(limit)
        if row is None:
            return
        yield start, row


def iter_csv(
    path: Path, columns: tuple[str, ...], text: str | None = None
) -> Iterator[tuple[int, dict]]:
    """Yields (the line it starts on, {column: cell}) for each non-blank row of a CSV file
    whose header row names `columns` (and maybe others); `text`, the file's, where the
    caller has read it.

    Raises:
        ValueError: naming the file and line, for a missing or repeated column of
            `columns`, a row of the wrong width or malformed CSV (and as `read_text`).
    """
    rows = csv_rows(path, read_text(path) if text is None else text)
    header = [cell.strip() for cell in next(rows, (1, []))[1]]  # "text, label" names label
    for column in columns:
        if column not in header:
            raise ValueError(
                f"{path}:1: the header has no column {column!r} (columns: {', '.join(header)})"
            )
        if header.count(column) > 1:
            raise ValueError(f"{path}:1: the header names column {column!r} twice")
    for number, row in rows:
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise ValueError(f"{path}:{number}: {len(row)} cells, the header has {len(header)}")
        yield number, dict(zip(header, row))
