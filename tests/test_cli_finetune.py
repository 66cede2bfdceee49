"""`linformer finetune` as a user runs it: sizing flags, resume, and honest errors."""

import importlib
import json
import re

import numpy as np
import pytest
import torch
from train_helpers import (
    count_checkpoint_checks,
    interrupted_after,
    pretrain_cli,
    write_classification,
)

from linformer_kit import LinformerConfig, LinformerForSeq2SeqLM, Seq2SeqConfig
from linformer_kit.cli import main
from linformer_kit.data.tokenizer import load_tokenizer
from linformer_kit.training.batches import LMEvaluator
from linformer_kit.training.evaluate import EvaluateSettings, _text_blocks
from linformer_kit.training.finetune import _sized
from linformer_kit.training.finetune_settings import FinetuneSettings, finetune_train_settings

MODEL = ["--max-seq-len", "64", "--dim", "32", "--depth", "1", "--num-heads", "2"]
TRAIN = ["--batch-size", "4", "--warmup-steps", "1", "--lr", "3e-3", "--log-every", "1"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny pretrained checkpoint shared by the module's tests (4 steps)."""
    root = tmp_path_factory.mktemp("pretrained")
    run = pretrain_cli(root, "--max-steps", "4", "--eval-every", "4", *MODEL, *TRAIN, files=2)
    return run / "best"


@pytest.fixture
def data(tmp_path):
    """Training (24 rows) and validation (8 rows) JSONL files."""
    return (
        write_classification(tmp_path / "train.jsonl", 24, seed=0),
        write_classification(tmp_path / "valid.jsonl", 8, seed=1),
    )


def finetune(pretrained, data, out, *flags):
    train, valid = data
    main(
        ["finetune", "--init", str(pretrained), "--data", str(train), "--eval", str(valid)]
        + ["--batch-size", "8", "--log-every", "1", "--warmup-steps", "1"]
        + ["--output-dir", str(out), *flags]
    )


def records(run_dir, split):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["split"] == split]


