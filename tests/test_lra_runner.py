"""`linformer lra`: LRA's recipes scaled, both models trained on a tiny task, the reports."""

import json
import random
import shutil
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import pytest
import torch

from linformer_kit import files
from linformer_kit.cli import main
from linformer_kit.config import LinformerConfig
from linformer_kit.models import LinformerForSequenceClassification
from linformer_kit.training.loop import Trainer
from linformer_kit.training.lra import init_like_lra, run_lra
from linformer_kit.training.lra_settings import MODELS, RECIPES, LRASettings


def tiny_listops(tmp_path, **overrides):
    """Settings of a small ListOps run (one operator over 2-10 digits) writing under tmp_path."""
    return LRASettings(
        **{
            "output_dir": str(tmp_path / "runs"),
            "cache_dir": str(tmp_path / "cache"),
            "min_length": 4,
            "max_length": 12,
            "max_depth": 1,
            **overrides,
        }
    )


def test_a_second_lra_run_into_a_task_folder_in_use_is_refused(tmp_path):
    # it removed the first's runs, wrote its settings over theirs, and its report
    settings = tiny_listops(tmp_path)
    with files.exclusive(tmp_path / "runs" / "listops", "lra listops run"):
        with pytest.raises(ValueError, match="listops is in use by another lra listops run"):
            run_lra("listops", settings)


@pytest.mark.parametrize(
    "name, what", [("listops.png", "a .png image"), ("summary.md", "a report that begins")]
)
def test_a_user_file_where_the_report_goes_is_named_before_any_work(tmp_path, name, what):
    settings = tiny_listops(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / name).write_text("mine")  # replaced by the plot, or the summary
    named = f"--output-dir {tmp_path / 'runs' / name} exists and is not {what}"
    with pytest.raises(ValueError, match=named):
        run_lra("listops", settings)
    assert not (tmp_path / "runs" / "listops").exists()  # no data made, no run started


def test_recipes_scale_width_and_steps():
    listops = LRASettings(scale=0.125).recipe("listops")
    assert (listops.dim, listops.num_heads, listops.depth, listops.ffn_dim) == (64, 1, 6, 256)
    assert (listops.steps, listops.warmup_steps, listops.batch_size) == (625, 125, 32)
    tiny = LRASettings(scale=0.0625, steps=7, batch_size=3).recipe("pathfinder")
    assert (tiny.dim, tiny.num_heads, tiny.steps, tiny.batch_size) == (8, 1, 7, 3)
    # Fewer steps keep LRA's warm-up share (text: 8K of 20K), unless the warm-up is given.
    assert LRASettings(scale=0.125, steps=300).recipe("text").warmup_steps == 120
    assert LRASettings(scale=0.125, steps=300).recipe("listops").warmup_steps == 60
    # from LRA's figures, not the scaled recipe's rounded ones (which gave 0 and 10000 here)
    assert LRASettings(scale=0.001, steps=2000).recipe("pathfinder").warmup_steps == 10
    assert LRASettings(scale=0.0001, steps=20000).recipe("text").warmup_steps == 8000
    given = LRASettings(scale=0.125, steps=300, warmup_steps=125).recipe("listops")
    assert given.warmup_steps == 125
    assert RECIPES["pathfinder"].published == {"linformer": 76.34, "transformer": 71.40}
    # LRA's pooling: the first position for ListOps and text, the mean for Pathfinder.
    assert [RECIPES[task].pooling for task in ("listops", "text", "pathfinder")] == [
        "cls",
        "cls",
        "mean",
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("scale", 0.0),
        ("scale", 1.5),
        ("steps", -1),
        ("warmup_steps", -2),
        ("lr", -1.0),
        ("proj_dim", 0),
        ("sharing", ""),
        ("projection", "lsh"),
        ("models", ""),
        ("models", "linformer,performer"),
        ("models", "linformer,linformer"),
    ],
)
def test_settings_out_of_range_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        LRASettings(**{field: value})


