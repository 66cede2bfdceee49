"""The pretrain / finetune / evaluate / demo subcommands end to end on tiny generated data."""

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
from train_helpers import (
    count_checkpoint_checks,
    interrupted_after,
    write_classification,
    write_corpus,
)

from linformer_kit import LinformerForCausalLM, cli
from linformer_kit.cli import build_parser, main
from linformer_kit.cli.common import print_checkpoints
from linformer_kit.cli.overrides import collect_overrides
from linformer_kit.training import distributed
from linformer_kit.training.interfaces import mark_stopped
from linformer_kit.training.loop import Trainer, TrainingInterrupted

MODEL = ["--max-seq-len", "64", "--dim", "32", "--depth", "2", "--num-heads", "2"]
TRAIN = ["--batch-size", "4", "--warmup-steps", "2", "--lr", "3e-3", "--log-every", "1"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LINFORMER_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def pretrained(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    main(
        ["pretrain", "--data", str(corpus), "--vocab-size", "300", "--proj-dim", "16"]
        + MODEL
        + TRAIN
        + ["--max-steps", "8", "--eval-every", "4", "--output-dir", str(run)]
    )
    return run


def test_pretrain_writes_checkpoints_and_resumes_from_its_config(pretrained, capsys, monkeypatch):
    out = capsys.readouterr().out
    assert "val_ppl" in out and "checkpoints:" in out
    assert (pretrained / "last").is_dir() and (pretrained / "best").is_dir()
    saved = json.loads((pretrained / "run_config.json").read_text())
    assert saved["model"]["proj_dim"] == 16 and saved["model"]["vocab_size"] == 300

    checks, last = count_checkpoint_checks(monkeypatch), (pretrained / "last").resolve()
    main(["pretrain", "--config", str(pretrained), "--max-steps", "12", "--resume"])
    # the checkpoint resumed from is read once (the trainer verified it again: twice)
    assert checks == {last: 1}
    # run_config.json now records resume: a --config of it went on without --resume
    with pytest.raises(SystemExit):
        main(["pretrain", "--config", str(pretrained), "--max-steps", "13"])
    assert "holds checkpoints: pass --resume to continue that run" in capsys.readouterr().err
    # a copied (or moved) run went on in the folder it was saved in, the copy untouched
    copy = pretrained.parent / "copy"
    shutil.copytree(pretrained, copy, symlinks=True)
    for config in (copy, copy / "run_config.json"):
        with pytest.raises(SystemExit):
            main(["pretrain", "--config", str(config), "--max-steps", "13", "--resume"])
        assert (
            f"--config {config} is of the run in {copy}, saved to --output-dir {pretrained}: "
            f"give --output-dir {copy} to go on with it there" in capsys.readouterr().err
        )
    # a hand-edited value of another type was a TypeError traceback naming no file
    edited = pretrained.parent / "edited.json"
    edits = [("train", "lr", "x"), ("train", "beta2", None), ("train", "weight_decay", "0.1")]
    for section, name, value in [*edits, ("model", "dim", 0)]:
        config = json.loads((pretrained / "run_config.json").read_text())
        config[section][name] = value
        edited.write_text(json.dumps(config))
        with pytest.raises(SystemExit):
            main(["pretrain", "--config", str(edited)])
        assert f"linformer pretrain: error: {edited}: {name} must be " in capsys.readouterr().err
    records = [json.loads(line) for line in (pretrained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, 13))


def train_losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["split"] == "train"]


def test_ctrl_c_prints_one_line_to_resume_and_resuming_matches_an_uninterrupted_run(
    tmp_path, capsys
):
    corpus = write_corpus(tmp_path / "corpus", files=2)
    flags = ["pretrain", "--data", str(corpus), "--vocab-size", "300", "--proj-dim", "16"]
    flags += MODEL + TRAIN + ["--max-steps", "6", "--eval-every", "2", "--save-every", "2"]
    main(flags + ["--output-dir", str(tmp_path / "straight")])
    run = tmp_path / "run"
    argv = flags + ["--output-dir", str(run)]
    capsys.readouterr()
    with interrupted_after(3), pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 130
    err = capsys.readouterr().err.splitlines()
    command = shlex.join(["linformer", *argv, "--resume"])
    assert err[-1] == (
        f"linformer pretrain: interrupted at step 3; last checkpoint: "
        f"{run}/checkpoints/step-00000002; continue with: {command}"
    )
    assert not any("Traceback" in line for line in err)
    main(shlex.split(command)[1:])
    assert train_losses(run) == train_losses(tmp_path / "straight")


def pretrain_in(tmp_path, monkeypatch):
    """A 6-step `pretrain` command saving every 2 steps into run/ under tmp_path (the cwd)."""
    corpus = write_corpus(tmp_path / "corpus", files=2)
    argv = ["pretrain", "--data", str(corpus), "--vocab-size", "300", "--proj-dim", "16"]
    monkeypatch.chdir(tmp_path)
    return [*argv, *MODEL, *TRAIN, "--max-steps", "6", "--save-every", "2", "--output-dir", "run"]


def test_sigterm_stops_training_as_ctrl_c_does_with_status_143(tmp_path, capsys, monkeypatch):
    argv = pretrain_in(tmp_path, monkeypatch)
    step = Trainer._train_step

    def terminated_at_step_3(trainer, model):
        if trainer.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as `kill` or a job scheduler would
        return step(trainer, model)

    monkeypatch.setattr(Trainer, "_train_step", terminated_at_step_3)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 143
    last_line = capsys.readouterr().err.splitlines()[-1]
    assert last_line.startswith(
        "linformer pretrain: interrupted at step 3; last checkpoint: run/checkpoints/step-00000002"
    )
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored after the command


def test_a_peer_death_then_torchruns_sigterm_names_the_step_the_error_and_the_resume(
    tmp_path, capsys, monkeypatch
):
    # A DDP peer's death reaches the survivors as an error in a collective; torchrun's SIGTERM
    # then came while it unwound (in the job's teardown): rank 0 printed a bare
    # "interrupted", the step, the error and the checkpoint lost.
    argv = pretrain_in(tmp_path, monkeypatch)
    step = Trainer._train_step

    def peer_gone_at_step_3(trainer, model):
        if trainer.step == 3:
            raise RuntimeError("[pair.cc:553] Connection closed by peer\nmore detail")
        return step(trainer, model)

    def sigterm_in_teardown():
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's, to the processes left

    monkeypatch.setattr(Trainer, "_train_step", peer_gone_at_step_3)
    monkeypatch.setattr(distributed, "teardown_distributed", sigterm_in_teardown)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 143
    command = shlex.join(["torchrun", "--nproc_per_node", "2", "--no-python", "linformer"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert capsys.readouterr().err.splitlines()[-1] == (
        "linformer pretrain: interrupted at step 3 after RuntimeError: [pair.cc:553] Connection "
        "closed by peer; last checkpoint: run/checkpoints/step-00000002; continue with: "
        + shlex.join(["linformer", *argv, "--resume"])
    )
    error = RuntimeError("Connection closed by peer")
    mark_stopped(error, 3, Path("run"))
    assert error.__notes__ == ["training stopped at step 3 of run"]  # a traceback's last line
    args, interrupt = build_parser().parse_args(argv), KeyboardInterrupt()
    interrupt.__context__ = error
    line = cli.interrupted(args, argv, interrupt)
    assert line.endswith(f"continue with: {command} {shlex.join([*argv, '--resume'])}")
    demo = build_parser().parse_args(["demo"])  # no --resume: the run folder, then the error
    assert cli.interrupted(demo, ["demo"], interrupt) == (
        "linformer demo: interrupted at step 3 of run after RuntimeError: Connection closed by peer"
    )

    @dataclasses.dataclass(frozen=True)
    class Frozen(Exception):
        path: str

    frozen = Frozen("shard-3")
    mark_stopped(frozen, 3, Path("run"))  # raised as it is (its own error lost before)
    assert not hasattr(frozen, "linformer_stopped_at")
    interrupt.__context__ = BlockingIOError(11, "Resource temporarily unavailable")
    # handled, not what stopped training: a Ctrl-C during a lock's wait, after its first try
    assert cli.interrupted(args, argv, interrupt) == "linformer pretrain: interrupted"


@pytest.mark.parametrize("resumed", [False, True])
def test_an_interrupted_lra_model_says_how_to_continue_it(tmp_path, resumed, monkeypatch):
    # lra's flag is `resume` (its settings are not a "train" section): the line repeated it.
    saved = SimpleNamespace(path=tmp_path / "step-00000002")
    monkeypatch.setattr(cli, "latest_checkpoint", lambda run_dir: saved)
    argv = ["lra", "listops", "--output-dir", str(tmp_path)] + ["--resume"] * resumed
    args = build_parser().parse_args(argv)
    line = cli.interrupted(args, argv, TrainingInterrupted(3, tmp_path / "listops" / "linformer"))
    assert line.endswith(f"continue with: {shlex.join(['linformer', *argv[:4], '--resume'])}")
    # a command without --resume (its runs now raise where they stopped) is not told to use it
    argv = ["demo", "--output-dir", str(tmp_path)]
    line = cli.interrupted(build_parser().parse_args(argv), argv, TrainingInterrupted(3, tmp_path))
    assert line == f"linformer demo: interrupted at step 3 of {tmp_path}"


def test_an_interrupted_torchrun_job_is_told_to_continue_under_torchrun(tmp_path, monkeypatch):
    # The line left torchrun out: pasted, it ran one process, which the resume refuses.
    saved = SimpleNamespace(path=tmp_path / "step-00000002")
    monkeypatch.setattr(cli, "latest_checkpoint", lambda run_dir: saved)
    argv = ["pretrain", "--data", "corpus", "--output-dir", str(tmp_path)]
    args = build_parser().parse_args(argv)
    for env, launcher in [
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "torchrun --nproc_per_node 2 --no-python"),
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "node0",
          "MASTER_PORT": "29500"}, "torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint "
         "node0:29500 --nproc_per_node 8 --no-python"),
    ]:  # fmt: skip
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        line = cli.interrupted(args, argv, TrainingInterrupted(3, tmp_path))
        command = shlex.join(["linformer", *argv, "--resume"])
        assert line.endswith(f"continue with: {launcher} {command}")


