"""`linformer convert`: MiniLM round trip through save_pretrained / from_pretrained, and the
report's building blocks on a tiny sample."""

import json
import shutil

import pytest
import torch

from linformer_kit import LinformerModel, linformer_tiny, manifest
from linformer_kit.cli import convert as cli_convert
from linformer_kit.cli import distill as cli_distill
from linformer_kit.cli import main
from linformer_kit.interop import convert_hf_model
from linformer_kit.interop.report import (
    ConversionReport,
    conversion_report,
    minilm_path,
    model_tokenizer,
    stdlib_files,
    text_windows,
)
from linformer_kit.interop.task_bench_settings import TaskBenchSettings


def test_convert_round_trip(tmp_path, capsys):
    out = tmp_path / "linminilm"
    args = ["--from", str(minilm_path()), "--proj-dim", "64", "--init", "mean"]
    main(["convert", *args, "--out", str(out)])
    assert "k=64, layerwise" in capsys.readouterr().out
    assert (out / "tokenizer.json").is_file()
    loaded = LinformerModel.from_pretrained(out).eval()
    direct = convert_hf_model(minilm_path(), proj_dim=64, init="mean")
    assert loaded.config == direct.config and loaded.config.pooler
    ids = torch.randint(1000, 30000, (1, 300))
    with torch.no_grad():
        assert torch.equal(loaded(ids).last_hidden_state, direct(ids).last_hidden_state)


def test_convert_exact_refuses_the_flags_that_shape_a_linformer(tmp_path):
    # Before, they were ignored (and --sharing / --projection recorded in the exact config).
    out = tmp_path / "exact"
    for flags, named in [
        (["--init", "attention"], "--init"),
        (["--proj-dim", "8", "--sharing", "none"], "--proj-dim, --sharing"),
        (["--projection", "adaptive"], "--projection"),
    ]:
        message = f"--exact keeps exact attention: {named} shape a Linformer"
        with pytest.raises(SystemExit, match=message):
            main(["convert", "--exact", *flags, "--out", str(out)])
    assert not out.exists()
    main(["convert", "--exact", "--out", str(out)])
    assert LinformerModel.from_pretrained(out).config.is_exact


def test_stdlib_splits_are_disjoint_and_windows_are_full_length():
    calibration, heldout = stdlib_files("calibration"), stdlib_files("heldout")
    assert calibration and heldout and not set(calibration) & set(heldout)
    ids = text_windows(minilm_path() / "tokenizer.json", heldout, 128, 3)
    assert ids.shape == (3, 128)
    assert (ids[:, 0] == 101).all() and (ids[:, -1] == 102).all()  # [CLS] ... [SEP]
    assert (ids[:, 1:-1] != 0).all()  # no [PAD] (the tokenizer.json pads to 128 by default)


def test_report_rows_on_a_small_sample(tmp_path, capsys):
    settings = ConversionReport(
        proj_dims="64", inits="mean", heldout_texts=2, batch_size=1, repeats=1, memory_runs=1
    )
    result = conversion_report(minilm_path(), settings, calibration_texts=1)
    (row,) = result["rows"]
    assert row["proj_dim"] == 64 and row["init"] == "mean"
    assert 0.0 < row["cosine_mean"] <= 1.0 and row["speedup"] > 0
    assert json.loads(json.dumps(result))["seq_len"] == 512
    if result["teacher"]["forward_peak_mib"] is not None:  # Linux
        assert row["memory_ratio"] > 0  # (at batch 1 it reads 0.92-0.99: no place to compare)


