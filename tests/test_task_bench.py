"""`linformer bench-task`: variant names, the Markdown table, bad settings as usage errors,
and (slow) a whole run on a tiny converted BERT."""

import dataclasses
import json
import shutil

import pytest
import torch
from hf_helpers import write_tiny_bert
from script_helpers import BENCHMARKS, load_script
from train_helpers import write_classification

from linformer_kit import LinformerForSequenceClassification
from linformer_kit.cli import main
from linformer_kit.data.classification import read_labelled
from linformer_kit.files import exclusive
from linformer_kit.hub import read_weights
from linformer_kit.interop import task_bench
from linformer_kit.interop.convert import convert_to_dir
from linformer_kit.interop.task_bench import _best_validation, run_task_bench
from linformer_kit.interop.task_bench_report import earlier_rows, markdown_table, report_file
from linformer_kit.interop.task_bench_settings import TaskBenchSettings, Variant, parse_variants


def test_variants_parse_and_malformed_ones_are_named():
    spec = "exact@512, k256@2048, k128@2048:adaptive, k512@2048:adaptive:after, k64@1024:after"
    assert parse_variants(spec) == [
        Variant("exact@512", None, 512, "linear", False),
        Variant("k256@2048", 256, 2048, "linear", False),
        Variant("k128@2048:adaptive", 128, 2048, "adaptive", False),
        Variant("k512@2048:adaptive:after", 512, 2048, "adaptive", True),
        Variant("k64@1024:after", 64, 1024, "linear", True),
    ]
    bad_ones = ("k256", "exact@512:adaptive", "exact@512:after", "k8@64:after:adaptive")
    for bad in (*bad_ones, "k8@64:adaptive:linear"):
        with pytest.raises(ValueError, match=f"variant '{bad}' is not exact@N or kK@N"):
            parse_variants(f"exact@512,{bad}")
    for bad in ("k128@2048:fft", "k8@64:after:after"):
        with pytest.raises(ValueError, match="projection must be one of linear, .*; got '"):
            parse_variants(bad)
    with pytest.raises(ValueError, match="k8@64:after converts the fine-tuned exact@64: list"):
        parse_variants("k8@64:after,exact@64")  # it would convert an older checkpoint
    assert parse_variants("k8@64:after")[0].exact == "exact@64"  # one from an earlier run


def test_bad_settings_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench-task", "--train", "a", "--val", "b", "--test", "c", "--variants", "k@1"])
    assert exit_info.value.code == 2
    assert "variant 'k@1' is not exact@N or kK@N" in capsys.readouterr().err
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        TaskBenchSettings(train="a", val="b", test="c", batch_size=0)
    # before the baseline ran and the first variant was converted, and naming the flag
    with pytest.raises(ValueError, match="threads must be an integer >= 0"):
        TaskBenchSettings(train="a", val="b", test="c", threads=-1)
    with pytest.raises(FileNotFoundError, match="--train 'a': no such file"):
        run_task_bench(TaskBenchSettings(train="a", val="b", test="c"))
    for spec, message in [
        ("k128@64", "variant 'k128@64' .*: proj_dim must be an integer in \\[1, max_seq_len=64\\]"),
        ("k0@64", "variant 'k0@64' .*, got 0"),
        # named after the baseline and every variant before it had run
        (
            "exact@64,k20@64:pool",
            "variant 'k20@64:pool' .*proj_dim \\(20\\) must divide max_seq_len",
        ),
        ("exact@64,exact@64", "variants names one twice"),  # trained once, reported twice
    ]:
        with pytest.raises(ValueError, match=message):
            parse_variants(spec)


def test_markdown_table_has_a_row_per_model_and_dashes_for_missing_figures():
    rows = [
        {"variant": "tfidf", "model": "TF-IDF", "test_acc": 0.8, "train_s": 1.26},
        {"variant": "exact@64", "model": "exact, n=64", "test_acc": 0.75, "s_per_step": 0.1234}
        | {"peak_mem_mb": 350.4, "train_s": 12.0, "wall_s": 30.6, "test_docs_cut": 3},
    ]
    lines = markdown_table(rows).splitlines()
    assert lines[0].startswith("| model | test accuracy | s / step | peak memory (MB) |")
    assert lines[2] == "| TF-IDF | 0.800 | - | - | 1 | - | - |"
    assert lines[3] == "| exact, n=64 | 0.750 | 0.123 | 350 | 12 | 31 | 3 |"


