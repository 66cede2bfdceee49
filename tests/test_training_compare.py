"""The demo's probe and time budget: a slow or busy machine gets a shorter demo, and says so."""

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from train_helpers import write_corpus

from linformer_kit import files
from linformer_kit.training import TrainResult, compare
from linformer_kit.training.compare import ComparisonSettings, fit_to_budget, seconds_per_step

TINY = ComparisonSettings(
    vocab_size=300, seq_len=64, dim=32, depth=1, proj_dim=16, batch_size=2, block_size=16
)


def test_probe_times_a_step_of_every_model():
    assert 0 < seconds_per_step(TINY) < 60


def test_the_probe_runs_at_the_runs_threads(monkeypatch):
    # It ran at torch's default while every run trained at --threads: on 2 cores with
    # --threads 1 it measured 0.13 s a step where training took 0.20.
    torch.set_num_threads(2)
    seen = []
    monkeypatch.setattr(compare, "_probe_steps", lambda s: seen.append(torch.get_num_threads()))
    seconds_per_step(dataclasses.replace(TINY, threads=1))
    seconds_per_step(TINY)  # 0: torch's default, as the runs
    assert seen == [1, 2] and torch.get_num_threads() == 2


def test_each_objective_pairs_linformer_with_the_exact_transformer(tmp_path):
    runs = dataclasses.replace(TINY, output_dir=str(tmp_path)).run_configs()
    assert list(runs) == ["mlm/linformer", "mlm/transformer", "clm/linformer", "clm/transformer"]
    for name, run in runs.items():
        objective, model = name.split("/")
        assert run.train.objective == objective and run.model.causal == (objective == "clm")
        assert run.model.proj_dim == (16 if model == "linformer" else None)
        assert run.train.output_dir == str(tmp_path / objective / model)
    causal = dataclasses.replace(TINY, objectives="clm").run_configs()
    assert list(causal) == ["clm/linformer", "clm/transformer"]


@pytest.mark.parametrize("objectives", ["", "mlm,mlm", "mlm,seq2seq"])
def test_unknown_or_repeated_objectives_are_refused(objectives):
    with pytest.raises(ValueError, match="objectives must be .* mlm and clm; got"):
        ComparisonSettings(objectives=objectives)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(block_size=64), r"block_size \(64\) must be below seq_len \(64\)"),
        (dict(budget_min=-1.0), r"budget_min must be a finite number >= 0, got -1.0"),
        (dict(proj_dim=128), r"proj_dim \(128\) must be at most seq_len \(64\)"),
    ],
)
def test_a_causal_pair_that_would_be_exact_twice_and_a_negative_budget_are_refused(
    changes, message
):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **changes)
    assert dataclasses.replace(TINY, objectives="mlm", block_size=64).block_size == 64  # no clm


def test_a_run_that_fits_the_budget_is_unchanged():
    settings = ComparisonSettings()
    # 500 steps x 1 s (+10% validation) = 9.2 min < 20 min
    assert fit_to_budget(settings, 1.0) is settings
    unlimited = dataclasses.replace(settings, budget_min=0)
    assert fit_to_budget(unlimited, 100.0) is unlimited


def test_a_slow_machine_runs_fewer_steps_and_says_how_many(caplog):
    settings = ComparisonSettings()
    with caplog.at_level(logging.WARNING):
        fitted = fit_to_budget(settings, 10.0)
    # 20 min / (10 s x 1.1) = 109 steps; warm-up and validation interval shrink to fit.
    assert (fitted.steps, fitted.warmup_steps, fitted.eval_every) == (109, 10, 50)
    assert caplog.messages == [
        "this machine takes 10.00 s per training step of all 4 models (probe), so 500 steps "
        "would take about 92 min, over the 20-min budget: running 109 steps instead "
        "(--budget-min 0 runs all 500)"
    ]


@pytest.mark.parametrize("step_s", [1e3, 1e6])
def test_at_least_one_step_runs(step_s):
    fitted = fit_to_budget(ComparisonSettings(eval_every=50), step_s)
    assert fitted.steps == 1 and fitted.eval_every == 1 and fitted.warmup_steps == 0


def test_a_missing_corpus_is_named_before_the_probe_steps_every_model(tmp_path, monkeypatch):
    def probe(settings):
        raise AssertionError("the probe ran before the corpus was read")

    monkeypatch.setattr(compare, "seconds_per_step", probe)
    settings = dataclasses.replace(TINY, data=str(tmp_path / "missing"), output_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="missing"):
        compare.run_comparison(settings)


