"""RoBERTa masking and classification JSONL data (with clear errors naming file and line)."""

import json

import pytest
import torch

from linformer_kit.data import IGNORE_INDEX, load_classification, mask_tokens, train_tokenizer


def test_masking_picks_15_percent_and_splits_80_10_10():
    ids = torch.randint(10, 1000, (64, 512))
    ids[:, ::50] = 2  # separators: never chosen
    generator = torch.Generator().manual_seed(0)
    inputs, labels = mask_tokens(
        ids, mask_id=4, vocab_size=1000, special_ids=[0, 1, 2, 4], generator=generator
    )
    chosen = labels != IGNORE_INDEX
    assert not chosen[:, ::50].any()
    assert abs(chosen.float().mean().item() - 0.15) < 0.01
    assert torch.equal(labels[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])
    masked = (inputs[chosen] == 4).float().mean().item()
    unchanged = (inputs[chosen] == ids[chosen]).float().mean().item()
    assert abs(masked - 0.8) < 0.02 and abs(unchanged - 0.1) < 0.02


def test_masking_is_reproducible_from_the_seed_and_fresh_otherwise():
    ids = torch.randint(10, 100, (4, 64))
    kwargs = dict(mask_id=4, vocab_size=100, special_ids=[0, 1, 2, 4])
    a = mask_tokens(ids, generator=torch.Generator().manual_seed(1), **kwargs)
    b = mask_tokens(ids, generator=torch.Generator().manual_seed(1), **kwargs)
    c = mask_tokens(ids, generator=torch.Generator().manual_seed(2), **kwargs)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["the cat eats red apples", "the dog sees blue fish"] * 20, 300)


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_classification_batches_pad_and_mask(tmp_path, tok):
    path = write(tmp_path / "d.jsonl", [{"text": "the cat", "label": 1}, {"text": "a", "label": 0}])
    data = load_classification(path, tok, max_seq_len=16, num_labels=2)
    batch = data.batch([0, 1], tok.pad_id)
    assert batch["input_ids"].shape == batch["key_padding_mask"].shape
    assert batch["labels"].tolist() == [1, 0]
    assert batch["input_ids"][0, 0] == tok.cls_id
    row = batch["key_padding_mask"][1]
    assert torch.all(batch["input_ids"][1][~row] == tok.pad_id)


def test_classification_truncates_to_max_seq_len(tmp_path, tok):
    path = write(tmp_path / "d.jsonl", [{"text": "the cat eats " * 40, "label": 0}])
    data = load_classification(path, tok, max_seq_len=8)
    assert len(data.ids[0]) == 8 and data.ids[0][-1] == tok.sep_id


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", r"d.jsonl: file is empty"),
        (b'{"text": "ok", "label": 0}\n{"text": "caf\xe9", "label": 1}\n', r"d.jsonl:2: not valid"),
        (b'{"text": "ok", "label": 0}\n{"text": "no label"}\n', r"d.jsonl:2: no field 'label'"),
        (b'{"text": "ok", "label": 0}\n{"text": "x", "label": 5}\n', r"d.jsonl:2: label 5 is out"),
        (
            b'{"text": "ok", "label": 0}\n{"text": "x", "label": "yes"}\n',
            r"d.jsonl:2: 'label' must",
        ),
        (b'{"text": 3, "label": 0}\n', r"d.jsonl:1: 'text' must be a string"),
    ],
)
def test_malformed_classification_files_name_file_and_line(tmp_path, tok, content, message):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_classification(path, tok, max_seq_len=16, num_labels=2)
