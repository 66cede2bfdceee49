"""The `linformer` command: thin subcommands over library functions.

Each subcommand lives in its own module with a `register(commands)` function.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

from .. import __version__
from ..training.checkpoint import CHECKPOINTS_DIR, latest_checkpoint
from ..training.distributed import is_main_process, job_size
from ..training.interfaces import stopped_at
from . import (
    analysis,
    bench,
    bench_task,
    convert,
    demo,
    distill,
    evaluate,
    finetune,
    generate,
    lra,
    pretrain,
    seq2seq,
)

INTERRUPTED = 130  # the shell's status for a command ended by SIGINT (128 + 2)
SUBCOMMANDS = (
    demo,
    pretrain,
    finetune,
    evaluate,
    generate,
    convert,
    distill,
    analysis,
    bench,
    bench_task,
    lra,
    seq2seq,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="linformer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"linformer-kit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(commands)
    return parser


def interrupted(args: argparse.Namespace, argv: list[str], err: KeyboardInterrupt) -> str:
    """The one line that replaces a Ctrl-C traceback: where training stopped (and the error
    it stopped on, when the interrupt came after one: a DDP peer's death, then torchrun's
    SIGTERM), its last checkpoint and the command that continues it."""
    stop, error = stopped_at(err)
    during = f" after {error}" if error else ""
    if stop is None:
        return f"linformer {args.command}: interrupted{during}"
    where = f"linformer {args.command}: interrupted at step {stop.step}"
    if build_parser().parse_known_args([*argv, "--resume"])[1]:  # no --resume: demo, bench-task
        return f"{where} of {stop.run_dir}{during}"
    checkpoint = latest_checkpoint(stop.run_dir)
    command = [*_launcher(), "linformer"]
    if checkpoint is None:
        return (
            f"{where}{during}, before the first checkpoint; start again with: "
            f"{shlex.join([*command, *argv])}"
        )
    resumed = getattr(args, "train.resume", getattr(args, "resume", False)) is True  # lra's
    again = argv if resumed else [*argv, "--resume"]
    last = stop.run_dir / CHECKPOINTS_DIR / checkpoint.path.name
    return (
        f"{where}{during}; last checkpoint: {last}; continue with: {shlex.join([*command, *again])}"
    )


def _launcher() -> list[str]:
    """torchrun's part of the command that continues a job of several processes (without
    it the command ran one, which the resume refuses); none for one process."""
    world = job_size()
    if world == 1:
        return []
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = []
    if world > local:  # on every machine of the job, meeting where it met
        host, port = (os.environ.get(name, name) for name in ("MASTER_ADDR", "MASTER_PORT"))
        nodes = ["--nnodes", str(world // local), "--rdzv-backend", "c10d"]
        nodes += ["--rdzv-endpoint", f"{host}:{port}"]
    return ["torchrun", *nodes, "--nproc_per_node", str(local), "--no-python"]


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[list[int]]:
    """Within the block, SIGTERM (what `kill` and job schedulers send) interrupts as Ctrl-C
    does; yields a list that gets the signal number when it came. The main thread only
    (where Python runs signal handlers); the previous handler is restored after."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def interrupt(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `linformer` command; Ctrl-C ends it with one line and status 130,
    SIGTERM with the same line and status 143."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    with sigterm_as_interrupt() as terminated:
        try:
            args.func(args)
        except KeyboardInterrupt as err:
            if is_main_process():  # one line per job, not one per DDP process
                print(interrupted(args, argv, err), file=sys.stderr)
            raise SystemExit(128 + signal.SIGTERM if terminated else INTERRUPTED) from None