def test_init_like_lra_draws_lra_scales_and_keeps_the_rest():
    torch.manual_seed(0)
    config = LinformerConfig(vocab_size=300, max_seq_len=64, dim=64, depth=2, num_heads=2,
                             ffn_dim=256, proj_dim=16)  # fmt: skip
    model = LinformerForSequenceClassification(config, num_labels=3)
    kept = {
        name: tensor.clone()
        for name, tensor in model.state_dict().items()
        if "norm" in name or "position" in name or "proj" in name
    }
    init_like_lra(model)
    tokens = model.linformer.embeddings.tokens.weight
    assert tokens.std().item() == pytest.approx(1.0, rel=0.05)  # BERT's was 0.02
    up = model.linformer.encoder.layers[0].ffn.up  # 64 -> 256: Xavier's bound sqrt(6 / 320)
    bound = (6 / (64 + 256)) ** 0.5
    assert up.weight.abs().max().item() <= bound
    assert up.weight.std().item() == pytest.approx(bound / 3**0.5, rel=0.05)
    assert not up.bias.any()
    dense, logits = model.head[1], model.head[4]  # LeCun normal: std 1 / sqrt(fan_in)
    assert dense.weight.std().item() == pytest.approx(64**-0.5, rel=0.1)
    assert logits.weight.std().item() == pytest.approx(64**-0.5, rel=0.25)
    assert kept  # norms, positions and Linformer's projections are untouched
    for name, tensor in model.state_dict().items():
        if name in kept:
            assert torch.equal(tensor, kept[name]), name


def test_unknown_task_names_the_known_ones():
    with pytest.raises(ValueError, match="listops, text, pathfinder"):
        LRASettings().recipe("retrieval")


def test_a_torchrun_job_of_several_processes_is_refused(tmp_path, monkeypatch):
    # Each rank trained on rows another rank took a step later, and every rank wrote the
    # report (rank 1 removed the run folder rank 0 had just made).
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="process 1 of a job of 2: run it without torchrun"):
        run_lra("listops", LRASettings(output_dir=str(tmp_path)))
    assert not any(tmp_path.iterdir())


def test_both_models_learn_short_listops_above_the_majority_class(tmp_path):
    # One operator over 2-10 digits: the operator alone tells much of the answer (MAX leans
    # to 9, MIN to 0), which a small model learns in a hundred steps.
    settings = tiny_listops(
        tmp_path, scale=0.0625, steps=150, batch_size=32, lr=3e-3, proj_dim=8, num_train=2000,
        num_eval=300, eval_every=75, isolate=False,
    )  # fmt: skip
    report = run_lra("listops", settings)
    majority = 100 * report["majority_baseline"]
    constant = 100 * report["best_constant_baseline"]
    assert majority <= constant < 20
    for row in report["rows"]:
        assert row["test_acc"] > constant + 5, (row["model"], row["test_acc"], constant)
    assert [row["published"] for row in report["rows"]] == [35.70, 36.37]
    saved = json.loads((tmp_path / "runs" / "listops.json").read_text())
    assert saved["rows"][0]["model"] == "Linformer k=8"
    assert saved["rows"][1]["model"] == "Transformer (exact)"
    assert saved["data"]["sizes"] == [2000, 300, 300]
    assert (tmp_path / "runs" / "listops.png").stat().st_size > 10_000
    summary = (tmp_path / "runs" / "summary.md").read_text().splitlines()
    rows = [line.split(" | ") for line in summary if line.startswith("| listops")]
    exact, linformer = report["rows"][1], report["rows"][0]
    assert [row[2] for row in rows] == ["Linformer k=8", "Transformer (exact)"]
    assert rows[0][3] == f"{linformer['test_acc']:.1f}" and rows[0][5] == f"{majority:.1f}"
    assert rows[0][6] == f"{constant:.1f}"
    speedup = exact["s_per_step"] / linformer["s_per_step"]
    assert rows[0][8] == f"{speedup:.2f}" and rows[1][8] == "1.00"
    recipe = "- listops: scale 0.0625: width 32, 6 layers, 1 head, cls pooling, 150 steps of 32;"
    assert any(line.startswith(recipe) for line in summary), summary


