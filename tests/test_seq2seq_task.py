"""Seq2seq tasks and commands: ROUGE-L against hand-computed values, docstring extraction and its
split, exact resume of a seq2seq run, and `linformer seq2seq` / `linformer generate`."""

import dataclasses
import json
import re
import textwrap

import pytest
import torch
from train_helpers import count_checkpoint_checks

from linformer_kit import LinformerForSeq2SeqLM, hub
from linformer_kit.cli import main
from linformer_kit.data import seq2seq as seq2seq_data
from linformer_kit.data.docstrings import CodeDoc, function_pairs, split_by_file
from linformer_kit.data.seq2seq import Seq2SeqDataSettings, load_seq2seq_data
from linformer_kit.data.tokenizer import train_tokenizer
from linformer_kit.training.rouge import lcs_length, rouge_l, words
from linformer_kit.training.seq2seq import (
    Seq2SeqModelSettings,
    Seq2SeqRunConfig,
    train_seq2seq,
)
from linformer_kit.training.settings import TrainSettings


def test_rouge_l_matches_hand_computed_values():
    # LCS "the cat on the mat": 5 of 6 words on each side, so P = R = F = 5/6.
    cand, ref = words("The cat sat on the mat."), words("the cat was on the mat")
    assert lcs_length(cand, ref) == 5
    assert rouge_l(cand, ref) == pytest.approx(5 / 6)
    # LCS "a c e": P = 3/5, R = 3/3, F = 2 * 0.6 * 1 / 1.6 = 0.75.
    assert rouge_l(list("abcde"), list("ace")) == pytest.approx(0.75)
    assert rouge_l(list("ace"), list("abcde")) == pytest.approx(0.75)  # symmetric F1
    assert rouge_l([], list("abc")) == 0.0 and rouge_l(list("xyz"), list("abc")) == 0.0
    assert words("Return the N-th item.") == ["return", "the", "n", "th", "item"]


SOURCE = textwrap.dedent(
    '''
    def area(width, height):
        """Return the area of a rectangle.

        More words that the summary leaves out.
        """
        return width * height

    class Shelf:
        def add(self, book):
            """Put a book
            on the shelf."""
            self.books.append(book)

        async def fetch(self):
            """Fetch every book remotely."""
            return await load()

    def stub():
        """Nothing to see here at all."""
        pass

    def terse(x):
        """Return x."""
        return x
    '''
)


def test_function_pairs_drop_the_docstring_and_keep_the_summary():
    pairs = function_pairs(SOURCE, "shelf.py")
    assert [p.where for p in pairs] == ["shelf.py:2", "shelf.py:10", "shelf.py:15"]
    assert pairs[0].code == "def area(width, height):\n    return width * height"
    assert pairs[0].summary == "Return the area of a rectangle."
    assert pairs[1].code == "def add(self, book):\n    self.books.append(book)"  # dedented
    assert pairs[1].summary == "Put a book on the shelf."
    assert pairs[2].code.startswith("async def fetch(self):\n    return await")
    assert function_pairs("def broken(:\n", "x.py") == []
    # a docstring sharing a line with code: the code was cut to '' or lost its tail
    shared = 'def one(x): """Return one more than x."""; return x + 1\n'
    shared += 'def two(x):\n    """Return two more than x."""; y = x + 2\n    return y\n'
    assert function_pairs(shared, "m.py") == []


