"""Whether bfloat16 is fast on this machine: measured with a small matmul, not read off CPU
flags, because oneDNN's ISA cap (`ONEDNN_MAX_CPU_ISA`), a hypervisor's masked flags and
torch's own dispatch (`ATEN_CPU_CAPABILITY`) all decide what runs. On CPUs with AVX-512 BF16
or AMX a bf16 matmul runs at or above the float32 rate; on AVX2-only CPUs it is emulated,
at about 1 GFLOP/s against about 80 for float32 (measured: 50-100x slower)."""

from __future__ import annotations

import functools
import logging
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

PROBE_SIZE = 256  # 256^3 bf16 on one thread: 0.05 ms where native, about 15 ms where emulated
SLOW_FACTOR = 4.0  # bf16 slower than float32 by more than this: not native

# The flags that decide matmul speed: vector width, and native bf16 (AVX-512 BF16, AMX).
MATMUL_FLAGS = {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni"}

_warned: set[tuple[str, str]] = set()  # (device, advice) pairs already warned about
_found: dict[str, bool] = {}  # machine facts, each found once per process


@dataclass(frozen=True)
class Bf16Support:
    """What the probe found on one device type."""

    device: str  # cpu or cuda
    native: bool  # bf16 compute at least a quarter of the float32 rate
    slowdown: float  # time of the probe matmul in bf16 / in float32 (nan where not timed)
    capability: str  # torch's CPU dispatch level (AVX2, AVX512, ...) or the GPU's name

    def describe(self) -> str:
        """One clause for a message: what was measured and on what."""
        if self.device != "cpu":
            return f"{self.capability} has no native bf16"
        return (
            f"this CPU has no native bf16 (torch CPU capability {self.capability}): a bf16 "
            f"matmul measured {self.slowdown:.0f}x slower than float32"
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields, for a JSON report."""
        return asdict(self)


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU's model name and vendor, torch's dispatch level and the instruction-set flags
    that decide matmul speed (from /proc/cpuinfo where there is one): what a published figure
    ran on.

    Two machines can share a model name and differ twice in speed (two 2-core "AMD EPYC" VMs
    read float32 ceilings of about 200 and 400-450 GFLOP/s: their family and model number
    tell the core generations apart), so those are kept too.

    Args:
        cpuinfo: where the kernel lists the CPUs.

    Returns:
        {"model": ..., "vendor": ..., "family": ..., "model_number": ..., "capability": ...,
        "flags": [...]}; family and model number are ints, None where /proc/cpuinfo does not
        give them; where it is absent the model is `platform.processor()`, the vendor "" and
        the flags empty.
    """
    info = {}
    if cpuinfo.exists():
        # The first processor's block: the rest repeat it (on a big machine, a megabyte; this
        # runs at `linear_backend`'s import).
        first = cpuinfo.read_text().split("\n\n", 1)[0]
        for line in first.splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    flags = set(info.get("flags", "").split())
    return {
        "model": info.get("model name", platform.processor()),
        "vendor": info.get("vendor_id", ""),
        "family": _integer(info.get("cpu family")),
        "model_number": _integer(info.get("model")),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "flags": sorted(flags & MATMUL_FLAGS),
    }


def _integer(value: str | None) -> int | None:
    """A /proc/cpuinfo number, or None where it is missing or not a decimal integer."""
    return int(value) if value is not None and value.isdigit() else None


def mkl_without_avx512() -> bool:
    """Whether torch's float32 GEMMs run MKL's AVX2 code on an AVX-512 CPU here: a non-Intel
    CPU with AVX-512, an AMD one say (MKL takes its generic path on non-Intel CPUs;
    `MKL_VERBOSE` says "Intel(R) Architecture processors"), torch dispatching AVX-512, MKL and
    oneDNN built in. The vendor is read from /proc/cpuinfo: False where there is none (Linux
    only). Where `linear_backend` sends linear maps to oneDNN, and the kernels' GEMMs go to
    oneDNN's micro-kernel (`native.kernel_gemm`, which `kernel_rule` reads). Found once per
    process (`linear_backend` asks at import); under torch.compile before that, False: a
    graph never traces the read."""
    if "mkl_without_avx512" not in _found:
        if torch.compiler.is_compiling():
            return False
        features = cpu_features()
        _found["mkl_without_avx512"] = (
            features["vendor"] not in ("", "GenuineIntel")
            and features["capability"] == "AVX512"
            and torch.backends.mkl.is_available()
            and torch.backends.mkldnn.is_available()
        )
    return _found["mkl_without_avx512"]


def _median_seconds(a: torch.Tensor, repeats: int = 3) -> float:
    torch.mm(a, a)  # warm-up: oneDNN builds its kernel on the first call
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        torch.mm(a, a)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def bf16_support(device: str | torch.device = "cpu") -> Bf16Support:
    """Measures (once per process and device type) whether bf16 compute is native.

    Args:
        device: a device or device type ("cpu", "cuda:1", ...): each type is probed once.

    Returns:
        The verdict, with the measured slowdown on CPU (the probe costs under 0.1 s).
    """
    return _probe(torch.device(device).type)


@functools.cache
def _probe(device: str) -> Bf16Support:
    """`bf16_support` of one device type (cached: "cpu" and "cpu:0" share one probe)."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
        return Bf16Support(
            device=device,
            native=torch.cuda.is_bf16_supported(including_emulation=False),
            slowdown=float("nan"),
            capability=name,
        )
    a = torch.randn(PROBE_SIZE, PROBE_SIZE)
    # One thread: a multi-threaded float32 matmul this small slows tenfold on a busy machine
    # (its threads wait on each other), which would hide an emulated bf16.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        slowdown = _median_seconds(a.bfloat16()) / _median_seconds(a)
    finally:
        torch.set_num_threads(threads)
    return Bf16Support(
        device=device,
        native=slowdown <= SLOW_FACTOR,
        slowdown=slowdown,
        capability=torch.backends.cpu.get_cpu_capability(),
    )


def warn_if_bf16_is_slow(device: str, alternative: str) -> Bf16Support:
    """Logs one WARNING (once per process, device and advice) when bf16 is emulated here.

    Call it before a run that asked for bf16 starts; the run still goes ahead in bf16.

    Args:
        device: the device type the run uses (cpu or cuda).
        alternative: how to get full speed instead, e.g. "--precision fp32".

    Returns:
        What the probe found.
    """
    support = bf16_support(torch.device(device).type)
    if not support.native and (support.device, alternative) not in _warned:
        _warned.add((support.device, alternative))
        logger.warning(
            "bf16 was asked for, but %s, so expect matmul-heavy work to run many times slower "
            "than in float32 (it still runs in bf16, as asked). For full speed use %s.",
            support.describe(),
            alternative,
        )
    return support


def bf16_autocast(device: str | torch.device, *, enabled: bool, alternative: str) -> torch.autocast:
    """The bf16 autocast context of a run (disabled unless `enabled`), warning first where
    bf16 is emulated.

    Args:
        device: the run's device.
        enabled: whether the run asked for bf16.
        alternative: the float32 way to run instead, named in the warning.

    Returns:
        A reusable `torch.autocast` context.
    """
    device_type = torch.device(device).type
    if enabled:
        warn_if_bf16_is_slow(device_type, alternative)
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=enabled)
