"""`linformer bench` end to end on tiny sizes."""

import json

import pytest

from linformer_kit.cli import main


@pytest.mark.parametrize("native", [True, False])
def test_bench_command_writes_results_and_prints_the_table(tmp_path, capsys, native, bf16_is):
    support = bf16_is(native)
    out = tmp_path / "bench"
    main(
        ["bench", "--n", "32", "--proj-dim", "8,16", "--dim", "16", "--num-heads", "2"]
        + ["--mode", "fwd", "--dtype", "float32,bfloat16", "--sharing", "layerwise"]
        + ["--exact", "sdpa", "--scope", "attention"]
        + [
            "--repeats",
            "1",
            "--min-time-s",
            "0",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--no-memory",
            "--no-keep-freed-memory",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert "linformer layerwise" in printed and "matmul ceiling" in printed
    result = json.loads((out / "bench.json").read_text())
    assert result["freed_memory_kept"] is False
    rows = result["rows"]
    assert [(r["dtype"], r["variant"], r["k"]) for r in rows] == [
        ("float32", "linformer layerwise", 8),
        ("float32", "linformer layerwise", 16),
        ("float32", "exact sdpa", None),
        ("bfloat16", "linformer layerwise", 8),
        ("bfloat16", "linformer layerwise", 16),
        ("bfloat16", "exact sdpa", None),
    ]
    assert result["bf16"] == support.to_dict()
    assert (out / "grid.png").exists() and (out / "bench.csv").exists()
    assert not (out / "peers.png").exists() and "faster peer" not in printed
    bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
    if native:
        low = result["summary"]["attention"]["bfloat16"]["linformer layerwise k=8"]["32"]
        assert low["speedup_vs_float32"] > 0 and 0 < low["relative_error_vs_float32"] < 0.1
        assert all(r["status"] == "ok" for r in rows)
        assert "emulated" not in printed
    else:
        # Timed, as asked, but marked: no summary, no speed-ups, a reason on every row.
        assert "bfloat16" not in result["summary"]["attention"]
        assert all(r["status"] == "emulated" and r["speedup_vs_sdpa"] is None for r in bf16)
        assert all("not a result: this CPU has no native bf16" in r["reason"] for r in bf16)
        assert "bfloat16 rows marked 'emulated' are not a result" in printed


def run_peer_bench(out, capsys, *, n, repeats):
    """`linformer bench --peers` of kv attention at tiny sizes: what it printed and the
    summary of linformer kv by n (as text, read back from bench.json)."""
    args = f"bench --peers --n {n} --proj-dim 16 --dim 16 --num-heads 2 --sharing kv "
    args += f"--scope attention --repeats {repeats} --min-time-s 0 --warmup 0 --threads 1 "
    args += "--no-memory --no-keep-freed-memory"
    main([*args.split(), "--exact", "", "--out", str(out)])
    summary = json.loads((out / "bench.json").read_text())["summary"]
    return capsys.readouterr().out, summary["attention"]["float32"]["linformer kv k=16"]


def test_bench_with_peers_prints_and_plots_the_faster_peer_over_ours(tmp_path, capsys):
    out = tmp_path / "bench"
    printed, by_n = run_peer_bench(out, capsys, n="32,64", repeats=1)
    assert "the faster peer's median time over ours (above 1: ours faster):" in printed
    table = printed.split("ours faster):\n")[1].splitlines()
    assert table[0].split() == ["scope", "dtype", "variant", "n=32", "n=64"]
    cells = [f"{by_n[n]['speedup_vs_faster_peer']:.2f}x" for n in ("32", "64")]
    assert table[1].split() == ["attention", "float32", "linformer", "kv", "k=16", *cells]
    assert "in brackets" not in printed  # one round: no quartiles
    assert (out / "peers.png").read_bytes()[:4] == b"\x89PNG"
    assert str(out / "peers.png") in printed.splitlines()[-1]


def test_bench_command_reports_bad_settings_without_a_traceback(tmp_path):
    with pytest.raises(SystemExit, match="device must be one of cpu, cuda; got .tpu."):
        main(["bench", "--device", "tpu", "--out", str(tmp_path)])


def test_peers_flag_is_a_switch():
    from linformer_kit.cli import build_parser

    assert build_parser().parse_args(["bench", "--peers"]).peers is True
    assert build_parser().parse_args(["bench"]).peers is False


def test_the_peer_table_gives_the_round_by_round_quartiles_in_brackets(tmp_path, capsys):
    printed, by_n = run_peer_bench(tmp_path / "bench", capsys, n="32", repeats=5)
    first, third = by_n["32"]["speedup_vs_faster_peer_quartiles"]
    assert first <= third
    cell = f"{by_n['32']['speedup_vs_faster_peer']:.2f}x ({first:.2f}-{third:.2f})"
    row = printed.split("ours faster):\n")[1].splitlines()[1]
    assert row.split("k=16", 1)[1].strip() == cell
    assert "(in brackets: the quartiles of the same ratio round by round)" in printed
