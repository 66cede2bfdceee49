"""Class names in LinformerConfig (`id2label` / `label2id`, as in Hugging Face configs)."""

import json

import pytest

from linformer_kit import LinformerConfig, LinformerForSequenceClassification
from linformer_kit.config import linformer_tiny


def test_label2id_alone_derives_id2label_and_survives_config_json(tmp_path):
    cfg = linformer_tiny(label2id={"neg": 0, "pos": 1})
    assert cfg.id2label == {0: "neg", 1: "pos"}
    model = LinformerForSequenceClassification(cfg, num_labels=2)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["config"]
    assert saved["id2label"] == {"0": "neg", "1": "pos"}
    assert saved["label2id"] == {"neg": 0, "pos": 1}
    loaded = LinformerForSequenceClassification.from_pretrained(tmp_path)
    assert loaded.config == cfg and loaded.config.id2label == {0: "neg", 1: "pos"}


def test_a_config_without_names_has_none():
    cfg = linformer_tiny()
    assert cfg.id2label is None and cfg.label2id is None
    assert LinformerConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.replace(label2id={"a": 0}).replace(label2id=None, id2label=None) == cfg


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"id2label": {0: "a", 2: "b"}}, "must map the ids 0..n-1 to distinct names"),
        ({"id2label": {0: "a", 1: "a"}}, "must map the ids 0..n-1 to distinct names"),
        ({"id2label": {"x": "a"}}, "id2label keys must be integer ids"),
        ({"id2label": {0: "a"}, "label2id": {"b": 0}}, "is not the inverse of id2label"),
        ({"label2id": {}}, "must be non-empty dicts"),
    ],
)
def test_inconsistent_label_names_are_rejected(fields, message):
    with pytest.raises(ValueError, match=message):
        linformer_tiny(**fields)
