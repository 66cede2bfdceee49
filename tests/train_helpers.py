"""Generated corpora and files for the data and training tests (no downloads)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "cat", "dog", "runs", "eats"]


def sentence(rng: random.Random) -> str:
    """A sentence from a tiny grammar, so a model can learn something quickly."""
    subject = rng.choice(["the cat", "the dog", "a bird"])
    verb = rng.choice(["eats", "sees", "likes"])
    obj = rng.choice(["red apples", "green apples", "blue fish"])
    return f"{subject} {verb} {obj} every {rng.choice(['day', 'night'])}."


def write_corpus(directory: Path, files: int = 6, sentences: int = 120, seed: int = 0) -> Path:
    """A directory of .txt files of grammar sentences; returns the directory."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        text = "\n".join(sentence(rng) for _ in range(sentences))
        (directory / f"doc{i}.txt").write_text(text + "\n")
    return directory


def write_classification(path: Path, count: int = 64, seed: int = 0) -> Path:
    """A JSONL file where the label says whether the text mentions a cat (1) or not (0)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        text = sentence(rng)
        lines.append(json.dumps({"text": text, "label": int("cat" in text)}))
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def interrupted_after(step: int) -> Iterator[None]:
    """Training raises KeyboardInterrupt, as Ctrl-C would, once `step` steps are done."""
    from linformer_kit.training.loop import Trainer

    original = Trainer._train_step

    def train_step(trainer: Trainer, model: object) -> object:
        if trainer.step == step:
            raise KeyboardInterrupt
        return original(trainer, model)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Trainer, "_train_step", train_step)
        yield


def tiny_run(tmp_path: Path, **train: object):
    """A RunConfig for a ~40k-parameter masked LM on a generated corpus, cached under tmp_path."""
    from linformer_kit.config import linformer_tiny
    from linformer_kit.data import DataSettings
    from linformer_kit.training import RunConfig, TrainSettings

    corpus = write_corpus(tmp_path / "corpus")
    defaults = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=12,
        batch_size=4,
        lr=3e-3,
        warmup_steps=2,
        eval_every=4,
        save_every=4,
        log_every=1,
        eval_batches=2,
    )
    return RunConfig(
        model=linformer_tiny(max_seq_len=64, dim=32, num_heads=2, proj_dim=16),
        train=TrainSettings(**{**defaults, **train}),
        data=DataSettings(
            data=[str(corpus)], vocab_size=300, val_fraction=0.1, cache_dir=str(tmp_path / "cache")
        ),
    )


def flip_last_byte(file: Path) -> None:
    """Alters a file without changing its size: the damage only a checksum can see."""
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))


def pretrain_cli(root: Path, *flags: str, files: int = 6) -> Path:
    """`linformer pretrain` on a generated corpus under `root`, with its own token cache
    (vocabulary 300, k = 16); returns the run directory."""
    from linformer_kit.cli import main

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LINFORMER_CACHE", str(root / "cache"))
        main(
            ["pretrain", "--data", str(write_corpus(root / "corpus", files=files))]
            + ["--vocab-size", "300", "--proj-dim", "16", "--output-dir", str(root / "run")]
            + list(flags)
        )
    return root / "run"


def write_pid_and_sleep(path: str, seconds: float) -> None:
    """Writes this process's id to `path`, then sleeps (a run that a test stops)."""
    Path(path).write_text(str(os.getpid()))
    time.sleep(seconds)


def write_pid_and_train(path: str, seconds: float) -> None:
    """As `write_pid_and_sleep`, interrupted as a Trainer is: `TrainingInterrupted` at step 3,
    its run folder `path`'s."""
    from linformer_kit.training.loop import TrainingInterrupted

    try:
        write_pid_and_sleep(path, seconds)
    except KeyboardInterrupt:
        raise TrainingInterrupted(3, Path(path).parent) from None


def count_checkpoint_checks(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """Counts, by path, the checkpoints read through `load_checkpoint`'s integrity check
    (each a pass over every byte of the checkpoint)."""
    from linformer_kit import manifest

    checks: collections.Counter = collections.Counter()
    verify = manifest.verify_manifest

    def counted(path: str | os.PathLike, **kwargs: object) -> bool:
        checks[Path(path).resolve()] += 1
        return verify(path, **kwargs)

    monkeypatch.setattr(manifest, "verify_manifest", counted)
    return checks


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return not stat.parent.parent.is_dir()  # no /proc: trust kill(pid, 0)


def ends_within(pid: int, seconds: float) -> bool:
    """Whether process `pid` has ended (`process_alive`) within `seconds`."""
    deadline = time.monotonic() + seconds
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not process_alive(pid)