def test_finetune_reports_accuracy_per_epoch_and_evaluate_reads_it(tmp_path, pretrained, capsys):
    train = write_classification(tmp_path / "train.jsonl", 48, seed=0)
    valid = write_classification(tmp_path / "valid.jsonl", 16, seed=1)
    out_dir = tmp_path / "ft"
    capsys.readouterr()
    main(
        ["finetune", "--init", str(pretrained / "best"), "--data", str(train)]
        + ["--eval", str(valid), "--epochs", "2", "--batch-size", "8", "--output-dir", str(out_dir)]
    )
    out = capsys.readouterr().out
    assert "accuracy" in out and "f1" in out
    assert out.count("\n") >= 4  # header, two epochs, checkpoint line
    main(["evaluate", str(out_dir / "best"), "--data", str(valid)])
    captured = capsys.readouterr()
    assert "accuracy" in captured.out and "validation: " in captured.err  # a progress bar
    main(["evaluate", str(pretrained / "best"), "--data", str(tmp_path / "corpus")])
    captured = capsys.readouterr()
    assert "val_ppl" in captured.out and "validation: " in captured.err


def test_malformed_data_ends_with_a_message_naming_file_and_line(tmp_path, pretrained):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "the cat", "label": 0}\n{"text": "the dog"}\n')
    with pytest.raises(SystemExit, match=rf"{bad}:2: no field 'label'"):
        main(
            ["finetune", "--init", str(pretrained / "best"), "--data", str(bad), "--eval", str(bad)]
        )
    with pytest.raises(SystemExit, match="does not exist"):
        main(["pretrain", "--data", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "x")])


