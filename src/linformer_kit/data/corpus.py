"""Text corpora: files, directories (recursive glob), JSONL with a text field, CSV with a
text column, the stdlib.

Every document is yielded as a `Document(source, text)`; `source` names the file (and line,
for JSONL and CSV), so later errors can point at it.
"""

from __future__ import annotations

import functools
import logging
import sysconfig
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .records import iter_csv, iter_jsonl, jsonl_field, read_text

logger = logging.getLogger(__name__)

STDLIB = "stdlib"  # the data name that selects the running Python's standard library
HF_PREFIX = "hf:"  # `hf:NAME[:CONFIG]` reads a Hugging Face `datasets` corpus
JSONL_SUFFIXES = (".jsonl", ".ndjson")
CSV_SUFFIX = ".csv"
READ_FORMAT = 2  # how files give documents (in the caches' keys): 2, line ends as \n


def is_csv(path: Path) -> bool:
    """Whether `path` names a CSV file (`.csv`, in any case)."""
    return path.suffix.lower() == CSV_SUFFIX


def is_jsonl(path: Path) -> bool:
    """Whether `path` names a JSONL file (`.jsonl` or `.ndjson`, in any case)."""
    return path.suffix.lower() in JSONL_SUFFIXES


@dataclass(frozen=True)
class Document:
    """One training document and where it came from (`path` or `path:line`)."""

    source: str
    text: str


def stdlib_root() -> Path:
    """The running Python's standard-library source directory (from sysconfig)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _one_newline(text: str) -> str:
    """`text` with its Windows (\\r\\n) and old Mac (\\r) line ends as \\n: the same text
    saved on another system gives the same tokens (byte-level BPE kept a \\r token on every
    line of a Windows file)."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _record_documents(path: Path, text_field: str) -> Iterator[Document]:
    """The `text_field` of each JSONL record or CSV row, one document each."""
    records = iter_csv(path, (text_field,)) if is_csv(path) else iter_jsonl(path)
    number = None
    for number, record in records:
        text = jsonl_field(path, number, record, text_field)
        if not isinstance(text, str):
            raise ValueError(
                f"{path}:{number}: field {text_field!r} must be a string, got {type(text).__name__}"
            )
        yield Document(f"{path}:{number}", text)
    if number is None:  # a header alone, as an empty file: nothing of it was read
        raise ValueError(f"{path}: no rows below its header")


def _hf_documents(name: str, text_field: str) -> Iterator[Document]:
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            f"data {HF_PREFIX}{name} needs the optional `datasets` package (pip install datasets)"
        ) from err
    dataset_name, _, config = name.partition(":")
    dataset = datasets.load_dataset(dataset_name, config or None, split="train")
    for index, record in enumerate(dataset):
        yield Document(
            f"{HF_PREFIX}{name}#{index}", jsonl_field(Path(name), index, record, text_field)
        )


def _no_match(path: Path, glob: str) -> str:
    """Why a directory gave no file, and how to pick its files with --glob."""
    suffixes = Counter(p.suffix for p in path.rglob("*") if p.is_file() and p.suffix)
    if not suffixes:
        return f"no file in {path} matches --glob {glob!r} (it holds no file with a suffix)"
    held = ", ".join(f"{n} {s}" for s, n in suffixes.most_common(5))
    return (
        f"no file in {path} matches --glob {glob!r} (it holds {held}); choose its files with "
        f"--glob, e.g. --glob '**/*{suffixes.most_common(1)[0][0]}'"
    )


def check_glob(glob: str) -> None:
    """Raises ValueError unless `glob` is a pattern relative to a directory (`Path.glob`'s
    rule; an absolute or empty one failed there with a traceback or an unnamed error)."""
    if not glob or Path(glob).is_absolute():
        raise ValueError(
            f"--glob must be a non-empty pattern relative to the data directory (e.g. "
            f"'**/*.txt'), got {glob!r}"
        )


