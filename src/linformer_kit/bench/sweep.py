"""The sweep behind `linformer bench`: every variant x sequence length x k x scope, timed
interleaved in one run next to the machine's own matmul ceilings, with peak memory, FLOP
rates, budget skipping and the JSON + CSV + PNG outputs."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import itertools
import logging
import os
import statistics
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..files import atomic_write, check_replaceable, exclusive, save_json
from ..precision import warn_if_bf16_is_slow
from ..training.compare import machine
from ..training.settings import keep_freed_memory
from .flops import Shape, matmul_flops
from .settings import MODES, BenchSettings, split_ints, split_names
from .summary import summarise
from .timing import (
    Call,
    autocast_error,
    make_step,
    matmul_step,
    peak_memory,
    size_ceiling_matmul,
    time_interleaved,
)
from .variants import compile_limits, estimate_bytes, peer_available, variant_flops

logger = logging.getLogger(__name__)

RESULT_NAME, TABLE_NAME = "bench.json", "bench.csv"
TABLE_BEGINS = "scope,"  # the CSV's header, in `_row`'s order (every version's)
PLOT_NAMES = ("scaling.png", "grid.png", "peers.png")  # what `plots.plot_result` draws
EMULATED = "emulated"  # the status of a bf16 row on a CPU without native bf16


def _nothing_to_project(call: Call) -> bool:
    """A Linformer variant whose k is not below n (k > n cannot even be built)."""
    return not call.variant.exact and call.shape.proj_dim >= call.shape.seq_len


def _skip_reason(call: Call, settings: BenchSettings, ceiling_flops_s: float) -> str | None:
    """Why a configuration is not run (None: run it), from estimates made before running."""
    shape, variant = call.shape, call.variant
    if _nothing_to_project(call):
        return f"k = {shape.proj_dim} >= n = {shape.seq_len}: nothing to project"
    if variant.kind not in ("ours", "sdpa", "naive") and not peer_available(variant.kind):
        return f"{variant.name} is not installed (pip install 'linformer-kit[bench]')"
    gib = estimate_bytes(variant, shape, call.scope, backward=call.backward) / 2**30
    if gib > settings.memory_budget_gb:
        return f"estimated {gib:.1f} GiB > memory budget {settings.memory_budget_gb:g} GiB"
    # Assume a third of the matmul ceiling: a pessimistic guess for a memory-bound variant.
    # Every round calls each step twice (`time_interleaved`: a settling call, the timed one).
    flops = variant_flops(variant, shape, call.scope, backward=call.backward)
    seconds = flops / (ceiling_flops_s / 3) * 2 * (settings.warmup + settings.repeats)
    if seconds > settings.time_budget_s:
        return f"estimated {seconds:.0f} s > time budget {settings.time_budget_s:g} s"
    return None


def _calls(settings: BenchSettings, seq_len: int) -> list[Call]:
    """The configurations at one sequence length: scope x dtype x variant x k (exact ones
    once)."""
    calls = []
    for scope, dtype in itertools.product(split_names(settings.scope), split_names(settings.dtype)):
        for variant in settings.variants():
            for proj_dim in [None] if variant.exact else split_ints(settings.proj_dim):
                shape = Shape(
                    batch_size=settings.batch_size,
                    seq_len=seq_len,
                    dim=settings.dim,
                    num_heads=settings.num_heads,
                    proj_dim=proj_dim,
                    ffn_dim=4 * settings.dim,
                )
                calls.append(
                    Call(
                        variant=variant,
                        shape=shape,
                        scope=scope,
                        backward=MODES[settings.mode],
                        dtype=dtype,
                        device=settings.device,
                        threads=settings.threads,
                    )
                )
    return calls


def _key(call: Call) -> str:
    k = "" if call.shape.proj_dim is None else f" k={call.shape.proj_dim}"
    return f"{call.scope} {call.dtype}: {call.variant.name}{k} n={call.shape.seq_len}"


def _row(
    call: Call, ceilings: tuple[float, float] | None, seconds: list[float] | None
) -> dict[str, Any]:
    """One result row; `ceilings`: the probe's FLOP/s by its median and by its fastest round,
    for the ceiling fraction by median and by best-of-rounds times (interference only adds
    time, to both)."""
    flops = (
        None
        if _nothing_to_project(call)
        else variant_flops(call.variant, call.shape, call.scope, backward=call.backward)
    )
    row: dict[str, Any] = {
        "scope": call.scope,
        "dtype": call.dtype,
        "variant": call.variant.name,
        "kind": call.variant.kind,
        "sharing": call.variant.sharing,
        "kernel": call.variant.kernel,
        "compile": call.variant.compile,
        "attention_dropout": call.variant.attention_dropout,
        "n": call.shape.seq_len,
        "k": call.shape.proj_dim,
        "status": "ok",
        "reason": "",
        "median_ms": None,
        "min_ms": None,
        "gflop": None if flops is None else flops / 1e9,
        "gflop_per_s": None,
        "ceiling_fraction": None,
        "ceiling_fraction_best": None,
        "peak_mem_mb": None,
        "speedup_vs_sdpa": None,
        "memory_saving_vs_sdpa": None,
        "speedup_vs_naive": None,
        "memory_saving_vs_naive": None,
    }
    if seconds:
        median = statistics.median(seconds)
        row.update(
            median_ms=median * 1e3, min_ms=min(seconds) * 1e3, gflop_per_s=flops / median / 1e9
        )
        if ceilings:
            row["ceiling_fraction"] = flops / median / ceilings[0]
            row["ceiling_fraction_best"] = flops / min(seconds) / ceilings[1]
        row["times_ms"] = [s * 1e3 for s in seconds]
    return row


def _compare_to_exact(rows: list[dict[str, Any]]) -> None:
    """Adds each row's speed-up and memory saving over exact SDPA (today's baseline) and over
    naive exact attention (the paper's), at the same scope, n, attention dropout and
    torch.compile setting."""

    def key(r: dict[str, Any]) -> tuple:
        return r["scope"], r["dtype"], r["n"], r["attention_dropout"], r.get("compile")

    for kind in ("sdpa", "naive"):
        base = {key(r): r for r in rows if r["kind"] == kind and r["status"] == "ok"}
        for row in rows:
            ref = base.get(key(row))
            if ref is None or row["status"] != "ok":
                continue
            row[f"speedup_vs_{kind}"] = ref["median_ms"] / row["median_ms"]
            if ref["peak_mem_mb"] and row["peak_mem_mb"]:
                row[f"memory_saving_vs_{kind}"] = ref["peak_mem_mb"] / row["peak_mem_mb"]


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    """Runs the sweep and writes bench.json, bench.csv and the plots into `settings.out`.

    For each n, one interleaved timing run holds every variant of every scope and k plus
    the fp32 and bf16 matmul ceilings, so ratios and ceiling fractions come from the same
    minutes of the same machine; on CPU glibc keeps freed memory in this process while it
    times (`settings.keep_freed_memory`, as training does). Peak memory is measured
    afterwards, one fresh process per configuration, with glibc's defaults.

    Returns:
        The result: settings, machine (with load averages before and after), ceilings and
        one row per configuration.
    """
    out = Path(settings.out)  # a user's file of these names was replaced (plots: removed)
    check_replaceable(out / RESULT_NAME, "json")
    check_replaceable(out / TABLE_NAME, "text", begins=TABLE_BEGINS)
    for name in PLOT_NAMES:
        check_replaceable(out / name, "png")
    with exclusive(out, "bench run"):  # two into one folder removed each other's plots
        return _sweep(settings)


def _sweep(settings: BenchSettings) -> dict[str, Any]:
    """`run_bench` with its folder held."""
    from .plots import plot_result

    if settings.threads:
        torch.set_num_threads(settings.threads)
    # Process-wide; peak memory is measured in fresh processes with glibc's defaults.
    kept = settings.device == "cpu" and settings.keep_freed_memory and keep_freed_memory()
    before = machine()
    dtypes = split_names(settings.dtype)
    # Only the dtypes asked for: a bf16 probe where bf16 is emulated costs minutes.
    bf16 = (
        warn_if_bf16_is_slow(settings.device, "--dtype float32") if "bfloat16" in dtypes else None
    )
    sizes, first_ceiling = {}, {}
    for dtype in dtypes:
        sizes[dtype], seconds = size_ceiling_matmul(
            dtype, settings.device, limit=16384 if settings.device == "cuda" else 4096
        )
        first_ceiling[dtype] = matmul_flops(sizes[dtype]) / seconds
    ceiling_steps = {f"matmul {d}": matmul_step(sizes[d], d, settings.device) for d in dtypes}
    seq_lens = split_ints(settings.n)
    rows, ceilings, best_ceilings = [], {}, {}

    def result() -> dict[str, Any]:
        table = [row for _, row in rows]
        _compare_to_exact(table)
        return {
            "settings": dataclasses.asdict(settings),
            "machine": before,
            "load_avg_after": os.getloadavg(),
            "freed_memory_kept": kept,
            "flop_convention": "matmul FLOPs (2 per multiply-add), backward = 2x forward; see "
            "linformer_kit.bench.flops",
            "ceiling_matmul_size": sizes,
            "bf16": bf16.to_dict() if bf16 else None,
            "ceiling_gflop_per_s": {str(n): c for n, c in ceilings.items()},
            "ceiling_gflop_per_s_best": {str(n): c for n, c in best_ceilings.items()},
            "summary": summarise(table),
            "rows": table,
        }

    def time_runnable(seq_len: int, runnable: list[tuple[Call, None]], bar: tqdm) -> None:
        """Times the configurations to run at one n, beside the matmul ceiling."""
        steps = {}
        for call, _ in runnable:
            if call.variant.compile:  # seconds to a minute each: say what it is doing
                bar.set_postfix_str(f"n={seq_len}, compiling {_key(call)}")
            steps[_key(call)] = make_step(call)
        steps.update(ceiling_steps)
        bar.set_postfix(n=seq_len)
        times = time_interleaved(
            steps,
            warmup=settings.warmup,
            repeats=settings.repeats,
            device=settings.device,
            min_seconds=settings.min_time_s,
            tick=lambda: bar.update(1),
        )
        del steps
        if compiling:
            torch._dynamo.reset()  # this n's compiled code is not needed again
        flop_s = {d: tuple(matmul_flops(sizes[d]) / pick(times[f"matmul {d}"])
                           for pick in (statistics.median, min)) for d in dtypes}  # fmt: skip
        ceilings[seq_len] = {d: f[0] / 1e9 for d, f in flop_s.items()}
        best_ceilings[seq_len] = {d: f[1] / 1e9 for d, f in flop_s.items()}
        for call, _ in runnable:
            row = _row(call, flop_s[call.dtype], times[_key(call)])
            if call.dtype != "float32":
                row["relative_error_vs_float32"] = autocast_error(call)
                if not bf16.native:
                    row.update(status=EMULATED, reason=f"not a result: {bf16.describe()}")
            rows.append((call, row))

    if (Path(settings.out) / RESULT_NAME).is_file():
        logger.info(
            "%s holds an earlier run's results: replaced once the first n is timed (give "
            "--out another folder to keep them)",
            settings.out,
        )
    rounds = len(seq_lens) * (settings.warmup + settings.repeats)
    compiling = bool(split_names(settings.compile))
    limits = compile_limits() if compiling else contextlib.nullcontext()
    with tqdm(total=rounds, desc="timing", unit="round") as bar, limits:
        for seq_len in seq_lens:
            runnable, skipped = [], []
            for call in _calls(settings, seq_len):
                reason = _skip_reason(call, settings, first_ceiling[call.dtype])
                (skipped if reason else runnable).append((call, reason))
            if runnable:
                time_runnable(seq_len, runnable, bar)
            else:  # the ceiling alone, timed for no row: --repeats 10**12 ran on
                bar.update(settings.warmup + settings.repeats)
            _add_rows(rows, skipped)
            # Written after each n, so a run stopped early keeps the lengths it finished; the
            # first write removes an earlier run's plots, which no longer describe the JSON.
            if seq_len == seq_lens[0]:
                _remove_earlier_plots(Path(settings.out))
            write_outputs(result(), Path(settings.out))
    interrupted = None
    try:
        if settings.memory:
            # Not the compiled variants: on CPU the compile's own memory would count.
            measured = [(c, r) for c, r in rows if r["status"] == "ok" and not c.variant.compile]
            for call, row in tqdm(measured, desc="peak memory", unit="config"):
                row["peak_mem_mb"] = peak_memory(call) / 2**20
    except KeyboardInterrupt as err:  # the longest phase: keep the timings and peaks so far
        logger.warning(
            "interrupted while measuring peak memory: %s keeps every timing and the peaks "
            "measured so far, with its plots",
            settings.out,
        )
        interrupted = err
    final = result()
    write_outputs(final, Path(settings.out))
    plot_result(final, Path(settings.out), title=_title(settings))
    if interrupted is not None:
        raise interrupted
    return final


def _add_rows(rows: list[tuple[Call, dict[str, Any]]], skipped: list[tuple[Call, str]]) -> None:
    """Adds the rows of configurations not run, each with why."""
    for call, reason in skipped:
        row = _row(call, None, None)
        row.update(status="skipped", reason=reason)
        rows.append((call, row))


def _title(settings: BenchSettings) -> str:
    dtypes = " + ".join(split_names(settings.dtype))
    return (
        f"{settings.mode}, {dtypes}, dim {settings.dim}, {settings.num_heads} heads, "
        f"batch {settings.batch_size}, {settings.device}"
    )


def _remove_earlier_plots(out: Path) -> None:
    for name in PLOT_NAMES:
        (out / name).unlink(missing_ok=True)


def write_outputs(result: dict[str, Any], out: Path) -> None:
    """Writes the result as CSV (one line per row, no raw times) and JSON (everything),
    each whole or not at all (an interrupt left a truncated JSON or a CSV of other rows)."""
    rows = result["rows"]
    # Every row's keys, in order of first appearance: bf16 rows add relative_error_vs_float32.
    columns = [c for c in dict.fromkeys(key for row in rows for key in row) if c != "times_ms"]

    def write_table(path: Path) -> None:
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)

    atomic_write(out / TABLE_NAME, write_table)
    save_json(result, out / RESULT_NAME)