def test_report_refuses_what_it_would_ignore_before_any_work(tmp_path, monkeypatch):
    # --max-seq-len / --projection / --proj-dim ... gave the n 512 linear table silently, a
    # folder as --report-out failed after every conversion, and bad settings after the
    # teacher had run, naming no flag.
    monkeypatch.setattr(cli_convert, "conversion_report", lambda *a, **k: pytest.fail("ran"))
    out = ["--report-out", str(tmp_path / "r.json")]
    for flags, message in [
        (["--max-seq-len", "1024", "--projection", "adaptive"], "--max-seq-len, --projection wo"),
        (["--proj-dim", "32", "--exact"], "--exact, --proj-dim would be ignored"),
        (["--report-out", str(tmp_path)], f"--report-out {tmp_path} is a directory; name a file"),
        (["--heldout-texts", "0", *out], "heldout_texts must be an integer >= 1, got 0"),
        (["--proj-dims", "64,abc", *out], "proj_dims must be integers >= 1, got '64,abc'"),
        (["--inits", "xavier,bogus", *out], "inits must be one of .*; got 'bogus'"),
    ]:
        with pytest.raises(SystemExit, match=message):
            main(["convert", "--report", *flags])
    # and the reverse: a conversion ignored --report's settings (--proj-dims 8, a typo for
    # --proj-dim 8, converted at k 128 without a word)
    monkeypatch.setattr(cli_convert, "convert_to_dir", lambda *a, **k: pytest.fail("ran"))
    for flags, message in [
        (["--proj-dims", "8"], "--proj-dims set what --report measures; a conversion would ig"),
        (["--repeats", "2", *out], "--repeats, --report-out set what --report measures"),
    ]:
        with pytest.raises(SystemExit, match=message):
            main(["convert", "--out", str(tmp_path / "m"), *flags])
    # distill --report named a folder as --report-out, and --proj-dims abc unnamed ("invalid
    # literal for int()"), after every distillation
    monkeypatch.setattr(cli_distill, "distillation_report", lambda *a, **k: pytest.fail("ran"))
    (tmp_path / "r.png").write_text("mine")  # replaced by the curves, without a word
    for flags, message in [
        (["--report-out", str(tmp_path)], f"--report-out {tmp_path} is a directory; name a file"),
        (["--proj-dims", "abc", *out], "proj_dims must be integers >= 1, got 'abc'"),
        (out, f"--report-out {tmp_path / 'r.png'} exists and is not a .png image"),
    ]:
        with pytest.raises(SystemExit, match=message):
            main(["distill", "--report", *flags])
    assert (tmp_path / "r.png").read_text() == "mine"


def test_missing_source_directories_end_with_a_message_not_a_traceback(tmp_path):
    missing = tmp_path / "nowhere"
    for argv in (
        ["convert", "--from", str(missing), "--out", str(tmp_path / "out")],
        ["distill", "--teacher", str(missing), "--student", str(tmp_path / "student")],
    ):
        with pytest.raises(SystemExit, match=rf"error: no config.json in {missing}"):
            main(argv)


def test_a_student_or_work_folder_that_is_a_file_is_named_by_its_flag(tmp_path):
    note = tmp_path / "notes.txt"
    note.write_text("mine")  # "--out ... is a file", after the teacher was converted
    with pytest.raises(SystemExit, match=rf"--student {note} is a file; name a directory"):
        main(["distill", "--student", str(note), "--max-steps", "1"])
    with pytest.raises(ValueError, match=rf"--work-dir {note} is a file; name a directory"):
        TaskBenchSettings(train="t", val="v", test="t", work_dir=str(note))  # was Errno 17
    assert note.read_text() == "mine"


