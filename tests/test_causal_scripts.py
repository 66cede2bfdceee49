"""The causal benchmark scripts: a tiny run writes its results where --out says, and
--help writes nothing (it ran the whole sweep over the committed results)."""

import json
import shutil

import pytest
from script_helpers import BENCHMARKS, load_script


@pytest.mark.parametrize(
    "name, flags, rows",
    [("causal_generation", ["--positions", "120,128"], "results"),
     ("causal_step", ["--seq-lens", "128"], "rows")],
)  # fmt: skip
def test_a_tiny_run_writes_into_out_and_help_writes_nothing(tmp_path, capsys, name, flags, rows):
    script = load_script(BENCHMARKS / f"{name}.py")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help", "--out", str(tmp_path / "help")])
    assert exit_info.value.code == 0 and not (tmp_path / "help").exists()
    script.main([*flags, "--out", str(tmp_path / "out")])
    results = json.loads((tmp_path / "out/results.json").read_text())
    assert results["machine"]["cpu"] and results[rows]


def test_the_seq2seq_figure_is_drawn_from_and_into_out(tmp_path):
    # it read and wrote benchmarks/seq2seq alone, wherever it ran from
    shutil.copy(BENCHMARKS / "seq2seq" / "cost.json", tmp_path / "cost.json")
    load_script(BENCHMARKS / "seq2seq.py").main(["plot", "--out", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cost.json", "seq2seq.png"]