@pytest.mark.slow
def test_a_tiny_run_writes_json_table_and_plot(tmp_path, capsys):
    pytest.importorskip("sklearn")
    tiny = write_tiny_bert(tmp_path / "hf")
    files = {
        name: write_classification(tmp_path / f"{name}.jsonl", count, seed=seed)
        for name, count, seed in (("train", 24, 0), ("val", 8, 1), ("test", 8, 2))
    }
    out = tmp_path / "report"
    main(
        ["bench-task", "--source", str(tiny), "--variants", "exact@64,k8@96,k8@64:adaptive:after"]
        + [f"--{name}={path}" for name, path in files.items()]
        + ["--calibration-texts", "1", "--work-dir", str(tmp_path / "work"), "--out", str(out)]
    )
    report = json.loads(out.with_suffix(".json").read_text())
    variants = ["tfidf", "exact@64", "k8@96", "k8@64:adaptive:after"]
    assert [row["variant"] for row in report["rows"]] == variants
    for row, steps in zip(report["rows"][1:], (3, 3, 6)):  # :after: 2 epochs of 3 steps
        assert 0 <= row["test_acc"] <= 1 and row["peak_mem_mb"] > 0 and row["steps"] == steps
    # The :after variant converted the exact run's best classifier, its head kept.
    exact = tmp_path / "work" / "exact@64" / "run" / "best"
    assert report["rows"][3]["converted_from"] == str(exact)
    converted = read_weights(tmp_path / "work" / "k8@64:adaptive:after" / "model")
    assert torch.equal(converted["head.4.weight"], read_weights(exact)["head.4.weight"])
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| exact, n=64 |" in out.with_suffix(".md").read_text()
    # val_acc is the tested checkpoint's (`best`, the lowest val_loss): it was the last
    # validation's, beside the best one's test accuracy
    for row in report["rows"][1:]:
        lines = (tmp_path / "work" / row["variant"] / "run" / "metrics.jsonl").read_text()
        scored = [r for r in map(json.loads, lines.splitlines()) if r["split"] == "val"]
        assert row["val_acc"] == min(scored, key=lambda r: r["val_loss"])["accuracy"]


def test_val_acc_is_the_tested_checkpoints():
    # bench-task reported the last validation's accuracy beside the test accuracy of `best`
    # (the first lowest val_loss, as the Trainer keeps it)
    records = [{"split": "val", "val_loss": loss, "accuracy": acc}
               for loss, acc in ((0.73, 0.5), (0.58, 0.67), (0.64, 0.58), (0.58, 0.1))]  # fmt: skip
    assert _best_validation([{"split": "train"}, *records]) == records[1]
    assert _best_validation([{"split": "train"}]) == {}


def test_rows_of_an_earlier_run_with_the_same_settings_are_kept(tmp_path, monkeypatch):
    pytest.importorskip("sklearn")
    files = {
        name: str(write_classification(tmp_path / f"{name}.jsonl", 12, seed=seed))
        for name, seed in (("train", 0), ("val", 1), ("test", 2))
    }
    out = tmp_path / "report"
    settings = TaskBenchSettings(**files, variants="exact@64", out=str(out), truncation="head")
    settings = dataclasses.replace(settings, work_dir=str(tmp_path / "work"))  # never ./runs
    earlier = {"variant": "exact@64", "model": "exact, n=64", "test_acc": 0.25}
    earlier |= {"s_per_step": 0.1, "peak_mem_mb": 300.0, "train_s": 1.0, "wall_s": 9.0}
    elsewhere = dataclasses.replace(settings, work_dir="/elsewhere", out="/moved/report")
    old = dataclasses.asdict(elsewhere)
    del old["grad_accum_steps"]  # written before the bench had the setting: 1 was used
    del old["truncation"]  # likewise: every text kept its head
    out.with_suffix(".json").write_text(  # an earlier run that wrote elsewhere, then was moved
        json.dumps({"settings": old, "rows": [earlier]})
    )
    ran = []  # the variants run again (converting and fine-tuning them is not this test's)
    monkeypatch.setattr(task_bench, "_variant_row", lambda v, s: ran.append(v.name) or earlier)
    report = run_task_bench(settings)  # nothing to convert or train: the row is kept
    assert [row["variant"] for row in report["rows"]] == ["tfidf", "exact@64"]
    assert report["rows"][1] == earlier and ran == []
    for changed in (dict(batch_size=3), dict(grad_accum_steps=2), dict(truncation="head+tail")):
        run_task_bench(dataclasses.replace(settings, **changed))  # other settings: run again
        assert ran == ["exact@64"], changed
        ran.clear()
        out.with_suffix(".json").write_text(json.dumps({"settings": old, "rows": [earlier]}))
    del old["projections"]  # before the setting existed every run trained the projections
    out.with_suffix(".json").write_text(json.dumps({"settings": old, "rows": [earlier]}))
    trained = dataclasses.replace(settings, projections="train")
    assert run_task_bench(trained)["rows"][1] == earlier and ran == []
    run_task_bench(settings)  # finetune's default (frozen) is another recipe: run again
    assert ran == ["exact@64"]


