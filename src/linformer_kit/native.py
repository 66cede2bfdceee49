"""The compiled CPU kernels (`csrc/`), built on first use: `dropout_forward` (`csrc/dropout.cpp`,
for `dropout.Dropout`), `attention_forward` / `attention_backward` (`csrc/attention.cpp`,
the explicit attention kernel with its dropout, `kernels._fused_attention`) and
`feedforward_forward` / `feedforward_backward` (`csrc/feedforward.cpp`, for
`encoder.FeedForward`; bf16 rows in `csrc/feedforward_bf16.cpp`), their backward formulas
(`csrc/autograd.cpp`) and fake kernels (torch.compile, `python_side`).

`cpu_ops()` compiles the C++ files with torch's `cpp_extension` (g++ and ninja; about
20-55 s once per machine, then loaded from torch's extension cache) and returns
`torch.ops.linformer_kit`, or None where it cannot: no compiler, a failed build, or
`LINFORMER_KIT_NATIVE=0` in the environment (`LINFORMER_KIT_MARCH` sets the instruction
set, `target_arch`). None is never an error: `Dropout` is then `nn.Dropout`, `FeedForward`
its three modules, and the explicit attention kernel runs by PyTorch ops with the same
dropout mask (`dropout.dropout_bits`), the same outputs to rounding, only slower. The
attention and feed-forward kernels' GEMMs call the BLAS that torch's CPU wheel links in
(`csrc/blas.h`: `sgemm_` / `dgemm_`, and MKL's bf16 GEMM where the wheel has it), or, for
float32 where MKL runs its AVX2 code on an AVX-512 CPU (AMD's; `kernel_gemm`,
`set_kernel_gemm`), oneDNN's brgemm micro-kernel, which libtorch exports.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import platform
import re
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import files, precision, python_side

logger = logging.getLogger(__name__)

LOCK_SETTLE_S = 2.0  # torch's build lock standing this long, no process in its folder: stale
LOCK_WAIT_S = 60.0  # a build waiting this long on torch's lock names it (and what runs there)
PROC = Path("/proc")  # where Linux shows each process's working directory
CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "dropout.cpp",
        "attention.cpp",
        "feedforward.cpp",
        "feedforward_bf16.cpp",
        "autograd.cpp",
        "blas.cpp",
    )
)
HEADERS = tuple(
    CSRC / name
    for name in (
        "bf16_gemm.h",
        "bits.h",
        "blas.h",
        "feedforward.h",
        "matrices.h",
        "softmax_rows.h",
        "vmath.h",
    )
)
ENV_SWITCH = "LINFORMER_KIT_NATIVE"
MARCH_SWITCH = "LINFORMER_KIT_MARCH"
# =widen: the bf16 GEMMs widen to fp32 for the float GEMM instead of calling MKL's bf16 GEMM
# or AVX-512 BF16's dot products (what a libtorch without MKL runs on a CPU without them;
# read by csrc/blas.h once per process).
BF16_GEMM_SWITCH = "LINFORMER_KIT_BF16_GEMM"
_loaded: dict[str, object] = {}
# The library of the kernels' float GEMMs: the one `set_kernel_gemm` set ("blas", "onednn",
# or None for the machine's), and the one the loaded kernels use (None before they load).
_kernel_gemm: dict[str, Any] = {"backend": None, "applied": None}


def target_arch() -> str:
    """The g++ `-march` the kernels are built for: `native` (this CPU's instructions), or
    `LINFORMER_KIT_MARCH` from the environment, e.g. `x86-64-v3` for one build that every
    AVX2 machine can load, or `haswell` to time the AVX2 code on an AVX-512 machine.

    Raises:
        ValueError: if `LINFORMER_KIT_MARCH` is not a single g++ architecture name.
    """
    arch = os.environ.get(MARCH_SWITCH, "native")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", arch):
        raise ValueError(
            f"{MARCH_SWITCH}={arch!r} is not a g++ -march name (letters, digits, '_.+-'; "
            f"e.g. native, x86-64-v3, haswell, skylake-avx512)"
        )
    return arch


def _cpu_flags() -> str:
    """This CPU's feature flags (/proc/cpuinfo), or "unknown"."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next(line for line in info.splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"


def _build_tag(arch: str) -> str:
    """A short hash of the target, this CPU's feature flags (for `-march=native` only) and
    the headers: native code must not be loaded from a shared extension cache by a machine
    that lacks some of its instructions, code for a named target is the same build on every
    machine (so they share it), and torch's cache notices a changed source but not a changed
    header."""
    flags = _cpu_flags() if arch == "native" else ""
    headers = "".join(path.read_text() for path in HEADERS)
    return hashlib.sha1((arch + flags + headers).encode()).hexdigest()[:10]


def _x86_flags() -> list[str]:
    """512-bit vectors where the target has AVX-512 (g++ defaults to 256 bits on Intel
    targets; the MKL GEMMs beside these loops use 512 already): the attention kernel's
    forward (fp32, 1 thread, n 4096, 4 heads, M 256, head_dim 64) took 10.1 -> 9.1 ms,
    backward 20.4 -> 20.3 (medians of 3 alternating processes each; AVX-512 Xeon). An x86
    option only: other g++ targets reject it."""
    return ["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []


def _std_flags() -> list[str]:
    """`-std=c++17` up to torch 2.13 (after torch's own `-std`, so it wins): torch before 2.13
    builds extensions with it (torch 2.11's build of these sources failed on
    std::bit_cast), and with it on 2.13 too every build proves the sources keep to it. A
    later torch keeps its own standard: its headers may need it."""
    return ["-std=c++17"] if torch.__version__ < "2.14" else []


def _build() -> object:
    from torch.utils.cpp_extension import load  # imports setuptools: only when building

    if shutil.which("ninja") is None:  # the ninja that pip installed beside this Python
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    arch = target_arch()
    logger.info(
        "loading the CPU kernels for -march=%s from torch's extension cache, or building them "
        "from %s (once per machine: 20-55 s)",
        arch,
        CSRC,
    )
    name = f"linformer_kit_cpu_{_build_tag(arch)}"
    with _build_held(name):
        load(
            name=name,
            sources=[str(path) for path in SOURCES],
            # -fopenmp: at::parallel_for; -fno-trapping-math: lets g++ vectorise the exp's clamp
            extra_cflags=[
                "-O3",
                f"-march={arch}",
                "-fopenmp",
                "-fno-trapping-math",
                *_std_flags(),
                *_x86_flags(),
            ],
            is_python_module=False,
            verbose=False,
        )
    python_side.register(ENV_SWITCH)
    _apply_kernel_gemm(torch.ops.linformer_kit)
    _loaded["bf16_dot"] = bool(torch.ops.linformer_kit.bf16_dot())
    return torch.ops.linformer_kit


@contextlib.contextmanager
def _build_held(name: str) -> Iterator[None]:
    """Holds the build of extension `name` for this process (`files.exclusive`, waiting for
    another process's build to end), then removes a `lock` of torch's that a killed build
    left in its folder (`_left_by_a_killed_build`): torch marks a build by that file alone
    and waits on it without a timeout, so a build killed mid-way (Ctrl-C, a job's time
    limit) hung every later one."""
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, verbose=False))
    with files.exclusive(folder, "build of the CPU kernels", wait=True):
        lock = folder / "lock"
        if _left_by_a_killed_build(lock):
            logger.warning("%s: removed, left by a build of the CPU kernels that was killed", lock)
            lock.unlink(missing_ok=True)
        yield


