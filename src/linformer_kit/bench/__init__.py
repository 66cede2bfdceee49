"""Efficiency benchmarks: timing, peak memory, FLOP rates, sweeps, tables and plots."""

from .flops import Shape
from .settings import BenchSettings
from .sweep import run_bench
from .timing import Call, make_step, peak_memory, time_interleaved
from .variants import Variant, build_variant, default_variants, variant_flops

__all__ = [
    "BenchSettings",
    "Call",
    "Shape",
    "Variant",
    "build_variant",
    "default_variants",
    "make_step",
    "peak_memory",
    "run_bench",
    "time_interleaved",
    "variant_flops",
]
