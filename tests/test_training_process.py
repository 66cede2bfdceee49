"""`in_fresh_process`: the result comes back, and the fresh process never outlives its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest
from train_helpers import ends_within, process_alive

from linformer_kit.training.process import in_fresh_process

TESTS = Path(__file__).parent


def _kill_both(parent: subprocess.Popen, pid_file: Path) -> None:
    """Kills a test's parent process and the fresh process whose id it wrote, if alive."""
    parent.kill()
    if pid_file.exists() and pid_file.read_text():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_returns_the_result_and_reraises_the_error_of_the_function():
    assert in_fresh_process(divmod, 17, 5) == (3, 2)
    assert in_fresh_process(os.getpid) != os.getpid()
    with pytest.raises(ZeroDivisionError):
        in_fresh_process(divmod, 1, 0)


def test_a_process_killed_in_the_fresh_process_breaks_the_pool():
    with pytest.raises(BrokenProcessPool):
        in_fresh_process(os._exit, 9)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_the_fresh_process_ends_when_its_parent_is_killed(tmp_path):
    # Before: a `linformer lra` stopped with SIGTERM / SIGKILL left its model's training running
    # (and writing checkpoints) for the rest of the run.
    pid_file, stderr = tmp_path / "child.pid", tmp_path / "parent.stderr"
    # The killed parent's multiprocessing resource tracker (which inherits its stderr) then
    # frees the semaphores of its process pool and warns of "5 leaked semaphore objects":
    # into this file, not into the test run's output after its summary.
    with open(stderr, "w") as err:
        parent = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(f"""
                import sys
                sys.path.insert(0, {str(TESTS)!r})
                from train_helpers import write_pid_and_sleep
                from linformer_kit.training.process import in_fresh_process
                in_fresh_process(write_pid_and_sleep, {str(pid_file)!r}, 120)
                """)],
            stderr=err,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            alive = parent.poll() is None and time.monotonic() < deadline
            assert alive, f"no fresh process: {stderr.read_text()}"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        assert child != parent.pid and process_alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert ends_within(child, 20), "the fresh process outlived its killed parent"
    finally:
        _kill_both(parent, pid_file)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
@pytest.mark.parametrize("how", ["kill the parent", "Ctrl-C the group", "kill the group"])
def test_an_interrupted_parent_stops_the_fresh_process_and_raises_where_it_stopped(tmp_path, how):
    # Before: `kill` (SIGTERM) on `linformer lra` left its parent waiting for the model's
    # training to run to its end, writing checkpoints; a Ctrl-C ended the parent with a bare
    # "interrupted", never the checkpoint and the command that continues it.
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(TESTS)!r})
            from train_helpers import write_pid_and_train
            from linformer_kit.cli import sigterm_as_interrupt
            from linformer_kit.training.loop import TrainingInterrupted
            from linformer_kit.training.process import in_fresh_process
            with sigterm_as_interrupt():
                try:
                    in_fresh_process(write_pid_and_train, {str(pid_file)!r}, 120)
                except TrainingInterrupted as err:
                    print("stopped at step", err.step, "in", err.run_dir)
            """)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None and time.monotonic() < deadline, parent.stderr.read()
            time.sleep(0.1)
        child = int(pid_file.read_text())
        if how == "kill the parent":
            parent.send_signal(signal.SIGTERM)
        elif how == "kill the group":  # `timeout`, a job scheduler: the fresh process gets
            os.killpg(parent.pid, signal.SIGTERM)  # it twice (and raised twice: a traceback)
        else:  # the terminal's Ctrl-C: SIGINT to every process of the group
            os.killpg(parent.pid, signal.SIGINT)
        out, err = parent.communicate(timeout=30)
        assert out == f"stopped at step 3 in {tmp_path}\n", err
        assert "Traceback" not in err, err
        assert not process_alive(child)
    finally:
        _kill_both(parent, pid_file)