def _left_by_a_killed_build(lock: Path) -> bool:
    """Whether torch's `lock` in a build folder, found while this library's builds are held
    (`_build_held`), is a killed build's: it stays LOCK_SETTLE_S while no process runs in
    the folder (torch runs ninja there). Another holder can only be a process of a version
    of this library before the hold (its `load` takes the file for milliseconds to find
    the build current, or for a whole build, run in the folder): waited for, and after
    LOCK_WAIT_S a warning names the processes running there. Without Linux's /proc (which
    shows where processes run) nothing is removed: after LOCK_WAIT_S a warning names the
    file, and torch's wait goes on."""
    if not (PROC / "self" / "cwd").exists():
        deadline = time.monotonic() + LOCK_WAIT_S
        while lock.exists():
            if time.monotonic() > deadline:
                logger.warning(
                    "%s: the CPU kernels' build has waited %.0f s for it: another process is "
                    "building them, or a build killed earlier left it; if no build runs (no "
                    "ninja or cc1plus process), remove it",
                    lock,
                    LOCK_WAIT_S,
                )
                break
            time.sleep(0.1)
        return False
    settled, named = time.monotonic() + LOCK_SETTLE_S, time.monotonic() + LOCK_WAIT_S
    while lock.exists():
        if running := _running_in(lock.parent):
            settled = time.monotonic() + LOCK_SETTLE_S
            if time.monotonic() > named:  # a shell left in the folder kept it without a word
                logger.warning(
                    "%s: the CPU kernels' build has waited %.0f s for it while %s run in its "
                    "folder: a build going on, or a process left there; end it if it builds "
                    "nothing",
                    lock,
                    LOCK_WAIT_S,
                    ", ".join(running),
                )
                named = math.inf
        elif time.monotonic() > settled:
            return True
        time.sleep(0.1)
    return False