def keyword_reviews(root, per_class):
    """`root/{neg,pos}/*.txt`: 40 filler words and one keyword ("dull" or "grand") at a random
    place, so the label is in a few bytes anywhere in the document."""
    rng = random.Random(0)
    filler = "the a film of and in plot actor scene story it was".split()
    for name, word in (("neg", "dull"), ("pos", "grand")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            words = [rng.choice(filler) for _ in range(40)]
            words.insert(rng.randrange(len(words) + 1), word)
            (root / name / f"{i}.txt").write_text(" ".join(words))
    return root


def test_both_models_learn_a_keyword_anywhere_in_a_document(tmp_path):
    # LRA's text recipe at a quarter of its width; the Linformer with the length-adaptive
    # projection: with the paper's learned `linear` E it reached 47-63% test accuracy (docs/lra.md).
    settings = LRASettings(
        data=str(keyword_reviews(tmp_path / "reviews", 300)), output_dir=str(tmp_path / "runs"),
        cache_dir=str(tmp_path / "cache"), scale=0.25, steps=150, batch_size=16, lr=1e-3,
        proj_dim=32, projection="adaptive", max_length=256, eval_every=75, isolate=False,
    )  # fmt: skip
    report = run_lra("text", settings)
    assert [row["model"] for row in report["rows"]] == [
        "Linformer k=32 adaptive",
        "Transformer (exact)",
    ]
    constant = 100 * report["best_constant_baseline"]
    for row in report["rows"]:
        assert row["test_acc"] > constant + 20, (row["model"], row["test_acc"], constant)


def test_cli_text_end_to_end_writes_json_and_png(tmp_path, capsys):
    keyword_reviews(tmp_path / "reviews", 20)
    out = tmp_path / "runs"
    main(
        ["lra", "text", "--data", str(tmp_path / "reviews"), "--output-dir", str(out),
         "--cache-dir", str(tmp_path / "cache"), "--scale", "0.0625", "--steps", "6",
         "--batch-size", "4", "--max-length", "256", "--proj-dim", "32"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert "Transformer (exact)" in printed and "Linformer k=32" in printed
    assert "53.94" in printed and "64.27" in printed
    report = json.loads((out / "text.json").read_text())
    assert report["data"]["classes"] == ["neg", "pos"] and report["data"]["max_seq_len"] == 256
    assert all(row["peak_mem_mb"] > 0 and row["steps"] == 6 for row in report["rows"])
    assert (out / "text.png").is_file()


def test_cli_table_of_one_model_shows_a_dash_for_the_ratio_it_has_not(tmp_path, capsys):
    main(["lra", "listops", "--output-dir", str(tmp_path / "runs"), "--cache-dir",
          str(tmp_path / "cache"), "--min-length", "4", "--max-length", "12", "--max-depth",
          "1", "--scale", "0.0625", "--steps", "2", "--batch-size", "8", "--proj-dim", "4",
          "--num-train", "16", "--num-eval", "8", "--models", "linformer",
          "--no-isolate"])  # fmt: skip
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("listops"))
    # ... s / step, step time: exact / this, peak MB, steps
    assert "nan" not in row and row.split()[-3] == "-"  # the ratio (was nan)


@pytest.mark.parametrize(
    ("task", "flags", "message"),
    [
        ("listops", ["--data", "reviews"], "--data sets the data of text only; listops does not"),
        ("text", ["--max-depth", "3"], "--max-depth sets the data of listops only; text does"),
        ("pathfinder", ["--max-length", "50"], "--max-length sets the data of listops and text"),
        ("listops", ["--max-depth", "1"], r"got 2000 \(LRA's, --max-length left at 0; give one\)"),
    ],
)
def test_a_flag_the_task_does_not_read_is_named(tmp_path, task, flags, message):
    # Before, listops ran with --data or --contour-length and ignored them without a word.
    with pytest.raises(SystemExit, match=message):
        main(["lra", task, *flags, "--output-dir", str(tmp_path), "--steps", "1"])
    assert not any(tmp_path.iterdir())


def test_resume_refuses_text_whose_files_changed(tmp_path):
    # Before, a resumed text run went on training on the rewritten files without a word.
    reviews = keyword_reviews(tmp_path / "reviews", 10)
    settings = LRASettings(
        data=str(reviews), output_dir=str(tmp_path / "runs"), cache_dir=str(tmp_path / "cache"),
        scale=0.0625, steps=2, batch_size=4, max_length=64, proj_dim=8, models="linformer",
        isolate=False, resume=True,
    )  # fmt: skip
    run_lra("text", settings)
    run_lra("text", settings)  # the same files: resumed (nothing left to train)
    (reviews / "pos" / "0.txt").write_text("a different review, grand")
    with pytest.raises(ValueError, match=r"on the data it started with; these differ: files '"):
        run_lra("text", settings)
    assert (tmp_path / "runs" / "text" / "linformer").is_dir()  # the run is kept


def test_cli_text_without_data_or_selecting_rows_of_folders_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["lra", "text", "--output-dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--data" in capsys.readouterr().err
    keyword_reviews(tmp_path / "reviews", 2)
    with pytest.raises(SystemExit) as exit_:
        main(
            ["lra", "text", "--data", str(tmp_path / "reviews"), "--data-where", "source=imdb",
             "--output-dir", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache")]
        )  # fmt: skip
    assert exit_.value.code == 2
    assert "selecting rows by 'source=imdb' needs a CSV file" in capsys.readouterr().err


class KilledPool:
    """A process pool whose worker dies (as when the kernel kills it for memory)."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, *args):
        future = Future()
        future.set_exception(BrokenProcessPool("terminated abruptly"))
        return future


def test_models_trains_only_those_named(tmp_path):
    settings = tiny_listops(tmp_path, models="linformer", **RESUMABLE)
    report = run_lra("listops", settings)
    assert [row["model"] for row in report["rows"]] == ["Linformer k=4"]
    assert not (tmp_path / "runs" / "listops" / "transformer").exists()
    # No exact model to compare with: no step-time ratio, every other figure.
    row = next(line for line in (tmp_path / "runs" / "summary.md").read_text().splitlines()
               if line.startswith("| listops"))  # fmt: skip
    assert row.split(" | ")[3] == f"{report['rows'][0]['test_acc']:.1f}"
    assert row.split(" | ")[8] == "-"
    assert LRASettings(models=" transformer , linformer").model_names == MODELS[::-1]


def test_a_fresh_run_of_one_model_leaves_the_others_resume_to_its_own_settings(tmp_path):
    # Before, it overwrote the task's one settings.json: `--resume --models transformer` then
    # went on from the exact model's 6-step checkpoint under the 8-step settings silently.
    run_lra("listops", tiny_listops(tmp_path, **RESUMABLE))
    shutil.rmtree(tmp_path / "runs/listops/linformer")  # a fresh run of one model
    run_lra("listops", tiny_listops(tmp_path, models="linformer", **{**RESUMABLE, "steps": 8}))
    again = tiny_listops(tmp_path, models="transformer", resume=True, **{**RESUMABLE, "steps": 8})
    message = r"continues the run in .*/listops/transformer .*these differ: steps 8 \(the run's: 6"
    with pytest.raises(ValueError, match=message):
        run_lra("listops", again)
    for name in MODELS:  # each model's own settings and data beside its checkpoints
        started = json.loads((tmp_path / "runs/listops" / name / "settings.json").read_text())
        assert started["steps"] == (8 if name == "linformer" else 6)
        assert (tmp_path / "runs/listops" / name / "data.json").is_file()


def test_a_killed_model_run_is_reported_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setattr("linformer_kit.training.process.ProcessPoolExecutor", KilledPool)
    report = run_lra("listops", tiny_listops(tmp_path, num_train=8, num_eval=4))
    assert [row["model"] for row in report["rows"]] == ["Linformer k=12", "Transformer (exact)"]
    assert all("out of memory" in row["error"] for row in report["rows"])
    assert (tmp_path / "runs" / "listops.json").is_file()
    assert (tmp_path / "runs" / "listops.png").is_file()
    table = (tmp_path / "runs" / "summary.md").read_text()
    assert "| listops | 12 | Transformer (exact) | - | 36.37 |" in table


# Six steps, a checkpoint every two, in this process (so a patched step reaches it).
RESUMABLE = {
    "scale": 0.0625, "steps": 6, "batch_size": 8, "proj_dim": 4, "num_train": 64,
    "num_eval": 16, "eval_every": 2, "isolate": False,
}  # fmt: skip


def scores(row):
    """Every record of a run but its timings: the losses and validation metrics by step."""
    timing = {"train_s", "tokens_per_s"}
    return [{k: v for k, v in r.items() if k not in timing} for r in row["records"]]


def test_resume_continues_a_stopped_run_to_what_an_unstopped_run_gives(tmp_path, monkeypatch):
    whole = run_lra("listops", tiny_listops(tmp_path / "whole", **RESUMABLE))
    step, calls = Trainer._train_step, []

    def counted(self, model):
        calls.append(1)
        if len(calls) == stop_at:
            raise RuntimeError("the machine went away")
        return step(self, model)

    monkeypatch.setattr(Trainer, "_train_step", counted)
    stop_at = 5  # the Linformer's fifth step: its checkpoint of step 4 is the last
    with pytest.raises(RuntimeError, match="went away"):
        run_lra("listops", tiny_listops(tmp_path / "stopped", resume=True, **RESUMABLE))
    calls.clear()
    stop_at = 0
    resumed = run_lra("listops", tiny_listops(tmp_path / "stopped", resume=True, **RESUMABLE))
    assert len(calls) == 2 + 6  # the Linformer's last two steps, then the exact model's six
    for before, after in zip(whole["rows"], resumed["rows"], strict=True):
        assert after["steps"] == 6
        assert after["test_acc"] == before["test_acc"]
        assert scores(after) == scores(before)
    # Resuming a finished run trains nothing: the same test accuracy, the run's mean step time,
    # the peak memory of the processes that trained it (saved with each checkpoint), not the
    # testing process's own.
    calls.clear()
    monkeypatch.setattr("linformer_kit.training.loop.peak_memory_mb", lambda device: 1.0)
    again = run_lra("listops", tiny_listops(tmp_path / "stopped", resume=True, **RESUMABLE))
    assert not calls
    for before, after in zip(resumed["rows"], again["rows"], strict=True):
        assert after["test_acc"] == before["test_acc"]
        assert 0 < after["s_per_step"] < 60
        assert 1.0 < after["peak_mem_mb"] <= before["peak_mem_mb"]
    # A resume must train what the run started to: other steps or lr are refused, by name,
    # before any training; where and how it runs (threads here) may change.
    calls.clear()
    other = {**RESUMABLE, "steps": 8, "lr": 1e-3}
    with pytest.raises(ValueError, match=r"steps 8 \(the run's: 6\), lr 0.001 \(the run's: 0.0\)"):
        run_lra("listops", tiny_listops(tmp_path / "stopped", resume=True, **other))
    run_lra("listops", tiny_listops(tmp_path / "stopped", resume=True, threads=1, **RESUMABLE))
    assert not calls
    # Without resume the run's checkpoints are refused before any work (they were removed
    # with a warning: a rerun of the default --output-dir lost a 5000-step run); a folder
    # of settings alone (a run stopped before its first checkpoint) starts over.
    with pytest.raises(ValueError, match=r"listops/linformer already holds checkpoints: pass --r"):
        run_lra("listops", tiny_listops(tmp_path / "stopped", **other))
    assert not calls
    for name in ("linformer", "transformer"):
        shutil.rmtree(tmp_path / "stopped/runs/listops" / name / "checkpoints")
    run_lra("listops", tiny_listops(tmp_path / "stopped", **other))
    assert len(calls) == 8 + 8
    # a file as --output-dir or --cache-dir is named before the data is generated
    (tmp_path / "file.txt").write_text("")
    for flag, field in (("--output-dir", "output_dir"), ("--cache-dir", "cache_dir")):
        with pytest.raises(ValueError, match=rf"^{flag} .*file.txt is a file; name a directory"):
            run_lra("listops", tiny_listops(tmp_path, **{field: str(tmp_path / "file.txt")}))


def test_a_proj_dim_above_the_tasks_length_is_said_to_run_at_the_length(tmp_path, caplog):
    # the table said "Linformer k=12" for --proj-dim 10**12 (the JSON the flag's value)
    flags = {**RESUMABLE, "steps": 1, "proj_dim": 10**12}
    with caplog.at_level("WARNING"):
        report = run_lra("listops", tiny_listops(tmp_path, models="linformer", **flags))
    assert (
        "--proj-dim 1000000000000 exceeds the task's length 12: the Linformer runs at k = 12"
        in caplog.text
    )
    assert report["rows"][0]["model"].endswith("k=12")