def test_the_split_is_by_file_and_fixed_by_the_seed():
    pairs = [
        CodeDoc(f"m{f}.py:{line}", "code", "a summary here") for f in range(40) for line in (1, 9)
    ]
    splits = split_by_file(pairs, seed=3, val_fraction=0.1, test_fraction=0.1)
    assert [len(splits[s]) for s in ("train", "val", "test")] == [64, 8, 8]
    files = {s: {p.where.split(":")[0] for p in splits[s]} for s in splits}
    assert not (files["train"] & files["val"] or files["train"] & files["test"])
    assert split_by_file(pairs, 3, 0.1, 0.1) == splits
    assert split_by_file(pairs, 4, 0.1, 0.1) != splits
    with pytest.raises(ValueError, match="val_fraction > 0, test_fraction > 0 and their sum < 1"):
        split_by_file(pairs, 3, 0.5, 0.5)
    # Shares that round to no file left a split empty: val scored 0 (and chose `best` by
    # it), evaluate --split test divided by zero, an empty train split crashed the batches.
    for val, test, empty in [(0.01, 0.1, "val"), (0.1, 0.01, "test"), (0.5, 0.49, "train")]:
        with pytest.raises(ValueError, match=rf"of 40 files leave {empty} without a file"):
            split_by_file(pairs, 3, val, test)


def test_the_docstrings_task_frames_targets_and_keys_its_tokenizer_by_vocabulary_size(
    tmp_path, monkeypatch
):
    # A key without the vocabulary size reused the tokenizer trained at another size; a
    # target without its end token would teach the decoder never to stop.
    pairs = [
        CodeDoc(f"m{f}.py:{line}", f"def add_{f}_{line}(x): return x + {line}",
                f"Adds {line} to x in module {f}.")
        for f in range(40) for line in (1, 9)
    ]  # fmt: skip
    monkeypatch.setattr(seq2seq_data, "extract_stdlib_pairs", lambda cache_dir=None: pairs)
    sizes = []
    for vocab_size in (300, 280):
        settings = Seq2SeqDataSettings(vocab_size=vocab_size, cache_dir=str(tmp_path))
        data = load_seq2seq_data(settings)
        sizes.append(data.vocab_size)
        batch = data.train.batch([0])
        ids, real = batch["decoder_input_ids"][0], batch["decoder_padding_mask"][0]
        assert ids[0] == data.tokenizer.cls_id and ids[real][-1] == data.tokenizer.sep_id
        assert ids[real][1:-1].tolist() == data.train.targets[0]
    assert sizes == [300, 280]


