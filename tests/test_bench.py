"""The benchmark toolkit: FLOP formulas, variants, the sweep and its settings, budgets, outputs,
summaries and plots (the timing itself: test_bench_timing.py).

No wall-clock asserts: structure, counts and files only, on tiny sizes with one repeat.
"""

import csv
import dataclasses
import json
import re
import statistics
from pathlib import Path

import matplotlib.colors
import pytest
import torch
from bench_helpers import NAIVE, OURS, SDPA, SHAPE, tiny_settings

from linformer_kit import precision
from linformer_kit.bench import (
    Variant,
    build_variant,
    default_variants,
    plots,
    run_bench,
    sweep,
    variant_flops,
)
from linformer_kit.bench.flops import (
    exact_attention_flops,
    linformer_attention_flops,
    matmul_flops,
)
from linformer_kit.bench.summary import summarise
from linformer_kit.bench.timing import Call
from linformer_kit.bench.variants import NaiveAttention, estimate_bytes
from linformer_kit.files import exclusive


def test_flop_formulas_match_hand_counts():
    b, n, d, k, f = 2, 64, 32, 16, 128
    assert exact_attention_flops(SHAPE) == 8 * b * n * d * d + 4 * b * n * n * d
    mapped_then_projected = 8 * b * n * d * d + 4 * b * n * k * d + 4 * b * n * k * d
    assert linformer_attention_flops(SHAPE, input_first=False, shared_kv=False) == (
        mapped_then_projected
    )
    # (E X) W: q and out on n rows, k and v on k rows, one input projection when E = F.
    input_first = 4 * b * n * d * d + 4 * b * k * d * d + 4 * b * n * k * d + 2 * b * n * k * d
    assert linformer_attention_flops(SHAPE, input_first=True, shared_kv=True) == input_first
    layer = variant_flops(SDPA, SHAPE, "layer", backward=True)
    assert layer == 3 * (exact_attention_flops(SHAPE) + 4 * b * n * d * f)
    assert matmul_flops(64) == 2 * 64**3  # the ceiling: halved, every fraction doubled


def test_ours_counts_the_order_it_runs():
    long = dataclasses.replace(SHAPE, seq_len=4096, proj_dim=64)
    module = build_variant(OURS["kv"], long, "attention").module
    assert module.projects_input_first(long.seq_len)
    assert variant_flops(OURS["kv"], long, "attention", backward=False) == (
        linformer_attention_flops(long, input_first=True, shared_kv=True)
    )
    per_head = linformer_attention_flops(long, input_first=False, shared_kv=False)
    assert variant_flops(OURS["none"], long, "attention", backward=False) == per_head
    assert variant_flops(OURS["headwise"], long, "attention", backward=False) == (
        linformer_attention_flops(long, input_first=True, shared_kv=False)
    )  # E and F: two input projections (counted as one, its GFLOP/s read high)


@pytest.mark.parametrize("scope", ["attention", "layer"])
@pytest.mark.parametrize("variant", [*OURS.values(), SDPA, NAIVE], ids=lambda v: v.name)
def test_every_variant_maps_b_n_dim_to_itself(variant, scope):
    x = torch.randn(SHAPE.batch_size, SHAPE.seq_len, SHAPE.dim)
    assert build_variant(variant, SHAPE, scope)(x).shape == x.shape


