"""What a user meets when the data is wrong: `linformer pretrain` and `finetune` / `evaluate`
on bad files, directories without matches, CSV and string labels (tiny generated data)."""

import json
import logging
import re

import pytest
from train_helpers import write_classification, write_corpus

from linformer_kit import LinformerForMaskedLM, linformer_tiny
from linformer_kit.cli import main
from linformer_kit.data.corpus import list_files

MODEL = ["--max-seq-len", "64", "--dim", "32", "--depth", "2", "--num-heads", "2"]
TINY = ["--vocab-size", "300", "--proj-dim", "16", "--batch-size", "4", "--warmup-steps", "1"]
TINY += ["--eval-batches", "1", "--val-fraction", "0.1"] + MODEL


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LINFORMER_CACHE", str(tmp_path / "cache"))


def corpus_with_bad_files(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", files=3)
    (corpus / "empty.txt").write_text("")
    (corpus / "latin1.txt").write_bytes("one\ntwo\ncaf\u00e9\n".encode("latin-1"))
    return corpus


def pretrain(tmp_path, *flags):
    main(["pretrain", *flags, "--max-steps", "2", "--output-dir", str(tmp_path / "run"), *TINY])


def test_a_bad_file_in_a_directory_stops_pretrain_with_one_line(tmp_path):
    corpus = corpus_with_bad_files(tmp_path)
    with pytest.raises(SystemExit) as stop:
        pretrain(tmp_path, "--data", str(corpus))
    assert str(stop.value) == f"linformer pretrain: error: {corpus / 'empty.txt'}: file is empty"
    (corpus / "empty.txt").unlink()
    with pytest.raises(SystemExit) as stop:
        pretrain(tmp_path, "--data", str(corpus))
    assert str(stop.value) == (
        f"linformer pretrain: error: {corpus / 'latin1.txt'}:3: not valid UTF-8 "
        "(byte 0xe9 at offset 11)"
    )
    assert not (tmp_path / "run").exists()


def test_skip_bad_files_warns_per_file_and_counts_them_in_the_summary(tmp_path, caplog):
    corpus = corpus_with_bad_files(tmp_path)
    with caplog.at_level(logging.INFO):
        pretrain(tmp_path, "--data", str(corpus), "--skip-bad-files")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"skipping bad file {corpus / 'empty.txt'}: file is empty",
        f"skipping bad file {corpus / 'latin1.txt'}:3: not valid UTF-8 (byte 0xe9 at offset 11)",
    ]
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cached ")]
    assert len(summary) == 1
    assert summary[0].startswith("cached ") and " of 3 documents in " in summary[0]
    assert summary[0].endswith("; skipped 2 bad files")
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["data"]["skip_bad_files"]