def test_override_flags_parse_their_field_types():
    parser = build_parser()
    args = parser.parse_args(
        ["pretrain", "--proj-dim", "16,8", "--norm-first", "false", "--resume", "--data", "a", "b"]
    )
    overrides = collect_overrides(args)
    assert overrides["model"] == {"proj_dim": [16, 8], "norm_first": False}
    assert overrides["train"] == {"resume": True}
    assert overrides["data"] == {"data": ["a", "b"]}
    args = parser.parse_args(["pretrain", "--proj-dim", "none", "--ffn-dim", "64"])
    assert collect_overrides(args)["model"] == {"proj_dim": None, "ffn_dim": 64}


def test_demo_compares_both_models_per_objective_and_publishes_table_and_plot(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    publish = tmp_path / "benchmarks"
    main(
        ["demo", "--data", str(corpus), "--output-dir", str(tmp_path / "demo")]
        + ["--publish-dir", str(publish), "--vocab-size", "300", "--seq-len", "64", "--dim", "32"]
        + ["--depth", "1", "--proj-dim", "16", "--steps", "4", "--eval-every", "2"]
        + ["--eval-batches", "1", "--warmup-steps", "1", "--block-size", "16"]
    )
    out = capsys.readouterr().out
    assert "Linformer k=16" in out and "Transformer (exact)" in out
    assert "Linformer k=16, block 16" in out  # the causal one, as the README's table
    assert "masked LM: Linformer / Transformer" in out and "causal LM: Linformer" in out
    result = json.loads((publish / "comparison.json").read_text())
    names = ["mlm/linformer", "mlm/transformer", "clm/linformer", "clm/transformer"]
    assert [r["run"] for r in result["rows"]] == names
    assert [r["objective"] for r in result["rows"]] == ["masked LM"] * 2 + ["causal LM"] * 2
    assert result["rows"][0]["params"] > result["rows"][1]["params"]
    for objective in ("mlm", "clm"):
        rows = [r for r in result["rows"] if r["run"].startswith(objective)]
        pair = result["pairs"][objective]
        assert pair["ppl_ratio"] == pytest.approx(rows[0]["val_ppl"] / rows[1]["val_ppl"])
        assert pair["speedup_per_step"] == pytest.approx(
            rows[1]["sec_per_step"] / rows[0]["sec_per_step"]
        )
    assert (publish / "comparison.png").stat().st_size > 1000
    for name in names:
        assert (tmp_path / "demo" / name / "last" / "model.safetensors").is_file()
    causal = LinformerForCausalLM.from_pretrained(tmp_path / "demo" / "clm" / "linformer" / "last")
    assert causal.config.causal and causal.config.block_size == 16


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--output-dir", ""], "output_dir must name the run's directory, got ''"),
        (["--eval-batches", "-1"], "eval_batches must be an integer >= 0, got -1"),
        (["--lr", "inf"], r"lr must be a number in \(0, 10\], got inf"),
        (["--lr", "nan"], r"lr must be a number in \(0, 10\], got nan"),
        (["--lr", "1e38"], r"lr must be a number in \(0, 10\], got 1e\+38"),
        (["--weight-decay", "nan"], r"weight_decay must be a finite number >= 0 .*, got nan"),
        (["--weight-decay", "-1"], r"weight_decay must be a finite number >= 0 .*, got -1.0"),
        (["--clip-grad-norm", "nan"], r"clip_grad_norm must be a finite number >= 0 .*got nan"),
        (["--clip-grad-norm", "-1"], r"clip_grad_norm must be a finite number >= 0 .*got -1.0"),
        (["--beta2", "1.5"], r"beta2 must be a number in \[0, 1\), got 1.5"),
        (["--beta2", "1"], r"beta2 must be a number in \[0, 1\), got 1.0"),
        (["--mlm-probability", "0"], r"mlm_probability must be in \(0, 1\), got 0.0"),
        (["--max-val-blocks", "-1"], r"max_val_blocks must be an integer >= 0 \(0 = no limit\)"),
        (["--max-documents", "-1"], r"max_documents must be an integer >= 0 \(0 = no limit\)"),
    ],
)
def test_bad_training_flags_are_named_before_any_work(tmp_path, capsys, flags, message):
    argv = ["pretrain", "--data", str(tmp_path / "none"), *MODEL, "--proj-dim", "16"]
    argv += ["--output-dir", "x", *flags]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_paths_that_cannot_be_written_end_with_a_message_and_touch_nothing(
    tmp_path, pretrained, capsys, monkeypatch
):
    # An --output-dir or --cache-dir that is a file was named by errno only ("File exists",
    # "Not a directory"), after the tokenizer was trained and the corpus cached.
    corpus = tmp_path / "corpus"  # the fixture's (its tokenizer and tokens cached)
    monkeypatch.setenv("LINFORMER_CACHE", str(tmp_path / "fresh"))
    note = tmp_path / "notes.txt"
    note.write_text("mine")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "bench.json").write_text("mine")
    pretrain = ["pretrain", "--data", str(corpus), "--vocab-size", "300", *MODEL, *TRAIN]
    pretrain += ["--proj-dim", "16", "--max-steps", "1"]
    evaluate = ["evaluate", str(pretrained / "best"), "--data", str(corpus)]
    run = ["--output-dir", str(tmp_path / "new-run")]
    for argv, message in [
        ([*pretrain, "--output-dir", str(note)], f"--output-dir {note} is a file; name a"),
        ([*pretrain, "--output-dir", str(note / "run")], f"{note} is a file, not a directory"),
        ([*pretrain, *run, "--cache-dir", str(note)], f"--cache-dir {note} is a file; name a"),
        ([*pretrain, *run, "--config", str(tmp_path / "nope")], f"--config {tmp_path / 'nope'}"),
        ([*pretrain, *run, "--config", ""], "--config is empty (''); name a run_config.json"),
        ([*pretrain, *run, "--data", ""], "a data path is empty ('')"),  # was: the working dir
        ([*pretrain, *run, "--data", "/dev/null"], "/dev/null is neither a file nor a directory"),
        ([*evaluate, "--out", str(tmp_path)], f"--out {tmp_path} is a directory; name a file"),
        # the metrics replaced a file that was no report (the training data of another run)
        ([*evaluate, "--out", str(note)], f"--out {note} exists and is not a JSON report"),
        ([*evaluate, "--out", f"{note}/m.json"], f"{note} is a file, not a directory"),
        (["bench", "--n", "64", "--out", str(note)], f"--out {note} is a file; name a directory"),
        # a user's bench.json in --out was replaced, a grid.png removed
        (["bench", "--n", "64", "--out", str(mine)], f"--out {mine / 'bench.json'} exists and"),
        # the metrics were written over the data file, or into the checkpoint
        (
            ["evaluate", str(pretrained / "best"), "--data", str(note), "--out", str(note)],
            f"--out {note} is an input (--data, or in the checkpoint)",
        ),
        ([*evaluate, "--out", str(pretrained / "best" / "m.json")], "is an input (--data, or"),
        # '' wrote into the working directory
        (["bench", "--n", "64", "--out", ""], "--out is empty (''); name a directory"),
    ]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err, err
        assert "Traceback" not in err and "validation" not in err  # stopped before the work
        assert not (tmp_path / "fresh").exists()  # no tokenizer trained, no corpus cached
    assert note.read_text() == "mine"
    user_best = tmp_path / "fresh" / "best"
    user_best.parent.mkdir()
    user_best.write_text("mine too")
    with pytest.raises(SystemExit):
        main([*pretrain, "--max-steps", "1", "--output-dir", str(user_best.parent)])
    assert "is not a run's checkpoint link" in capsys.readouterr().err
    assert user_best.read_text() == "mine too"


def test_the_checkpoint_line_names_only_checkpoints_that_exist(tmp_path, capsys):
    # A run whose validation loss was nan at every validation saved `last` but never `best`.
    (tmp_path / "last").mkdir()
    print_checkpoints(SimpleNamespace(run_dir=tmp_path))
    assert capsys.readouterr().out == (
        f"checkpoints: {tmp_path / 'last'} (no best: no validation loss was a number)\n"
    )
    (tmp_path / "best").mkdir()
    print_checkpoints(SimpleNamespace(run_dir=tmp_path))
    assert capsys.readouterr().out == f"checkpoints: {tmp_path / 'last'} and {tmp_path / 'best'}\n"


def test_seq2seq_errors_name_the_subcommand_as_argparse_does(tmp_path, capsys):
    # The library's errors said "linformer seq2seq: error:", argparse's own "linformer
    # seq2seq train: error:".
    for argv in (
        ["seq2seq", "train", "--task", "reverse", "--max-len", "0"],
        ["seq2seq", "evaluate", str(tmp_path / "none"), "--batch-size", "0"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--output-dir", str(tmp_path / "run")] if "train" in argv else argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"linformer seq2seq {argv[1]}: error: "), err
