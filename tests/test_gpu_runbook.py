"""benchmarks/gpu_runbook.py: the prepared GPU call keeps working while no GPU is lent (its
steps run on CPU at tiny sizes), packs what they wrote, and keeps to its budget."""

from __future__ import annotations

import json
import tarfile

import pytest
from script_helpers import BENCHMARKS, load_script

pytest.importorskip("linformer")  # the peers (dev extra): the bench steps time them
pytest.importorskip("linformer_pytorch")
# In order of priority.
STEPS = ["kernels", "bench-b1", "bench-b8", "compile", "compile-explicit", "compile-sdpa"]
STEPS += ["kernels-fp16", "kernels-causal", "compile-bf16-explicit", "compile-bf16-sdpa"]
STEPS += ["compile-b8-explicit", "compile-b8-sdpa", "bench-b1-compiled", "kernels-split"]
STEPS += ["profile", "compile-8192-explicit", "compile-8192-sdpa", "feedforward-sums"]
STEPS += ["lm-loss", "split-layers", "bench-b8-bf16-compiled", "train-compile"]


def test_the_smoke_run_does_every_step_and_packs_their_results(tmp_path, capsys):
    runbook = load_script(BENCHMARKS / "gpu_runbook.py")
    runbook.main(["--smoke", "--out", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt", "results.tar.gz"]
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        files = {name: tar.extractfile(name) for name in tar.getnames() if name.endswith(".json")}
        results = {name.split("/")[1]: json.load(file) for name, file in files.items()}
    assert set(results) == set(STEPS)
    assert results["kernels"]["device"] == "cpu"
    assert results["bench-b8"]["settings"]["batch_size"] == 2
    variants = {row["variant"] for row in results["bench-b1"]["rows"]}
    assert {"exact sdpa", "lucidrains", "linformer-pytorch", "linformer kv [explicit]"} <= variants
    assert set(results["compile"]["rows"]) == {"training", "inference"}
    for name, kernel in [
        ("compile", "rule"),
        ("compile-explicit", "explicit"),
        ("compile-sdpa", "sdpa"),
        ("compile-bf16-explicit", "explicit"),
        ("compile-bf16-sdpa", "sdpa"),
        ("compile-b8-explicit", "explicit"),
        ("compile-b8-sdpa", "sdpa"),
        ("compile-8192-explicit", "explicit"),
        ("compile-8192-sdpa", "sdpa"),
    ]:
        assert results[name]["kernel"] == kernel
        assert all("error" not in key for row in results[name]["rows"].values() for key in row)
    assert {row["dtype"] for row in results["kernels-fp16"]["rows"]} == {"float16"}
    assert {row["k"] for row in results["kernels-causal"]["rows"]} == {"n"}  # n keys
    assert results["compile-bf16-sdpa"]["autocast"] == "bf16"
    assert results["compile-b8-sdpa"]["batch"] == 2
    compiled = {row["variant"] for row in results["bench-b1-compiled"]["rows"] if row["compile"]}
    assert compiled == {f"{name} [compiled aot_eager]" for name in
                        ("linformer kv", "linformer kv [explicit]", "lucidrains",
                         "linformer-pytorch")}  # fmt: skip
    assert {row["best_splits"] for row in results["kernels-split"]["rows"]} <= {1, 2}
    assert "lucidrains [compiled aot_eager]" in results["profile"]["variants"]
    sums = results["feedforward-sums"]
    assert [(row["dim"], row["rows"], row["threads"]) for row in sums["rows"]] == [
        (8, 32, 2), (8, 64, 2)
    ]  # fmt: skip
    trained = results["train-compile"]["summary"]
    assert set(trained) == {"mlm/linformer [eager]", "mlm/linformer [aot_eager]"}
    losses = [row["val_loss"][0] for row in trained.values()]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)  # compiled trains as eager does
    lm_loss = results["lm-loss"]
    assert [row["model"] for row in lm_loss["rows"]] == ["tiny causal", "tiny masked"]
    assert all(set(row["peak_mib"]) == {"logits", "chunked"} for row in lm_loss["rows"])
    fused = results["bench-b8-bf16-compiled"]
    assert fused["settings"]["batch_size"] == 2 and fused["settings"]["peers"] is False
    assert {row["variant"] for row in fused["rows"] if row["compile"]} == {
        "linformer kv [compiled aot_eager]"
    }
    summary = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in summary] == STEPS
    assert all(": done in " in line for line in summary), summary


def test_steps_past_the_budget_are_not_started(tmp_path, capsys):
    runbook = load_script(BENCHMARKS / "gpu_runbook.py")
    runbook.main(["--smoke", "--budget-s", "0", "--out", str(tmp_path)])
    assert capsys.readouterr().out.split("\n")[: len(STEPS)] == [
        f"{name}: not started (budget spent)" for name in STEPS
    ]
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        assert tar.getnames() == ["results"]


def test_steps_names_the_steps_to_run_and_refuses_others(tmp_path, capsys):
    runbook = load_script(BENCHMARKS / "gpu_runbook.py")
    assert list(runbook.STEPS) == STEPS
    calls = []
    runbook._run = lambda argv, out, env, deadline: calls.append(argv) or "done"
    only = ("compile-explicit", "kernels-causal")
    lines = runbook.run_steps(tmp_path, tmp_path / "log.txt", smoke=True, budget_s=60, only=only)
    assert [argv[-1] for argv in calls] == [str(tmp_path / name) for name in only]  # --out
    assert [line.split(":")[0] for line in lines] == list(only)
    with pytest.raises(SystemExit):
        runbook.main(["--smoke", "--steps", "compile,gpu", "--out", str(tmp_path)])
    assert "--steps: unknown gpu; the steps are kernels, bench-b1" in capsys.readouterr().err


def test_a_bench_step_that_fails_with_kernels_pinned_runs_again_on_the_rule_alone(tmp_path):
    runbook = load_script(BENCHMARKS / "gpu_runbook.py")
    calls = []

    def run(argv, out, env, deadline):
        calls.append(argv)
        failing = {"rule,explicit", "explicit"} & set(argv)
        return "failed (exit status 1)" if failing else "done"

    runbook._run = run
    lines = runbook.run_steps(tmp_path, tmp_path / "log.txt", smoke=True, budget_s=60)
    # A step with one kernel pinned (compile-explicit) has no fallback.
    assert [argv[argv.index("--kernel") + 1] for argv in calls if "--kernel" in argv] == [
        "rule,explicit", "rule", "rule,explicit", "rule", "explicit", "sdpa",
        "explicit", "sdpa", "explicit", "sdpa", "rule,explicit", "rule", "explicit", "sdpa",
    ]  # fmt: skip
    assert lines[4] == "compile-explicit: failed (exit status 1) in 0 s"
    assert calls[2][-1] == str(tmp_path / "bench-b1-rule")
    assert lines[1].startswith("bench-b1: failed (exit status 1), then on the rule's kernel")
    assert lines[0].startswith("kernels: done") and lines[3].startswith("compile: done")