def test_naive_exact_equals_sdpa_exact_with_the_same_weights():
    sdpa = build_variant(SDPA, SHAPE, "attention").module
    naive = NaiveAttention(dim=SHAPE.dim, num_heads=SHAPE.num_heads)
    naive.load_state_dict(sdpa.state_dict())
    x = torch.randn(SHAPE.batch_size, SHAPE.seq_len, SHAPE.dim)
    torch.testing.assert_close(naive(x)[0], sdpa(x)[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["lucidrains", "linformer-pytorch"])
@pytest.mark.parametrize("scope", ["attention", "layer"])
def test_peers_build_with_the_same_shape(kind, scope):
    pytest.importorskip({"lucidrains": "linformer"}.get(kind, "linformer_pytorch"))
    variant = Variant(name=kind, kind=kind, sharing="headwise")
    x = torch.randn(SHAPE.batch_size, SHAPE.seq_len, SHAPE.dim)
    assert build_variant(variant, SHAPE, scope)(x).shape == x.shape
    mapped_then_projected = linformer_attention_flops(SHAPE, input_first=False, shared_kv=False)
    assert variant_flops(variant, SHAPE, "attention", backward=False) == mapped_then_projected


def test_sweep_writes_json_csv_and_plots(tmp_path, monkeypatch):
    def no_bf16_probe(device):
        raise AssertionError("a float32 bench must not probe bf16")

    monkeypatch.setattr(precision, "bf16_support", no_bf16_probe)
    settings = tiny_settings(tmp_path)
    result = run_bench(settings)
    out = tmp_path / "bench"
    saved = json.loads((out / "bench.json").read_text())
    assert saved["settings"]["n"] == "32,64"
    assert len(saved["machine"]["load_avg_1_5_15min"]) == 3 and len(saved["load_avg_after"]) == 3
    # Only the dtype asked for is probed: no bf16 matmul, no bf16 verdict.
    assert set(saved["ceiling_gflop_per_s"]["64"]) == {"float32"}
    assert set(saved["ceiling_matmul_size"]) == {"float32"} and saved["bf16"] is None
    assert saved["freed_memory_kept"] is False
    # 2 n x 2 scopes x (2 sharings + sdpa + naive), all run; one time each.
    assert len(result["rows"]) == 16
    for row in result["rows"]:
        assert row["status"] == "ok" and len(row["times_ms"]) == 1
        assert row["gflop_per_s"] > 0 and row["ceiling_fraction"] > 0
        # by best-of-rounds times against the probe's fastest round
        best_ceiling = saved["ceiling_gflop_per_s_best"][str(row["n"])]["float32"] * 1e9
        best = row["gflop"] * 1e9 / (row["min_ms"] / 1e3) / best_ceiling
        assert row["ceiling_fraction_best"] == pytest.approx(best)
    sdpa = [r for r in result["rows"] if r["kind"] == "sdpa"]
    assert all(r["speedup_vs_sdpa"] == 1.0 for r in sdpa)
    with open(out / "bench.csv") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 16 and "times_ms" not in table[0]
    for name in ("scaling.png", "grid.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert not (out / "peers.png").exists()  # no peers timed


def test_a_sweep_stopped_early_keeps_the_lengths_it_finished(tmp_path, monkeypatch, caplog):
    # bench.json is rewritten after every n: a run killed at a deadline (the GPU runbook's)
    # keeps what it timed, and no earlier run's plots beside it (they described other rows).
    out = tmp_path / "bench"
    out.mkdir()
    (out / "bench.json").write_text('{"rows": "an earlier run\'s"}')
    for name in ("scaling.png", "grid.png", "peers.png"):
        (out / name).write_bytes(b"\x89PNG an earlier run's")
    real = sweep.make_step

    def failing(call):
        if call.shape.seq_len == 64:
            raise RuntimeError("stopped")
        return real(call)

    monkeypatch.setattr(sweep, "make_step", failing)
    with pytest.raises(RuntimeError, match="stopped"), caplog.at_level("INFO"):
        run_bench(tiny_settings(tmp_path))
    saved = json.loads((out / "bench.json").read_text())
    assert {r["n"] for r in saved["rows"]} == {32} and set(saved["ceiling_gflop_per_s"]) == {"32"}
    assert sorted(p.name for p in out.iterdir()) == [".lock", "bench.csv", "bench.json"]
    assert (
        f"{out} holds an earlier run's results: replaced once the first n is timed" in caplog.text
    )
    # a user's table of that name was replaced; the run's own (above) is
    (out / "bench.csv").write_text("date,loss\n1,2\n")
    with pytest.raises(ValueError, match=r"bench.csv exists and is not a report that begins"):
        run_bench(tiny_settings(tmp_path))
    assert (out / "bench.csv").read_text() == "date,loss\n1,2\n"


def test_an_interrupted_write_leaves_the_earlier_files_whole(tmp_path, monkeypatch):
    # bench.json was written in place, then bench.csv row by row: Ctrl-C in between left a
    # truncated JSON or a CSV of other rows (5 and 27 of 300 timed interrupts).
    out = tmp_path / "bench"
    result = {"rows": [{"variant": "a", "n": 1, "times_ms": [1.0]}]}
    sweep.write_outputs(result, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(self, rows):
        raise KeyboardInterrupt

    monkeypatch.setattr(csv.DictWriter, "writerows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sweep.write_outputs({"rows": [{"variant": "b", "n": 2, "times_ms": [2.0]}]}, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_interrupt_while_measuring_memory_keeps_the_timings_peaks_and_plots(
    tmp_path, monkeypatch, caplog
):
    # The JSON kept no peak at all, and no plots were drawn (the earlier ones removed).
    measured = []

    def peak(call):
        if measured:
            raise KeyboardInterrupt
        measured.append(call)
        return 3 * 2**20

    monkeypatch.setattr(sweep, "peak_memory", peak)
    settings = tiny_settings(tmp_path, n="32", memory=True)
    with pytest.raises(KeyboardInterrupt), caplog.at_level("WARNING"):
        run_bench(settings)
    out = tmp_path / "bench"
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [r["peak_mem_mb"] for r in rows if r["peak_mem_mb"] is not None] == [3.0]
    assert {"bench.csv", "scaling.png", "grid.png"} <= {p.name for p in out.iterdir()}
    assert "interrupted while measuring peak memory" in caplog.text


def test_the_time_budget_counts_both_calls_of_every_round(tmp_path):
    # time_interleaved calls each step twice a round (settling, timed); the estimate counted
    # one, so configurations of up to twice the budget ran.
    settings = tiny_settings(tmp_path, n="64", scope="attention", sharing="kv", exact="")
    [call] = sweep._calls(settings, 64)
    flops = sweep.variant_flops(call.variant, call.shape, call.scope, backward=call.backward)
    one_call_per_round = flops * (settings.warmup + settings.repeats)  # at 3 FLOP/s / 3
    for budget, skipped in [(1.5 * one_call_per_round, True), (2.5 * one_call_per_round, False)]:
        settings = dataclasses.replace(settings, time_budget_s=budget)
        assert (sweep._skip_reason(call, settings, 3.0) is not None) == skipped


def test_budgets_skip_with_a_stated_reason(tmp_path):
    settings = tiny_settings(tmp_path, n="16,64", scope="attention", memory_budget_gb=1e-4)
    rows = run_bench(settings)["rows"]
    reasons = {(r["variant"], r["n"]): r["reason"] for r in rows if r["status"] == "skipped"}
    assert "nothing to project" in reasons[("linformer kv", 16)]
    assert "memory budget" in reasons[("exact naive", 64)]
    assert all(r["median_ms"] is None for r in rows if r["status"] == "skipped")
    slow = run_bench(dataclasses.replace(settings, memory_budget_gb=8.0, time_budget_s=1e-9))
    assert all(r["status"] == "skipped" for r in slow["rows"])
    assert sum("time budget" in r["reason"] for r in slow["rows"]) == 6


def test_a_second_sweep_into_a_folder_in_use_is_refused(tmp_path):
    # two sweeps into one --out removed each other's plots as they went
    settings = tiny_settings(tmp_path)
    with exclusive(Path(settings.out), "bench run"):  # as another process holds it
        with pytest.raises(ValueError, match=r"bench is in use by another bench run \(pid"):
            run_bench(settings)


def test_a_length_where_nothing_runs_times_no_ceiling(tmp_path, monkeypatch):
    # Every configuration over the budget, the matmul ceiling was still timed alone, its
    # rounds in no estimate: --repeats 10**12 ran on (3 rounds a second) until stopped.
    def ceiling_alone(steps, **kwargs):
        assert not all(key.startswith("matmul") for key in steps), "the ceiling timed alone"
        return timed(steps, **kwargs)

    timed = sweep.time_interleaved
    monkeypatch.setattr(sweep, "time_interleaved", ceiling_alone)
    settings = tiny_settings(tmp_path, n="64", repeats=10**12, warmup=10**12)
    result = run_bench(settings)
    assert {r["status"] for r in result["rows"]} == {"skipped"}
    assert all("time budget" in r["reason"] for r in result["rows"])
    assert result["ceiling_gflop_per_s"] == {}


def test_a_k_above_n_is_skipped_and_bf16_rows_keep_their_error_in_the_csv(tmp_path):
    settings = tiny_settings(
        tmp_path, n="8,32", scope="attention", sharing="kv", exact="sdpa", dtype="float32,bfloat16"
    )
    rows = run_bench(settings)["rows"]
    ours = {(r["dtype"], r["n"]): r for r in rows if r["variant"] == "linformer kv"}
    assert ours[("float32", 8)]["reason"] == "k = 16 >= n = 8: nothing to project"
    assert ours[("float32", 8)]["gflop"] is None and ours[("float32", 32)]["gflop"] > 0
    header = (tmp_path / "bench" / "bench.csv").read_text().splitlines()[0].split(",")
    assert "relative_error_vs_float32" in header  # a bfloat16 row's, not the first row's


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(scope=""), "n, proj_dim, scope, kernel, attention_dropout need at least one"),
        # these two dropped our rows, silently
        (dict(kernel=""), "n, proj_dim, scope, kernel, attention_dropout need at least one"),
        (dict(attention_dropout=""), "kernel, attention_dropout need at least one value each"),
        # a value twice: timed once, reported twice, its n's ceiling overwritten
        (dict(n="32,32"), "n names a value twice: '32,32'"),
        (dict(sharing="kv, kv"), "sharing names a value twice: 'kv, kv'"),
        (dict(attention_dropout="0.1,0.10"), "attention_dropout names a value twice"),
        # (it failed after the probe and the timing bar had started)
        (dict(dim=30, num_heads=4), "dim (30) must be divisible by num_heads (4)"),
        (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
        (dict(warmup=-1), "warmup must be an integer >= 0, got -1"),
        (dict(num_heads=0), "num_heads must be an integer >= 1, got 0"),
        (dict(sharing="", exact=""), "nothing to time: name a --sharing or an --exact"),
    ],
)
def test_settings_that_leave_nothing_to_time_are_refused_before_timing(tmp_path, changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_settings(tmp_path, **changes)


def test_the_speed_up_over_the_faster_peer_comes_with_its_round_by_round_quartiles():
    def row(kind, variant, times):
        return dict(
            scope="attention", dtype="float32", kind=kind, variant=variant, k=8, n=64,
            sharing="kv" if kind == "ours" else None, kernel=None, attention_dropout=0.0,
            median_ms=statistics.median(times), min_ms=min(times), times_ms=times,
            peak_mem_mb=None, ceiling_fraction=0.5, ceiling_fraction_best=0.6,
            speedup_vs_sdpa=None, status="ok",
        )  # fmt: skip

    ours = [2.0, 3.0, 4.0, 2.0, 5.0]
    faster = [3.0, 3.0, 6.0, 4.0, 6.0]  # a slow round is slow for both: ratios by round
    rows = [
        row("ours", "linformer kv", ours),
        row("lucidrains", "lucidrains", faster),
        row("linformer-pytorch", "linformer-pytorch", [9.0] * 5),
    ]
    entry = summarise(rows)["attention"]["float32"]["linformer kv k=8"][64]
    assert entry["speedup_vs_faster_peer"] == pytest.approx(4.0 / 3.0)
    paired = [1.5, 1.0, 1.5, 2.0, 1.2]  # lucidrains' time over ours, round by round
    first, _, third = statistics.quantiles(paired, n=4)
    assert entry["speedup_vs_faster_peer_quartiles"] == pytest.approx([first, third])
    # Fewer than 4 rounds, or rounds that do not pair: no quartiles.
    for peer_times in ([3.0, 3.0, 6.0], [3.0, 3.0, 6.0, 4.0]):
        rows[1] = row("lucidrains", "lucidrains", peer_times)
        rows[0] = row("ours", "linformer kv", ours[: 3 if len(peer_times) == 3 else 5])
        entry = summarise(rows)["attention"]["float32"]["linformer kv k=8"][64]
        assert "speedup_vs_faster_peer_quartiles" not in entry


def test_a_row_reads_the_median_and_the_fastest_of_its_rounds():
    # Every sweep test times one round, where the median, the mean, the min and the max agree.
    call = Call(
        variant=SDPA, shape=SHAPE, scope="attention", backward=True, dtype="float32",
        device="cpu", threads=1,
    )  # fmt: skip
    row = sweep._row(call, (1e12, 2e12), [0.001, 0.002, 0.009])
    assert (row["median_ms"], row["min_ms"]) == pytest.approx((2.0, 1.0))
    flops = variant_flops(SDPA, SHAPE, "attention", backward=True)
    assert row["ceiling_fraction"] == pytest.approx(flops / 0.002 / 1e12)
    assert row["ceiling_fraction_best"] == pytest.approx(flops / 0.001 / 2e12)


def test_rows_compare_to_exact_attention_of_their_own_setting():
    def row(kind, ms, mem, dropout=0.0):
        return dict(scope="attention", dtype="float32", n=64, attention_dropout=dropout,
                    kind=kind, status="ok", median_ms=ms, peak_mem_mb=mem)  # fmt: skip

    rows = [row("sdpa", 8.0, 30.0), row("ours", 2.0, 10.0), row("sdpa", 20.0, 40.0, 0.1),
            row("ours", 4.0, 8.0, 0.1), row("naive", 16.0, 60.0)]  # fmt: skip
    sweep._compare_to_exact(rows)
    ours, dropped = rows[1], rows[3]
    assert (ours["speedup_vs_sdpa"], ours["memory_saving_vs_sdpa"]) == (4.0, 3.0)
    assert (ours["speedup_vs_naive"], ours["memory_saving_vs_naive"]) == (8.0, 6.0)
    assert (dropped["speedup_vs_sdpa"], dropped["memory_saving_vs_sdpa"]) == (5.0, 5.0)
    assert "speedup_vs_naive" not in dropped  # no naive row with dropout


def test_the_memory_estimate_doubles_with_backward():
    forward = estimate_bytes(OURS["kv"], SHAPE, "layer", backward=False)
    assert estimate_bytes(OURS["kv"], SHAPE, "layer", backward=True) == 2 * forward


def test_summary_reads_the_targets_off_the_rows():
    def row(kind, variant, n, ms, mem, k=8, dropout=0.0, kernel=None):
        return dict(
            min_ms=ms / 2,
            sharing="kv" if kind == "ours" else None,
            kernel=kernel,
            attention_dropout=dropout,
            scope="attention",
            dtype="float32",
            kind=kind,
            variant=variant,
            k=k,
            n=n,
            median_ms=ms,
            peak_mem_mb=mem,
            ceiling_fraction=0.5,
            ceiling_fraction_best=0.6,
            speedup_vs_sdpa=None,
            status="ok",
        )

    rows = [
        row("ours", "linformer kv", 32, 1.0, 10.0),
        row("ours", "linformer kv", 64, 2.0, 19.0),
        row("lucidrains", "lucidrains", 64, 3.0, 30.0),
        row("linformer-pytorch", "linformer-pytorch", 64, 5.0, 40.0),
        row("sdpa", "exact sdpa", 64, 8.0, 20.0, k=None),
        row("ours", "linformer kv attn-dropout 0.1", 64, 2.2, 21.0, dropout=0.1),
        row("sdpa", "exact sdpa attn-dropout 0.1", 64, 22.0, 40.0, k=None, dropout=0.1),
    ]
    entry = summarise(rows)["attention"]["float32"]["linformer kv k=8"][64]
    assert entry["speedup_vs_faster_peer"] == pytest.approx(1.5)
    assert entry["speedup_vs_faster_peer_by_min"] == pytest.approx(1.5)
    assert (entry["ceiling_fraction"], entry["ceiling_fraction_best"]) == (0.5, 0.6)
    assert entry["time_growth_from_half_n"] == pytest.approx(2.0)
    assert entry["memory_growth_from_half_n"] == pytest.approx(1.9)
    assert entry["memory_vs_sdpa"] == pytest.approx(0.95)
    assert "time_vs_no_attention_dropout" not in entry
    dropped = summarise(rows)["attention"]["float32"]["linformer kv attn-dropout 0.1 k=8"][64]
    assert dropped["time_vs_no_attention_dropout"] == pytest.approx(1.1)
    bf16 = dict(rows[1], dtype="bfloat16", median_ms=0.5)  # 4x its fp32 row's speed
    entry = summarise([*rows, bf16])["attention"]["bfloat16"]["linformer kv k=8"][64]
    assert entry["speedup_vs_float32"] == pytest.approx(4.0)
    assert dropped["memory_vs_sdpa"] == pytest.approx(21.0 / 40.0)  # against SDPA with dropout
    # Ours pinned to a kernel is compared with the same kernel without dropout.
    rows += [
        row("ours", "linformer kv [sdpa]", 64, 4.0, 19.0, kernel="sdpa"),
        row(
            "ours",
            "linformer kv [sdpa] attn-dropout 0.1",
            64,
            10.0,
            21.0,
            dropout=0.1,
            kernel="sdpa",
        ),
    ]
    pinned = summarise(rows)["attention"]["float32"]["linformer kv [sdpa] attn-dropout 0.1 k=8"]
    assert pinned[64]["time_vs_no_attention_dropout"] == pytest.approx(2.5)
    dropped = summarise(rows)["attention"]["float32"]["linformer kv attn-dropout 0.1 k=8"][64]
    assert dropped["time_vs_no_attention_dropout"] == pytest.approx(1.1)
    bf16 = dict(rows[1], dtype="bfloat16", median_ms=0.5)  # 4x its fp32 row's speed
    entry = summarise([*rows, bf16])["attention"]["bfloat16"]["linformer kv k=8"][64]
    assert entry["speedup_vs_float32"] == pytest.approx(4.0)


def test_settings_reject_unknown_choices(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        tiny_settings(tmp_path, mode="backward")
    with pytest.raises(ValueError, match="sharing"):
        tiny_settings(tmp_path, sharing="kv,everything")
    with pytest.raises(ValueError, match="dtype"):
        tiny_settings(tmp_path, dtype="float16")
    with pytest.raises(ValueError, match="attention_dropout"):
        tiny_settings(tmp_path, attention_dropout="0,1.5")


@pytest.mark.parametrize("scope", ["attention", "layer"])
def test_attention_dropout_variants_drop_attention_weights_in_training(scope):
    names = [v.name for v in default_variants(sharings=("kv",), peers=False,
                                              attention_dropouts=(0.0, 0.1))]  # fmt: skip
    assert names == [
        "linformer kv", "exact sdpa", "linformer kv attn-dropout 0.1",
        "exact sdpa attn-dropout 0.1", "exact naive",
    ]  # fmt: skip
    variant = Variant(name="kv", kind="ours", sharing="kv", attention_dropout=0.5)
    module = build_variant(variant, SHAPE, scope).train()
    x = torch.randn(SHAPE.batch_size, SHAPE.seq_len, SHAPE.dim)
    assert not torch.equal(module(x), module(x))  # fresh masks: the weights are dropped
    assert torch.equal(module.eval()(x), module(x))


def test_ours_on_each_kernel_times_the_same_layer_through_that_kernel(tmp_path, explicit_calls):
    # --kernel rule,explicit: ours twice per sharing, the second pinned to the explicit
    # kernel (kernel_rule.use_kernel), which without dropout the CPU rule does not pick.
    names = [v.name for v in default_variants(sharings=("kv",), peers=False,
                                              kernels=(None, "explicit"))]  # fmt: skip
    assert names == ["linformer kv", "linformer kv [explicit]", "exact sdpa", "exact naive"]
    rows = run_bench(tiny_settings(tmp_path, n="64", kernel="rule,explicit", exact="sdpa"))["rows"]
    assert {(r["variant"], r["kernel"]) for r in rows} == {
        ("linformer headwise", None), ("linformer kv", None),
        ("linformer headwise [explicit]", "explicit"), ("linformer kv [explicit]", "explicit"),
        ("exact sdpa", None),
    }  # fmt: skip
    # Explicit calls, and only from the pinned variants (the rule takes SDPA here): 2 of
    # them x 2 scopes x one timed call each (+ one settling call on CPU).
    assert len(explicit_calls) == 8
    x = torch.randn(SHAPE.batch_size, SHAPE.seq_len, SHAPE.dim)
    pinned = Variant(name="kv", kind="ours", sharing="kv", kernel="explicit")
    torch.manual_seed(0)
    out = build_variant(pinned, SHAPE, "layer").eval()(x)
    torch.manual_seed(0)
    torch.testing.assert_close(out, build_variant(OURS["kv"], SHAPE, "layer").eval()(x))
    with pytest.raises(ValueError, match="kernel"):
        tiny_settings(tmp_path, kernel="rule,flash")


def kept(figures, figure, file):
    """A stand-in for Figure.savefig: keeps the figure, writes an empty file."""
    figures.append(figure)
    Path(file).touch()


def test_the_plots_keep_a_variant_s_colour_across_dtypes(tmp_path, monkeypatch):
    # More than ten lines (tab10's colours) used to wrap around: two variants shared a
    # colour. Now a variant and k keep one colour, a dtype one line style, in both plots.
    figures = []
    monkeypatch.setattr(
        plots.Figure,
        "savefig",
        lambda figure, file, **k: figures.append(figure) or Path(file).touch(),
    )
    variants = [f"linformer v{i}" for i in range(6)] + ["lucidrains"]
    rows, summary = [], {"attention": {}}
    for dtype in ("float32", "bfloat16"):
        for i, variant in enumerate(variants):
            kind = "lucidrains" if variant == "lucidrains" else "ours"
            for n in (64, 128):
                row = dict(scope="attention", dtype=dtype, variant=variant, kind=kind, k=16)
                rows.append(dict(row, n=n, status="ok", median_ms=1.0 + i, peak_mem_mb=None))
            if kind == "ours":  # JSON's keys: n as text
                by_n = {"64": {"speedup_vs_faster_peer": 1.5}, "128": {"median_ms": 2.0}}
                summary["attention"].setdefault(dtype, {})[f"{variant} k=16"] = by_n
    plots.plot_scaling(rows, tmp_path / "scaling.png", title="t")
    assert plots.plot_peers(summary, tmp_path / "peers.png", title="t")
    assert not plots.plot_peers({"attention": {"float32": {}}}, tmp_path / "none.png", title="t")
    scaling, peers = figures
    for figure, count in ((scaling, 14), (peers, 12)):
        lines = [line for line in figure.axes[0].get_lines() if line.get_label()[0] != "_"]
        assert len(lines) == count
        by_label = {line.get_label(): line for line in lines}
        colours = {line.get_color() for line in lines if line.get_label().endswith("float32")}
        assert len(colours) == count // 2  # a colour each
        for label, line in by_label.items():
            if label.endswith("float32"):
                twin = by_label[label.replace("float32", "bfloat16")]
                assert twin.get_color() == line.get_color()
                assert (line.get_linestyle(), twin.get_linestyle()) == ("-", "--")
    assert len(peers.axes[0].get_lines()[1].get_xdata()) == 1  # n 128 has no peer ratio


def test_the_peer_plot_bars_the_round_by_round_quartiles(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(
        plots.Figure,
        "savefig",
        lambda figure, file, **k: figures.append(figure) or Path(file).touch(),
    )
    by_n = {  # as bench.json reads back: n as text; n 128 without quartiles (too few rounds)
        "64": {"speedup_vs_faster_peer": 1.5, "speedup_vs_faster_peer_quartiles": [1.4, 1.6]},
        "128": {"speedup_vs_faster_peer": 2.0},
    }
    summary = {"attention": {"float32": {"linformer kv k=16": by_n}}}
    assert plots.plot_peers(summary, tmp_path / "peers.png", title="t")
    (axis,) = figures[0].axes
    line = next(line for line in axis.get_lines() if line.get_label()[0] != "_")
    (bars,) = axis.collections
    assert [segment.tolist() for segment in bars.get_segments()] == [[[64, 1.4], [64, 1.6]]]
    assert matplotlib.colors.same_color(bars.get_colors()[0][:3], line.get_color())
