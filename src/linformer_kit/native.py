"""The compiled CPU dropout kernel (`csrc/dropout.cpp`), built on first use.

`dropout_ops()` compiles the C++ file with torch's `cpp_extension` (g++ and ninja; about
20 s once per machine, then loaded from torch's extension cache) and returns
`torch.ops.linformer_kit`, or None where it cannot: no compiler, a failed build, or
`LINFORMER_KIT_NATIVE=0` in the environment. None is never an error: the explicit kernel
then applies the same dropout mask with PyTorch ops (`dropout.dropout_bits`), bit for bit
the same outputs, only slower.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "dropout.cpp"
ENV_SWITCH = "LINFORMER_KIT_NATIVE"
_loaded: dict[str, object] = {}


def _cpu_tag() -> str:
    """A short hash of this CPU's feature flags: `-march=native` code must not be loaded
    from a shared extension cache by a machine that lacks some of its instructions."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next(line for line in info.splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = "unknown"
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _build() -> object:
    from torch.utils.cpp_extension import load  # imports setuptools: only when building

    if shutil.which("ninja") is None:  # the ninja that pip installed beside this Python
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    logger.info("building the CPU dropout kernel %s (once per machine)", SOURCE)
    load(
        name=f"linformer_kit_dropout_{_cpu_tag()}",
        sources=[str(SOURCE)],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],  # OpenMP: at::parallel_for
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.linformer_kit


def dropout_ops() -> object | None:
    """`torch.ops.linformer_kit` with `dropout_forward` / `dropout_backward`, or None if
    the kernel is switched off (`LINFORMER_KIT_NATIVE=0`) or cannot be built here (a
    warning says why, once per process)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if "ops" not in _loaded:
        try:
            _loaded["ops"] = _build()
        except Exception as error:  # noqa: BLE001 - any build failure means the fallback
            warnings.warn(
                f"linformer-kit: the CPU dropout kernel could not be built ({error}); "
                f"attention dropout uses PyTorch ops (same results, slower). Set "
                f"{ENV_SWITCH}=0 to skip the build.",
                RuntimeWarning,
                stacklevel=2,
            )
            _loaded["ops"] = None
    return _loaded["ops"]