def tiny_run(output_dir, steps, resume=False):
    return Seq2SeqRunConfig(
        model=Seq2SeqModelSettings(
            dim=16, depth=1, decoder_depth=1, num_heads=2, proj_dim=4, decoder_proj_dim=3,
            block_size=2, dropout=0.1,
        ),
        train=TrainSettings(
            output_dir=str(output_dir), max_steps=steps, batch_size=4, eval_every=3,
            eval_batches=1, save_every=3, warmup_steps=0, schedule="constant", resume=resume,
            threads=1,
        ),
        data=Seq2SeqDataSettings(
            task="reverse", max_source_len=8, max_target_len=10, num_train=64, num_eval=8,
            min_len=2, max_len=6, num_symbols=5,
        ),
    )  # fmt: skip


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, monkeypatch):
    # A constant learning rate: a 3-step run and a 6-step run share it up to step 3.
    calls = []
    forward = LinformerForSeq2SeqLM.forward
    monkeypatch.setattr(
        LinformerForSeq2SeqLM, "forward", lambda *a, **kw: calls.append(kw) or forward(*a, **kw)
    )
    straight = train_seq2seq(tiny_run(tmp_path / "straight", 6))
    # Training steps skip the logits; validation reads them (token accuracy).
    steps = [call for call in calls if call.get("return_logits") is False]
    assert len(steps) == 6
    assert any("return_logits" not in call for call in calls)
    # the tokens read: the sources' and the decoder's (the sources' alone were counted)
    read = sum(int(c["key_padding_mask"].sum() + c["decoder_padding_mask"].sum()) for c in steps)
    assert [r["tokens"] for r in straight.records if r["split"] == "train"][-1] == read
    train_seq2seq(tiny_run(tmp_path / "resumed", 3))
    checks, last = count_checkpoint_checks(monkeypatch), (tmp_path / "resumed/last").resolve()
    result = train_seq2seq(tiny_run(tmp_path / "resumed", 6, resume=True))
    assert checks == {last: 1}  # the trainer verified it again: twice
    assert result.steps == 6 and 0 <= result.final["token_accuracy"] <= 1
    weights = [hub.read_weights(tmp_path / run / "last") for run in ("straight", "resumed")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    # Another --data-seed (a new split: validation scored other pairs) or --batch-size
    # went on without a word
    run = tiny_run(tmp_path / "resumed", 9, resume=True)
    run.data = dataclasses.replace(run.data, data_seed=7)
    run.train = dataclasses.replace(run.train, batch_size=2)
    with pytest.raises(ValueError, match=r"continues the training of .*step-00000006 on its "
                       r"pairs and order; these differ: --data-seed 7 \(the run's: 0\), "
                       r"--batch-size 2 \(the run's: 4\)"):  # fmt: skip
        train_seq2seq(run)
    # Other pairs under the same flags (a stdlib or cache changed since, a tokenizer trained
    # anew: the docstring task's) went on without a word under the run's weights
    run = tiny_run(tmp_path / "resumed", 9, resume=True)
    data = load_seq2seq_data(run.data)
    data.train.targets[0] = data.train.targets[0][::-1] + [1]
    with pytest.raises(ValueError, match=r"on the data it trained on \(num_pairs 72, sha256 "):
        train_seq2seq(run, data)


def test_the_commands_train_evaluate_and_refuse_bad_input(tmp_path, capsys):
    run = tmp_path / "run"
    main(["seq2seq", "train", "--task", "copy", "--max-source-len", "8", "--max-target-len",
          "10", "--max-len", "6", "--num-train", "64", "--num-eval", "8", "--dim", "16",
          "--depth", "1", "--decoder-depth", "1", "--num-heads", "2", "--proj-dim", "4",
          "--max-steps", "2", "--batch-size", "4", "--eval-every", "2", "--threads", "1",
          "--output-dir", str(run)])  # fmt: skip
    assert "token_accuracy" in capsys.readouterr().out
    saved = json.loads((run / "last" / "run_config.json").read_text())
    assert saved["data"]["task"] == "copy" and saved["model"]["proj_dim"] == 4
    main(["seq2seq", "evaluate", str(run / "last"), "--split", "val", "--threads", "1"])
    table = capsys.readouterr().out
    assert "rouge_l" in table and "exact_match" in table
    # generate said "no tokenizer at ...", not why a copy-task model has none
    with pytest.raises(SystemExit, match="a model of a synthetic task .* reads symbol ids, not"):
        main(["generate", str(run / "last"), "--prompt", "abc"])
    with pytest.raises(SystemExit) as exit_info:  # it was torch's RuntimeError, a traceback
        main(["seq2seq", "evaluate", str(run / "last"), "--threads", "-1"])
    assert exit_info.value.code == 2
    assert "threads must be an integer >= 0 (0 = torch's default), got -1" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["seq2seq", "train", "--task", "poems", "--output-dir", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert "task must be one of docstrings, copy, reverse; got 'poems'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["seq2seq", "train", "--task", "copy", "--max-target-len", "16", "--max-len", "8",
              "--decoder-proj-dim", "64", "--output-dir", str(tmp_path / "y")])  # fmt: skip
    assert (
        "the decoder (--max-target-len, --decoder-proj-dim, --decoder-depth): proj_dim must be "
        "an integer in [1, max_seq_len=16], got 64"
    ) in capsys.readouterr().err


