"""The measurement scripts, run on CPU at small sizes: behind the GPU cuts
(`benchmarks/kernels_split.py`: SDPA's queries and the explicit kernel's backward sums, and
`kernels_split_layers.py` in the layers), the kernel-by-kernel profile
(`benchmarks/kernels_profile.py`), the feed-forward kernel's weight-gradient rule
(`benchmarks/kernels_feedforward_sums.py`), the check of a fused CPU attention sub-layer
(`benchmarks/kernels_sublayer.py`), the bytes-against-FLOPs bound (`benchmarks/roofline.py`),
the CPU's products-alone bound (`benchmarks/cpu_bound.py`), the attention kernel against
its block GEMMs' rate (`benchmarks/kernel_gemm_rate.py`), the bf16 GEMMs' A/B
(`benchmarks/kernels_bf16_gemm.py`) and the split reduction's table
(`benchmarks/gemm_split.py`). A GPU call runs the first three with `--device cuda`."""

import json
import os

import pytest
import torch
from script_helpers import BENCHMARKS, load_script

from linformer_kit.kernel_rule import use_kernel


def test_the_split_script_times_every_cut_of_every_shape(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports benchmarks/kernels.py
    script = load_script(BENCHMARKS / "kernels_split.py")
    cuts, make_step = [], script.make_step
    monkeypatch.setattr(
        script, "make_step", lambda *a, **kw: cuts.append(kw.get("splits")) or make_step(*a, **kw)
    )
    pins, pin = [], script.use_reduction_splits
    monkeypatch.setattr(script, "use_reduction_splits", lambda s: pins.append(s) or pin(s))
    args = "--device cpu --dtype float32 --batch 1,2 --n 128,256 --k 8 --head-dim 4"
    args += " --reduction-splits 1,4,256"  # 256 does not divide n 128
    script.main([*args.split(), "--max-splits", "4", "--min-seconds", "0", "--out", str(tmp_path)])
    table = json.loads((tmp_path / "table.json").read_text())
    rows = table["rows"]
    assert table["device"] == "cpu" and len(rows) == 2 * 2 * len(script.MODES)
    for row in rows:
        # chunks of at least 64 queries: n 128 is cut in 2 at most, 256 in 4
        assert list(row["sdpa_ms"]) == [str(s) for s in (1, 2, 4) if row["n"] // s >= 64]
        best = min(row["sdpa_ms"].values())
        assert row["sdpa_ms"][str(row["best_splits"])] == best
        # (the ratios are rounded to 3 decimals: a ratio of 0.025 read 0.0247 from the times)
        assert row["best_speedup"] == pytest.approx(row["sdpa_ms"]["1"] / best, 0.01, 1e-3)
        assert row["best_vs_explicit"] == pytest.approx(row["explicit_ms"] / best, 0.01, 1e-3)
        # the explicit kernel's backward cut as pinned (where it divides n), and the rule's
        # count (none on CPU)
        assert list(row["explicit_cut_ms"]) == ["1", "4"] + (["256"] if row["n"] == 256 else [])
        assert row["explicit_splits"] == 1
    assert set(cuts) == {None, 1, 2, 4}  # None: the explicit kernel's steps
    assert set(pins) == {1, 4, 256}
    assert (tmp_path / "table.png").stat().st_size > 0


def test_the_profile_script_lists_each_variant_s_kernels(tmp_path):
    script = load_script(BENCHMARKS / "kernels_profile.py")
    args = "--n 64 --dim 32 --proj-dim 16 --scope attention --kernel rule,explicit --steps 1"
    args += " --sharing kv,headwise"
    args += " --no-keep-freed-memory"  # (process-wide: the test process stays untouched)
    script.main([*args.split(), "--warmup", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "profile.json").read_text())
    assert result["shape"]["seq_len"] == 64 and result["scope"] == "attention"
    assert result["freed_memory_kept"] is False
    ours = ["linformer kv [rule]", "linformer kv [explicit]"]
    ours += ["linformer headwise [rule]", "linformer headwise [explicit]"]
    assert list(result["variants"])[:4] == ours
    for name, row in result["variants"].items():
        assert row["wall_ms"] > 0 and row["kernel_ms_per_step"] > 0, name
        assert row["top"] and all(top["ms_per_step"] >= 0 for top in row["top"]), name
        assert row["ops"] and all(op["shapes"].startswith("[") for op in row["ops"]), name
        # by input shapes an operator's time is split, never added to
        by_name = {top["name"]: top["ms_per_step"] for top in row["top"]}
        for op in row["ops"]:
            assert op["ms_per_step"] <= by_name.get(op["name"], float("inf")) + 1e-3, op
        # the host's share: operators' own CPU time, whole and split by thread and by name
        host = row["host"]
        assert host["ms_per_step"] > 0 and host["top"], name
        assert sum(host["threads_ms_per_step"]) == pytest.approx(host["ms_per_step"], abs=1e-3)
        assert sum(top["ms_per_step"] for top in host["top"]) <= host["ms_per_step"] + 1e-3
        assert row["cudagraphs"] == {}, name  # eager on CPU: no CUDA graphs to count
        assert row["compiled_autograd"] == {}, name  # and no backward captured
    # the explicit kernel shows up as its own operator (compiled) or as its GEMMs
    names = " ".join(top["name"] for top in result["variants"][ours[1]]["top"])
    assert "attention_forward" in names or "bmm" in names
    wrong_args = (["--kernel", "flash"], ["--sharing", "kv,per-head"], ["--compile", "tvm"])
    for wrong in (*wrong_args, ["--compile", "reduce-overhead"]):  # (CUDA graphs, on CPU)
        with pytest.raises(SystemExit):
            script.main(wrong)


def test_the_feedforward_sums_script_times_each_way_against_the_modules(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports benchmarks/kernels_fused.py
    script = load_script(BENCHMARKS / "kernels_feedforward_sums.py")
    args = "--dim 8,16 --rows 32,64 --threads 1 --repeats 1"
    script.main([*args.split(), "--out", str(tmp_path)])
    table = json.loads((tmp_path / "table.json").read_text())
    assert [(row["dim"], row["rows"]) for row in table["rows"]] == [
        (8, 32), (8, 64), (16, 32), (16, 64)
    ]  # fmt: skip
    for row in table["rows"]:
        ms = row["median_ms"]
        assert set(ms) == {"thread sums", "all rows", "rule", "modules"}
        assert all(t > 0 for t in ms.values())
        assert row["rows_per_thread_width"] == row["rows"] / row["dim"]
        ratio = ms["all rows"] / ms["thread sums"]
        assert row["all_rows_over_thread_sums"] == pytest.approx(ratio, abs=0.002)
    assert (tmp_path / "table.png").stat().st_size > 0


def test_the_bf16_gemm_script_times_both_ways_in_their_own_processes(tmp_path, monkeypatch):
    from linformer_kit import native
    from linformer_kit.precision import bf16_support

    monkeypatch.undo()  # this CPU as it is (the conftest's Intel CPU would keep MKL's GEMMs)
    native.set_kernel_gemm(None)
    if native.cpu_ops() is None or native.kernel_gemm() != "onednn" or not bf16_support().native:
        pytest.skip("the bf16 GEMMs leave MKL only where the kernels' GEMMs are oneDNN's")
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports benchmarks/kernels.py
    script = load_script(BENCHMARKS / "kernels_bf16_gemm.py")
    args = "--n 64,96 --threads 1 --rounds 1 --min-seconds 0.01"
    script.main([*args.split(), "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "ab.json").read_text())["rows"]
    assert [(r["mode"], r["n"]) for r in rows] == [
        (mode, n) for mode in ("train", "inference") for n in (64, 96)
    ]
    for row in rows:
        ms = row["median_ms"]
        assert set(ms) == {f"{d}, {w}" for d in ("float32", "bfloat16") for w in ("dot", "widened")}
        assert all(t > 0 for t in ms.values())
        ratio = ms["bfloat16, widened"] / ms["bfloat16, dot"]
        assert row["dot_speedup"] == pytest.approx(ratio)


def test_the_sublayer_script_s_one_backward_equals_the_module(tmp_path):
    script = load_script(BENCHMARKS / "kernels_sublayer.py")
    x, norm, attn, weights = script.sublayer(300)  # two blocks of queries, one part-full
    with use_kernel("explicit"):
        wanted = torch.autograd.grad((x + attn(norm(x))[0]).square().sum(), [x, *weights])
    got = torch.autograd.grad(
        (x + script.OneBackward.apply(norm(x), *weights)).square().sum(), [x, *weights]
    )
    for a, b in zip(got, wanted, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    script.main(["--n", "300", "--repeats", "1", "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "table.json").read_text())["rows"]
    assert row["n"] == 300 and row["one backward / module"] == pytest.approx(
        row["one backward"] / row["module"], abs=0.002
    )


def test_the_layers_split_script_cuts_each_variant_as_it_says(tmp_path, monkeypatch):
    from linformer_kit import kernels

    script = load_script(BENCHMARKS / "kernels_split_layers.py")
    # The rule cuts in 4 here (on a CPU it never cuts): each variant's cut is seen in SDPA.
    monkeypatch.setattr(kernels, "choose_splits", lambda **call: 4 if call["backward"] else 1)
    cuts, sdpa = [], kernels.sdpa
    monkeypatch.setattr(kernels, "sdpa", lambda *a: cuts.append(a[-1]) or sdpa(*a))
    args = "--device cpu --dtype float32 --shapes 1x256 --dim 16 --k 8 --cuts 1,2,8 --repeats 1"
    with use_kernel("sdpa"):
        script.main([*args.split(), "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "splits.json").read_text())["rows"]
    assert [(row["scope"], row["rule_splits"]) for row in rows] == [("attention", 4), ("layer", 4)]
    names = {"rule", "uncut", "cut 2", "cut 8"} | (
        {"lucidrains"} if script.peer_available("lucidrains") else set()
    )
    for row in rows:
        assert set(row["median_ms"]) == set(row["burst_ms"]) == names
        assert all(ms > 0 for ms in [*row["median_ms"].values(), *row["burst_ms"].values()])
    assert set(cuts) == {1, 2, 4}  # 8 would leave chunks of 32 queries: uncut
    assert kernels.choose_splits(backward=True) == 4  # the rule restored after every step
    assert (tmp_path / "splits.png").stat().st_size > 0


def test_the_roofline_script_counts_each_op_s_bytes_and_bounds_the_fraction(tmp_path):
    script = load_script(BENCHMARKS / "roofline.py")
    x, w, b = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
    ops = script.count_bytes(lambda: torch.nn.functional.linear(x, w, b))
    # addmm reads b (16), x (4 x 8) and W^T (8 x 16), writes 4 x 16 floats; W^T is a view
    assert ops == {"aten.addmm.default": [1, 4 * (16 + 32 + 128 + 64)]}

    shape = script.Shape(batch_size=2, seq_len=64, dim=32, num_heads=2, proj_dim=16, ffn_dim=64)
    before = os.environ.get("LINFORMER_KIT_NATIVE")
    traced = script.layer_step_bytes("layer", shape, "float32", "kv")
    assert not any("linformer_kit" in name for name in traced)  # the GPU's PyTorch ops
    assert any("scaled_dot_product" in name for name in traced)
    assert os.environ.get("LINFORMER_KIT_NATIVE") == before  # our kernels back on after

    args = ["--n", "64,128", "--batch", "2", "--dim", "32", "--k", "16", "--dtype", "bfloat16"]
    args += ["--out", str(tmp_path)]
    script.main([*args, "--ceiling-gflops", "1000", "--bandwidth-gbs", "100"])
    rows = json.loads((tmp_path / "roofline.json").read_text())["rows"]
    assert [row["n"] for row in rows] == [64, 128]
    for row in rows:
        assert row["other_gb"] > 0 and row["compute_gb"] > 0
        compute, other = row["compute_ms_at_ceiling"], row["other_ms_at_bandwidth"]
        assert compute == pytest.approx(row["gflop"] / 1000 * 1e3)
        assert other == pytest.approx(row["other_gb"] / 100 * 1e3)
        assert row["bound_fraction"] == pytest.approx(compute / (compute + other))
    with pytest.raises(SystemExit):
        script.main(["--out", str(tmp_path)])  # neither --bench nor --ceiling-gflops


def test_the_gemm_split_script_times_both_ways_and_leaves_the_split_on(tmp_path, monkeypatch):
    from linformer_kit import native

    ops = native.cpu_ops()
    if ops is None:
        pytest.skip("no C++ compiler here: the kernels cannot be built")
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports benchmarks/kernels_fused.py
    script = load_script(BENCHMARKS / "gemm_split.py")
    monkeypatch.setattr(script, "keep_freed_memory", lambda: True)  # (process-wide)
    settings, real = [], ops.split_reduction
    monkeypatch.setattr(ops, "split_reduction", lambda on=None: settings.append(on) or real(on))
    args = "--outputs 8x16 --k 64,2048 --n 32 --threads 2 --repeats 2 --min-seconds 0"
    script.main([*args.split(), "--out", str(tmp_path)])
    table = json.loads((tmp_path / "table.json").read_text())
    shapes = [(row["m"], row["n"], row["k"], row["trans_a"]) for row in table["products"]]
    assert shapes == [(8, 16, 64, True), (8, 16, 2048, True), (8, 16, 64, False),
                      (8, 16, 2048, False)]  # fmt: skip
    for row in table["products"]:
        ms = row["median_ms"]
        assert set(ms) == {"split", "tiles"} and all(t > 0 for t in ms.values())
        assert row["split_speedup"] == pytest.approx(ms["tiles"] / ms["split"], abs=0.002)
    (layers,) = table["layers"]
    assert layers["n"] == 32 and set(layers["split_speedup"]) == {"attention", "layer"}
    assert False in settings and real() is True  # both ways ran; the split left on
    assert (tmp_path / "table.png").stat().st_size > 0


def test_the_cpu_bound_script_times_each_product_alone_and_bounds_the_fraction(
    tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports benchmarks/roofline.py
    script = load_script(BENCHMARKS / "cpu_bound.py")
    a, b, w = torch.randn(8, 4), torch.randn(4, 6), torch.randn(4, 6)
    recorded = script.products(lambda: torch.nn.functional.linear(torch.mm(a, b).relu(), w))
    # the two products, not the relu, each called again alone on copies of its inputs
    assert [name for name, _ in recorded] == ["mm [8, 4] x [4, 6]", "mm [8, 6] x [6, 4]"]
    torch.testing.assert_close(recorded[0][1](), a @ b)

    monkeypatch.setattr(script, "keep_freed_memory", lambda: True)  # (process-wide)
    monkeypatch.setattr(script, "size_ceiling_matmul", lambda *a, **kw: (64, 1e-4))
    args = "--n 64,128 --dim 32 --num-heads 2 --proj-dim 16 --repeats 2"
    script.main([*args.split(), "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bound.json").read_text())
    assert result["probe_size"] == 64 and [row["n"] for row in result["rows"]] == [64, 128]
    for row in result["rows"]:
        names = [p["op"] for p in row["products"]]
        assert any("attention" in name for name in names), names  # the kernel, or SDPA's
        assert any(name.startswith(("matmul", "addmm", "mm")) for name in names), names
        alone = sum(p["ms"] for p in row["products"])
        assert row["products_alone_ms"] == pytest.approx(alone, abs=0.01)
        rate = row["probe_gflop_per_s"]
        assert row["bound"] == pytest.approx(row["model_gflop"] / alone * 1e3 / rate, rel=0.02)
        assert row["measured"] == pytest.approx(
            row["model_gflop"] / row["step_ms"] * 1e3 / rate, rel=0.02
        )
    assert (tmp_path / "bound.png").stat().st_size > 0


def test_the_gemm_rate_script_times_the_kernel_on_each_library_and_its_block_gemms(
    tmp_path, monkeypatch
):
    from linformer_kit import native

    if native.cpu_ops() is None:
        pytest.skip("the CPU kernels are not built here")
    script = load_script(BENCHMARKS / "kernel_gemm_rate.py")
    monkeypatch.setattr(script, "size_ceiling_matmul", lambda *a, **kw: (64, 1e-4))
    threads, setting = torch.get_num_threads(), native.set_kernel_gemm("blas")
    native.set_kernel_gemm(setting)
    args = "--n 96 --proj-dim 16 --head-dim 8 --num-heads 2 --block-rows 32 --dropout 0.1"
    script.main([*args.split(), "--threads", "2", "--repeats", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "rate.json").read_text())
    kernel = [
        f"kernel {way} [{lib}]" for lib in script.LIBRARIES for way in ("forward", "backward")
    ]
    assert list(result["threads_1"]) == [*kernel, "mm Q K^T", "mm P V", "mm Q^T dS", "probe"]
    assert list(result["threads_2"]) == kernel
    assert set(result["libraries_taken"]) == set(script.LIBRARIES)
    product = 2 * 2 * 96 * 16 * 8  # one GEMM over every block: B H N M D
    flops = {"forward": 2 * product, "backward": 5 * product, "mm": 2 * 32 * 16 * 8}
    for threads_key, count in (("threads_1", 1), ("threads_2", 2)):
        for name, row in result[threads_key].items():
            if name == "probe":
                assert row["gflop_per_s_per_thread"] == pytest.approx(
                    2 * 64**3 / row["ms"] / 1e6, rel=0.02
                )
                continue
            expected = flops[name.split()[1] if name.startswith("kernel") else "mm"]
            rate = expected / row["ms"] / 1e6 / count
            assert row["gflop_per_s_per_thread"] == pytest.approx(rate, rel=0.01)
    # the process's settings come back: the thread count and the kernels' library
    assert torch.get_num_threads() == threads and native.set_kernel_gemm(setting) == setting
