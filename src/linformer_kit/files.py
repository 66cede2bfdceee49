"""Writing files so that nothing a user has is lost: atomic replacement (readers see the old
file or the new, never half of one), private temporary folders whose leftovers the next write
removes, an advisory lock that keeps two runs out of one folder, and the check that an output
path can be written before the work that fills it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def umask_mode(mode: int) -> int:
    """`mode` less what the process's umask forbids: the permissions a file or directory
    made with open() or mkdir() gets, which mkstemp / mkdtemp's private ones are set to."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def private_folder(path: Path, *, bare_pids: bool = False) -> Path:
    """A new private temporary folder beside `path`, to build it (or its file) in and rename
    into place; named for this machine and process, so that the next call for `path` removes
    the folders of killed processes (`_remove_leftovers`; `bare_pids`: also those named by a
    process id alone, as `atomic_write`'s first versions named them): each held a full-size
    file for good, and they piled up."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(path, bare_pids)
    prefix = f".{path.name}.{_writer()}."
    return Path(tempfile.mkdtemp(dir=path.parent, prefix=prefix, suffix=".tmp"))


LOCK_NAME = ".lock"


@contextlib.contextmanager
def exclusive(folder: Path, what: str, *, wait: bool = False) -> Iterator[None]:
    """Holds `folder/.lock` (an advisory `flock`, let go when the process ends, however)
    while the block runs; a second process asking for it is refused at once, naming the
    folder and the holder: two runs into one folder mixed their checkpoints, metrics and
    reports, or one removed the other's. Folders it made that hold nothing else after the
    block (a command refused before it wrote) are removed again. Without `fcntl`
    (Windows) nothing is locked.

    Args:
        folder: the folder to hold (made if missing).
        what: the holder's work, as the refusal names it ("training run").
        wait: wait for the holder to let go (logged, naming it) instead of refusing.

    Raises:
        ValueError: when another process holds the folder (and `wait` is False).
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # the deepest first
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_NAME, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            if not wait:
                raise ValueError(
                    f"{folder} is in use by another {what} ({holder}): wait for it to end, "
                    f"or choose another folder"
                ) from None
            logger.warning("%s: waiting for another %s (%s) to end", folder, what, holder)
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        try:
            yield
        finally:
            with contextlib.suppress(OSError):  # never in place of the block's own error
                if made and [p.name for p in folder.iterdir()] == [LOCK_NAME]:
                    (folder / LOCK_NAME).unlink()  # held still: no other process has it
                    for path in made:
                        path.rmdir()
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def replacing(folder: Path, entries: Callable[[Path], list[Path]], what: str) -> Iterator[None]:
    """Moves an earlier run's `entries(folder)` (those there) aside, into
    `folder/.earlier-WHAT`, while the block writes the new ones, saying so: put back if the
    block stops (an error, Ctrl-C; a killed one's at the next call), removed when it ends.
    Removed before the work, an interrupted run lost the earlier one for good. The aside
    folder lists what it takes before anything moves, so a move stopped half-way is undone
    without taking an earlier entry not yet moved for the new run's.

    Args:
        folder: where the entries are.
        entries: the paths of a run's entries under a folder (`folder`, or the aside one);
            none inside another.
        what: the run, as the messages name it ("demo").
    """
    aside = folder / (".earlier-" + re.sub(r"[^\w@.:-]+", "-", what))
    staged = aside.with_name(aside.name + ".new")  # the aside folder and its list, then renamed
    done = aside.with_name(aside.name + ".old")  # renamed from aside as the block ends, removed

    def present(root: Path) -> list[str]:
        found = [path for path in entries(root) if path.exists() or path.is_symlink()]
        return [path.relative_to(root).as_posix() for path in found]

    def put_back() -> None:
        shutil.rmtree(staged, ignore_errors=True)  # killed before anything moved
        shutil.rmtree(done, ignore_errors=True)  # killed as the earlier run was removed
        if not aside.is_dir():
            return
        listed = aside / _MOVED_NAME  # none: aside by a version before the list
        names = json.loads(listed.read_text()) if listed.is_file() else present(aside)
        waiting = set(present(aside))
        for name in present(folder):  # the new run's; an earlier one not (or again) in place
            if name not in names or name in waiting:
                _remove(folder / name)
        for name in sorted(waiting):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(aside / name, folder / name)
        shutil.rmtree(aside)
        logger.warning("the earlier %s in %s is back in place", what, folder)

    put_back()  # one stopped before its end left one aside
    if names := present(folder):
        logger.warning(
            "replacing the earlier %s in %s once this one ends: %s", what, folder, ", ".join(names)
        )
        staged.mkdir()
        (staged / _MOVED_NAME).write_text(json.dumps(names))
        os.replace(staged, aside)
        for name in names:
            (aside / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(folder / name, aside / name)
    try:
        yield
    except BaseException:
        put_back()
        raise
    if aside.is_dir():  # at once out of put_back's way: half removed, it restored the half
        os.replace(aside, done)
        shutil.rmtree(done, ignore_errors=True)


_MOVED_NAME = ".moved.json"  # what `replacing` set aside, written before it moves


def _remove(path: Path) -> None:
    """Removes a file, link or folder."""
    path.unlink() if path.is_file() or path.is_symlink() else shutil.rmtree(path)


def atomic_write(path: Path, write: Any) -> None:
    """Calls `write(tmp_path)` then renames tmp_path to `path`, so readers see old or new.

    tmp_path lies in a private folder beside `path`, where a writer's own temporary file
    (safetensors makes one) lands too; the folder is removed after, and one that a killed
    process left is removed by the next write of `path`.
    """
    folder = private_folder(path, bare_pids=True)
    try:
        write(folder / path.name)
        os.chmod(folder / path.name, umask_mode(0o666))  # not a private temporary's 0o600
        os.replace(folder / path.name, path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def save_json(data: Any, path: str | os.PathLike) -> None:
    """Writes `data` as indented JSON to `path`, atomically (a kill leaves the old file)."""
    text = json.dumps(data, indent=2) + "\n"
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(text))


def save_figure(
    fig: Any, path: str | os.PathLike, *, dpi: int = 120, image_format: str = "png"
) -> None:
    """Writes a matplotlib figure with `atomic_write`: an interrupted save leaves the old
    file, not a truncated image."""
    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format=image_format, dpi=dpi))