def user_error(capsys, run) -> str:
    """Runs a command expected to fail with exit status 2; returns its stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run()
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_max_steps_overrides_epochs_and_eval_every_sets_validation(
    pretrained, data, tmp_path, capsys
):
    out = tmp_path / "ft"
    finetune(pretrained, data, out, "--epochs", "5", "--max-steps", "5", "--eval-every", "2")
    assert records(out, "train") == [1, 2, 3, 4, 5]
    assert records(out, "val") == [2, 4, 5]
    captured = capsys.readouterr()
    table = captured.out.splitlines()
    assert table[0].split() == ["step", "val_loss", "accuracy", "f1"]
    assert [row.split()[0] for row in table[1:4]] == ["2", "4", "5"]
    assert table[4].split() == ["steps", "params", "s_per_step", "tokens_per_s", "peak_mem_mb"]
    assert table[5].split()[0] == "5" and float(table[5].split()[-1]) > 0
    assert table[6] == f"checkpoints: {out}/last and {out}/best"
    assert "validation: " in captured.err  # the progress bar
    saved = json.loads((out / "run_config.json").read_text())
    assert sorted(saved) == ["finetune", "model", "train"]
    assert saved["train"]["max_steps"] == 5 and saved["train"]["eval_every"] == 2
    assert saved["finetune"]["init"] == str(pretrained) and saved["model"]["dim"] == 32


def test_resume_continues_a_finetuning_run_and_is_required_to_reuse_its_folder(
    pretrained, data, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "ft"
    finetune(pretrained, data, out, "--max-steps", "2")
    err = user_error(capsys, lambda: finetune(pretrained, data, out, "--max-steps", "4"))
    assert err == (
        f"linformer finetune: error: {out} already holds checkpoints: pass --resume to "
        "continue that run, or choose another --output-dir\n"
    )
    checks, last = count_checkpoint_checks(monkeypatch), (out / "last").resolve()
    finetune(pretrained, data, out, "--max-steps", "4", "--resume")
    assert records(out, "train") == [1, 2, 3, 4]
    assert checks[last] == 1  # the trainer verified it again: twice
    # Texts cut at another length went on training without a word (validation then scored
    # other inputs than before); the model's own length (0 = the model's) is the run's.
    err = user_error(
        capsys,
        lambda: finetune(
            pretrained, data, out, "--max-steps", "6", "--resume", "--max-seq-len", "32"
        ),  # fmt: skip
    )
    assert "these differ: --max-seq-len 32 (the run's: 0 = the model's 64)" in err
    finetune(pretrained, data, out, "--max-steps", "6", "--resume", "--max-seq-len", "64")
    assert records(out, "train") == [1, 2, 3, 4, 5, 6]
    # Another batch size, seed or training file went on without a word (the order indexed
    # anew from the step: examples seen again, others skipped; a changed split scored apart)
    other = data[0].with_name("other.jsonl")
    other.write_bytes(data[0].read_bytes())
    flags = ["--batch-size", "4", "--seed", "9", "--data", str(other)]
    err = user_error(capsys, lambda: finetune(pretrained, data, out, "--max-steps", "8",
                                              "--resume", *flags))  # fmt: skip
    # the same file named from another working directory goes on (its relative path was
    # resolved against the new one and refused)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(data[0].parent)
        relative = (data[0].name, data[1].name)
        finetune(pretrained, relative, out, "--max-steps", "7", "--resume")
    finetune(pretrained, data, out, "--max-steps", "8", "--resume")
    assert records(out, "train") == list(range(1, 9))
    assert (
        f"--resume continues the fine-tuning of {out}/checkpoints/step-00000006 on its texts, "
        f"read and ordered as it started; these differ: --data '{other}' (the run's: "
        f"'{data[0]}'), --batch-size 4 (the run's: 8), --seed 9 (the run's: 0)"
    ) in err


def test_threads_cover_the_probe_too(pretrained, data, tmp_path, monkeypatch):
    # --threads was set as training began: the probe's pass over the data (and a teacher's)
    # ran at torch's own count
    finetune_module = importlib.import_module("linformer_kit.training.finetune")  # not the
    seen, probe = [], finetune_module.init_head_from_probe  # function the package exports
    monkeypatch.setattr(
        finetune_module,
        "init_head_from_probe",
        lambda *a, **kw: seen.append(torch.get_num_threads()) or probe(*a, **kw),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        finetune(pretrained, data, tmp_path / "ft", "--max-steps", "1", "--threads", "1")
    finally:
        torch.set_num_threads(threads)
    assert seen == [1]


def test_a_sequence_length_beyond_the_models_is_an_error_naming_both(
    pretrained, data, tmp_path, capsys
):
    err = user_error(
        capsys, lambda: finetune(pretrained, data, tmp_path / "ft", "--max-seq-len", "65")
    )
    assert err == (
        "linformer finetune: error: --max-seq-len 65 is longer than the model's max_seq_len "
        f"64 ({pretrained}); pass at most 64\n"
    )
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--epochs", "0"], "epochs must be an integer >= 1, got 0"),
        (["--max-steps", "-1"], "max_steps must be an integer >= 0, got -1"),
        (["--num-labels", "1"], "num_labels must be at least 2 (or 0: max label + 1), got 1"),
    ],
)
def test_sizing_flags_that_cannot_be_honoured_are_errors(
    pretrained, data, tmp_path, capsys, flags, message
):
    err = user_error(capsys, lambda: finetune(pretrained, data, tmp_path / "ft", *flags))
    assert err == f"linformer finetune: error: {message}\n"


def test_eval_is_a_required_flag_and_pretraining_only_flags_are_gone(capsys):
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    help_text = capsys.readouterr().out
    assert "--eval EVAL           validation JSONL or CSV (text + label) (required)" in help_text
    assert "--mlm-probability" not in help_text and "--eval-batches" not in help_text
    err = user_error(capsys, lambda: main(["finetune", "--init", "a", "--data", "b"]))
    assert err.endswith("linformer finetune: error: the following arguments are required: --eval\n")
    err = user_error(
        capsys,
        lambda: main(
            ["finetune", "--init", "a", "--data", "b", "--eval", "c"] + ["--eval-batches", "2"]
        ),
    )
    assert err.endswith("linformer: error: unrecognized arguments: --eval-batches 2\n")


ONE_CLASS = (
    r"every prediction on {data} is class [01] \(accuracy 0\.\d{{3}}, F1 0\.\d{{3}}\): the "
    "classifier does not tell the classes apart. Likely causes: a learning rate too high or "
    r"too low \(--lr\), too few steps \(--epochs, --max-steps\), or texts truncated before the "
    r"words that decide the label \(--max-seq-len\)"
)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_classifier_predicting_one_class_gets_a_warning_naming_likely_causes(
    pretrained, data, tmp_path, caplog
):
    # One text repeated with both labels: any classifier predicts one class for all of it.
    rows = [json.loads(line) for line in data[1].read_text().splitlines()]
    same_text = tmp_path / "same_text.jsonl"
    same_text.write_text("".join(json.dumps({**r, "text": rows[0]["text"]}) + "\n" for r in rows))
    assert {r["label"] for r in rows} == {0, 1}
    out = tmp_path / "ft"
    finetune(pretrained, (data[0], same_text), out, "--max-steps", "1")
    expected = ONE_CLASS.format(data=re.escape(str(same_text)))
    [warning] = warnings(caplog)
    assert re.fullmatch(expected, warning)
    caplog.clear()
    main(["evaluate", str(out / "best"), "--data", str(same_text)])
    [warning] = warnings(caplog)
    assert re.fullmatch(expected, warning)


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_evaluating_a_base_model_on_labelled_data_says_it_is_not_a_classifier(
    pretrained, data, caplog, capsys, suffix
):
    labelled = data[1]
    if suffix == "csv":  # the CSV's labels went unnoticed
        labelled = labelled.with_suffix(".csv")
        rows = [json.loads(line) for line in data[1].read_text().splitlines()]
        labelled.write_text("text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in rows))
    main(["evaluate", str(pretrained), "--data", str(labelled)])
    assert warnings(caplog) == [
        f"{pretrained} is not a classifier (LinformerForMaskedLM, no classification head): the "
        f"labels in {labelled} are ignored and its texts scored for masked-LM perplexity. For "
        f"accuracy and F1, fine-tune it first: linformer finetune --init {pretrained} "
        "--data ... --eval ..."
    ]
    assert "val_ppl" in capsys.readouterr().out


def test_evaluate_masks_at_the_runs_rate_and_refuses_documents_without_text(
    pretrained, data, tmp_path, capsys
):
    # evaluate masked 15% whatever --mlm-probability the run trained (and reported val_ppl)
    # with; documents that tokenize to nothing were scored as nan.
    run = pretrain_cli(tmp_path, "--max-steps", "1", "--mlm-probability", "0.4", *MODEL, *TRAIN)
    text = str(data[1])

    def metrics(path, *flags):
        out = tmp_path / "e.json"
        main(["evaluate", str(path), "--data", text, "--out", str(out), *flags])
        return json.loads(out.read_text())["metrics"][text]

    assert metrics(run / "last") == metrics(run / "last", "--mlm-probability", "0.4")
    assert metrics(run / "last") != metrics(run / "last", "--mlm-probability", "0.15")
    assert metrics(pretrained) == metrics(pretrained, "--mlm-probability", "0.15")  # its rate
    # several files: one row each, as the README says (one pooled "a+b" row before)
    out = tmp_path / "two.json"
    main(["evaluate", str(pretrained), "--data", text, str(data[0]), "--out", str(out)])
    both = json.loads(out.read_text())["metrics"]
    assert list(both) == [text, str(data[0])] and both[text] == metrics(pretrained)
    # a file of less than a block was named after the files before it had been scored
    short = tmp_path / "short.txt"
    short.write_text("a cat.")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LMEvaluator, "__call__", lambda *a: pytest.fail("scored first"))
        err = user_error(capsys, lambda: main(["evaluate", str(pretrained), "--data", text,
                                               str(short)]))  # fmt: skip
    assert "fewer than one block of 64 (each --data is scored on its own" in err
    # every file's tokens are held until the last is scored: as narrow as the cache's (int64:
    # 4x the memory of the one file held before)
    settings = EvaluateSettings(data=[text])
    blocks = _text_blocks([text], load_tokenizer(pretrained), 64, settings)
    assert blocks.tokens.dtype == np.uint16
    err = user_error(capsys, lambda: metrics(pretrained, "--mlm-probability", "1"))
    assert err == "linformer evaluate: error: mlm_probability must be in (0, 1), got 1.0\n"
    classifier = tmp_path / "ft"
    finetune(pretrained, data, classifier, "--max-steps", "1")
    err = user_error(capsys, lambda: metrics(classifier / "last", "--mlm-probability", "0.3"))
    assert "mlm_probability is the masking of a masked LM; " in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": ""}) + "\n")
    err = user_error(capsys, lambda: main(["evaluate", str(pretrained), "--data", str(empty)]))
    assert err.endswith(f"error: {empty}: no text (its 2 documents are empty)\n")


def test_ctrl_c_before_the_first_checkpoint_says_to_start_again(pretrained, data, tmp_path, capsys):
    out = tmp_path / "ft"
    argv = ["finetune", "--init", str(pretrained), "--data", str(data[0]), "--eval", str(data[1])]
    argv += ["--output-dir", str(out)]
    capsys.readouterr()
    with interrupted_after(1), pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        "linformer finetune: interrupted at step 1, before the first checkpoint; start again "
        f"with: linformer {' '.join(argv)}"
    )
    main(argv)  # the folder holds no checkpoint, so starting again needs no --resume
    assert records(out, "val") == [2, 4, 5]  # 24 rows at 16 a step: 3 epochs in ceil(4.5) steps


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_threads_sets_torchs_cpu_threads_in_every_training_command(
    pretrained, data, tmp_path, capsys, restore_threads
):
    for command in ("pretrain", "finetune", "evaluate", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--threads THREADS" in capsys.readouterr().out
    wanted = restore_threads + 1
    finetune(pretrained, data, tmp_path / "ft", "--max-steps", "1", "--threads", str(wanted))
    assert torch.get_num_threads() == wanted
    torch.set_num_threads(restore_threads)
    main(["evaluate", str(pretrained), "--data", str(data[1]), "--threads", str(wanted)])
    assert torch.get_num_threads() == wanted
    err = user_error(capsys, lambda: finetune(pretrained, data, tmp_path / "x", "--threads", "-1"))
    assert err == (
        "linformer finetune: error: threads must be an integer >= 0 (0 = torch's default), got -1\n"
    )


def test_a_warmup_longer_than_the_run_is_stated_and_evaluate_rejects_what_it_cannot_do(
    pretrained, data, tmp_path, caplog, capsys
):
    finetune(pretrained, data, tmp_path / "ft", "--max-steps", "2", "--warmup-steps", "5")
    assert (
        "warmup_steps (5) > max_steps (2): the run ends during warm-up, with the learning rate "
        "at 40% of --lr 5e-05"
    ) in warnings(caplog)
    err = user_error(capsys, lambda: main(["evaluate", str(pretrained)]))
    assert err.endswith("linformer evaluate: error: the following arguments are required: --data\n")
    evaluate = ["evaluate", str(pretrained), "--data", str(data[1]), "--batch-size", "0"]
    err = user_error(capsys, lambda: main(evaluate))
    assert err == "linformer evaluate: error: batch_size must be an integer >= 1, got 0\n"


def test_training_data_of_one_class_and_an_encoder_decoder_init_are_refused(
    pretrained, data, tmp_path, capsys
):
    one_class = tmp_path / "one.jsonl"
    one_class.write_text((json.dumps({"text": "a cat", "label": 0}) + "\n") * 8)
    err = user_error(capsys, lambda: finetune(pretrained, (one_class, data[1]), tmp_path / "a"))
    assert f"{one_class} has one class only (every label is 0)" in err
    # one class whose id is not 0 made max(label) + 1 = 2 classes and trained without a word
    one_class.write_text((json.dumps({"text": "a cat", "label": 1}) + "\n") * 8)
    err = user_error(capsys, lambda: finetune(pretrained, (one_class, data[1]), tmp_path / "c"))
    assert f"{one_class} has one class only (every label is 1)" in err
    seq2seq = tmp_path / "s2s"
    encoder = LinformerConfig(
        vocab_size=40, max_seq_len=16, dim=16, depth=1, num_heads=2, proj_dim=8
    )
    LinformerForSeq2SeqLM(
        Seq2SeqConfig(encoder=encoder, decoder=encoder.replace(causal=True, block_size=4))
    ).save_pretrained(seq2seq)
    (seq2seq / "tokenizer.json").write_bytes((pretrained / "tokenizer.json").read_bytes())
    err = user_error(capsys, lambda: finetune(seq2seq, data, tmp_path / "b"))
    assert f"{seq2seq} is a LinformerForSeq2SeqLM (an encoder-decoder): fine-tune a" in err
    err = user_error(capsys, lambda: main(["evaluate", str(seq2seq), "--data", str(data[0])]))
    assert f"evaluate it with `linformer seq2seq evaluate {seq2seq}`" in err
    err = user_error(capsys, lambda: main(["seq2seq", "evaluate", str(pretrained)]))
    assert f"{pretrained} is a LinformerForMaskedLM, not an encoder-decoder" in err


def named(path, names, rows):
    """`rows` of the file at `path` with their 0 / 1 labels as `names`, written to a copy."""
    lines = [json.loads(line) for line in path.read_text().splitlines()][:rows]
    out = path.with_name(f"{'-'.join(names)}-{path.name}")
    out.write_text("".join(json.dumps({**r, "label": names[r["label"]]}) + "\n" for r in lines))
    return out


def test_a_kept_head_keeps_the_meaning_of_its_classes(pretrained, data, tmp_path):
    # Before, the file's names were numbered afresh: fine-tuning a neg/pos classifier on
    # pos-only data trained the old "neg" output on every "pos" example (saved as {pos: 0}).
    train, valid = (named(path, ["neg", "pos"], 24) for path in data)
    finetune(pretrained, (train, valid), tmp_path / "first", "--max-steps", "2")
    first = tmp_path / "first" / "last"
    assert LinformerConfig.from_dict(json.loads((first / "config.json").read_text())["config"]
                                     ).label2id == {"neg": 0, "pos": 1}  # fmt: skip
    lines = [json.loads(line) for line in train.read_text().splitlines()]
    only_pos = tmp_path / "pos.jsonl"
    only_pos.write_text("".join(json.dumps(r) + "\n" for r in lines if r["label"] == "pos"))
    finetune(first, (only_pos, only_pos), tmp_path / "again", "--max-steps", "1")
    finetune(
        first, (only_pos, only_pos), tmp_path / "sized", "--max-steps", "1", "--num-labels", "2"
    )
    for run in ("again", "sized"):
        saved = json.loads((tmp_path / run / "last" / "config.json").read_text())
        assert saved["config"]["label2id"] == {"neg": 0, "pos": 1}, run
        assert saved["model_kwargs"]["num_labels"] == 2
    # Other names are another task: a new head, the file's names in sorted order.
    other = named(data[0], ["cat", "dog"], 24)
    finetune(first, (other, other), tmp_path / "other", "--max-steps", "1")
    saved = json.loads((tmp_path / "other" / "last" / "config.json").read_text())
    assert saved["config"]["label2id"] == {"cat": 0, "dog": 1}


@pytest.mark.parametrize(
    ("examples", "batch", "epochs", "steps"), [(10, 16, 3, 2), (10, 4, 3, 8), (500, 8, 3, 188)]
)
def test_epochs_are_passes_over_the_data_not_rounded_up_each(examples, batch, epochs, steps):
    # Each epoch's steps were rounded up and the stream went on: 10 examples at 16 a step
    # for 3 epochs ran 3 steps, 48 rows (4.8 passes); now 2 steps (3.2), ceil(3 x 10 / 16).
    settings = FinetuneSettings(init="x", data="x", eval="x", epochs=epochs)
    train = _sized(settings, finetune_train_settings(batch_size=batch), examples, 1)
    assert train.max_steps == steps
    assert epochs <= steps * batch / examples < epochs + batch / examples
    assert train.eval_every == -(-examples // batch)  # about an epoch, the last step too