def list_files(spec: str, glob: str) -> list[Path]:
    """The files a data argument names: itself, or a directory's files matching `glob`
    (sorted, so the corpus order never depends on the file system).

    Raises:
        FileNotFoundError: if the path does not exist or a directory has no matching file
            (the message names the glob, the suffixes the directory holds and --glob).
        ValueError: for a directory and a glob `check_glob` refuses.
    """
    if spec == STDLIB:
        root = stdlib_root()
        return sorted(
            p
            for p in root.rglob("*.py")
            if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
        )
    if not spec:  # Path("") is the working directory: read whatever lies there
        raise FileNotFoundError("a data path is empty ('')")
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.exists() and not path.is_dir():  # a device, a fifo: /dev/null
        raise FileNotFoundError(f"data path {path} is neither a file nor a directory")
    if not path.is_dir():
        raise FileNotFoundError(f"data path {path} does not exist")
    check_glob(glob)
    found = list(path.glob(glob))
    files = sorted(p for p in found if p.is_file())
    if dangling := tuple(sorted(p for p in found if p.is_symlink() and not p.exists())):
        _warn_of_dangling_links(path, dangling)
    if "**" in glob:
        _warn_of_folder_links(path.resolve(), glob)
    if not files:
        raise FileNotFoundError(_no_match(path, glob))
    return files


@functools.cache  # once a process: the corpus is listed for each cache key and each read
def _warn_of_dangling_links(path: Path, dangling: tuple[Path, ...]) -> None:
    """Warns of the links under `path` that point to nothing, left out."""
    shown = ", ".join(str(p) for p in dangling[:5]) + (", ..." if len(dangling) > 5 else "")
    logger.warning("%d link(s) under %s point to nothing, left out: %s", len(dangling), path, shown)


@functools.cache
def _warn_of_folder_links(path: Path, glob: str) -> None:
    """Warns of the links to folders under `path`, which `**` in a glob does not enter (a
    linked folder's files were left out without a word)."""
    linked = sorted(p for p in path.rglob("*") if p.is_symlink() and p.is_dir())
    if linked:
        shown = ", ".join(str(p) for p in linked[:5]) + (", ..." if len(linked) > 5 else "")
        logger.warning(
            "%d link(s) to folders under %s left out: --glob %s does not enter them (%s); "
            "pass each as a --data of its own to read it",
            len(linked),
            path,
            glob,
            shown,
        )


def _file_documents(path: Path, text_field: str) -> Iterator[Document]:
    if is_csv(path) or is_jsonl(path):
        return _record_documents(path, text_field)
    return iter([Document(str(path), _one_newline(read_text(path)))])


def iter_documents(
    specs: Sequence[str],
    *,
    glob: str = "**/*.txt",
    text_field: str = "text",
    skip_bad_files: bool = False,
    skipped: dict[Path, str] | None = None,
) -> Iterator[Document]:
    """Yields every document of the given data arguments, in a fixed order.

    A bad file (empty, not UTF-8, malformed JSONL) raises, whether named directly or found
    in a directory, unless `skip_bad_files`: then it is left out whole and logged at
    WARNING with its reason. The stdlib's few empty or non-UTF-8 files are always left out
    (logged at DEBUG, counted in the summary): a known source tree, not the user's data.

    Args:
        specs: file paths, directory paths, `stdlib`, or `hf:NAME[:CONFIG]`.
        glob: pattern for files inside directories (recursive with `**/`).
        text_field: the JSONL / dataset field that holds the text.
        skip_bad_files: leave bad files out instead of raising.
        skipped: collects each left-out file and its reason; a file already in it is passed
            over quietly, so several passes over one corpus report each file once.

    Raises:
        ValueError: naming file and line, for a bad file (unless skipped).
        FileNotFoundError: for missing paths.
    """
    skipped = {} if skipped is None else skipped
    for spec in specs:
        if spec.startswith(HF_PREFIX):
            yield from _hf_documents(spec[len(HF_PREFIX) :], text_field)
            continue
        skip = skip_bad_files or spec == STDLIB
        level = logging.DEBUG if spec == STDLIB else logging.WARNING
        for path in list_files(spec, glob):
            if not skip:
                yield from _file_documents(path, text_field)
                continue
            if path in skipped:
                continue
            try:
                # Read the whole file first: a file is kept or left out as a unit.
                documents = list(_file_documents(path, text_field))
            except ValueError as err:
                skipped[path] = str(err)
                logger.log(level, "skipping bad file %s", err)
                continue
            yield from documents


def fingerprint(specs: Sequence[str], glob: str, text_field: str) -> list[list]:
    """What identifies a corpus without reading it: each file's path, size, modification
    time and status-change time (ctime, which no tool sets back: a file rewritten at its
    old size and modification time, as `cp -p` or `touch -r` leave it, changes it)."""
    rows: list[list] = [[glob, text_field]]
    for spec in specs:
        if spec.startswith(HF_PREFIX):
            rows.append([spec])
            continue
        for path in list_files(spec, glob):
            stat = path.stat()
            rows.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns])
    return rows