def _writer(pid: int | None = None) -> str:
    """This machine and a process of it, as a temporary folder's name carries them: a hash
    of the host name and process-id namespace (no dots) and the process id."""
    # with the process-id namespace: containers that share a host name (and a cache volume)
    # number their processes apart, and one took another's live build for a dead one's
    try:
        space = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:  # no /proc: not Linux
        space = ""
    host = hashlib.sha256((socket.gethostname() + space).encode()).hexdigest()[:8]
    return f"{host}-{os.getpid() if pid is None else pid}"


def _remove_leftovers(path: Path, bare_pids: bool) -> None:
    """Removes the temporary folders of `atomic_write`s of `path` whose process, on this
    machine, is gone (killed mid-write: a model's weights in full, each); another machine's
    (a shared file system) are left. Not on Windows, whose os.kill ends the process it
    probes."""
    if sys.platform == "win32":
        return
    host = _writer().split("-")[0]
    # what mkdtemp made for `path`: HOST-PID, or with `bare_pids` a bare PID (a version before
    # the host was named: this host's), then its 8 random characters
    host_part = r"(?:([0-9a-f]{8})-)" + ("?" if bare_pids else "")
    made = re.compile(rf"\.{re.escape(path.name)}\.{host_part}(\d+)\.[a-z0-9_]{{8}}\.tmp")
    for folder in path.parent.glob(f".{path.name}.*.tmp"):
        match = made.fullmatch(folder.name)
        if match is None or match[1] not in (None, host) or not folder.is_dir():
            continue
        pid = match[2]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # another user's, alive
            continue


def sha256(file: Path) -> str:
    """The SHA-256 hex digest of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# how a file of each image format matplotlib writes begins (avif, raw, rgba and pgf: no telling)
IMAGE_SIGNATURES = {
    "png": (b"\x89PNG",),
    "pdf": (b"%PDF",),
    "jpg": (b"\xff\xd8\xff",),
    "jpeg": (b"\xff\xd8\xff",),
    "eps": (b"%!PS", b"\xc5\xd0\xd3\xc6"),
    "ps": (b"%!PS",),
    "svg": (b"<?xml", b"<svg"),
    "svgz": (b"\x1f\x8b",),
    "tif": (b"II*\x00", b"MM\x00*"),
    "tiff": (b"II*\x00", b"MM\x00*"),
    "webp": (b"RIFF",),
    "gif": (b"GIF8",),
}
MAX_REPORT_BYTES = 2**24  # a larger file at a report's path is no report: never read whole


def is_output(path: Path, kind: str, begins: str = "") -> bool:
    """Whether the file at `path` is an output of `kind` ("json": one JSON object of report
    size; an image format: a file that begins as one does; "text": one that begins with
    `begins`, a table's header or a title), as an earlier run wrote it."""
    if kind == "text":
        with open(path, "rb") as handle:
            return handle.read(len(begins.encode())) == begins.encode()
    if kind == "json":
        if path.stat().st_size > MAX_REPORT_BYTES:
            return False
        try:
            return isinstance(json.loads(path.read_bytes()), dict)
        except (ValueError, OSError):  # UnicodeDecodeError is a ValueError
            return False
    with open(path, "rb") as handle:
        return handle.read(8).startswith(IMAGE_SIGNATURES.get(kind, (b"",)))


def check_replaceable(
    path: str | os.PathLike, kind: str, flag: str = "--out", begins: str = ""
) -> None:
    """Raises ValueError for a file at `path` that an output of `kind` ("json", an image
    format: "png", "pdf", ..., or "text" that begins with `begins`) would replace and that is
    no such output (`is_output`; an empty file is replaced): a slip of `--out` replaced a
    user's training data with a report, or a user's files with a run's, without a word.
    Checked before the work.
    """
    out = Path(path)
    if out.is_file() and out.stat().st_size and not is_output(out, kind, begins):
        what = {"json": "a JSON report", "text": f"a report that begins {begins[:40]!r}"}.get(
            kind, f"a .{kind} image"
        )
        raise ValueError(
            f"{flag} {out} exists and is not {what}: writing would replace it; remove it "
            f"first, or choose another path"
        )


def check_output_path(path: str | os.PathLike, *, directory: bool, flag: str = "--out") -> None:
    """Raises ValueError if output could not be written at `path` (a file where a folder is
    wanted or the reverse, or a file where a folder of its path should be), naming `flag`:
    checked before the work, not after it."""
    kind = "directory" if directory else "file"
    if not os.fspath(path):  # Path("") is the working directory: written into it
        raise ValueError(f"{flag} is empty (''); name a {kind}")
    out = Path(path)
    if directory and out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} is a file; name a directory")
    if not directory and out.is_dir():
        raise ValueError(f"{flag} {out} is a directory; name a file")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{flag} {out}: {parent} is a file, not a directory")