def test_generate_decodes_a_target_with_a_seq2seq_checkpoint(tmp_path, capsys):
    from linformer_kit import LinformerConfig, LinformerForSeq2SeqLM, Seq2SeqConfig

    tokenizer = train_tokenizer(["def add(a, b): return a + b", "Add two numbers."] * 20, 300)
    common = dict(vocab_size=tokenizer.vocab_size, dim=16, num_heads=2, depth=1)
    config = Seq2SeqConfig(
        encoder=LinformerConfig(**common, max_seq_len=32, proj_dim=8),
        decoder=LinformerConfig(**common, max_seq_len=12, proj_dim=None, causal=True),
        share_embeddings=True,
        decoder_start_token_id=tokenizer.cls_id,
        eos_token_id=tokenizer.sep_id,
    )
    torch.manual_seed(0)
    model = LinformerForSeq2SeqLM(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save(tmp_path / "tokenizer.json")
    prompt = "def add(a, b): return a + b"
    main(
        [
            "generate",
            str(tmp_path),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
        ]
    )
    tokens = model.generate(torch.tensor([tokenizer.encode_batch([prompt])[0]]), 8, temperature=0)
    ids = tokens[0, 1:].tolist()
    ids = ids[: ids.index(tokenizer.sep_id)] if tokenizer.sep_id in ids else ids
    alone = tokenizer.tokenizer.decode(ids)
    assert capsys.readouterr().out == alone + "\n"
    # with a second, shorter source: one padded batch, each target as if decoded alone,
    # greedy or sampled (each prompt's own generator)
    for temperature in ("0", "1"):
        argv = ["generate", str(tmp_path), "--max-new-tokens", "8", "--temperature", temperature]
        main([*argv, "--prompt", prompt])
        alone = capsys.readouterr().out
        main([*argv, "--prompt", "Add", "--prompt", prompt])
        out = capsys.readouterr().out
        assert out.startswith("==> prompt 1 <==\n") and out.endswith(
            f"\n\n==> prompt 2 <==\n{alone}"
        )
    # the default --max-new-tokens (64) is capped at the decoder's room (max_seq_len 12 - 1)
    main(["generate", str(tmp_path), "--prompt", prompt, "--temperature", "0"])
    full = model.generate(torch.tensor([tokenizer.encode_batch([prompt])[0]]), 11, temperature=0)
    ids = full[0, 1:].tolist()
    ids = ids[: ids.index(tokenizer.sep_id)] if tokenizer.sep_id in ids else ids
    assert capsys.readouterr().out == tokenizer.tokenizer.decode(ids) + "\n"


def test_synthetic_data_settings_check_the_lengths():
    with pytest.raises(ValueError, match=r"max_len \(40\) must fit both sides"):
        Seq2SeqDataSettings(task="copy", max_len=40, max_source_len=64, max_target_len=32)
    with pytest.raises(ValueError, match=r"num_train must be an integer >= 1, got 0"):
        Seq2SeqDataSettings(task="copy", num_train=0)
    # the other kind of task's flags were ignored without a word (refused as given on the
    # command line: a saved run's settings, which an earlier version kept, load as they are);
    # --vocab-size 0 was named after the stdlib was parsed (~15 s)
    for task, flags, named in [
        ("copy", ["--vocab-size", "300", "--val-fraction", "0.1"], "--vocab-size, "
         "--val-fraction set the data of the docstrings task only; --task copy would ignore"),
        ("docstrings", ["--num-train", "5"], "--num-train set the data of the synthetic tasks"),
        ("docstrings", ["--vocab-size", "0"], "vocab_size must be in [261, 16777216] for byte"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit, match=re.escape(named)):
            main(["seq2seq", "train", "--task", task, *flags])
    assert Seq2SeqDataSettings(task="copy", val_fraction=0.1).read()[:3] == (
        "task",
        "max_source_len",
        "max_target_len",
    )
    data = load_seq2seq_data(Seq2SeqDataSettings(task="reverse", num_train=10, num_eval=4))
    assert data.vocab_size == 16 + 3 and data.tokenizer is None
    assert all(t == s[::-1] for s, t in zip(data.train.sources, data.train.targets))
    assert data.train.sources != data.val.sources != data.test.sources
