"""Multi-process training with torch.distributed: set up from torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), gloo on CPU and NCCL on GPU."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import resource
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)
LAUNCHER_POLL_S = 1.0  # how often a torchrun worker looks whether its launcher is alive
_watching: list[int] = []  # the launcher watched (once per process)


@dataclass
class Distributed:
    """This process's place in the job: rank, world size and device."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Whether this process writes logs and checkpoints (rank 0)."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """Whether more than one process trains."""
        return self.world_size > 1

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model wrapped in DistributedDataParallel when the job has several processes.

        A `layerwise` projection is one Parameter used by every layer; DDP reduces its
        gradient once, after autograd has summed the contributions of all layers.
        """
        if not self.enabled:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def mean(self, value: float) -> float:
        """The mean of a number over all processes."""
        if not self.enabled:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return float(tensor) / self.world_size

    def gather(self, value: Any) -> list[Any]:
        """Every process's `value` (a picklable object), in rank order."""
        if not self.enabled:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def barrier(self) -> None:
        """Waits for every process."""
        if self.enabled:
            dist.barrier()


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when available; `cpu` / `cuda` / `cuda:N` are taken as given.

    Raises:
        ValueError: for any other name, or CUDA asked for on a machine without it.
    """
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available here")
    return torch.device(name)


def job_size() -> int:
    """The number of processes of the torchrun job this one is in (1 without one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """Whether this process is rank 0 of its torchrun job (or in none): the one that prints
    and logs at INFO, before the process group exists."""
    return os.environ.get("RANK", "0") == "0"


def setup_distributed(device: str = "auto") -> Distributed:
    """Joins the torchrun job described by the environment (or runs alone without one).

    Under torchrun every process takes GPU LOCAL_RANK when on CUDA.
    """
    world_size = job_size()
    target = resolve_device(device)
    stop_with_launcher()
    if world_size == 1:
        return Distributed(0, 1, target)
    if target.type == "cuda":
        target = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(target)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if target.type == "cuda" else "gloo")
    rank = dist.get_rank()
    logger.info("process %d of %d on %s", rank, world_size, target)
    return Distributed(rank, world_size, target)


def stop_with_launcher() -> None:
    """Under torchrun, SIGTERM to this process when its launcher dies without a word.

    torchrun forwards the signals it gets to its workers, but when it is killed (SIGKILL,
    out of memory) they trained on to the end, writing into the run folder and holding it
    (a rerun with --resume was refused). Here a daemon thread sees the parent change and
    stops this process as `kill` would (the command prints where training stopped).
    Nothing outside torchrun (no TORCHELASTIC_RUN_ID).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or _watching:
        return
    launcher = os.getppid()
    _watching.append(launcher)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(LAUNCHER_POLL_S)
        logger.warning("torchrun (pid %d) is gone: this process stops", launcher)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="stop-with-launcher", daemon=True).start()


def teardown_distributed() -> None:
    """Leaves the process group, if one was joined.

    Call it once nothing refers to the DDP-wrapped model any more. A DistributedDataParallel
    wrapper keeps the process group alive; left to the interpreter's exit (a reference cycle
    keeps it until then), gloo's threads take the GIL of an interpreter being torn down and
    the process aborts ("terminate called without an active exception": 5 of 30 two-process
    runs holding the wrapper to the end, none of 40 that freed it first). So unreferenced
    wrappers are collected here, before the group is destroyed.
    """
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed_job(device: str = "auto") -> Iterator[Distributed]:
    """This process's part of its job (`setup_distributed`) while the block runs: a block that
    ends without an error waits for every process (gloo can abort a process whose peer already
    left the group), and the group is left after it however it ends (`teardown_distributed`).

    Build the DDP-wrapped model inside the block, so that it is gone when the group is left.
    """
    dist = setup_distributed(device)
    try:
        yield dist
        dist.barrier()
    finally:
        teardown_distributed()


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process so far: allocated CUDA memory, or the CPU resident set.

    On Linux the resident peak is VmHWM (reset when a process starts, unlike ru_maxrss,
    which a spawned child inherits from its parent).
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**10  # kB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB else
