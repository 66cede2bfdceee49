"""Checkpoints: atomic writes, truncation and alteration detection, fallback to the previous
checkpoint, and a clear stop when none is intact."""

import json
import re

import pytest
import torch
from train_helpers import flip_last_byte, tiny_run

from linformer_kit import manifest
from linformer_kit.files import umask_mode
from linformer_kit.manifest import IntegrityError, write_manifest
from linformer_kit.masked_lm import LinformerForMaskedLM
from linformer_kit.training import checkpoint as checkpoint_module
from linformer_kit.training import latest_checkpoint, load_checkpoint, pretrain


@pytest.fixture
def run_dir(tmp_path):
    pretrain(tiny_run(tmp_path, max_steps=8, save_every=4, eval_every=100))
    return tmp_path / "run"


def test_checkpoint_holds_everything_needed_to_resume(run_dir):
    names = {p.name for p in (run_dir / "last").iterdir()}
    assert names >= {
        "config.json",
        "model.safetensors",
        "trainer_state.pt",
        "run_config.json",
        "tokenizer.json",
        "manifest.json",
    }
    state = load_checkpoint(run_dir / "last").state
    assert state["step"] == 8
    assert set(state) >= {"optimizer", "scheduler", "rng", "data_position", "tokens"}
    model = LinformerForMaskedLM.from_pretrained(run_dir / "best")
    assert model.config.vocab_size == 300


def test_truncated_checkpoint_is_rejected_and_the_previous_one_loads(run_dir):
    weights = run_dir / "checkpoints" / "step-00000008" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model.safetensors has \d+ bytes, expected \d+"):
        load_checkpoint(run_dir / "last")
    previous = latest_checkpoint(run_dir)
    assert previous.state["step"] == 4
    LinformerForMaskedLM.from_pretrained(previous.path)


def test_altered_checkpoint_is_refused_by_every_loader_and_resume_falls_back(run_dir, caplog):
    newest = run_dir / "checkpoints" / "step-00000008"
    flip_last_byte(newest / "model.safetensors")
    problem = "model.safetensors was altered (same size, but its SHA-256 differs)"
    with pytest.raises(IntegrityError) as err:
        LinformerForMaskedLM.from_pretrained(run_dir / "last")
    assert str(err.value).startswith(f"{newest.resolve()} failed its integrity check: {problem}")
    with pytest.raises(IntegrityError) as err:
        load_checkpoint(newest)
    assert err.value.problems == [problem]
    assert latest_checkpoint(run_dir).state["step"] == 4
    assert f"skipping a corrupt checkpoint in {run_dir}: step-00000008: {problem}" in caplog.text
    assert LinformerForMaskedLM.from_pretrained(run_dir / "last", verify=False).config.dim == 32


@pytest.mark.parametrize("load", ["from_pretrained", "from_pretrained of last/", "load_checkpoint"])
def test_a_load_through_a_link_a_live_run_moves_reads_one_save(run_dir, monkeypatch, load):
    # A run moves `last` to each new save. Read through the link, the manifest, config and
    # weights were read in turn and could be of two saves: a false IntegrityError (86 of
    # 4,059 loads of a live run's `last` in a review), or weights other than those checked.
    checkpoints, verify = run_dir / "checkpoints", manifest.verify_manifest

    def verified_then_the_link_moves(path, **kwargs):
        checked = verify(path, **kwargs)
        checkpoint_module._point(run_dir / "last", checkpoints / "step-00000004")
        return checked

    monkeypatch.setattr(manifest, "verify_manifest", verified_then_the_link_moves)
    if load.startswith("from_pretrained"):  # "run/last/", as a shell completes it, too
        last = f"{run_dir / 'last'}/" if load.endswith("/") else run_dir / "last"
        model = LinformerForMaskedLM.from_pretrained(last)
        saved = LinformerForMaskedLM.from_pretrained(checkpoints / "step-00000008")
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved.parameters()))
    else:
        assert load_checkpoint(run_dir / "last").state["step"] == 8


