"""files.replacing: an earlier run set aside while a new one writes, put back if it stops,
whatever the moment it stops at."""

import os

import pytest

from linformer_kit import files


def entries(root):
    return [root / "a.json", root / "runs" / "b", root / "c.png"]


def earlier_run(folder):
    (folder / "runs" / "b").mkdir(parents=True)
    (folder / "runs" / "b" / "weights").write_text("old b")
    (folder / "a.json").write_text("old a")
    (folder / "c.png").write_text("old c")


def contents(folder):
    return {
        p.relative_to(folder).as_posix(): p.read_text()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    }


OLD = {"a.json": "old a", "c.png": "old c", "runs/b/weights": "old b"}


def test_an_interrupted_run_puts_the_earlier_back_and_a_finished_one_replaces_it(tmp_path):
    earlier_run(tmp_path)
    with pytest.raises(KeyboardInterrupt), files.replacing(tmp_path, entries, "demo"):
        assert contents(tmp_path) == {}
        (tmp_path / "a.json").write_text("new a")
        raise KeyboardInterrupt
    assert contents(tmp_path) == OLD and not (tmp_path / ".earlier-demo").exists()
    with files.replacing(tmp_path, entries, "demo"):
        (tmp_path / "a.json").write_text("new a")
    assert contents(tmp_path) == {"a.json": "new a"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "runs"]


@pytest.mark.parametrize("moves", [1, 2, 3])
def test_a_run_killed_while_moving_loses_nothing(tmp_path, monkeypatch, moves):
    # Killed between two moves (setting aside, then putting back), the next call took the
    # earlier entries not yet moved for the new run's and removed them.
    earlier_run(tmp_path)
    replace, calls = os.replace, []

    def killed_after(source, target):
        if len(calls) == moves:
            raise KeyboardInterrupt  # the process ends here: nothing more is put back
        calls.append(target)
        replace(source, target)

    monkeypatch.setattr(files.os, "replace", killed_after)
    with pytest.raises(KeyboardInterrupt), files.replacing(tmp_path, entries, "demo"):
        pass
    monkeypatch.undo()
    with pytest.raises(KeyboardInterrupt), files.replacing(tmp_path, entries, "demo"):
        (tmp_path / "c.png").write_text("new c")  # the new run writes, then stops
        raise KeyboardInterrupt
    assert contents(tmp_path) == OLD
    # and killed half-way through putting back
    with pytest.raises(KeyboardInterrupt), files.replacing(tmp_path, entries, "demo"):
        (tmp_path / "a.json").write_text("new a")
        calls.clear()
        monkeypatch.setattr(files.os, "replace", killed_after)
        raise KeyboardInterrupt
    monkeypatch.undo()
    with files.replacing(tmp_path, entries, "demo"):  # the earlier run back, then aside
        assert contents(tmp_path) == {} and contents(tmp_path / ".earlier-demo") == OLD
    assert contents(tmp_path) == {}


def test_a_run_killed_as_the_earlier_one_is_removed_keeps_its_own(tmp_path, monkeypatch):
    # The earlier run stayed in .earlier-demo until its removal ended: killed half-way, the
    # next call "put back" what was left over the finished run's entries.
    earlier_run(tmp_path)
    rmtree, calls = files.shutil.rmtree, []

    def killed_half_way(path, ignore_errors=False):
        if path.name.startswith(".earlier-demo") and (path / "a.json").exists():
            (path / "a.json").unlink()  # half removed, then the process ends
            calls.append(path)
            raise KeyboardInterrupt
        rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(files.shutil, "rmtree", killed_half_way)
    with pytest.raises(KeyboardInterrupt), files.replacing(tmp_path, entries, "demo"):
        (tmp_path / "a.json").write_text("new a")
    monkeypatch.undo()
    assert calls
    with files.replacing(tmp_path, entries, "demo"):  # the next run finds the finished one
        assert contents(tmp_path / ".earlier-demo") == {"a.json": "new a"}
    assert contents(tmp_path) == {}