def _running_in(folder: Path) -> list[str]:
    """The processes of this machine that we may inspect with `folder` as their working
    directory (Linux's /proc), each as "pid N (its command)"."""
    folder, running = folder.resolve(), []
    for cwd in PROC.glob("[0-9]*/cwd"):
        with contextlib.suppress(OSError):
            if Path(os.readlink(cwd)) == folder:
                command = (cwd.parent / "comm").read_text().strip()
                running.append(f"pid {cwd.parent.name} ({command})")
    return running


def switched_off() -> bool:
    """Whether `LINFORMER_KIT_NATIVE=0` switches the kernels off."""
    return os.environ.get(ENV_SWITCH, "1") == "0"


@contextlib.contextmanager
def kernels_off() -> Iterator[None]:
    """The compiled kernels switched off inside, as `LINFORMER_KIT_NATIVE=0` does (read at
    each call): PyTorch ops everywhere. The environment is restored on leaving."""
    before = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV_SWITCH]
        else:
            os.environ[ENV_SWITCH] = before


def kernel_gemm() -> str:
    """The library of the kernels' float32 GEMMs (the attention and feed-forward kernels',
    and `linear_backend.matmul`'s): the one the loaded kernels use, else (not loaded yet)
    the one they will: what `set_kernel_gemm` set, or the machine's (found when the kernels
    load or the setting changes). The machine's is "onednn" where MKL runs its AVX2 code on
    an AVX-512 CPU (`precision.mkl_without_avx512`), else "blas". Not on a non-Intel CPU
    without AVX-512: there both libraries run AVX2 code, and on a real one (AMD EPYC Zen 3)
    MKL was as fast or faster: the attention layer 1.04 / 1.01 / 1.03x at n 1024 / 4096 /
    16384 with every GEMM on MKL (`benchmarks/kernels/zen3-avx2/gemm-ab/`), the attention
    kernel alone a tie in float32 and faster in bfloat16, MKL's bf16 GEMM against the
    widening onto oneDNN (`zen3-avx2/gemm-rate*/`; an emulation of AVX2 on an AVX-512 EPYC
    had sent that CPU's attention kernel to oneDNN until 2026-11-28). "blas" while
    `torch.backends.mkldnn.enabled` is False (the kernels' GEMMs then take the BLAS too),
    and where the kernels are switched off or failed to build."""
    kernels_off = switched_off() or _loaded.get("ops", True) is None
    if kernels_off or not torch.backends.mkldnn.enabled:
        return "blas"
    return _kernel_gemm["applied"] or _wanted_kernel_gemm()


def bf16_feedforward() -> bool:
    """Whether the feed-forward kernel takes bf16 rows (`csrc/feedforward_bf16.cpp`): the
    kernels are loaded with their float32 GEMMs on oneDNN (`kernel_gemm`), so their bf16
    GEMMs off MKL, and built with AVX-512 BF16's dot products (`csrc/bf16_gemm.h`; not where
    `LINFORMER_KIT_BF16_GEMM=widen`). Python state only: torch.compile traces it."""
    return bool(_loaded.get("bf16_dot")) and kernel_gemm() == "onednn"