def test_variants_added_one_run_at_a_time_keep_the_earlier_rows(tmp_path, monkeypatch, caplog):
    # A second run naming only a new variant wrote a report of that one alone (and TF-IDF):
    # the earlier rows vanished without a word; settings that differ now say why they go.
    pytest.importorskip("sklearn")
    files = {
        name: str(write_classification(tmp_path / f"{name}.jsonl", 12, seed=seed))
        for name, seed in (("train", 0), ("val", 1), ("test", 2))
    }
    settings = TaskBenchSettings(**files, variants="exact@64", out=str(tmp_path / "report"))
    settings = dataclasses.replace(settings, work_dir=str(tmp_path / "work"))

    def row(v, s):
        return {"variant": v.name, "test_acc": 0.5, "s_per_step": 0.1, "peak_mem_mb": 300.0}

    monkeypatch.setattr(task_bench, "_variant_row", row)
    # a second bench-task on the work folder in use: refused (it set the first's runs aside
    # as a killed run's, then put them back over the live ones)
    with exclusive(tmp_path / "work", "bench-task"):
        with pytest.raises(ValueError, match=r"work is in use by another bench-task \(pid"):
            run_task_bench(settings)
    run_task_bench(settings)
    with caplog.at_level("INFO"):
        report = run_task_bench(dataclasses.replace(settings, variants="exact@32"))
    assert [r["variant"] for r in report["rows"]] == ["tfidf", "exact@32", "exact@64"]
    saved = json.loads((tmp_path / "report.json").read_text())
    assert [r["variant"] for r in saved["rows"]] == ["tfidf", "exact@32", "exact@64"]
    kept = f"exact@64: kept from the earlier {tmp_path / 'report'}.json (not in --variants)"
    assert kept in caplog.messages
    caplog.clear()
    with caplog.at_level("WARNING"):
        report = run_task_bench(dataclasses.replace(settings, variants="exact@32", seed=5))
    assert [r["variant"] for r in report["rows"]] == ["tfidf", "exact@32"]
    replaced = "was made with other settings (seed): this run replaces its rows"
    assert f"{tmp_path / 'report.json'} {replaced}" in caplog.messages
    # ... once a variant has run: a stop in the first wrote a report of TF-IDF alone (the
    # earlier rows lost), beside the earlier figure
    files = [tmp_path / f"report.{suffix}" for suffix in ("json", "md", "png")]
    before = [file.read_bytes() for file in files]

    def stopped(v, s):
        raise KeyboardInterrupt

    monkeypatch.setattr(task_bench, "_variant_row", stopped)
    with pytest.raises(KeyboardInterrupt):
        run_task_bench(dataclasses.replace(settings, variants="exact@32", seed=7))
    assert [file.read_bytes() for file in files] == before


def test_a_dot_in_out_stays_in_the_file_names_and_a_foreign_json_is_named():
    # with_suffix made `runs/x.v1` write runs/x.json: two outputs overwrote each other.
    assert report_file("runs/x.v1", ".json") == task_bench.Path("runs/x.v1.json")
    assert report_file("runs/x.v1", ".png") == task_bench.Path("runs/x.v1.png")
    assert report_file("runs/report.json", ".md") == task_bench.Path("runs/report.md")


@pytest.mark.parametrize("text", ['{"rows": []}', "not json"])
def test_an_out_json_that_is_not_a_report_is_named_before_any_work(tmp_path, text):
    (tmp_path / "report.json").write_text(text)
    settings = TaskBenchSettings(train="t", val="v", test="t", out=str(tmp_path / "report"))
    with pytest.raises(ValueError, match=r"report.json is not a bench-task report"):
        earlier_rows(dataclasses.asdict(settings))


