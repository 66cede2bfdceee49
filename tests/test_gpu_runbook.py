"""benchmarks/gpu_runbook.py: the prepared GPU call keeps working while no GPU is lent (its
steps run on CPU at tiny sizes), packs what they wrote, and keeps to its budget."""

from __future__ import annotations

import argparse
import json
import tarfile
from pathlib import Path

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
STEPS += ["bench-b1-autograd", "train-autograd", "profile-autograd"]


# Run end to end by the smoke test, one of each kind: the others' programs are the same
# scripts with other sizes, which the parse test checks (and the scripts' own tests run).
RUN = ["kernels", "bench-b1", "compile-bf16-explicit", "compile-b8-sdpa", "train-compile"]


class Parsed(Exception):
    """Raised in place of running a program, with the arguments it parsed."""


def parsed(argv, monkeypatch):
    """What the program of a step's argv (`python -m linformer_kit.cli ...` or `python
    SCRIPT ...`) parses its arguments into, without running it (argparse's errors exit)."""
    from linformer_kit import cli

    original = argparse.ArgumentParser.parse_args

    def stop(parser, args=None, namespace=None):
        raise Parsed(original(parser, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # scripts importing their neighbours
    program = cli if argv[1:3] == ["-m", "linformer_kit.cli"] else load_script(Path(argv[1]))
    with pytest.raises(Parsed) as stopped:
        program.main(argv[3:] if program is cli else argv[2:])
    return vars(stopped.value.args[0])


@pytest.mark.parametrize("smoke", [True, False], ids=["smoke", "gpu"])
def test_every_step_s_arguments_are_those_its_program_takes(smoke, tmp_path, monkeypatch):
    runbook = load_script(BENCHMARKS / "gpu_runbook.py")
    args = {name: parsed([*argv, "--out", str(tmp_path / name)], monkeypatch)
            for name, argv in runbook.steps(smoke)}  # fmt: skip
    assert list(args) == STEPS
    device = "cpu" if smoke else "cuda"
    assert all(a["device"] == device for name, a in args.items() if name != "feedforward-sums")
    assert all(a["out"] == tmp_path / name or a["out"] == str(tmp_path / name)
               for name, a in args.items())  # fmt: skip
    for name, kernel in [("compile", "rule"), ("compile-explicit", "explicit"),
                         ("compile-sdpa", "sdpa"), ("compile-bf16-explicit", "explicit"),
                         ("compile-bf16-sdpa", "sdpa"), ("compile-b8-explicit", "explicit"),
                         ("compile-b8-sdpa", "sdpa"), ("compile-8192-explicit", "explicit"),
                         ("compile-8192-sdpa", "sdpa")]:  # fmt: skip
        assert args[name]["kernel"] == kernel
        assert args[name]["backend"] == ("aot_eager" if smoke else "inductor")
    assert {args[name]["autocast"] for name in STEPS if "bf16-explicit" in name} == {"bf16"}
    assert args["compile-b8-sdpa"]["batch"] == (2 if smoke else 8)
    assert args["kernels-causal"]["causal"] and not args["kernels"]["causal"]
    assert args["bench-b8"]["batch_size"] == (2 if smoke else 8)
    # ours pinned too, the peers
    for name in ("bench-b1", "bench-b8", "bench-b1-compiled", "bench-b1-autograd"):
        assert args[name]["kernel"] == "rule,explicit" and args[name]["peers"], name
    fused = args["bench-b8-bf16-compiled"]
    assert not fused["peers"] and fused["compile"] == ("aot_eager" if smoke else "inductor")
    both = "aot_eager" if smoke else "inductor,reduce-overhead"
    assert args["bench-b1-compiled"]["compile"] == args["profile"]["compile"] == both
    graphs = "aot_eager" if smoke else "reduce-overhead"  # with and without compiled autograd
    assert args["bench-b1-autograd"]["compile"] == f"{graphs},{graphs}+autograd"
    assert args["profile-autograd"]["compile"] == f"{graphs}+autograd"
    assert args["train-autograd"]["compile"] == (
        "aot_eager+autograd" if smoke else "reduce-overhead,reduce-overhead+autograd"
    )
    if not smoke:  # the sizes the targets are read at
        assert fused["dtype"] == "bfloat16" and args["bench-b1"]["dtype"] == "float32,bfloat16"
        assert args["compile-8192-sdpa"]["n"] == 8192 and args["compile-sdpa"]["n"] == 16384
        assert args["train-compile"]["compile"] == "inductor,reduce-overhead"


def test_the_smoke_run_does_its_steps_and_packs_their_results(tmp_path, capsys):
    runbook = load_script(BENCHMARKS / "gpu_runbook.py")
    runbook.main(["--smoke", "--steps", ",".join(RUN), "--out", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt", "results.tar.gz"]
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        files = {name: tar.extractfile(name) for name in tar.getnames() if name.endswith(".json")}
        results = {name.split("/")[1]: json.load(file) for name, file in files.items()}
    assert set(results) == set(RUN)
    assert results["kernels"]["device"] == "cpu"
    variants = {row["variant"] for row in results["bench-b1"]["rows"]}
    assert {"exact sdpa", "lucidrains", "linformer-pytorch", "linformer kv [explicit]"} <= variants
    for name, kernel in [("compile-bf16-explicit", "explicit"), ("compile-b8-sdpa", "sdpa")]:
        assert results[name]["kernel"] == kernel
        assert set(results[name]["rows"]) == {"training", "inference"}
        assert all("error" not in key for row in results[name]["rows"].values() for key in row)
    assert results["compile-bf16-explicit"]["autocast"] == "bf16"
    assert results["compile-b8-sdpa"]["batch"] == 2
    trained = results["train-compile"]["summary"]
    assert set(trained) == {"mlm/linformer [eager]", "mlm/linformer [aot_eager]"}
    losses = [row["val_loss"][0] for row in trained.values()]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)  # compiled trains as eager does
    summary = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in summary] == RUN
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
        "rule,explicit", "rule",
    ]  # fmt: skip
    assert lines[4] == "compile-explicit: failed (exit status 1) in 0 s"
    assert calls[2][-1] == str(tmp_path / "bench-b1-rule")
    assert lines[1].startswith("bench-b1: failed (exit status 1), then on the rule's kernel")
    assert lines[0].startswith("kernels: done") and lines[3].startswith("compile: done")
