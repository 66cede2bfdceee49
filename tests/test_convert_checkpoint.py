"""`linformer convert --from` an exact checkpoint of this library (a fine-tuned classifier):
every weight and the head kept, the projections those of a conversion from the Hugging Face
source, exact where adaptive pooling keeps every token; clear errors otherwise; and
`finetune --init` of such a classifier keeps its head."""

import importlib
import logging
import shutil

import pytest
import torch
from hf_helpers import N, write_tiny_bert
from train_helpers import write_classification

from linformer_kit import LinformerConfig
from linformer_kit.causal_lm import LinformerForCausalLM
from linformer_kit.cli import main
from linformer_kit.files import exclusive
from linformer_kit.hub import read_config, read_weights
from linformer_kit.interop.convert import convert_to_dir
from linformer_kit.models import LinformerForSequenceClassification
from linformer_kit.training.evaluate import classifier_length


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny BERT, its exact conversion and a 3-class classifier (random head) built on it."""
    root = tmp_path_factory.mktemp("convert_checkpoint")
    hf = write_tiny_bert(root / "hf")
    main(["convert", "--from", str(hf), "--exact", "--out", str(root / "exact")])
    torch.manual_seed(0)
    classifier = LinformerForSequenceClassification.from_pretrained(
        root / "exact", num_labels=3, pooling="mean"
    )
    classifier.save_pretrained(root / "classifier")
    shutil.copy(root / "exact" / "tokenizer.json", root / "classifier")
    return root


def logits(path, ids):
    model = LinformerForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return model(ids).logits


def test_a_classifier_converts_with_every_weight_and_its_head_kept(dirs, tmp_path):
    out = tmp_path / "adaptive"
    main(["convert", "--from", str(dirs / "classifier"), "--proj-dim", "16"] + ["--out", str(out)])
    assert not read_config(out)["config"].is_exact  # linear projections, k = 16
    main(
        ["convert", "--from", str(dirs / "classifier"), "--proj-dim", "16"]
        + ["--projection", "adaptive", "--out", str(out)]
    )
    meta = read_config(out)
    assert meta["architecture"] == "LinformerForSequenceClassification"
    assert meta["model_kwargs"] == {"num_labels": 3, "pooling": "mean"}
    assert (meta["config"].proj_dim, meta["config"].projection) == (16, "adaptive")
    source, converted = read_weights(dirs / "classifier"), read_weights(out)
    assert sorted(source) == sorted(converted)
    assert all(torch.equal(source[name], converted[name]) for name in source)
    generator = torch.Generator().manual_seed(0)
    short = torch.randint(1000, 2000, (2, 16), generator=generator)  # <= k: every token a block
    torch.testing.assert_close(logits(out, short), logits(dirs / "classifier", short))
    long = torch.randint(1000, 2000, (2, N), generator=generator)
    assert not torch.allclose(logits(out, long), logits(dirs / "classifier", long), atol=1e-4)


def test_learned_projections_are_those_a_conversion_of_the_source_gets(dirs, tmp_path):
    # The classifier's backbone is the tiny BERT's, unchanged: the attention-based init on
    # the same calibration windows and seed must build the same projections either way.
    main(["convert", "--from", str(dirs / "hf"), "--proj-dim", "16", "--out", str(tmp_path / "a")])
    main(
        ["convert", "--from", str(dirs / "classifier"), "--proj-dim", "16"]
        + ["--out", str(tmp_path / "b")]
    )
    from_hf, from_checkpoint = read_weights(tmp_path / "a"), read_weights(tmp_path / "b")
    names = [name for name in from_hf if ".proj_" in name]
    assert names
    for name in names:
        torch.testing.assert_close(from_checkpoint["linformer." + name], from_hf[name])


def test_what_a_checkpoint_cannot_convert_to_is_refused_with_the_reason(dirs, tmp_path, capsys):
    main(["convert", "--from", str(dirs / "hf"), "--proj-dim", "16", "--out", str(tmp_path / "k")])
    config = LinformerConfig(vocab_size=64, max_seq_len=128, dim=16, depth=1, num_heads=2)
    causal = config.replace(proj_dim=None, causal=True)
    LinformerForCausalLM(causal).save_pretrained(tmp_path / "clm")
    cases = [
        ([str(tmp_path / "k"), "--proj-dim", "8"], "has Linformer (k=16) attention"),
        ([str(dirs / "classifier"), "--exact"], "has exact attention"),
        ([str(dirs / "classifier"), "--max-seq-len", "128"], "was trained at 64 positions"),
        ([str(tmp_path / "clm"), "--proj-dim", "8"], "is a LinformerForCausalLM"),
        ([str(dirs / "classifier"), "--report"], "is not one"),
    ]
    for flags, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(["convert", "--from", *flags, "--out", str(tmp_path / "x")])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, flags


def test_finetuning_a_classifier_keeps_its_head_instead_of_a_new_probe(dirs, tmp_path, caplog):
    train = write_classification(tmp_path / "train.jsonl", 16, seed=0)
    out = tmp_path / "ft"
    with caplog.at_level(logging.INFO):
        main(
            ["finetune", "--init", str(dirs / "classifier"), "--data", str(train), "--eval"]
            + [str(train), "--num-labels", "3", "--max-steps", "1", "--batch-size", "4"]
            + ["--output-dir", str(out), "--threads", "1"]
        )
    assert f"the classification head of {dirs / 'classifier'} is kept" in caplog.text
    assert "linear probe" not in caplog.text


def test_a_kept_head_keeps_its_pooling(dirs, tmp_path, capsys):
    # finetune's --pooling default (mean) replaced a kept cls-pooled head's: its weights were
    # then fed features they never learned from.
    init = tmp_path / "cls"
    LinformerForSequenceClassification.from_pretrained(
        dirs / "exact", num_labels=3, pooling="cls"
    ).save_pretrained(init)
    shutil.copy(dirs / "exact" / "tokenizer.json", init)
    train = write_classification(tmp_path / "train.jsonl", 16, seed=0)
    argv = ["finetune", "--init", str(init), "--data", str(train), "--eval", str(train)]
    argv += ["--num-labels", "3", "--max-steps", "1", "--batch-size", "4", "--threads", "1"]
    main([*argv, "--output-dir", str(tmp_path / "ft")])
    assert read_config(tmp_path / "ft" / "last")["model_kwargs"]["pooling"] == "cls"
    with pytest.raises(SystemExit):
        main([*argv, "--pooling", "mean", "--output-dir", str(tmp_path / "other")])
    assert f"--pooling mean: the head kept from {init} was trained on cls-pooled" in (
        capsys.readouterr().err
    )
    # a run an earlier version started so (the kept cls head pooled by mean) resumes as it was
    finetune = importlib.import_module("linformer_kit.training.finetune")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(finetune, "_pooling", lambda *args: "mean")
        main([*argv, "--output-dir", str(tmp_path / "earlier")])
    main([*argv, "--output-dir", str(tmp_path / "earlier"), "--resume", "--max-steps", "2"])
    assert read_config(tmp_path / "earlier" / "last")["model_kwargs"]["pooling"] == "mean"


def test_a_converted_classifier_reads_texts_at_its_fine_tuning_length(dirs, tmp_path):
    # convert dropped run_config.json: `evaluate` of the converted classifier read texts at
    # the model's 64 tokens, its source (fine-tuned at 32) at 32
    train = write_classification(tmp_path / "train.jsonl", 16, seed=0)
    argv = ["finetune", "--init", str(dirs / "classifier"), "--data", str(train), "--eval"]
    argv += [str(train), "--num-labels", "3", "--max-steps", "1", "--batch-size", "4"]
    main([*argv, "--max-seq-len", "32", "--threads", "1", "--output-dir", str(tmp_path / "ft")])
    out = tmp_path / "converted"
    main(
        ["convert", "--from", str(tmp_path / "ft" / "best"), "--proj-dim", "16", "--out", str(out)]
    )
    assert classifier_length(out, read_config(out)["config"]) == 32
    main(["convert", "--from", str(dirs / "classifier"), "--proj-dim", "16", "--out", str(out)])
    assert classifier_length(out, read_config(out)["config"]) == N  # the replaced one's gone
    # --out at a run's checkpoint (`best` links into it) replaced its weights, config and
    # tokenizer with a warning, beside its optimizer state
    best = tmp_path / "ft" / "best"
    weights = (best / "model.safetensors").read_bytes()
    # and at the run's folder, whose run_config.json it removed as a replaced model's
    for folder in (best, tmp_path / "ft"):
        with pytest.raises(SystemExit, match="is a training run or checkpoint"):
            main(["convert", "--from", str(dirs / "classifier"), "--out", str(folder)])
    assert (best / "model.safetensors").read_bytes() == weights
    assert (tmp_path / "ft" / "run_config.json").is_file()


def test_an_interrupted_conversion_never_leaves_one_models_weights_by_anothers_tokenizer(
    dirs, tmp_path, monkeypatch
):
    # The weights were replaced first and the replaced model's tokenizer.json and
    # run_config.json after: a Ctrl-C between left model B beside model A's tokenizer,
    # which evaluate read without a word.
    out = tmp_path / "converted"
    main(["convert", "--from", str(dirs / "classifier"), "--proj-dim", "16", "--out", str(out)])
    (out / "run_config.json").write_text("{}")  # as a converted training checkpoint has
    # Two conversions into one folder at once could leave one's weights beside the other's
    # tokenizer (each file renamed in turn), which evaluate scored without a word
    with exclusive(out, "conversion"):  # as another process holds it
        with pytest.raises(ValueError, match=r"converted is in use by another conversion"):
            convert_to_dir(dirs / "classifier", out, proj_dim=8)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(LinformerForSequenceClassification, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_to_dir(dirs / "classifier", out, proj_dim=8)
    assert not (out / "tokenizer.json").exists() and not (out / "run_config.json").exists()


def test_finetuning_a_classifier_on_other_classes_keeps_its_backbone_with_a_new_head(
    dirs, tmp_path, caplog
):
    train = write_classification(tmp_path / "train.jsonl", 16, seed=0)  # 2 classes
    out = tmp_path / "ft"
    with caplog.at_level(logging.INFO):
        main(
            ["finetune", "--init", str(dirs / "classifier"), "--data", str(train), "--eval"]
            + [str(train), "--max-steps", "1", "--batch-size", "4", "--lr", "1e-12"]
            + ["--output-dir", str(out), "--threads", "1"]
        )
    assert "--init is a classifier of 3 classes and the data has 2" in caplog.text
    assert "linear probe" in caplog.text  # the new head starts from the probe, as for a backbone
    before, after = read_weights(dirs / "classifier"), read_weights(out / "last")
    assert after["head.4.weight"].shape == (2, before["head.4.weight"].shape[1])
    backbone = [name for name in before if name.startswith("linformer.")]
    # One step of AdamW at lr 1e-12 moves no weight by more than about 1e-12.
    assert backbone and all(torch.allclose(before[n], after[n], atol=1e-9) for n in backbone)
