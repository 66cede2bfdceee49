"""`training.keep_freed_memory`: after it freed 16 MiB blocks are reused without page faults
(in fresh interpreters: the setting is process-wide), and a threshold out of range is a
clear error."""

import dataclasses
import subprocess
import sys
import textwrap

import pytest
from train_helpers import tiny_run

from linformer_kit.training import keep_freed_memory, loop, pretrain
from linformer_kit.training.settings import MAX_MMAP_THRESHOLD

SCRIPT = textwrap.dedent(
    """
    import resource, statistics, torch
    from linformer_kit.training import keep_freed_memory

    def faults(rounds=7):  # median minor page faults of 8 blocks of 16 MiB made and freed
        counts = []
        for _ in range(rounds):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            blocks = [torch.zeros(1 << 22) for _ in range(8)]
            del blocks
            counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return statistics.median(counts)

    fresh = faults()
    applied = keep_freed_memory()
    print(fresh, applied, faults())
    """
)


def test_freed_blocks_are_reused_without_page_faults():
    # glibc's default gives the blocks back in most processes (about 32700 faults a round
    # here, glibc 2.36) but keeps them in some, depending on what was allocated before:
    # up to three processes, until one shows the faults the setting must take away.
    for _ in range(3):
        run = subprocess.run(
            [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True
        )
        fresh, applied, kept = run.stdout.split()
        if applied != "True":
            pytest.skip("no glibc mallopt here")
        if float(fresh) > 4096:
            assert float(kept) < 50
            return
    pytest.skip("glibc's default kept the blocks in three processes: nothing to take away")


@pytest.mark.parametrize("threshold", [0, -1, MAX_MMAP_THRESHOLD + 1, 1.5])
def test_a_threshold_out_of_range_is_a_clear_error(threshold):
    with pytest.raises(ValueError, match=r"mmap_threshold must be an integer in \[1, 33554432\]"):
        keep_freed_memory(threshold)


@pytest.mark.parametrize("keep", [True, False])
def test_training_on_cpu_keeps_freed_memory_unless_told_not_to(tmp_path, monkeypatch, keep):
    calls = []
    monkeypatch.setattr(loop, "keep_freed_memory", lambda: calls.append(True) or True)
    run = tiny_run(tmp_path, max_steps=1, eval_every=1, save_every=1, device="cpu")
    run.train = dataclasses.replace(run.train, keep_freed_memory=keep)
    pretrain(run)
    assert calls == ([True] if keep else [])
