"""Corpora: files, directories, JSONL, the stdlib; malformed inputs name file and line."""

import json
import logging

import pytest

from linformer_kit.data import STDLIB, iter_documents
from linformer_kit.data.corpus import list_files


def test_directory_glob_is_recursive_and_sorted(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "skip.md").write_text("not matched")
    docs = list(iter_documents([str(tmp_path)], glob="**/*.txt"))
    assert [d.text for d in docs] == ["first", "second"]
    assert docs[0].source.endswith("a.txt")


def test_a_linked_folder_the_glob_does_not_enter_is_named(tmp_path, caplog):
    # `**` does not enter links to folders: their files were left out without a word
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "w.txt").write_text("linked")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "local.txt").write_text("local")
    (corpus / "wiki").symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING):
        docs = list(iter_documents([str(corpus)], glob="**/*.txt"))
        list(iter_documents([str(corpus)], glob="**/*.txt"))
    assert [d.text for d in docs] == ["local"]
    assert caplog.text.count("link(s) to folders under") == 1
    assert f"1 link(s) to folders under {corpus} left out: --glob **/*.txt does not " in caplog.text
    assert [d.text for d in iter_documents([str(corpus / "wiki")])] == ["linked"]


def test_jsonl_documents_come_from_the_text_field(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"body": "one"}) + "\n\n" + json.dumps({"body": "two"}) + "\n")
    docs = list(iter_documents([str(path)], text_field="body"))
    assert [d.text for d in docs] == ["one", "two"]
    assert docs[1].source == f"{path}:3"


def test_a_byte_order_mark_is_not_text_in_any_format(tmp_path):
    # Before: kept as "\ufeff" at the start of a .txt document (3 junk tokens), and a JSONL
    # file that begins with one refused as "not valid JSON"; CSV alone stripped it.
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.txt").write_bytes(bom + b"alpha beta\n")
    (tmp_path / "b.jsonl").write_bytes(bom + json.dumps({"text": "gamma"}).encode() + b"\n")
    (tmp_path / "c.csv").write_bytes(bom + b"text\ndelta\n")
    names = ("a.txt", "b.jsonl", "c.csv")
    texts = [d.text for name in names for d in iter_documents([str(tmp_path / name)])]
    assert texts == ["alpha beta\n", "gamma", "delta"]


def test_jsonl_without_the_field_names_file_and_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no"}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: no field 'text' \(fields: body\)"):
        list(iter_documents([str(path)]))


def test_csv_documents_come_from_the_text_column(tmp_path):
    path = tmp_path / "reviews.csv"
    path.write_text('label,body\npos,"one, with a comma"\n\nneg,"two\nlines"\n')
    docs = list(iter_documents([str(path)], text_field="body"))
    assert [d.text for d in docs] == ["one, with a comma", "two\nlines"]
    assert docs[1].source == f"{path}:4"  # the line where the row starts
    with pytest.raises(ValueError, match=rf"{path}:1: the header has no column 'text' "):
        list(iter_documents([str(path)]))


def test_jsonl_with_bad_json_names_file_and_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=rf"{path}:2: not valid JSON .*; expected JSONL, one"):
        list(iter_documents([str(path)]))


def test_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("  \n")
    with pytest.raises(ValueError, match=rf"{path}: file is empty"):
        list(iter_documents([str(path)]))


def test_non_utf8_file_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("line one\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{path}:2: not valid UTF-8 \(byte 0xe9"):
        list(iter_documents([str(path)]))


