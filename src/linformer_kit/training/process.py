"""Work in a fresh process: each run's peak memory is its own, and a run never outlives the
process that started it (a killed `linformer lra` or `linformer compare` leaves no training
behind, writing to the directory that a rerun with `--resume` would use)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.connection import wait
from typing import Any, TypeVar

T = TypeVar("T")
ORPHANED_EXIT_CODE = 70  # the fresh process's exit status when its parent died first


def _interrupt(signum: int, frame: object) -> None:
    # Once: a `kill` of the process group (`timeout`, a job scheduler) sends a SIGTERM here
    # beside the one the parent forwards, which raised again while the first was handled.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _start(level: int) -> None:
    """The fresh process's start: log at the parent's level, take interrupts from the parent
    only (the terminal's Ctrl-C reaches the whole process group; `in_fresh_process` forwards
    the parent's, Ctrl-C or `kill`, as one SIGTERM, which interrupts here as Ctrl-C would),
    and exit as soon as the parent ends (its sentinel becomes ready), whatever killed it."""
    logging.basicConfig(level=level)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _interrupt)
    parent = multiprocessing.parent_process()
    if parent is None:  # not started by multiprocessing
        return

    def exit_with_parent() -> None:
        wait([parent.sentinel])
        os._exit(ORPHANED_EXIT_CODE)  # no cleanup that could write on the parent's behalf

    threading.Thread(target=exit_with_parent, name="exit-with-parent", daemon=True).start()


def in_fresh_process(function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` in a new (spawned) process that logs at this process's level and
    ends when this one does, killed or not.

    An interrupt here (Ctrl-C, or SIGTERM where the CLI makes it one) interrupts the fresh
    process too, and this one waits for it to stop where it is: what it raises then (a
    training's `TrainingInterrupted`, which names its last checkpoint) is raised here. A
    second interrupt kills it.

    Args:
        function: a picklable callable (a module-level function).
        *args: its picklable arguments.

    Returns:
        What `function` returned.

    Raises:
        concurrent.futures.process.BrokenProcessPool: if the process died without a result
            (killed; most often out of memory). Whatever `function` raised, re-raised here.
        KeyboardInterrupt: when interrupted, as above.
    """
    level = logging.getLogger().getEffectiveLevel()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=_start, initargs=(level,)) as pool:
        future = pool.submit(function, *args)
        try:
            return future.result()
        except KeyboardInterrupt:
            # Leaving the block waits for the process: without this it trained on, to its end.
            processes = list(pool._processes.values())  # noqa: SLF001 (no public handle)
            for process in processes:
                process.terminate()
            try:
                error = future.exception()
            except KeyboardInterrupt:
                for process in processes:
                    process.kill()
                raise
            if isinstance(error, KeyboardInterrupt):
                raise error from None
            raise
