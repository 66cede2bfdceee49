"""Corpora: files, directories, JSONL, the stdlib; malformed inputs name file and line."""

import json

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


def test_jsonl_documents_come_from_the_text_field(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"body": "one"}) + "\n\n" + json.dumps({"body": "two"}) + "\n")
    docs = list(iter_documents([str(path)], text_field="body"))
    assert [d.text for d in docs] == ["one", "two"]
    assert docs[1].source == f"{path}:3"


def test_jsonl_without_the_field_names_file_and_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no"}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: no field 'text' \(fields: body\)"):
        list(iter_documents([str(path)]))


def test_jsonl_with_bad_json_names_file_and_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=rf"{path}:2: not valid JSON"):
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


def test_directory_scan_skips_empty_and_undecodable_files(tmp_path):
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    assert [d.text for d in iter_documents([str(tmp_path)])] == ["fine"]


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(iter_documents([str(tmp_path / "nope")]))
    with pytest.raises(FileNotFoundError, match="matches"):
        list(iter_documents([str(tmp_path)], glob="*.txt"))


def test_stdlib_corpus_is_python_source_without_site_packages():
    files = list_files(STDLIB, "")
    assert len(files) > 500
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert any(f.name == "argparse.py" for f in files)
