"""`linformer distill`: distillation recovers the exact teacher's outputs, trains only what it
is asked to, saves a loadable student, and refuses bad inputs clearly. Runs on a tiny
BERT-shaped Hugging Face directory (hf_helpers.py, with MiniLM's tokenizer)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_helpers import N, write_tiny_bert

from linformer_kit import LinformerModel
from linformer_kit.cli import main
from linformer_kit.files import exclusive
from linformer_kit.interop import convert_hf_model
from linformer_kit.interop.distill import (
    DistillSettings,
    HeldOut,
    distill,
    hidden_state_loss,
)
from linformer_kit.interop.distill_report import distillation_report, plot_curves
from linformer_kit.interop.distill_run import (
    DistillData,
    distill_checkpoint,
    distillation_files,
    split_documents,
)
from linformer_kit.interop.report import document_ids, stdlib_files, text_windows

K = 8
SMALL = DistillData(texts=8, per_file=2, heldout_texts=4, calibration_texts=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_bert(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="module")
def windows(tiny):
    """Distillation windows (calibration split) and scored windows (held-out split)."""
    tokenizer = tiny / "tokenizer.json"
    train = text_windows(tokenizer, stdlib_files("calibration"), N, 16, per_file=4)
    return train, text_windows(tokenizer, stdlib_files("heldout"), N, 8)


def _student(tiny):
    return convert_hf_model(tiny, proj_dim=K, init="mean")


def _distill_scored(tiny, windows, settings):
    """Distils a fresh student on the training windows, scored on the held-out ones."""
    train, heldout = windows
    teacher = convert_hf_model(tiny, proj_dim=None)
    scored = HeldOut.from_teacher(teacher, heldout)
    return distill(_student(tiny), teacher, train, settings, heldout=scored)


def test_text_windows_cut_several_windows_per_file(tiny):
    files = stdlib_files("calibration")[:3]
    one = text_windows(tiny / "tokenizer.json", files, N, 2)
    several = text_windows(tiny / "tokenizer.json", files, N, 2, per_file=2)
    assert torch.equal(one[0], several[0]) and not torch.equal(one[1], several[1])
    with pytest.raises(ValueError, match="at most 1 per file"):
        text_windows(tiny / "tokenizer.json", files, N, 4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_distillation_lowers_the_loss_and_raises_the_heldout_cosine(tiny, windows, precision):
    settings = DistillSettings(
        trainable="all", max_steps=8, lr=1e-3, warmup_steps=2, eval_every=4, precision=precision
    )
    history = _distill_scored(tiny, windows, settings)
    assert [record["step"] for record in history] == [0, 4, 8]
    assert history[0]["loss"] is None and history[-1]["loss"] < history[1]["loss"]
    before, after = history[0]["cosine_mean"], history[-1]["cosine_mean"]
    assert after > before + 0.05, history


def test_projections_only_change_only_the_projections(tiny, windows):
    train, _ = windows
    teacher = convert_hf_model(tiny, proj_dim=None)
    student = _student(tiny)
    start = {name: t.clone() for name, t in student.state_dict().items()}
    distill(student, teacher, train, DistillSettings(trainable="projections", max_steps=3))
    changed = {name for name, t in student.state_dict().items() if not torch.equal(t, start[name])}
    assert changed and all(".proj_" in name for name in changed)
    assert all(p.requires_grad for p in student.parameters())  # unfrozen afterwards


def test_cli_distill_converts_distils_saves_and_reloads(tiny, tmp_path, capsys):
    out = tmp_path / "student"
    flags = ["--texts", "4", "--per-file", "2", "--heldout-texts", "2", "--calibration-texts", "2"]
    command = ["distill", "--teacher", str(tiny), "--student", str(out), *flags]
    main([*command, "--proj-dim", str(K), "--max-steps", "2", "--batch-size", "2"])
    assert "held-out embedding cosine" in capsys.readouterr().out
    assert (out / "tokenizer.json").is_file()
    first = LinformerModel.from_pretrained(out)
    assert first.config.proj_dim == K
    # A shape flag that is not the existing student's was ignored without a word (the run
    # distilled k = 8 when asked for 16); its own shape, or none, distils it further.
    for flag, value in (("--proj-dim", "16"), ("--sharing", "kv"), ("--projection", "conv")):
        name = flag[2:].replace("-", "_")
        with pytest.raises(SystemExit, match=f"{name} {value} differs from the student's"):
            main([*command, flag, value, "--max-steps", "1"])
    untouched = LinformerModel.from_pretrained(out).state_dict()
    assert all(torch.equal(t, untouched[name]) for name, t in first.state_dict().items())
    main([*command, "--max-steps", "1", "--proj-dim", str(K)])
    second = LinformerModel.from_pretrained(out)  # distilled further, in place
    assert _projections(first).keys() == _projections(second).keys()
    assert any(not torch.equal(t, _projections(second)[n]) for n, t in _projections(first).items())
    # A Ctrl-C while the tokenizer was copied over the student's left half a file, which
    # every later load of the student failed to parse
    tokenizer = (out / "tokenizer.json").read_bytes()

    def cut_short(source, target, **kwargs):
        Path(target).write_bytes(Path(source).read_bytes()[:100])
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shutil, "copy", cut_short)
        patch.setattr(shutil, "copy2", cut_short)
        with pytest.raises(SystemExit, match="130"):  # Ctrl-C's status
            main([*command, "--max-steps", "1"])
    assert (out / "tokenizer.json").read_bytes() == tokenizer


def _projections(model):
    return {name: t for name, t in model.state_dict().items() if ".proj_" in name}


def test_report_rows_curves_and_plot(tiny, tmp_path):
    settings = DistillSettings(max_steps=2, batch_size=2, eval_every=1)
    result = distillation_report(tiny, [K], settings, SMALL)
    (row,) = result["rows"]
    assert row["proj_dim"] == K and 0 < row["cosine_before"] <= 1 and 0 < row["cosine_after"] <= 1
    assert [r["step"] for r in result["curves"][str(K)]] == [0, 1, 2]
    assert result["settings"]["texts"] == SMALL.texts
    assert result["text"]["files"] == len(stdlib_files("calibration"))
    plot_curves(json.loads(json.dumps(result)), tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_report_students_take_the_projection_and_length_asked(tiny):
    settings = DistillSettings(max_steps=1, batch_size=2)
    result = distillation_report(
        tiny, [K], settings, SMALL, projection="adaptive", max_seq_len=2 * N
    )
    assert result["seq_len"] == 2 * N and result["settings"]["projection"] == "adaptive"
    assert result["settings"]["init"] is None  # no calibration for a parameter-free kind
    assert 0 < result["rows"][0]["cosine_after"] <= 1


def test_report_distils_on_the_given_files(tiny, tmp_path):
    text = tmp_path / "text"
    text.mkdir()
    for i, file in enumerate(stdlib_files("calibration")[:4]):
        (text / f"{i}.txt").write_text(file.read_text(encoding="utf-8"))
    files = sorted(text.glob("*.txt"))
    settings = DistillSettings(max_steps=1, batch_size=2)
    result = distillation_report(tiny, [K], settings, SMALL, files=files)
    assert result["text"] == {"files": 4, "under": str(text)}
    with pytest.raises(ValueError, match="need 8"):  # one file gives at most per_file=2
        distillation_report(tiny, [K], settings, SMALL, files=files[:1])


def test_missing_teacher_dir_is_reported(tmp_path):
    settings = DistillSettings(max_steps=1)
    with pytest.raises(FileNotFoundError, match="config.json"):
        distill_checkpoint(tmp_path / "nope", tmp_path / "s", settings, SMALL, files=[])


def test_mismatched_student_is_reported(tiny, tmp_path):
    other = write_tiny_bert(tmp_path / "wide", hidden_size=48)
    convert_hf_model(other, proj_dim=K, init="mean").save_pretrained(tmp_path / "s")
    with pytest.raises(ValueError, match="dim: student 48, teacher 32"):
        distill_checkpoint(
            tiny,
            tmp_path / "s",
            DistillSettings(max_steps=1),
            SMALL,
            files=stdlib_files("calibration"),
        )


def test_a_student_another_distillation_holds_is_refused(tiny, tmp_path):
    # two distillations of one student: the last to save dropped the other's work
    convert_hf_model(tiny, proj_dim=K, init="mean").save_pretrained(tmp_path / "s")
    with exclusive(tmp_path / "s", "distillation"):  # as another process holds it
        with pytest.raises(ValueError, match=r"s is in use by another distillation \(pid"):
            distill_checkpoint(tiny, tmp_path / "s", DistillSettings(max_steps=1), SMALL, files=[])


def test_exact_student_and_k_beyond_n_are_refused(tiny, tmp_path):
    convert_hf_model(tiny, proj_dim=None).save_pretrained(tmp_path / "exact")
    files = stdlib_files("calibration")
    with pytest.raises(ValueError, match="exact attention"):
        distill_checkpoint(
            tiny, tmp_path / "exact", DistillSettings(max_steps=1), SMALL, files=files
        )
    with pytest.raises(ValueError, match="max_seq_len=64"):
        distill_checkpoint(
            tiny, tmp_path / "new", DistillSettings(max_steps=1), SMALL, files=files, proj_dim=2 * N
        )


def test_bad_settings_and_inputs_are_refused(tiny, windows):
    train, _ = windows
    with pytest.raises(ValueError, match="trainable"):
        DistillSettings(trainable="heads")
    with pytest.raises(ValueError, match="max_steps"):
        DistillSettings(max_steps=0)
    with pytest.raises(ValueError, match="precision"):
        DistillSettings(precision="fp8")
    teacher = convert_hf_model(tiny, proj_dim=None)
    with pytest.raises(ValueError, match=r"must be \(batch, length <= max_seq_len=64\)"):
        distill(_student(tiny), teacher, train[0], DistillSettings())
    with pytest.raises(ValueError, match="exact attention"):
        distill(teacher, teacher, train, DistillSettings())
    pooled = convert_hf_model(tiny, proj_dim=K, projection="pool")
    with pytest.raises(ValueError, match="no learned parameters"):
        distill(pooled, teacher, train, DistillSettings(trainable="projections"))


def test_device_cpu_runs_and_bad_devices_are_refused(tiny, windows):
    history = _distill_scored(tiny, windows, DistillSettings(max_steps=1, device="cpu"))
    assert [record["step"] for record in history] == [0, 1]
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        DistillSettings(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            DistillSettings(device="cuda").torch_device()


def test_heldout_files_are_refused_as_distillation_data(tmp_path):
    heldout = stdlib_files("heldout")[0]
    with pytest.raises(ValueError, match="held-out"):
        distillation_files([str(heldout)], "**/*.txt")
    with pytest.raises(FileNotFoundError):
        distillation_files([str(tmp_path / "missing")], "**/*.txt")
    text = tmp_path / "a.txt"
    text.write_text("some text")
    assert distillation_files([str(tmp_path)], "**/*.txt") == [text]
    assert distillation_files(None, "**/*.txt") == stdlib_files("calibration")


def _texts(count, seed=0):
    """`count` English-like documents of different lengths."""
    words = "the film was long and the plot slow but its actors gave it life at the end".split()
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 90, (count,), generator=generator).tolist()
    return [
        " ".join(words[i] for i in torch.randint(0, len(words), (n,), generator=generator))
        for n in lengths
    ]


def test_document_ids_cut_each_text_keep_its_end_token_and_mask_the_padding(tiny):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    texts = ["a short one", " ".join(["word"] * 100)]
    ids, mask = document_ids(tiny / "tokenizer.json", texts, N)
    short = tokenizer.encode(texts[0]).ids  # [CLS] ... [SEP]
    assert ids.shape == mask.shape == (2, N)
    assert ids[0, : len(short)].tolist() == short and mask[0].sum() == len(short)
    assert not mask[0, len(short) :].any() and mask[1].all()
    assert ids[1, 0] == short[0] and ids[1, -1] == short[-1]  # cut, [SEP] kept
    with pytest.raises(ValueError, match="no documents"):
        document_ids(tiny / "tokenizer.json", [], N)


def test_padding_counts_in_no_term_of_the_loss():
    torch.manual_seed(0)
    student = [torch.randn(2, 7, 5) for _ in range(3)]
    teacher = torch.randn(3, 2, 7, 5)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    loss = hidden_state_loss(student, teacher, 0.5, mask)
    noisy = [s.clone() for s in student]
    for s in noisy:
        s[1, 4:] = 1e3  # only padded positions change
    assert torch.equal(loss, hidden_state_loss(noisy, teacher, 0.5, mask))
    # Hand-written: per-layer error over the real positions, cosine of the real-token means.
    real = [(0, slice(0, 7)), (1, slice(0, 4))]
    stacked = torch.stack(student)
    num = [
        sum((stacked[i, b, t] - teacher[i, b, t]).pow(2).sum() for b, t in real) for i in range(3)
    ]
    den = [sum(teacher[i, b, t].pow(2).sum() for b, t in real) for i in range(3)]
    cosines = [
        torch.nn.functional.cosine_similarity(
            stacked[-1, b, t].mean(0), teacher[-1, b, t].mean(0), dim=0
        )
        for b, t in real
    ]
    want = 0.5 * sum(n / d for n, d in zip(num, den)) / 3 + sum(1 - c for c in cosines) / 2
    torch.testing.assert_close(loss, want)


def test_distilling_padded_documents_raises_their_cosine_and_ignores_padding(tiny):
    teacher = convert_hf_model(tiny, proj_dim=None)
    ids, mask = document_ids(tiny / "tokenizer.json", _texts(12), N)
    scored = HeldOut.from_teacher(teacher, *document_ids(tiny / "tokenizer.json", _texts(6, 1), N))
    settings = DistillSettings(max_steps=8, lr=1e-3, warmup_steps=2, batch_size=4)
    student = convert_hf_model(tiny, proj_dim=K, projection="adaptive")
    history = distill(student, teacher, ids, settings, key_padding_mask=mask, heldout=scored)
    assert history[-1]["cosine_mean"] > history[0]["cosine_mean"] + 0.02, history
    # The same documents with other ids under the padding train the student identically.
    other = torch.where(mask, ids, torch.randint_like(ids, 1000, 2000))
    again = convert_hf_model(tiny, proj_dim=K, projection="adaptive")
    distill(again, teacher, other, settings, key_padding_mask=mask)
    for (name, got), want in zip(again.state_dict().items(), student.state_dict().values()):
        torch.testing.assert_close(got, want, msg=name)
    with pytest.raises(ValueError, match="must match ids"):
        distill(again, teacher, ids, settings, key_padding_mask=mask[:, :-1])


def test_cli_distills_whole_documents_past_the_teachers_positions(tiny, tmp_path, capsys):
    docs = tmp_path / "docs.csv"  # the text column of a labelled CSV, one document a row
    docs.write_text("label,text\n" + "".join(f'1,"{t}"\n' for t in _texts(10)))
    out = tmp_path / "student"
    command = ["distill", "--teacher", str(tiny), "--student", str(out), "--max-seq-len", "128"]
    flags = ["--documents", str(docs), "--heldout-texts", "3", "--projection", "adaptive"]
    main([*command, *flags, "--proj-dim", str(K), "--max-steps", "2", "--batch-size", "2"])
    assert "held-out embedding cosine" in capsys.readouterr().out
    student = LinformerModel.from_pretrained(out)
    assert student.config.max_seq_len == 128 and student.config.projection == "adaptive"
    with pytest.raises(SystemExit, match="not both"):
        main([*command, "--documents", str(docs), "--data", str(docs)])
    with pytest.raises(SystemExit, match="differs from the student's 128"):
        main([*command[:-1], "256", *flags])  # the saved student is 128 long
    # of two flags of paths, a missing one was named without its flag
    missing = str(tmp_path / "held.csv")
    with pytest.raises(SystemExit, match=rf"--heldout-documents: data path {missing} does not"):
        main([*command, "--documents", str(docs), "--heldout-documents", missing])
    with pytest.raises(ValueError, match="no documents left"):
        split_documents(["one", "two"], None, DistillData(heldout_texts=2), seed=0)
