"""Timing (warm-up, interleaved repeats, median; CUDA events on a GPU) and peak memory
(a fresh process per configuration on CPU, the allocator's peak on CUDA)."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import signal
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..kernel_rule import use_kernel
from ..linear_backend import linear
from ..training.settings import compiled_backward
from .flops import Shape
from .settings import DTYPES
from .variants import Variant, build_variant


@dataclass(frozen=True, kw_only=True)
class Call:
    """Everything that defines one timed call; picklable, for the memory subprocess."""

    variant: Variant
    shape: Shape
    scope: str  # attention or layer
    backward: bool  # forward + backward (training) or forward only (inference)
    dtype: str  # float32, or bfloat16 through autocast
    device: str  # cpu or cuda
    threads: int  # CPU threads; 0 keeps torch's default
    seed: int = 0


def make_step(call: Call) -> Callable[[], None]:
    """Builds the variant and its input and returns one call to time (`module_step`); in
    inference the module is in eval mode. A compiled variant is called three times first:
    compiled, and its CUDA graphs recorded (reduce-overhead records on the third call),
    before anything is timed."""
    torch.manual_seed(call.seed)
    module = build_variant(call.variant, call.shape, call.scope).to(call.device)
    shape = (call.shape.batch_size, call.shape.seq_len, call.shape.dim)
    x = torch.randn(shape, device=call.device, requires_grad=call.backward)
    module.train(call.backward)
    autocast = None if call.dtype == "float32" else DTYPES[call.dtype]
    step = module_step(
        module, x, backward=call.backward, autocast=autocast, compile=call.variant.compile
    )
    for _ in range(3 if call.variant.compile else 0):
        step()
    return step


def module_step(
    module: nn.Module,
    x: Tensor,
    *,
    backward: bool,
    autocast: torch.dtype | None = None,
    kernel: str | None = None,
    compile: str | None = None,
) -> Callable[[], None]:
    """One call of `module` on x to time, as the benchmarks all make it.

    With backward: forward, then backward of one fixed random gradient shaped like x (the
    module's output, or its first output where it returns a tuple, must have x's shape),
    the gradients of x and of the module's parameters cleared before each call so calls
    never accumulate into `.grad`; give x `requires_grad` to time its gradient as well, as
    the input of a layer inside a network needs it. Without: the forward under
    `torch.inference_mode`.

    Args:
        module: the module (or compiled module) to call; its train/eval mode is the caller's.
        x: its input.
        backward: forward + backward (training) or forward only (inference).
        autocast: run the forward under autocast to this dtype (None: as x is).
        kernel: pin the attention kernel of every call (`kernel_rule.use_kernel`; None: as
            pinned around the call, else the rule's). A module that pins its own (the
            bench's `FirstOutput`, built from a `Variant`) overrides it.
        compile: the module's torch.compile setting: one ending in "+autograd" runs each
            call under compiled autograd (`training.settings.compiled_backward`).
    """
    grad = torch.randn_like(x)
    params = list(module.parameters())

    def forward() -> Tensor:
        with contextlib.ExitStack() as stack:
            if kernel is not None:
                stack.enter_context(use_kernel(kernel))
            if autocast is not None:
                stack.enter_context(torch.autocast(x.device.type, dtype=autocast))
            out = module(x)
        return out[0] if isinstance(out, tuple) else out

    def step() -> None:
        if not backward:
            with torch.inference_mode():
                forward()
            return
        x.grad = None
        for p in params:
            p.grad = None
        with compiled_backward(compile):
            out = forward()
            out.backward(grad.to(out.dtype))

    return step


def autocast_error(call: Call) -> float:
    """Relative error ||y - y32|| / ||y32|| of the forward output under the call's autocast
    dtype (not float32) against float32, same weights and input; eager (a compiled
    variant's error is its eager one's, without two more compiles)."""
    torch.manual_seed(call.seed)
    variant = dataclasses.replace(call.variant, compile=None)
    module = build_variant(variant, call.shape, call.scope).to(call.device).eval()
    x = torch.randn(call.shape.batch_size, call.shape.seq_len, call.shape.dim, device=call.device)
    with torch.inference_mode():
        reference = module(x)
        with torch.autocast(call.device, dtype=DTYPES[call.dtype]):
            low = module(x).float()
    return float((low - reference).norm() / reference.norm())


def matmul_step(size: int, dtype: str, device: str) -> Callable[[], None]:
    """One (size x size) @ (size x size)^T matmul in `dtype` on the library the layers' linear
    maps use (`linear_backend`: oneDNN on AMD CPUs with AVX-512, where MKL's is half as
    fast, else torch's): the machine's ceiling."""
    a = torch.randn(size, size, device=device, dtype=DTYPES[dtype])
    b = torch.randn(size, size, device=device, dtype=DTYPES[dtype])
    return lambda: linear(a, b)


def size_ceiling_matmul(
    dtype: str, device: str, *, target_s: float = 0.1, start: int = 256, limit: int = 16384
) -> tuple[int, float]:
    """Grows a square matmul in `dtype` until one call takes about `target_s`, so that the
    ceiling probe costs the same time on every machine, whether `dtype` runs at 1 GFLOP/s
    (emulated bf16) or at hundreds.

    Args:
        dtype: float32 or bfloat16.
        device: cpu or cuda.
        target_s: the time one call should take.
        start: the first size tried.
        limit: the largest size (the growth stops there, whatever the time).

    Returns:
        The size, and the seconds one call of it took (the best of two after a warm-up).
    """
    size = start
    while True:
        step = matmul_step(size, dtype, device)
        step()
        seconds = min(_seconds(step, device) for _ in range(2))
        if seconds >= target_s / 2 or size >= limit:
            return size, seconds
        # Time grows as size^3; at most 4x per try, since tiny calls time noisily. Above 1024
        # in multiples of 512: oneDNN ran 2432 at 406 GFLOP/s where 2048 and 2560 ran 434
        # and 444 (Zen 5, 2 threads), which read the layers 7 % nearer the ceiling.
        growth = min(4.0, (target_s / max(seconds, 1e-9)) ** (1 / 3))
        quantum = 512 if size * growth > 1024 else 64
        size = min(limit, -(-int(size * growth) // quantum) * quantum)


def _seconds(step: Callable[[], None], device: str) -> float:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    step()
    return time.perf_counter() - begin


def time_interleaved(
    steps: dict[str, Callable[[], None]],
    *,
    warmup: int,
    repeats: int,
    device: str,
    min_seconds: float = 0.0,
    max_repeats: int = 100,
    tick: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """Times every step in interleaved rounds: each round runs each step once, in an order
    rotated by one per round, so load from other processes falls on all steps alike.

    Each timed call directly follows an untimed call of the same step, as a training step
    follows the previous one. Otherwise a step is timed just after another variant
    (rotation changes who starts a round, never who precedes whom), with that variant's
    data in the caches and its freed memory in the allocator. On CPU two identical steps,
    our attention layer under `kv` and `layerwise` sharing, then timed 10-23 % apart at
    n = 1024 (the one after linformer-pytorch slower) and 2-3 % apart with the settling
    call. On CUDA (H200, B 1, n 4096, fp32 attention layer, two runs each) the same pair
    read 3.93 / 3.93 ms against 2.92 / 2.99 (kv after linformer-pytorch) and 2.67 / 2.75
    against 2.70 / 2.53 with it (`benchmarks/kernels/cuda/settle/`).

    Args:
        steps: name -> a call to time.
        warmup: untimed rounds first.
        repeats: timed rounds, at least.
        device: cpu or cuda (CUDA events, synchronised).
        min_seconds: keep adding timed rounds (up to `max_repeats`) until the timed rounds
            have taken this long: cheap configurations get more samples on a noisy machine.
        max_repeats: most timed rounds.
        tick: called after every round (a progress bar's update).

    Returns:
        name -> seconds of each timed call.
    """
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    round_, began = 0, time.perf_counter()
    while round_ < warmup + repeats or (
        time.perf_counter() - began < min_seconds and round_ < warmup + max_repeats
    ):
        if round_ == warmup:
            began = time.perf_counter()
        shift = round_ % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            steps[name]()  # settles caches and allocator to this step's own state
            seconds = _seconds(steps[name], device)
            if round_ >= warmup:
                times[name].append(seconds)
        round_ += 1
        tick()
    return times


def _resident_bytes(field: str) -> int:
    """A line of /proc/self/status in bytes: VmRSS (now) or VmHWM (high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_in_this_process(call: Call) -> int:
    """Peak bytes that building `call` and running it once add: on CPU the growth of the
    resident set's high-water mark over the resident set before (the mark is reset first,
    after a tiny warm-up run, so what this process did earlier does not count); on CUDA the
    allocator's peak."""
    if call.threads:
        torch.set_num_threads(call.threads)
    if call.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        make_step(call)()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    # A tiny run first, so the libraries' one-off buffers (thread pools, BLAS) are not
    # counted as this configuration's memory.
    tiny = dataclasses.replace(call.shape, seq_len=64, proj_dim=call.shape.proj_dim and 32)
    make_step(dataclasses.replace(call, shape=tiny))()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    base = _resident_bytes("VmRSS")
    make_step(call)()
    return _resident_bytes("VmHWM") - base


def peak_memory(call: Call) -> int:
    """Peak memory in bytes of building the module and input and running one call.

    On CPU (Linux) it runs in a fresh process forked from a clean server that has only
    imported this module (fast, and no other configuration's allocations in it); on CUDA
    in this process, with the allocator's peak reset.
    """
    if call.device == "cuda":
        return _peak_in_this_process(call)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    with ProcessPoolExecutor(1, mp_context=context, initializer=_ignore_interrupts) as pool:
        future = pool.submit(_peak_in_this_process, call)
        try:
            return future.result()
        except KeyboardInterrupt:  # the measurement is dropped: not waited for
            for process in pool._processes.values():  # noqa: SLF001 (no public handle)
                process.terminate()
            raise


def _ignore_interrupts() -> None:
    """A memory worker's start: the terminal's Ctrl-C, which reaches the whole process
    group, is the parent's to handle (the worker printed a traceback of its own)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
