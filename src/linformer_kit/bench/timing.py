"""Timing (warm-up, interleaved repeats, median; CUDA events on a GPU) and peak memory
(a fresh process per configuration on CPU, the allocator's peak on CUDA)."""

from __future__ import annotations

import contextlib
import multiprocessing
import resource
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from .flops import Shape
from .variants import Variant, build_variant

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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


def _autocast(call: Call) -> contextlib.AbstractContextManager:
    if call.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(call.device, dtype=DTYPES[call.dtype])


def make_step(call: Call) -> Callable[[], None]:
    """Builds the variant and its input and returns one call to time.

    In inference the module is in eval mode under `torch.inference_mode`; with backward
    the input requires its gradient (as the input of a layer inside a network does) and the
    gradients are cleared before each call, so calls never accumulate into `.grad`.
    """
    torch.manual_seed(call.seed)
    module = build_variant(call.variant, call.shape, call.scope).to(call.device)
    shape = (call.shape.batch_size, call.shape.seq_len, call.shape.dim)
    x = torch.randn(shape, device=call.device, requires_grad=call.backward)
    grad = torch.randn(shape, device=call.device)
    params = list(module.parameters())
    module.train(call.backward)

    def step() -> None:
        if call.backward:
            x.grad = None
            for p in params:
                p.grad = None
            with _autocast(call):
                out = module(x)
            out.backward(grad.to(out.dtype))
        else:
            with torch.inference_mode(), _autocast(call):
                module(x)

    return step


def matmul_step(size: int, dtype: str, device: str) -> Callable[[], None]:
    """One (size x size) @ (size x size) matmul in `dtype`: the machine's ceiling."""
    a = torch.randn(size, size, device=device, dtype=DTYPES[dtype])
    b = torch.randn(size, size, device=device, dtype=DTYPES[dtype])
    return lambda: torch.mm(a, b)


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
    tick: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """Times every step `repeats` times, interleaved: each round runs each step once, in an
    order rotated by one per round, so load from other processes falls on all steps alike.

    Args:
        steps: name -> a call to time.
        warmup: untimed rounds first.
        repeats: timed rounds.
        device: cpu or cuda (CUDA events, synchronised).
        tick: called after every round (a progress bar's update).

    Returns:
        name -> seconds of each timed call.
    """
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + repeats):
        shift = round_ % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            seconds = _seconds(steps[name], device)
            if round_ >= warmup:
                times[name].append(seconds)
        tick()
    return times


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _peak_in_this_process(call: Call) -> int:
    """Peak bytes one call of `call` adds: RSS high-water mark growth on CPU (so this
    process must be fresh), the caching allocator's peak on CUDA."""
    if call.threads:
        torch.set_num_threads(call.threads)
    if call.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _max_rss_bytes()
    make_step(call)()
    if call.device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return _max_rss_bytes() - base


def peak_memory(call: Call) -> int:
    """Peak memory in bytes of building the module and input and running one call.

    On CPU it runs in a fresh 'spawn' process (whose RSS high-water mark then belongs to
    this configuration alone); on CUDA in this process, with the allocator's peak reset.
    """
    if call.device == "cuda":
        with _released_cuda_cache():
            return _peak_in_this_process(call)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_peak_in_this_process, call).result()


@contextlib.contextmanager
def _released_cuda_cache() -> Iterator[None]:
    torch.cuda.empty_cache()
    yield
    torch.cuda.empty_cache()


def parameter_count(module: nn.Module) -> int:
    """Parameters of a module (shared tensors once)."""
    return sum(p.numel() for p in module.parameters())