@pytest.mark.parametrize(
    "name, what", [("report.png", "a .png image"), ("report.md", "a report that begins")]
)
def test_a_user_file_where_the_figure_goes_is_named_before_any_work(tmp_path, name, what):
    for data in "abc":
        (tmp_path / data).write_text("")
    files = {flag: str(tmp_path / data) for flag, data in zip(("train", "val", "test"), "abc")}
    (tmp_path / name).write_text("mine")  # the figure, or the table, replaced it
    settings = TaskBenchSettings(
        **files, out=str(tmp_path / "report"), work_dir=str(tmp_path / "w")
    )
    with pytest.raises(ValueError, match=rf"--out .*{name} exists and is not {what}"):
        task_bench.run_task_bench(settings)
    assert (tmp_path / name).read_text() == "mine" and not (tmp_path / "w").exists()


def test_an_after_row_is_run_again_with_its_exact_run_and_kept_rows_survive_a_crash(
    tmp_path, monkeypatch
):
    def row(variant, model):
        figures = {"test_acc": 0.5, "s_per_step": 0.1, "peak_mem_mb": 300.0, "train_s": 1.0}
        return {"variant": variant, "model": model, "wall_s": 9.0} | figures

    out = tmp_path / "report"
    for name in "abc":
        (tmp_path / name).write_text("")  # (read by the faked steps only)
    files = {flag: str(tmp_path / name) for flag, name in zip(("train", "val", "test"), "abc")}
    settings = TaskBenchSettings(**files, out=str(out), work_dir="w")
    spec = "exact@64,k8@64:adaptive:after,k4@64,k2@64"
    settings = dataclasses.replace(settings, variants=spec)
    monkeypatch.setattr(task_bench, "tfidf_baseline", lambda train, test: row("tfidf", "tfidf"))
    ran = []

    def fake_row(variant, s):
        ran.append(variant.name)
        if variant.name == "k4@64":
            raise RuntimeError("killed")
        return row(variant.name, "new")

    monkeypatch.setattr(task_bench, "_variant_row", fake_row)
    rows = [row(name, "old") for name in ("exact@64", "k8@64:adaptive:after", "k2@64")]
    earlier = {"settings": dataclasses.asdict(settings), "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(earlier))
    with pytest.raises(RuntimeError, match="killed"):
        run_task_bench(settings)
    assert ran == ["k4@64"]  # every earlier row kept, the one after k4@64 too ...
    written = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert written[1:] == rows  # ... and written before k4@64 ran and was killed
    earlier["rows"] = rows[1:]  # exact@64 missing: it runs, so its :after row runs again
    out.with_suffix(".json").write_text(json.dumps(earlier))
    ran.clear()
    with pytest.raises(RuntimeError, match="killed"):
        run_task_bench(settings)
    assert ran == ["exact@64", "k8@64:adaptive:after", "k4@64"]
    written = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["model"] for r in written] == ["tfidf", "new", "new", "old"]


def test_a_variant_run_again_starts_from_an_empty_folder_and_keeps_the_earlier_till_it_ends(
    tmp_path, monkeypatch, caplog
):
    # A run left in WORK_DIR/NAME (killed, or made with other settings) would make finetune
    # refuse its output dir: bench-task sets it aside. It removed it before the new run
    # began: a run stopped before its end lost the earlier one's checkpoints for good.
    settings = TaskBenchSettings(train="a", val="b", test="c", work_dir=str(tmp_path))
    (exact,) = parse_variants("exact@64")
    old = tmp_path / "exact@64" / "run" / "checkpoints" / "step-8"
    old.mkdir(parents=True)
    seen = []

    def fake_process(function, source, out, *args):
        seen.append(old.exists() or out.parent.exists())
        out.mkdir(parents=True)  # the new run's first files
        raise RuntimeError("stopped")

    monkeypatch.setattr(task_bench, "in_fresh_process", fake_process)
    with pytest.raises(RuntimeError, match="stopped"):
        task_bench._variant_row(exact, dataclasses.replace(settings, source="src"))
    assert seen == [False]
    assert old.is_dir() and not (tmp_path / "exact@64" / "model").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exact@64"]
    assert f"replacing the earlier run of exact@64 in {tmp_path} once this one ends" in caplog.text
    assert f"the earlier run of exact@64 in {tmp_path} is back in place" in caplog.text


