"""Work in a fresh process: each run's peak memory is its own, and a run never outlives the
process that started it (a killed `linformer lra` or `linformer compare` leaves no training
behind, writing to the directory that a rerun with `--resume` would use)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.connection import wait
from typing import Any, TypeVar

T = TypeVar("T")
ORPHANED_EXIT_CODE = 70  # the fresh process's exit status when its parent died first


def _start(level: int) -> None:
    """The fresh process's start: log at the parent's level, and exit as soon as the parent
    ends (its sentinel becomes ready), whatever killed it."""
    logging.basicConfig(level=level)
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

    Args:
        function: a picklable callable (a module-level function).
        *args: its picklable arguments.

    Returns:
        What `function` returned.

    Raises:
        concurrent.futures.process.BrokenProcessPool: if the process died without a result
            (killed; most often out of memory). Whatever `function` raised, re-raised here.
    """
    level = logging.getLogger().getEffectiveLevel()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=_start, initargs=(level,)) as pool:
        return pool.submit(function, *args).result()