def test_a_directory_without_matches_points_at_glob(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", files=1)
    with pytest.raises(SystemExit, match=r"matches --glob '\*\*/\*.md' \(it holds 1 .txt\)"):
        pretrain(tmp_path, "--data", str(corpus), "--glob", "**/*.md")
    # an absolute pattern gave a traceback (NotImplementedError), an empty one an unnamed
    # "Unacceptable pattern", pretrain's before any work and evaluate's on listing the files
    for glob in ("/etc/*", ""):
        message = rf"--glob must be a non-empty pattern relative to .*, got '{re.escape(glob)}'"
        with pytest.raises(SystemExit, match=message):
            pretrain(tmp_path, "--data", str(corpus), "--glob", glob)
    with pytest.raises(ValueError, match="--glob must be a non-empty pattern"):
        list_files(str(corpus), "/x/*.txt")


def test_finetune_from_a_missing_folder_says_it_does_not_exist(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a", "label": 0}\n')
    with pytest.raises(SystemExit) as stop:
        main(
            ["finetune", "--init", str(tmp_path / "runs"), "--data", str(data), "--eval", str(data)]
        )
    assert str(stop.value) == (
        f"linformer finetune: error: {tmp_path / 'runs'} does not exist "
        "(expected a checkpoint folder)"
    )


def test_finetune_names_a_missing_eval_file_by_its_flag_before_any_work(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a", "label": 0}\n')
    missing = tmp_path / "valid.jsonl"  # named without its flag, after --data was read
    init = tmp_path / "mlm"
    LinformerForMaskedLM(
        linformer_tiny(vocab_size=300, max_seq_len=16, proj_dim=8)
    ).save_pretrained(init)
    with pytest.raises(SystemExit) as stop:
        main(["finetune", "--init", str(init), "--data", str(data), "--eval", str(missing)])
    assert str(stop.value) == f"linformer finetune: error: --eval {missing}: no such file"


def named(path, names=("other", "cat")):
    """The classification file at `path` with its 0/1 labels replaced by names."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "label": names[r["label"]]}) + "\n" for r in rows))
    return path


def test_string_labels_round_trip_through_finetune_config_and_evaluate(tmp_path, capsys):
    pretrain(tmp_path, "--data", str(write_corpus(tmp_path / "corpus", files=2)))
    train = named(write_classification(tmp_path / "train.jsonl", 24, seed=0))
    valid = named(write_classification(tmp_path / "valid.jsonl", 8, seed=1))
    ft = tmp_path / "ft"
    main(
        ["finetune", "--init", str(tmp_path / "run" / "last"), "--data", str(train)]
        + ["--eval", str(valid), "--epochs", "1", "--batch-size", "8", "--output-dir", str(ft)]
    )
    config = json.loads((ft / "last" / "config.json").read_text())["config"]
    assert config["id2label"] == {"0": "cat", "1": "other"}
    assert config["label2id"] == {"cat": 0, "other": 1}
    rows = [json.loads(line) for line in valid.read_text().splitlines()]
    csv = tmp_path / "valid.csv"
    csv.write_text("text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in rows))
    capsys.readouterr()
    main(["evaluate", str(ft / "last"), "--data", str(valid), str(csv)])
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[1:] == table[2].split()[1:]  # the same metrics from JSONL and CSV
    csv.write_text(csv.read_text() + "the dog,dog\n")
    with pytest.raises(SystemExit) as stop:
        main(["evaluate", str(ft / "last"), "--data", str(csv)])
    assert str(stop.value) == (
        f"linformer evaluate: error: {csv}:10: unknown label 'dog'; known labels: cat, other"
    )


def test_truncation_travels_from_finetune_to_the_model_and_evaluate(tmp_path, caplog):
    pretrain(tmp_path, "--data", str(write_corpus(tmp_path / "corpus", files=2)))
    long = tmp_path / "long.jsonl"  # 100+ words: past the model's 64 positions
    long.write_text(
        "".join(
            json.dumps({"text": "the dog ran " * 40 + e, "label": i}) + "\n"
            for i, e in enumerate(["home", "cat"] * 4)
        )
    )
    ft = tmp_path / "ft"
    flags = ["--data", str(long), "--eval", str(long), "--epochs", "1", "--batch-size", "8"]
    with caplog.at_level(logging.INFO):
        main(
            ["finetune", "--init", str(tmp_path / "run" / "last"), *flags, "--truncation", "tail"]
            + ["--output-dir", str(ft)]
        )
        assert "8 documents (100%) cut to 64 tokens (tail kept)" in caplog.text
        config = json.loads((ft / "last" / "config.json").read_text())["config"]
        assert config["truncation"] == "tail"
        caplog.clear()
        main(["evaluate", str(ft / "last"), "--data", str(long), "--out", str(tmp_path / "e.json")])
        assert "(tail kept)" in caplog.text
        written = json.loads((tmp_path / "e.json").read_text())
        assert 0 <= written["metrics"][str(long)]["accuracy"] <= 1 and written["machine"]["torch"]
        caplog.clear()  # fine-tuned again: the model's rule unless --truncation says otherwise
        main(["finetune", "--init", str(ft / "last"), *flags, "--output-dir", str(tmp_path / "a")])
        assert "(tail kept)" in caplog.text
    with pytest.raises(SystemExit, match="truncation must be one of head, tail, head.tail; got"):
        main(["finetune", "--init", str(ft / "last"), *flags, "--truncation", "middle"])