def test_no_intact_checkpoint_lists_each_and_the_ways_on(run_dir):
    checkpoints = run_dir / "checkpoints"
    flip_last_byte(checkpoints / "step-00000008" / "model.safetensors")
    (checkpoints / "step-00000004" / "trainer_state.pt").unlink()
    with pytest.raises(ValueError) as err:
        latest_checkpoint(run_dir)
    assert str(err.value) == (
        f"no intact checkpoint to resume from in {run_dir}: every one failed its integrity check\n"
        "  step-00000008: model.safetensors was altered (same size, but its SHA-256 differs)\n"
        "  step-00000004: trainer_state.pt is missing\n"
        "To go on, either start a fresh run in another --output-dir, or remove the corrupt "
        f"checkpoints (rm -r {checkpoints}) to start again from step 0 in {run_dir}."
    )


@pytest.mark.parametrize(
    "state, problem",
    [
        ({}, "its step is 'None'"),
        ([1, 2], "a list, not a dict"),
        ("pickle", "is unreadable"),
        ({"step": -5}, "its step is '-5'"),
        ({"scheduler": 5}, "its scheduler is '5'"),
        ({"rng": [torch.zeros(3)]}, "its rng is"),
    ],
)
def test_a_trainer_state_of_another_shape_is_a_corrupt_checkpoint(run_dir, state, problem):
    # Listed in a manifest made anew, it passed the integrity check and the resume failed
    # in a traceback (KeyError, TypeError, inside torch) instead of falling back.
    newest = run_dir / "checkpoints" / "step-00000008"
    file = newest / "trainer_state.pt"
    if state == "pickle":
        file.write_bytes(b"not a pickle at all")
    else:
        saved = torch.load(file, weights_only=True)
        torch.save({**saved, **state} if isinstance(state, dict) and state else state, file)
    write_manifest(newest, step=8)
    with pytest.raises(IntegrityError, match=f"trainer_state.pt .*{re.escape(problem)}"):
        load_checkpoint(newest)
    assert latest_checkpoint(run_dir).state["step"] == 4
    # a manifest that leaves the trainer state out is no checkpoint's
    listing = json.loads((newest / "manifest.json").read_text())
    del listing["files"]["trainer_state.pt"]
    (newest / "manifest.json").write_text(json.dumps(listing))
    with pytest.raises(IntegrityError, match="trainer_state.pt is not in manifest.json"):
        load_checkpoint(newest)


def test_run_without_checkpoints_has_no_latest(tmp_path):
    assert latest_checkpoint(tmp_path) is None


def test_checkpoint_without_manifest_is_incomplete(run_dir):
    (run_dir / "last" / "manifest.json").unlink()
    with pytest.raises(ValueError, match="incomplete"):
        load_checkpoint(run_dir / "last")


def test_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    real_save = checkpoint_module.torch.save
    calls = []

    def dies_on_second_save(obj, path):
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as handle:
                handle.write(b"half a file")
            raise KeyboardInterrupt("killed mid-write")
        real_save(obj, path)

    monkeypatch.setattr(checkpoint_module.torch, "save", dies_on_second_save)
    with pytest.raises(KeyboardInterrupt):
        pretrain(tiny_run(tmp_path, max_steps=8, save_every=4, eval_every=100))
    run_dir = tmp_path / "run"
    assert load_checkpoint(run_dir / "last").state["step"] == 4
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-00000004"]


def test_the_next_save_removes_what_a_killed_save_left_and_checkpoints_get_umask_modes(
    tmp_path,
):
    run = tiny_run(tmp_path, max_steps=4, save_every=4, eval_every=100)
    pretrain(run)
    stale = tmp_path / "run" / "checkpoints" / ".tmp-killed"  # what SIGKILL mid-save leaves
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half a file")
    run.train.resume, run.train.max_steps = True, 8
    pretrain(run)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000004", "step-00000008"]
    for path in checkpoints.iterdir():  # mkdtemp's 0o700 would hide them from the group
        assert path.stat().st_mode & 0o777 == umask_mode(0o777)
