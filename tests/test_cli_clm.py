"""`linformer pretrain --objective clm` end to end: a causal LM that generate and evaluate read."""

import json

import pytest
import torch
from train_helpers import pretrain_cli

from linformer_kit import LinformerForCausalLM
from linformer_kit.cli import main

MODEL = ["--max-seq-len", "64", "--dim", "32", "--depth", "2", "--num-heads", "2"]
TRAIN = ["--batch-size", "4", "--warmup-steps", "2", "--lr", "3e-3", "--log-every", "1"]
CLM = ["--objective", "clm", "--block-size", "16", *MODEL, *TRAIN]


def records(run, split):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def test_clm_pretraining_learns_and_its_checkpoint_generates_and_evaluates(
    tmp_path, capsys, caplog, monkeypatch
):
    run = pretrain_cli(tmp_path, *CLM, "--max-steps", "36", "--eval-every", "12", files=2)
    val = [r["val_loss"] for r in records(run, "val")]
    assert len(val) == 3 and val[-1] < val[0] - 0.5, val
    saved = json.loads((run / "run_config.json").read_text())
    assert saved["train"]["objective"] == "clm" and saved["model"]["causal"] is True

    model = LinformerForCausalLM.from_pretrained(run / "best")
    assert model.config.causal and model.config.block_size == 16
    capsys.readouterr()
    main(["generate", str(run / "best"), "--prompt", "the cat", "--max-new-tokens", "8",
          "--temperature", "0"])  # fmt: skip
    text = capsys.readouterr().out.strip()
    # New text after the prompt; not a word count: whether a 36-step model emits a space
    # depends on the dropout masks drawn in training (same val loss either way).
    assert text.startswith("the cat") and len(text) > len("the cat")

    # ids the tokenizer does not know (a model of a larger vocabulary) were dropped silently
    with monkeypatch.context() as patch, caplog.at_level("WARNING"):
        patch.setattr(
            LinformerForCausalLM,
            "generate",
            lambda self, ids, *args, **kwargs: torch.cat([ids, torch.tensor([[5000]])], 1),
        )
        main(["generate", str(run / "best"), "--prompt", "the cat", "--temperature", "0"])
    assert capsys.readouterr().out.startswith("the cat")
    assert "prompt 1: 1 generated token(s) have ids the tokenizer does not know" in caplog.text

    main(["evaluate", str(run / "best"), "--data", str(tmp_path / "corpus")])
    table = capsys.readouterr().out.splitlines()
    ppl = float(table[1].split()[-1])
    assert table[0].split()[-2:] == ["val_loss", "val_ppl"] and 1 < ppl < 300

    # a classifier pooling its first token, which has attended to itself only, is refused
    # before the data is read (the data files here do not exist)
    with pytest.raises(SystemExit):
        main(["finetune", "--init", str(run / "best"), "--pooling", "cls", "--data",
              str(tmp_path / "none.jsonl"), "--eval", str(tmp_path / "none.jsonl"),
              "--output-dir", str(tmp_path / "ft")])  # fmt: skip
    err = capsys.readouterr().err
    assert "linformer finetune: error: --pooling cls: pooling 'cls' takes the first real" in err


def test_an_unknown_objective_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pretrain_cli(tmp_path, "--objective", "foo", files=1)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "linformer pretrain: error: objective must be one of mlm, clm; got 'foo'" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--block-size", "8"], "--block-size applies to --objective clm only"),
        (
            ["--objective", "clm", "--mlm-probability", "0.3"],
            "--mlm-probability applies to --objective mlm only",
        ),
    ],
)
def test_a_flag_of_the_other_objective_is_a_usage_error(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        pretrain_cli(tmp_path, *flags, files=1)
    assert exit_info.value.code == 2
    assert f"linformer pretrain: error: {message}" in capsys.readouterr().err


def test_clm_resume_continues_as_an_uninterrupted_run(tmp_path):
    flags = [*CLM, "--schedule", "constant", "--eval-every", "2", "--save-every", "2"]
    straight = pretrain_cli(tmp_path / "straight", *flags, "--max-steps", "6", files=1)
    run = pretrain_cli(tmp_path / "halves", *flags, "--max-steps", "3", files=1)
    main(["pretrain", "--config", str(run), "--max-steps", "6", "--resume"])
    losses = [r["loss"] for r in records(run, "train")]
    assert len(losses) == 6 and losses == [r["loss"] for r in records(straight, "train")]