def test_gradient_accumulation_reaches_finetune_and_sizes_the_warm_up(tmp_path, monkeypatch):
    seen = {}

    def recording_finetune(settings, train):
        seen.update(settings=settings, train=train)
        raise RuntimeError("recorded")

    monkeypatch.setattr(task_bench, "finetune", recording_finetune)
    train = write_classification(tmp_path / "train.jsonl", 48, seed=0)
    settings = TaskBenchSettings(train=str(train), val="v", test="t", epochs=2)
    settings = dataclasses.replace(settings, batch_size=2, grad_accum_steps=3)
    settings = dataclasses.replace(settings, truncation="head+tail")
    with pytest.raises(RuntimeError, match="recorded"):
        task_bench._finetune_and_test(tmp_path / "model", tmp_path / "run", settings)
    assert seen["train"].batch_size == 2 and seen["train"].grad_accum_steps == 3
    assert seen["train"].warmup_steps == 1  # 10% of 8 steps per epoch x 2 epochs, rounded down
    assert seen["settings"].epochs == 2 and seen["settings"].truncation == "head+tail"
    # An :after variant: its own epochs and lr, finetune's warm-up (the README's recipe).
    after = dataclasses.replace(settings, after_epochs=3, after_lr=1e-5, lr=1e-3)
    with pytest.raises(RuntimeError, match="recorded"):
        task_bench._finetune_and_test(tmp_path / "model", tmp_path / "run", after, True)
    assert seen["settings"].epochs == 3 and seen["train"].lr == 1e-5
    assert seen["train"].warmup_steps == 10 and seen["train"].grad_accum_steps == 3
    with pytest.raises(ValueError, match="truncation must be one of head, tail, head.tail"):
        dataclasses.replace(settings, truncation="middle")
    with pytest.raises(ValueError, match=r"after_lr must be a number in \(0, 10\], got 0"):
        dataclasses.replace(settings, after_lr=0)
    with pytest.raises(ValueError, match="grad_accum_steps must be an integer >= 1, got 0"):
        dataclasses.replace(settings, grad_accum_steps=0)


def test_an_after_variant_without_its_exact_run_names_what_to_add(tmp_path):
    settings = TaskBenchSettings(train="a", val="b", test="c", work_dir=str(tmp_path))
    (after,) = parse_variants("k8@64:adaptive:after")
    with pytest.raises(FileNotFoundError, match="put exact@64 before it in --variants"):
        task_bench.exact_checkpoint(after, settings)
    (tmp_path / "exact@64" / "run" / "best").mkdir(parents=True)
    assert task_bench.exact_checkpoint(after, settings) == tmp_path / "exact@64" / "run" / "best"


def longdoc_script(name):
    """A script of benchmarks/longdoc as a module."""
    return load_script(BENCHMARKS / "longdoc" / f"{name}.py")


def test_the_step_time_script_times_every_variant_on_the_same_documents(tmp_path):
    source = write_tiny_bert(tmp_path / "bert")
    data = write_classification(tmp_path / "docs.jsonl", count=12)
    out = tmp_path / "steps"
    longdoc_script("step_time").main(
        ["--data", str(data), "--source", str(source), "--variants", "exact@64,k4@64:adaptive"]
        + ["--rounds", "2", "--threads", "1", "--out", str(out)]
    )
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [row["variant"] for row in rows] == ["exact@64", "k4@64:adaptive"]
    assert rows[0]["speedup_vs_first"] == 1.0 and all(len(r["steps_s"]) == 2 for r in rows)
    assert rows[0]["tokens_per_step"] == rows[1]["tokens_per_step"] > 0  # the same documents
    assert "| k4@64:adaptive |" in out.with_suffix(".md").read_text()