class Stop(Exception):
    pass


def fake_result(run):
    """What a run's process returns, without training (its folder made as a run's is)."""
    Path(run.train.output_dir).mkdir(parents=True)
    val = {"step": 1, "split": "val", "train_s": 1.0, "val_loss": 1.0, "val_ppl": 2.7}
    return TrainResult(records=[val], final={"val_ppl": 2.7}, steps=1, params=1,
                       tokens_per_s=1.0, sec_per_step=1.0, peak_mem_mb=1.0,
                       run_dir=Path(run.train.output_dir), best_val=1.0)  # fmt: skip


def test_a_rerun_names_the_earlier_demo_it_replaces_and_keeps_it_until_it_ends(
    tmp_path, caplog, monkeypatch
):
    # It removed the earlier comparison and runs without a word, and left the runs of
    # objectives the rerun did not train beside a comparison that did not describe them.
    # Then it removed them before training: a Ctrl-C lost the earlier demo for good.
    out = tmp_path / "demo"
    earlier = ("comparison.json", "mlm/linformer/metrics.jsonl", "clm/transformer/x")
    for name in earlier:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("earlier")
    (out / "notes.txt").write_text("mine")
    runs = []

    def stopped(function, run):
        runs.append(run)
        (Path(run.train.output_dir) / "partial").mkdir(parents=True)
        assert not (out / "comparison.json").exists()  # the earlier one is not in the way
        raise Stop  # an error, a Ctrl-C

    monkeypatch.setattr(compare, "in_fresh_process", stopped)
    corpus = write_corpus(tmp_path / "corpus")
    settings = dataclasses.replace(
        TINY, data=str(corpus), output_dir=str(out), objectives="mlm", budget_min=0
    )
    with caplog.at_level(logging.WARNING), pytest.raises(Stop):
        compare.run_comparison(settings)
    assert caplog.messages == [
        f"replacing the earlier demo in {out} once this one ends: comparison.json, "
        "mlm/linformer, clm/transformer",
        f"the earlier demo in {out} is back in place",
    ]
    assert all((out / name).read_text() == "earlier" for name in earlier)
    assert sorted(p.name for p in out.iterdir()) == [
        ".lock",
        "clm",
        "comparison.json",
        "mlm",
        "notes.txt",
    ]
    assert not (out / "mlm/linformer/partial").exists()
    # a demo killed while it ran left the earlier one aside: the next start puts it back
    (out / ".earlier-demo").mkdir()
    for name in earlier:
        (out / name).rename((out / ".earlier-demo" / name).parent.mkdir(parents=True,
                            exist_ok=True) or out / ".earlier-demo" / name)  # fmt: skip
    (out / "mlm/linformer").mkdir(exist_ok=True)
    (out / "mlm/linformer/killed").write_text("partial")
    with pytest.raises(Stop):
        compare.run_comparison(settings)
    assert all((out / name).read_text() == "earlier" for name in earlier)
    assert not (out / "mlm/linformer/killed").exists() and not (out / ".earlier-demo").exists()
    # a demo that ends replaces it (the runs of objectives it did not train included)
    monkeypatch.setattr(compare, "in_fresh_process", lambda function, run: fake_result(run))
    compare.run_comparison(settings)
    names = [".lock", "clm", "comparison.json", "comparison.png", "mlm", "notes.txt"]
    assert sorted(p.name for p in out.iterdir()) == names
    # a second demo into a folder in use set the first's live runs aside, and removed them
    with files.exclusive(out, "demo"), pytest.raises(ValueError, match="in use by another demo"):
        compare.run_comparison(settings)
    assert not any((out / "clm").iterdir()) and not (out / "mlm/linformer/metrics.jsonl").exists()


@pytest.mark.parametrize("flag", ["output_dir", "publish_dir"])
def test_an_output_folder_that_is_a_file_is_named_before_any_work(tmp_path, flag, monkeypatch):
    # --publish-dir FILE failed with "[Errno 17] File exists" after every model had trained.
    monkeypatch.setattr(compare, "prepare_pretraining_data", lambda *a: pytest.fail("ran"))
    (tmp_path / "file").write_text("")
    settings = dataclasses.replace(TINY, output_dir=str(tmp_path / "out"))
    settings = dataclasses.replace(settings, **{flag: str(tmp_path / "file")})
    option = "--" + flag.replace("_", "-")
    with pytest.raises(ValueError, match=f"{option} {tmp_path / 'file'} is a file; name a dir"):
        compare.run_comparison(settings)