def _wanted_kernel_gemm() -> str:
    backend = _kernel_gemm["backend"]
    if backend is None:
        backend = "onednn" if precision.mkl_without_avx512() else "blas"
    return backend


def _apply_kernel_gemm(ops: object) -> None:
    """Sets the library in the loaded kernels and records the one they took (a libtorch
    without oneDNN's float micro-kernel keeps the BLAS)."""
    _kernel_gemm["applied"] = ops.float_gemm(_wanted_kernel_gemm())


def set_kernel_gemm(backend: str | None) -> str | None:
    """Sends the attention and feed-forward kernels' float32 GEMMs (`csrc/blas.h`), and
    `linear_backend.matmul`'s, to `backend`, process-wide: "blas" (`sgemm_`, MKL in
    torch's wheel) or "onednn" (oneDNN's brgemm micro-kernel, 2.2-2.7x MKL's AVX2 code at
    the kernels' block shapes on an AMD EPYC); None, the machine's choice (`kernel_gemm`).
    On "onednn" the kernels' bfloat16 GEMMs leave MKL too: AVX-512 BF16's dot products
    (`csrc/bf16_gemm.h`) where the CPU has them, else widened to float32 for the same
    micro-kernel (an Intel CPU with AMX pinned there gives up its AMX bf16 GEMMs).
    `linear_backend.use_linear_backend` sets it with the linear maps' backend. Applied now
    if the kernels are loaded, else when they load.

    Returns:
        The setting it replaces (for restoring it).

    Raises:
        ValueError: for an unknown backend.
    """
    if backend not in (None, "blas", "onednn"):
        raise ValueError(f"backend must be 'blas', 'onednn' or None; got {backend!r}")
    before, _kernel_gemm["backend"] = _kernel_gemm["backend"], backend
    if _loaded.get("ops") is not None:
        _apply_kernel_gemm(_loaded["ops"])
    return before


def rows_in_place(t: Tensor, *, matrix: bool = True) -> bool:
    """Whether the compiled kernels can read the last two dimensions of `t` in place: unit
    stride in the last (or one column) and, for a GEMM operand (`matrix`), rows at least
    a row apart (or one row). An expanded row (stride 0) fails the second: a BLAS raises
    such a leading dimension to the row length and reads past the tensor."""
    rows, cols = t.shape[-2:]
    unit = t.stride(-1) == 1 or cols <= 1
    return unit and (not matrix or rows <= 1 or t.stride(-2) >= cols)


def transformed(*tensors: Tensor | None) -> bool:
    """Whether a functorch transform (torch.func) is active or wraps any of `tensors`, or a
    forward-AD dual level is open: ops without batching or forward-mode rules (the compiled
    kernels, oneDNN's matmul, an autograd Function without `setup_context`) must not run
    there, not even on plain tensors inside a transform of something else. False while
    torch.compile traces: the callers keep the ops they put in compiled graphs."""
    if torch.compiler.is_compiling():
        return False
    if getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0:
        return True
    if torch._C._are_functorch_transforms_active():
        return True
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return any(t is not None and wrapped(t) for t in tensors)


def cpu_ops() -> object | None:
    """`torch.ops.linformer_kit` with `dropout_forward`, `attention_forward` /
    `attention_backward` and `feedforward_forward` / `feedforward_backward`, or None if the
    kernels are switched off (`LINFORMER_KIT_NATIVE=0`) or cannot be built here (a warning
    says why, once per process).

    Under torch.compile it never builds (a build traced by Dynamo would break the graph
    apart): a graph traced before any eager call built the kernels uses the PyTorch-ops
    paths, and is traced again, with the kernels, once they are built.
    """
    if switched_off():
        return None
    if "ops" not in _loaded:
        if torch.compiler.is_compiling():
            return None
        try:
            _loaded["ops"] = _build()
        except Exception as error:  # noqa: BLE001 - any build failure means the fallback
            warnings.warn(
                f"linformer-kit: the CPU kernels could not be built ({error}); dropout, "
                f"the feed-forward block and the explicit attention kernel use PyTorch ops "
                f"(same results, slower). Set "
                f"{ENV_SWITCH}=0 to skip the build.",
                RuntimeWarning,
                stacklevel=2,
            )
            _loaded["ops"] = None
    return _loaded["ops"]