def test_the_rescore_script_scores_checkpoints_and_tfidf_on_another_file(tmp_path):
    pytest.importorskip("sklearn")
    model = tmp_path / "model"
    convert_to_dir(write_tiny_bert(tmp_path / "bert"), model, proj_dim=None)
    classifier = LinformerForSequenceClassification.from_pretrained(model, num_labels=2)
    classifier.save_pretrained(tmp_path / "best")
    shutil.copy(model / "tokenizer.json", tmp_path / "best")
    train = write_classification(tmp_path / "train.jsonl", count=24)
    test = write_classification(tmp_path / "test.jsonl", count=12, seed=3)
    out = tmp_path / "rescored"
    longdoc_script("rescore").main(
        ["--train", str(train), "--test", str(test), "--threads", "1", "--out", str(out)]
        + ["--runs", f"a={tmp_path / 'best'}", f"b={tmp_path / 'best'}"]
    )
    report = json.loads(out.with_suffix(".json").read_text())
    tfidf, a, b = report["rows"]
    assert report["examples"] == 12 and tfidf["run"].startswith("TF-IDF")
    assert a["accuracy"] == b["accuracy"] and 0 <= a["f1"] <= 1  # one checkpoint, scored twice
    p = a["accuracy"]
    assert a["standard_error"] == pytest.approx((p * (1 - p) / 12) ** 0.5)
    assert out.with_suffix(".md").read_text().count("\n") == 5
    # --with: an earlier report's runs join a new one unscored; another test file is refused.
    again = tmp_path / "again"
    args = ["--train", str(train), "--threads", "1", "--runs", f"c={tmp_path / 'best'}"]
    longdoc_script("rescore").main(
        [*args, "--test", str(test), "--with", str(out.with_suffix(".json")), "--out", str(again)]
    )
    rows = json.loads(again.with_suffix(".json").read_text())["rows"]
    assert [row["run"] for row in rows[1:]] == ["a", "b", "c"]
    assert rows[1] == {**a, "from": str(out.with_suffix(".json"))}
    assert rows[3]["accuracy"] == a["accuracy"] and "from" not in rows[3]
    merged = tmp_path / "merged"  # no --runs: the reports' runs in one table and plot
    longdoc_script("rescore").main(
        ["--train", str(train), "--test", str(test), "--out", str(merged), "--with"]
        + [str(out.with_suffix(".json")), str(again.with_suffix(".json"))]
    )
    merged_rows = json.loads(merged.with_suffix(".json").read_text())["rows"]
    assert [row["run"] for row in merged_rows[1:]] == ["a", "b", "a", "b", "c"]
    with pytest.raises(SystemExit):
        longdoc_script("rescore").main(["--train", str(train), "--test", str(test), "--out", "x"])
    with pytest.raises(SystemExit, match="not"):
        longdoc_script("rescore").main(
            [*args, "--test", str(train), "--with", str(out.with_suffix(".json"))]
            + ["--out", str(tmp_path / "other")]
        )


def test_the_fidelity_script_scores_every_variant_against_the_exact_long_model(tmp_path, capsys):
    # benchmarks/longdoc/fidelity.py on a tiny BERT extended to 64 positions.
    script = longdoc_script("fidelity")
    source = write_tiny_bert(tmp_path / "bert")
    data = write_classification(tmp_path / "docs.jsonl", count=12)
    out = tmp_path / "fidelity"
    args = ["--data", str(data), "--source", str(source), "--docs", "6", "--out", str(out)]
    script.main([*args, "--variants", "k4@64,k4@64:adaptive,k64@64:adaptive"])
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {row["variant"]: row for row in report["rows"]}
    assert list(rows) == ["k4@64", "k4@64:adaptive", "k64@64:adaptive"]
    assert rows["k64@64:adaptive"]["pooled_cosine"] == pytest.approx(1.0, abs=1e-5)  # exact
    assert all(-1 <= row["pooled_cosine"] < 0.9999 for row in list(rows.values())[:2])
    assert rows["k4@64"]["docs_<=512"] == 6
    assert out.with_suffix(".md").read_text().count("\n") == 5
    with pytest.raises(SystemExit):
        script.main([*args, "--variants", "k4@64,k4@32"])  # one max_seq_len only
    with pytest.raises(SystemExit):
        script.main([*args, "--variants", "k4@64:after"])  # a classifier: nothing to compare
    assert "drop :after" in capsys.readouterr().err


def test_distillation_runs_on_the_training_texts_and_is_scored_on_the_validation_texts(
    tmp_path, monkeypatch
):
    seen = {}

    def recording_distill(source, model_dir, settings, data, **texts):
        seen.update(settings=settings, data=data, **texts)
        return [{"cosine_mean": 0.5}, {"cosine_mean": 0.75}]

    monkeypatch.setattr(task_bench, "distill_checkpoint", recording_distill)
    train = write_classification(tmp_path / "train.jsonl", 12, seed=0)
    val = write_classification(tmp_path / "val.jsonl", 5, seed=1)
    settings = TaskBenchSettings(train=str(train), val=str(val), test="t", distill_steps=7)
    row = task_bench._distill("source", tmp_path / "model", settings)
    assert row == {"distill_cosine_before": 0.5, "distill_cosine_after": 0.75}
    assert seen["documents"] == read_labelled(train)[0]
    assert seen["heldout_documents"] == read_labelled(val)[0]
    assert seen["settings"].max_steps == 7 and seen["data"].texts == 12
    with pytest.raises(ValueError, match="distill_steps must be an integer >= 0, got -1"):
        dataclasses.replace(settings, distill_steps=-1)