def test_a_source_without_a_tokenizer_converts_with_the_mean_init(tmp_path):
    source = tmp_path / "no-tokenizer"
    source.mkdir()
    for name in ("config.json", "model.safetensors"):  # a directory saved without one
        (source / name).symlink_to(minilm_path() / name)
    main(["convert", "--from", str(source), "--proj-dim", "64", "--out", str(tmp_path / "out")])
    converted = LinformerModel.from_pretrained(tmp_path / "out").eval()
    mean = convert_hf_model(minilm_path(), proj_dim=64, init="mean")
    want = mean.state_dict()
    assert all(torch.equal(value, want[name]) for name, value in converted.state_dict().items())


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    config = json.loads((minilm_path() / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    (tmp_path / "tokenizer.json").symlink_to(minilm_path() / "tokenizer.json")
    message = rf"{tmp_path}/tokenizer.json has 30522 tokens but the model in {tmp_path} has"
    with pytest.raises(ValueError, match=message + r" vocab_size 1000: the tokenizer is not"):
        model_tokenizer(tmp_path, "calibration")


def test_convert_refuses_to_overwrite_its_source_and_bad_sizes_before_any_work(tmp_path):
    # Before, --out = --from replaced the Hugging Face config and weights, then failed copying
    # tokenizer.json onto itself (a traceback); 0 read as "the source's length".
    source = tmp_path / "minilm"
    source.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (source / name).write_bytes((minilm_path() / name).read_bytes())
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    args = ["convert", "--from", str(source), "--proj-dim", "8"]
    with pytest.raises(SystemExit, match=rf"--out {source}/ is the source folder"):
        main([*args, "--out", f"{source}/"])
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before
    for flags, message in [
        (["--max-seq-len", "0"], "max_seq_len must be an integer >= 1, got 0"),
        (["--calibration-texts", "0"], "calibration_texts must be an integer >= 1, got 0"),
        # unused by the xavier init, and taken without a word
        (["--init", "xavier", "--calibration-texts", "-1"], "calibration_texts must be an inte"),
    ]:
        with pytest.raises(SystemExit, match=message):
            main([*args, "--out", str(tmp_path / "out"), *flags])
    assert not (tmp_path / "out").exists()
    # a Hugging Face model's folder (another one than --from) as --out: its config.json was
    # taken for a model of ours and replaced, its tokenizer.json removed
    other = tmp_path / "other"
    shutil.copytree(source, other)
    for config in (b'{"model_type": "bert"}', b"{bad"):
        (other / "config.json").write_bytes(config)
        before = {p.name: p.read_bytes() for p in other.iterdir()}
        with pytest.raises(SystemExit, match=rf"--out {other} holds a config.json of no model of"):
            main([*args, "--out", str(other)])
        assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    (source / "config.json").write_text("{bad")  # "Expecting property name ...", no file named
    with pytest.raises(
        SystemExit, match=rf"{source / 'config.json'} is not valid JSON \(line 1\): Expect"
    ):
        main([*args, "--out", str(tmp_path / "out")])


def test_converting_into_a_folder_with_an_old_manifest_gives_a_loadable_model(tmp_path):
    # The old manifest described the replaced files: loading refused the new ones as corrupt.
    out = tmp_path / "out"
    LinformerModel(linformer_tiny(vocab_size=50, max_seq_len=16, proj_dim=4)).save_pretrained(out)
    manifest.write_manifest(out)
    main(["convert", "--proj-dim", "16", "--init", "mean", "--out", str(out)])
    assert LinformerModel.from_pretrained(out).config.proj_dim == 16


def test_converting_over_a_model_says_so_and_drops_its_tokenizer(tmp_path, caplog):
    # A source without tokenizer.json left the replaced model's in --out: the folder then
    # paired a 1000-token model with a 30522-token tokenizer, refused only later.
    out, source = tmp_path / "out", tmp_path / "no_tokenizer"
    main(["convert", "--proj-dim", "16", "--init", "mean", "--out", str(out)])
    assert (out / "tokenizer.json").is_file()
    source.mkdir()
    for name in ("config.json", "model.safetensors"):
        (source / name).write_bytes((minilm_path() / name).read_bytes())
    with caplog.at_level("WARNING"):
        main(["convert", "--from", str(source), "--exact", "--out", str(out)])
    assert f"replacing the model in {out}" in caplog.messages
    assert f"removed the replaced model's tokenizer.json from {out}" in caplog.messages
    assert not (out / "tokenizer.json").exists()
