"""RoBERTa masking and classification JSONL data (with clear errors naming file and line)."""

import json

import pytest
import torch

from linformer_kit.data import IGNORE_INDEX, load_classification, mask_tokens, train_tokenizer
from linformer_kit.data.classification import cut_tokens, read_labelled


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
    # the other 10 %: ids drawn from the whole vocabulary (drawn from the special ids alone,
    # the rates above held)
    replaced = inputs[chosen & (inputs != ids) & (inputs != 4)]
    assert abs(len(replaced) / chosen.sum().item() - 0.1) < 0.02
    assert len(replaced.unique()) > 200 and replaced.max() < 1000  # ~490 draws of 1000


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


def test_cut_tokens_keeps_the_head_the_tail_or_a_quarter_of_head_and_the_rest_of_tail():
    row = list(range(20))
    assert cut_tokens(row, 8, "head") == [0, 1, 2, 3, 4, 5, 6, 7]
    assert cut_tokens(row, 8, "tail") == [12, 13, 14, 15, 16, 17, 18, 19]
    assert cut_tokens(row, 8, "head+tail") == [0, 1, 14, 15, 16, 17, 18, 19]
    assert cut_tokens(row, 510, "head+tail") == row  # short rows are kept whole
    assert cut_tokens(list(range(1000)), 510, "head+tail")[126:129] == [126, 617, 618]
    with pytest.raises(ValueError, match="truncation must be one of head, tail, head.tail; got"):
        cut_tokens(row, 8, "middle")


@pytest.mark.parametrize("truncation", ["head", "tail", "head+tail"])
def test_classification_truncation_keeps_the_chosen_tokens_between_cls_and_sep(
    tmp_path, tok, truncation
):
    text = " ".join(["the cat eats red apples"] * 6 + ["the dog sees blue fish"] * 6)
    path = write(tmp_path / "d.jsonl", [{"text": text, "label": 0}])
    data = load_classification(path, tok, max_seq_len=10, truncation=truncation)
    whole = tok.encode_batch([text])[0]
    assert data.ids[0] == [tok.cls_id, *cut_tokens(whole, 8, truncation), tok.sep_id]
    assert data.full_lengths == [len(whole) + 2]
    assert f"({truncation} kept)" in data.describe_truncation(10)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", r"d.jsonl: file is empty"),
        (b'{"text": "ok", "label": 0}\n{"text": "caf\xe9", "label": 1}\n', r"d.jsonl:2: not valid"),
        (b'{"text": "ok", "label": 0}\n{"text": "no label"}\n', r"d.jsonl:2: no field 'label'"),
        (b'{"text": "ok", "label": 0}\n{"text": "x", "label": 5}\n', r"d.jsonl:2: label 5 is out"),
        (
            b'{"text": "ok", "label": 0}\n{"text": "x", "label": "yes"}\n',
            r"d.jsonl:2: .label. must be an integer >= 0 like the label on line 1, got .yes.",
        ),
        (b'{"text": 3, "label": 0}\n', r"d.jsonl:1: 'text' must be a string"),
    ],
)
def test_malformed_classification_files_name_file_and_line(tmp_path, tok, content, message):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_classification(path, tok, max_seq_len=16, num_labels=2)


def test_label_names_map_to_ids_in_sorted_order_and_other_data_reuses_them(tmp_path, tok):
    rows = [{"text": "a", "label": n} for n in ["pos", "neg", "neutral", "pos"]]
    train = load_classification(write(tmp_path / "t.jsonl", rows), tok, max_seq_len=16)
    assert train.label2id == {"neg": 0, "neutral": 1, "pos": 2}
    assert train.labels == [2, 0, 1, 2]
    assert train.label_config() == {"label2id": train.label2id, "id2label": None}
    valid = write(tmp_path / "v.jsonl", [{"text": "b", "label": "neutral"}])
    mapped = load_classification(valid, tok, max_seq_len=16, label2id=train.label2id)
    assert mapped.labels == [1] and mapped.label2id == train.label2id


@pytest.mark.parametrize(
    ("labels", "label2id", "message"),
    [
        (
            ["neg", "great"],
            {"neg": 0, "pos": 1},
            ":2: unknown label 'great'; known labels: neg, pos",
        ),
        (
            ["neg", "pos"],
            {},
            ":1: unknown label 'neg'; known labels: none, the model was trained on integer ids",
        ),
        (
            [0, 1],
            {"neg": 0, "pos": 1},
            ":1: label 0 is an id, but the model's labels are names: neg, pos",
        ),
        (
            ["neg", 1],
            None,
            ":2: 'label' must be a string like the label on line 1, got 1 (a file's",
        ),
    ],
)
def test_labels_the_model_does_not_know_name_file_line_and_known_labels(
    tmp_path, tok, labels, label2id, message
):
    path = write(tmp_path / "v.jsonl", [{"text": "a", "label": label} for label in labels])
    with pytest.raises(ValueError) as caught:
        load_classification(path, tok, max_seq_len=16, label2id=label2id)
    assert str(caught.value).startswith(f"{path}{message}")


def test_integer_labels_are_unchanged_and_carry_no_names(tmp_path, tok):
    path = write(tmp_path / "d.jsonl", [{"text": "a", "label": 3}, {"text": "b", "label": 0}])
    data = load_classification(path, tok, max_seq_len=16, label2id={})
    assert data.labels == [3, 0] and data.label2id is None
    assert data.label_config() == {"label2id": None, "id2label": None}


