"""Shapes, variants and settings shared by the benchmark tests (tiny sizes, one repeat)."""

from __future__ import annotations

from linformer_kit.bench import BenchSettings, Shape, Variant, default_variants

SHAPE = Shape(batch_size=2, seq_len=64, dim=32, num_heads=4, proj_dim=16, ffn_dim=128)
OURS = {v.sharing: v for v in default_variants(sharings=("none", "headwise", "kv"), peers=False)}
SDPA, NAIVE = Variant(name="exact sdpa", kind="sdpa"), Variant(name="exact naive", kind="naive")


def tiny_settings(tmp_path, **changes) -> BenchSettings:
    """A sweep of two short lengths, one repeat, no memory runs; `changes` override it."""
    base = dict(
        n="32,64",
        proj_dim="16",
        dim=32,
        num_heads=2,
        sharing="headwise,kv",
        repeats=1,
        min_time_s=0.0,
        warmup=0,
        memory=False,
        keep_freed_memory=False,  # process-wide: not in the test process
        threads=1,
        out=str(tmp_path / "bench"),
    )
    return BenchSettings(**{**base, **changes})
