"""Through the `linformer` command: an altered checkpoint is refused by every subcommand that
loads one (unless LINFORMER_NO_VERIFY=1), and `pretrain --resume` with no intact checkpoint
says so, checkpoint by checkpoint."""

import logging
import os
import shutil
import subprocess
import sys

import pytest
from test_cli_train import MODEL, TRAIN
from train_helpers import flip_last_byte, pretrain_cli, write_classification

from linformer_kit.cli import main
from linformer_kit.interop.report import minilm_path
from linformer_kit.manifest import write_manifest

ALTERED = (
    "failed its integrity check: model.safetensors was altered (same size, but its SHA-256 "
    "differs); refusing to load it. If the files were changed on purpose, load with "
    "verify=False (from_pretrained), or set LINFORMER_NO_VERIFY=1 in the environment "
    "(the linformer command)."
)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """One tiny pretraining run (checkpoints at steps 4 and 8), shared: tests alter copies."""
    root = tmp_path_factory.mktemp("pretrained")
    pretrain_cli(root, *MODEL, *TRAIN, "--max-steps", "8", "--eval-every", "4")
    return root


@pytest.fixture
def run(pretrained, tmp_path, monkeypatch):
    """A copy of the run whose newest checkpoint (`last`, `best`) has one byte flipped."""
    monkeypatch.setenv("LINFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LINFORMER_NO_VERIFY", raising=False)
    copy = shutil.copytree(pretrained / "run", tmp_path / "run", symlinks=True)
    flip_last_byte(copy / "checkpoints" / "step-00000008" / "model.safetensors")
    return copy


def test_evaluate_refuses_an_altered_checkpoint_with_a_nonzero_status(run, pretrained):
    """In a real process, so the exit status is the one a shell sees."""
    entry = "from linformer_kit.cli import main; main()"
    args = ["evaluate", str(run / "last"), "--data", str(pretrained / "corpus")]
    done = subprocess.run(
        [sys.executable, "-c", entry, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "LINFORMER_CACHE": str(run.parent / "cache")},
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        f"linformer evaluate: error: {(run / 'last').resolve()} {ALTERED}"
    )


def test_finetune_init_refuses_an_altered_checkpoint(run, tmp_path):
    train = write_classification(tmp_path / "train.jsonl", 16)
    with pytest.raises(SystemExit) as err:
        main(
            ["finetune", "--init", str(run / "best"), "--data", str(train), "--eval", str(train)]
            + ["--epochs", "1", "--output-dir", str(tmp_path / "ft")]
        )
    assert (err.value.code, str(err.value)) == (
        2,
        f"linformer finetune: error: {(run / 'best').resolve()} {ALTERED}",
    )
    assert not (tmp_path / "ft" / "checkpoints").exists()


@pytest.mark.parametrize("command", ["spectrum", "attention-map"])
def test_analysis_refuses_an_altered_checkpoint(run, tmp_path, command):
    extra = {
        "spectrum": ["--data", "stdlib", "--out", str(tmp_path / "spec")],
        "attention-map": ["--text", "the cat", "--out", str(tmp_path / "map.png")],
    }[command]
    with pytest.raises(SystemExit) as err:
        main([command, str(run / "last"), *extra])
    assert (err.value.code, str(err.value)) == (
        2,
        f"linformer {command}: error: {(run / 'last').resolve()} {ALTERED}",
    )


def test_no_verify_environment_loads_an_altered_checkpoint(run, pretrained, monkeypatch, capsys):
    monkeypatch.setenv("LINFORMER_NO_VERIFY", "1")
    main(["evaluate", str(run / "last"), "--data", str(pretrained / "corpus")])
    assert "val_ppl" in capsys.readouterr().out


def test_resume_with_no_intact_checkpoint_lists_each_and_the_ways_on(run, caplog):
    checkpoints = run / "checkpoints"
    weights = checkpoints / "step-00000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    caplog.set_level(logging.INFO)
    with pytest.raises(SystemExit) as err:
        main(["pretrain", "--config", str(run), "--output-dir", str(run), "--resume"])
    message = str(err.value)
    assert err.value.code == 2
    assert message.startswith(
        f"linformer pretrain: error: no intact checkpoint to resume from in {run}:"
    )
    assert "  step-00000008: model.safetensors was altered" in message
    assert "  step-00000004: model.safetensors has 100 bytes, expected" in message
    assert "another --output-dir" in message and f"rm -r {checkpoints}" in message
    said = message + caplog.text
    assert "starting from scratch" not in said and "pass --resume" not in said


def test_convert_refuses_a_source_that_does_not_match_its_manifest(tmp_path):
    source = tmp_path / "minilm"
    source.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(minilm_path() / name, source / name)
    write_manifest(source)
    flip_last_byte(source / "model.safetensors")
    with pytest.raises(SystemExit) as err:
        main(["convert", "--from", str(source), "--exact", "--out", str(tmp_path / "out")])
    assert (err.value.code, str(err.value)) == (2, f"linformer convert: error: {source} {ALTERED}")