def test_csv_with_a_header_reads_ids_or_names(tmp_path, tok):
    ids = tmp_path / "ids.csv"
    ids.write_text('label,text\n1,"the cat, again"\n\n0,the dog\n')
    data = load_classification(ids, tok, max_seq_len=16)
    assert data.labels == [1, 0] and data.lines == [2, 4] and data.label2id is None
    spaced = tmp_path / "spaced.csv"  # " 1" was a class name, sorted before "0": 1 became 0
    spaced.write_text("text,label\na, 1\nb,0\n")
    assert load_classification(spaced, tok, max_seq_len=16).labels == [1, 0]
    names = tmp_path / "names.csv"
    names.write_text("text,label\nthe cat,pos\nthe dog,neg\n")
    data = load_classification(names, tok, max_seq_len=16)
    assert data.labels == [1, 0] and data.label2id == {"neg": 0, "pos": 1}


def test_a_csv_row_s_line_is_where_it_starts_and_a_long_cell_is_read_whole(tmp_path, tok):
    # Rows were numbered by their last line, and csv refused a cell over 131,072 characters
    # as "not valid CSV": a long document's text is one cell.
    path = tmp_path / "d.CSV"  # the suffix in any case
    long = "word " * 40_000
    path.write_text(f'text,label\n"two\nlines",1\n{long},0\n"three\n\nlines",1\n')
    data = load_classification(path, tok, max_seq_len=16)
    assert data.lines == [2, 4, 5] and data.labels == [1, 0, 1]
    assert data.full_lengths[1] > 40_000
    path.write_text('text,label\n"a\nb",\n')
    with pytest.raises(ValueError, match=r"d.CSV:2: the 'label' cell is empty"):
        load_classification(path, tok, max_seq_len=16)


def test_csv_whole_number_labels_map_through_a_model_s_names(tmp_path, tok):
    # Names "0" / "1" (from JSONL strings): a CSV's 0 / 1 are those names, not ids.
    path = tmp_path / "eval.csv"
    path.write_text("text,label\na,1\nb,0\n")
    data = load_classification(path, tok, max_seq_len=16, label2id={"0": 0, "1": 1})
    assert data.labels == [1, 0] and data.label2id == {"0": 0, "1": 1}
    with pytest.raises(ValueError, match=r"eval.csv:2: unknown label '1'; known labels: neg, pos"):
        load_classification(path, tok, max_seq_len=16, label2id={"neg": 0, "pos": 1})
    path.write_text("text,label\na,02\nb,01\n")  # read as 2 and 1, then looked up as "2"
    data = load_classification(path, tok, max_seq_len=16, label2id={"01": 0, "02": 1})
    assert data.labels == [1, 0]


def test_threads_reading_long_csv_cells_leave_csvs_limit_as_it_was(tmp_path):
    # Each thread restored the limit it found, another thread's raised one among them.
    import csv
    import sys
    import threading

    paths = []
    for i in range(4):
        paths.append(tmp_path / f"long{i}.csv")
        rows = [f"{'x' * (140_000 + 1000 * j)},{j % 2}" for j in range(10)]
        paths[-1].write_text("text,label\n" + "\n".join(rows) + "\n")
    before = csv.field_size_limit()
    errors = []

    def read(path):
        try:
            for _ in range(5):
                read_labelled(path)
        except Exception as err:  # noqa: BLE001 (collected for the assertion)
            errors.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes
    try:
        threads = [threading.Thread(target=read, args=(p,)) for p in paths]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors and csv.field_size_limit() == before


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("body,label\nx,1\n", r"d.csv:1: the header has no column 'text' \(columns: body, label\)"),
        ("text,label,text\nx,1,y\n", r"d.csv:1: the header names column 'text' twice"),
        # One label not a whole number made every label a class name (3 classes here).
        ("text,label\nx,0\ny,1\nz,1.0\n", r"d.csv:4: 'label' must be a whole number like the la"),
        (
            'text,label\nx,1\n"y\n',
            r"d.csv:3: not valid CSV \(unexpected end of data\)",
        ),  # open quote
        ("text,label\nx,1\ny\n", r"d.csv:3: 1 cells, the header has 2"),
        ("text,label\n", r"d.csv: no examples"),
        ("", r"d.csv: file is empty"),
        ("text,label\nx,1\ny,-1\n", r"d.csv:3: 'label' must be an integer >= 0 .* got -1"),
        ("text,label\nx,1\ny,\n", r"d.csv:3: the 'label' cell is empty"),
    ],
)
def test_malformed_csv_names_file_and_line(tmp_path, tok, content, message):
    path = tmp_path / "d.csv"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_classification(path, tok, max_seq_len=16)


def test_csv_content_in_a_jsonl_file_says_what_is_expected(tmp_path, tok):
    path = tmp_path / "train.txt"
    path.write_text("text,label\nthe cat,1\n")
    expected = (
        f"{path}:1: not valid JSON (Expecting value); expected JSONL, one object per line such "
        'as {"text": "a fine film", "label": "positive"}, or a .csv file with a header'
    )
    with pytest.raises(ValueError) as caught:
        load_classification(path, tok, max_seq_len=16)
    assert str(caught.value) == expected