def test_windows_and_old_mac_line_ends_give_the_unix_text(tmp_path):
    # Byte-level BPE kept a "\r" token on every line of a Windows file (14% more tokens
    # than the same text saved on Linux, none of which an LF-trained model had seen).
    text = "first line\nsecond line\n\nthird\n"
    for name, ends in (("unix.txt", "\n"), ("windows.txt", "\r\n"), ("mac.txt", "\r")):
        (tmp_path / name).write_bytes(text.replace("\n", ends).encode())
    assert {d.text for d in iter_documents([str(tmp_path)])} == {text}
    # and a bad byte is found on its line whatever ends the lines
    (tmp_path / "mac.txt").write_bytes(b"one\rtwo\rcaf\xe9\r")
    with pytest.raises(ValueError, match=r"mac.txt:3: not valid UTF-8 \(byte 0xe9"):
        list(iter_documents([str(tmp_path / "mac.txt")]))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        # UTF-16 without a byte-order mark is valid UTF-8: ASCII with a NUL after each
        # character, read as text (a BPE learnt space + NUL tokens)
        ("one\ntwo".encode("utf-16-le"), r"u.txt:1: a NUL byte at offset 1: not UTF-8 text"),
        (b"text\nab\0c\n", r"u.txt:2: a NUL byte at offset 7"),
        (b"\x1f\x8b\x08\x00", r"u.txt:1: not valid UTF-8 \(byte 0x8b .*\(gzip-compressed"),
    ],
)
def test_a_file_that_is_not_utf8_text_is_named(tmp_path, content, message):
    (tmp_path / "u.txt").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        list(iter_documents([str(tmp_path / "u.txt")]))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        # an emoji cut in half in scraped JSON: a traceback from the tokenizer, naming no file
        ("d.jsonl", '{"text": "ok"}\n{"text": "red cat \\ud83d"}\n', r"d.jsonl:2: a \\u escape of"),
        ("d.jsonl", "[" * 100_000 + "\n", r"d.jsonl:1: not valid JSON \(nested too deep\)"),
        # a quote inside a cell lost its quotes without a word ('"Hello" world': Hello world)
        ("d.csv", 'text,label\n"Hello" world,1\n', r"d.csv:2: not valid CSV \(',' expected"),
        # a header alone was read as no documents; an empty file stopped the run
        ("d.csv", "text,label\n", r"d.csv: no rows below its header"),
    ],
)
def test_malformed_records_are_named_with_their_line(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        list(iter_documents([str(tmp_path / name)]))


def test_a_paired_surrogate_escape_is_its_character_and_a_spaced_header_names_its_column(
    tmp_path,
):
    (tmp_path / "d.jsonl").write_text('{"text": "cat \\ud83d\\ude00"}\n')
    assert [d.text for d in iter_documents([str(tmp_path / "d.jsonl")])] == ["cat \U0001f600"]
    # "text, label" was refused: "no column 'label' (columns: text,  label)"
    (tmp_path / "d.csv").write_text("label, text\n1,a cat\n")
    assert [d.text for d in iter_documents([str(tmp_path / "d.csv")])] == ["a cat"]


def test_links_to_nothing_are_named(tmp_path, caplog):
    (tmp_path / "a.txt").write_text("kept")
    (tmp_path / "b.txt").symlink_to(tmp_path / "gone.txt")
    with caplog.at_level(logging.WARNING):
        assert [d.text for d in iter_documents([str(tmp_path)])] == ["kept"]
        list(iter_documents([str(tmp_path)]))  # said once a process, as folder links are
    assert caplog.text.count("point to nothing") == 1
    assert f"1 link(s) under {tmp_path} point to nothing, left out: {tmp_path / 'b.txt'}" in (
        caplog.text
    )


def bad_directory(tmp_path):
    """Two good files, an empty one and one with a non-UTF-8 byte on line 3."""
    (tmp_path / "a_good.txt").write_text("fine")
    (tmp_path / "b_empty.txt").write_text("")
    (tmp_path / "c_latin1.txt").write_bytes("one\ntwo\ncaf\u00e9\n".encode("latin-1"))
    (tmp_path / "d_good.txt").write_text("also fine")
    return tmp_path


def test_a_bad_file_in_a_directory_stops_like_a_file_named_directly(tmp_path):
    directory = bad_directory(tmp_path)
    with pytest.raises(ValueError, match=rf"^{directory / 'b_empty.txt'}: file is empty$"):
        list(iter_documents([str(directory)]))
    (directory / "b_empty.txt").unlink()
    message = rf"^{directory / 'c_latin1.txt'}:3: not valid UTF-8 \(byte 0xe9 at offset 11\)$"
    with pytest.raises(ValueError, match=message):
        list(iter_documents([str(directory)]))


def test_skip_bad_files_warns_once_per_file_and_records_the_reason(tmp_path, caplog):
    directory = bad_directory(tmp_path)
    skipped = {}
    for _ in range(2):  # a second pass over the corpus reports nothing new
        docs = iter_documents([str(directory)], skip_bad_files=True, skipped=skipped)
        assert [d.text for d in docs] == ["fine", "also fine"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    latin1 = directory / "c_latin1.txt"
    assert warnings == [
        f"skipping bad file {directory / 'b_empty.txt'}: file is empty",
        f"skipping bad file {latin1}:3: not valid UTF-8 (byte 0xe9 at offset 11)",
    ]
    assert sorted(skipped) == [directory / "b_empty.txt", directory / "c_latin1.txt"]


def test_skip_bad_files_leaves_out_a_malformed_jsonl_file_whole(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "kept"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "read before the bad line"}\n{"text": \n')
    skipped = {}
    docs = iter_documents([str(tmp_path)], glob="*.jsonl", skip_bad_files=True, skipped=skipped)
    assert [d.text for d in docs] == ["kept"]
    assert "b.jsonl:2: not valid JSON" in skipped[tmp_path / "b.jsonl"]


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(iter_documents([str(tmp_path / "nope")]))


def test_a_directory_without_matches_names_the_glob_and_how_to_change_it(tmp_path):
    (tmp_path / "a.md").write_text("x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("x")
    (tmp_path / "c.csv").write_text("x")
    message = (
        f"no file in {tmp_path} matches --glob '**/*.txt' (it holds 2 .md, 1 .csv); choose its "
        "files with --glob, e.g. --glob '**/*.md'"
    )
    with pytest.raises(FileNotFoundError) as caught:
        list(iter_documents([str(tmp_path)]))
    assert str(caught.value) == message
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="matches --glob '\\*\\*/\\*.txt' \\(it holds no"):
        list(iter_documents([str(tmp_path / "empty")]))


def test_stdlib_corpus_is_python_source_without_site_packages():
    files = list_files(STDLIB, "")
    assert len(files) > 500
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert any(f.name == "argparse.py" for f in files)
