import pytest

from linformer_kit.bench import StepComparison, compare_training_steps
from linformer_kit.cli import main

TINY = [
    "--seq-len",
    "64",
    "--batch-size",
    "2",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--dim",
    "32",
    "--depth",
    "1",
    "--num-heads",
    "2",
    "--proj-dim",
    "16",
    "--vocab-size",
    "100",
]


def test_demo_prints_both_models_and_the_speed_ratio(capsys):
    main(["demo", *TINY])
    out = capsys.readouterr().out
    assert "Linformer k=16" in out and "Transformer (exact)" in out
    assert "x the speed of exact attention" in out


def test_compare_uses_the_same_data_for_both_models():
    rows = compare_training_steps(
        StepComparison(
            seq_len=32,
            batch_size=2,
            steps=1,
            warmup=0,
            dim=16,
            depth=1,
            num_heads=2,
            proj_dim=8,
            vocab_size=50,
        )
    )
    assert [r["model"] for r in rows] == ["Linformer k=8", "Transformer (exact)"]
    assert rows[0]["params"] - rows[1]["params"] == 32 * 8
    assert all(r["sec_per_step"] > 0 for r in rows)


def test_bad_flag_value_is_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "many"])
    assert "invalid int value" in capsys.readouterr().err
