"""save_pretrained / from_pretrained: config.json + model.safetensors round trips and errors."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from train_helpers import flip_last_byte

import linformer_kit
from linformer_kit import (
    LinformerForMaskedLM,
    LinformerForSequenceClassification,
    LinformerModel,
    files,
    hub,
    linformer_tiny,
)
from linformer_kit.manifest import (
    CONFIG_NAME,
    MANIFEST_NAME,
    WEIGHTS_NAME,
    IntegrityError,
    verify_manifest,
    write_manifest,
)

SHARINGS = ["none", "headwise", "kv", "layerwise"]
KINDS = ["linear", "conv", "pool", "random", "adaptive"]
DEPTH = 2


def tiny(**changes):
    base = dict(vocab_size=100, max_seq_len=64, dim=32, depth=DEPTH, num_heads=4, proj_dim=16)
    return linformer_tiny(**{**base, "dropout": 0.0, "attention_dropout": 0.0, **changes})


def perturbed(model):
    """The model with every parameter moved off its deterministic init (e.g. conv kernels
    start at 1 / block), so a round trip that skips a tensor cannot pass by accident."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.eval()


def batch(seed=0, n=20):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (3, n), generator=gen)
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[1, n // 2 :] = False
    return ids, mask


def state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=0, msg=name)


def shared_weight_names(model):
    return [n for n in model.state_dict() if "proj" in n]


@pytest.fixture
def mlm_dir(tmp_path):
    """A saved masked-LM checkpoint; returns (model, directory)."""
    model = perturbed(LinformerForMaskedLM(tiny()))
    model.save_pretrained(tmp_path / "mlm")
    return model, tmp_path / "mlm"


ROUND_TRIPS = [dict(sharing=s, projection=p) for s in SHARINGS for p in KINDS] + [
    dict(proj_dim=None),
    dict(proj_dim=[16, 8], sharing="none"),
]


@pytest.mark.parametrize("changes", ROUND_TRIPS, ids=lambda c: "-".join(map(str, c.values())))
def test_round_trip_gives_identical_outputs(tmp_path, changes):
    model = perturbed(LinformerForMaskedLM(tiny(**changes)))
    model.save_pretrained(tmp_path)
    loaded = LinformerForMaskedLM.from_pretrained(tmp_path).eval()
    assert loaded.config == model.config
    state_equal(loaded, model)
    ids, mask = batch()
    torch.testing.assert_close(loaded(ids, mask).logits, model(ids, mask).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (LinformerForMaskedLM, {}),
        (LinformerForMaskedLM, dict(keep_head=False)),
        (LinformerModel, {}),
    ],
)
def test_from_pretrained_returns_the_model_in_eval_mode(mlm_dir, cls, kwargs):
    # As `transformers` does: a loaded model generated with dropout on (greedy decoding
    # changed from call to call) unless the caller knew to call eval().
    _, path = mlm_dir
    model = cls.from_pretrained(path, config_overrides=dict(dropout=0.1), **kwargs)
    assert not any(module.training for module in model.modules())


@pytest.mark.parametrize(
    "sharing, stored", [("none", 4), ("headwise", 4), ("kv", 2), ("layerwise", 1)]
)
def test_shared_projections_are_stored_once(tmp_path, sharing, stored):
    model = perturbed(LinformerModel(tiny(sharing=sharing)))
    assert len(shared_weight_names(model)) == 2 * DEPTH  # every alias is in the state dict
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / WEIGHTS_NAME), framework="pt") as f:
        keys = [k for k in f.keys() if "proj" in k]
        assert len(keys) == stored
        ours = model.state_dict()
        for key in keys:
            torch.testing.assert_close(f.get_tensor(key), ours[key], rtol=0, atol=0)


@pytest.mark.parametrize(("saved", "loaded"), [("kv", "layerwise"), ("headwise", "kv")])
def test_loading_under_a_sharing_that_ties_saved_projections_is_refused(tmp_path, saved, loaded):
    # Each saved E went into the one shared Parameter in turn: the last stayed, the others
    # were dropped, without a word.
    model = perturbed(LinformerModel(tiny(sharing=saved)))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"as different tensors, which this model shares"):
        LinformerModel.from_pretrained(tmp_path, config_overrides={"sharing": loaded})


@pytest.mark.parametrize("projection", ["linear", "conv", "random"])
def test_loaded_layerwise_projection_is_still_one_tensor(tmp_path, projection):
    model = perturbed(LinformerModel(tiny(sharing="layerwise", projection=projection)))
    model.save_pretrained(tmp_path)
    loaded = LinformerModel.from_pretrained(tmp_path)
    weights = [
        getattr(layer.attn, side).weight
        for layer in loaded.encoder.layers
        for side in ("proj_k", "proj_v")
    ]
    assert all(w is weights[0] for w in weights)
    torch.testing.assert_close(weights[0], model.encoder.layers[0].attn.proj_k.weight)
    assert isinstance(weights[0], torch.nn.Parameter) == (projection != "random")


def test_directory_holds_only_config_and_safetensors(mlm_dir):
    _, path = mlm_dir
    assert sorted(p.name for p in path.iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME])
    meta = json.loads((path / CONFIG_NAME).read_text())
    assert meta["architecture"] == "LinformerForMaskedLM"
    assert meta["config"]["dim"] == 32


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permission bits")
def test_a_model_on_the_meta_device_is_not_saved(tmp_path):
    # torch's NotImplementedError ("Cannot copy out of meta tensor"), after the folder was made
    with torch.device("meta"):
        model = LinformerModel(tiny())
    with pytest.raises(ValueError, match=r"weights are on the meta device \(embeddings"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_saved_files_get_ordinary_permissions(mlm_dir):
    """Files are readable as the umask allows (mkstemp's private 0o600 must not leak through),
    so a checkpoint directory can be shared like any other output."""
    _, path = mlm_dir
    umask = os.umask(0)
    os.umask(umask)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        assert oct((path / name).stat().st_mode & 0o777) == oct(0o666 & ~umask), name


def test_missing_directory_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        LinformerModel.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        LinformerModel.from_pretrained(tmp_path / "empty")


def test_saving_onto_a_file_is_refused_naming_it(tmp_path):
    (tmp_path / "notes").write_text("mine")  # was "[Errno 20] Not a directory: .../manifest.json"
    with pytest.raises(ValueError, match=rf"^path {tmp_path / 'notes'} is a file; name a dir"):
        LinformerModel(tiny()).save_pretrained(tmp_path / "notes")
    assert (tmp_path / "notes").read_text() == "mine"


def test_missing_weights_raise(mlm_dir):
    _, path = mlm_dir
    (path / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=WEIGHTS_NAME):
        LinformerForMaskedLM.from_pretrained(path)


def test_truncated_weights_raise_value_error_naming_the_file(mlm_dir):
    _, path = mlm_dir
    file = path / WEIGHTS_NAME
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=re.escape(str(file))):
        LinformerForMaskedLM.from_pretrained(path)


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        json.dumps({"architecture": "LinformerModel"}),
        json.dumps({"config": {"dim": -1}}),
    ],
    ids=["syntax", "not-a-dict", "no-config", "invalid-config"],
)
def test_corrupt_config_raises_value_error(mlm_dir, text):
    _, path = mlm_dir
    (path / CONFIG_NAME).write_text(text)
    with pytest.raises(ValueError, match=CONFIG_NAME):
        LinformerForMaskedLM.from_pretrained(path)


def test_a_config_of_a_newer_format_says_to_upgrade(mlm_dir):
    # format_version was written and never read: a newer file loaded silently, or was
    # called corrupt
    _, path = mlm_dir
    meta = json.loads((path / CONFIG_NAME).read_text())
    assert meta["linformer_kit_version"] == linformer_kit.__version__
    meta.update(format_version=2, linformer_kit_version="9.0.0")
    (path / CONFIG_NAME).write_text(json.dumps(meta))
    message = (
        rf"{CONFIG_NAME} was written by a newer linformer-kit \(9.0.0, format_version 2\); "
        rf"this one \({linformer_kit.__version__}\) reads format_version 1: upgrade"
    )
    with pytest.raises(ValueError, match=message):
        LinformerForMaskedLM.from_pretrained(path)


@pytest.mark.parametrize(
    "changes, problem",
    [
        (
            {"dim": 48},
            r"wrong shapes \[.*embeddings\.tokens\.weight: file \(100, 32\) vs model \(100, 48\)",
        ),
        ({"depth": 3}, r"missing \[.*layers\.2\."),
        ({"depth": 1}, r"unexpected \[.*layers\.1\."),
        ({"type_vocab_size": 2}, r"missing \[.*token_types"),
    ],
)
def test_weights_of_another_config_raise_listing_the_problem(mlm_dir, changes, problem):
    _, path = mlm_dir
    meta = json.loads((path / CONFIG_NAME).read_text())
    meta["config"].update(changes)
    (path / CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=problem):
        LinformerForMaskedLM.from_pretrained(path)


def test_classifier_from_masked_lm_gets_backbone_and_fresh_head(mlm_dir):
    mlm, path = mlm_dir
    torch.manual_seed(7)
    fresh = LinformerForSequenceClassification(mlm.config, num_labels=3, pooling="mean")
    torch.manual_seed(7)
    clf = LinformerForSequenceClassification.from_pretrained(path, num_labels=3, pooling="mean")
    assert (clf.num_labels, clf.pooling) == (3, "mean")
    state_equal(clf.linformer, mlm.linformer)
    state_equal(clf.head, fresh.head)
    assert not torch.equal(
        clf.linformer.embeddings.tokens.weight, fresh.linformer.embeddings.tokens.weight
    )
    ids, mask = batch()
    assert clf.eval()(ids, mask).logits.shape == (3, 3)


def test_a_classifier_reloaded_with_other_classes_names_keep_head(tmp_path):
    # Before, only the shapes were named: not the way to a new head of 5 classes.
    LinformerForSequenceClassification(tiny(), num_labels=3).save_pretrained(tmp_path)
    message = r"\{'num_labels': 5\} differ from the saved .*: pass keep_head=False"
    with pytest.raises(ValueError, match=message):
        LinformerForSequenceClassification.from_pretrained(tmp_path, num_labels=5)
    model = LinformerForSequenceClassification.from_pretrained(
        tmp_path, num_labels=5, keep_head=False
    )
    assert model.num_labels == 5


@pytest.mark.parametrize(
    "source", [LinformerForSequenceClassification, LinformerForMaskedLM, LinformerModel]
)
def test_backbone_from_any_checkpoint(tmp_path, source):
    model = perturbed(source(tiny()))
    model.save_pretrained(tmp_path)
    backbone = LinformerModel.from_pretrained(tmp_path).eval()
    state_equal(backbone, model.backbone)
    ids, mask = batch()
    torch.testing.assert_close(
        backbone(ids, mask).last_hidden_state, model(ids, mask).last_hidden_state, rtol=0, atol=0
    )


def test_masked_lm_from_backbone_checkpoint(tmp_path):
    backbone = perturbed(LinformerModel(tiny()))
    backbone.save_pretrained(tmp_path)
    mlm = LinformerForMaskedLM.from_pretrained(tmp_path)
    state_equal(mlm.linformer, backbone)


def test_config_overrides(mlm_dir):
    mlm, path = mlm_dir
    loaded = LinformerForMaskedLM.from_pretrained(
        path, config_overrides={"dropout": 0.3, "checkpointing": "layer"}
    )
    assert loaded.config == mlm.config.replace(dropout=0.3, checkpointing="layer")
    assert loaded.linformer.embeddings.dropout.p == 0.3
    state_equal(loaded, mlm)
    with pytest.raises(ValueError, match="dropout"):
        LinformerForMaskedLM.from_pretrained(path, config_overrides={"dropout": 2.0})


def test_classifier_kwargs_are_restored(tmp_path):
    clf = perturbed(LinformerForSequenceClassification(tiny(), num_labels=5, pooling="mean"))
    clf.save_pretrained(tmp_path)
    loaded = LinformerForSequenceClassification.from_pretrained(tmp_path).eval()
    assert (loaded.num_labels, loaded.pooling) == (5, "mean")
    ids, mask = batch()
    torch.testing.assert_close(loaded(ids, mask).logits, clf(ids, mask).logits, rtol=0, atol=0)


def altered_message(path, name=WEIGHTS_NAME):
    return (
        f"{path} failed its integrity check: {name} was altered (same size, but its SHA-256 "
        f"differs); refusing to load it. If the files were changed on purpose, load with "
        f"verify=False (from_pretrained), or set LINFORMER_NO_VERIFY=1 in the environment "
        f"(the linformer command)."
    )


@pytest.fixture
def manifested(mlm_dir):
    """A saved masked-LM directory with a manifest.json, as training checkpoints carry."""
    model, path = mlm_dir
    write_manifest(path, step=3)
    return model, path


def test_manifest_lists_every_file_with_size_and_sha256(manifested):
    _, path = manifested
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["step"] == 3
    assert set(manifest["files"]) == {CONFIG_NAME, WEIGHTS_NAME}
    weights = manifest["files"][WEIGHTS_NAME]
    assert weights["bytes"] == (path / WEIGHTS_NAME).stat().st_size
    assert weights["sha256"] == hashlib.sha256((path / WEIGHTS_NAME).read_bytes()).hexdigest()
    assert verify_manifest(path) is True


def test_altered_weights_are_refused_naming_file_and_opt_out(manifested):
    _, path = manifested
    flip_last_byte(path / WEIGHTS_NAME)
    with pytest.raises(IntegrityError) as err:
        LinformerForMaskedLM.from_pretrained(path)
    assert str(err.value) == altered_message(path)
    assert isinstance(err.value, ValueError)  # the CLI turns it into a one-line error


@pytest.mark.parametrize("opt_out", ["keyword", "environment"])
def test_opt_out_loads_altered_weights(manifested, monkeypatch, opt_out, caplog):
    model, path = manifested
    flip_last_byte(path / WEIGHTS_NAME)
    if opt_out == "environment":
        monkeypatch.setenv("LINFORMER_NO_VERIFY", "1")
    loaded = LinformerForMaskedLM.from_pretrained(path, verify=opt_out != "keyword")
    assert loaded.config == model.config
    assert "not checked against its manifest.json" in caplog.text


def test_no_verify_zero_still_verifies(manifested, monkeypatch):
    _, path = manifested
    flip_last_byte(path / WEIGHTS_NAME)
    monkeypatch.setenv("LINFORMER_NO_VERIFY", "0")
    with pytest.raises(IntegrityError):
        LinformerForMaskedLM.from_pretrained(path)


def test_resized_and_missing_files_are_each_named(manifested):
    _, path = manifested
    (path / CONFIG_NAME).write_text((path / CONFIG_NAME).read_text() + " ")
    (path / WEIGHTS_NAME).unlink()
    with pytest.raises(IntegrityError) as err:
        verify_manifest(path)
    size = (path / CONFIG_NAME).stat().st_size
    assert err.value.problems == [
        f"{CONFIG_NAME} has {size} bytes, expected {size - 1} (truncated or replaced)",
        f"{WEIGHTS_NAME} is missing",
    ]


def test_a_manifest_never_reaches_outside_its_folder_nor_leaves_out_the_model(manifested):
    _, path = manifested
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    (path.parent / "secret.txt").write_text("not the checkpoint's")
    # paths outside the folder were read (their sizes named in the error)
    for name in ("../secret.txt", "/etc/hostname", "sub/../../secret.txt"):
        files = {**manifest["files"], name: {"bytes": 0, "sha256": ""}}
        (path / MANIFEST_NAME).write_text(json.dumps({**manifest, "files": files}))
        with pytest.raises(IntegrityError) as err:
            verify_manifest(path)
        assert err.value.problems == [f"{name!r} is not a file name of this folder"]
    # malformed entries were tracebacks (AttributeError, KeyError, TypeError)
    for files in ([CONFIG_NAME], {**manifest["files"], CONFIG_NAME: "x"}, {CONFIG_NAME: {}}):
        (path / MANIFEST_NAME).write_text(json.dumps({**manifest, "files": files}))
        with pytest.raises(IntegrityError):
            verify_manifest(path)
    # a manifest listing nothing let altered weights load
    (path / MANIFEST_NAME).write_text(json.dumps({**manifest, "files": {}}))
    flip_last_byte(path / WEIGHTS_NAME)
    with pytest.raises(IntegrityError) as err:
        LinformerForMaskedLM.from_pretrained(path)
    assert err.value.problems == [
        f"{CONFIG_NAME} is not in {MANIFEST_NAME}",
        f"{WEIGHTS_NAME} is not in {MANIFEST_NAME}",
    ]


def test_integer_weights_and_foreign_architectures_are_refused(mlm_dir):
    model, path = mlm_dir
    tensors = {name: t.clone() for name, t in model.state_dict().items()}
    name = "linformer.embeddings.tokens.weight"
    # integers were cast to weights without a word
    tensors[name] = (tensors[name] * 1000).long()
    save_file(tensors, path / WEIGHTS_NAME)
    with pytest.raises(ValueError, match=rf"{name}: file torch.int64 vs model torch.float32"):
        LinformerForMaskedLM.from_pretrained(path)
    meta = json.loads((path / CONFIG_NAME).read_text())
    # an unknown architecture was loaded as another model's backbone ("missing" every
    # tensor), model_kwargs not a mapping and a seq2seq config of strings were tracebacks
    (path / CONFIG_NAME).write_text(json.dumps({**meta, "architecture": "Evil"}))
    with pytest.raises(ValueError, match=r"architecture 'Evil' is none of this library's \("):
        LinformerForMaskedLM.from_pretrained(path)
    for changed in (
        {"model_kwargs": [1, 2]},
        {"config": {"encoder": "x", "decoder": "y"}},
    ):
        (path / CONFIG_NAME).write_text(json.dumps({**meta, **changed}))
        with pytest.raises(ValueError, match=f"{CONFIG_NAME} is corrupt or not a config"):
            LinformerForMaskedLM.from_pretrained(path)
    (path / CONFIG_NAME).write_text("[" * 100_000)
    with pytest.raises(ValueError, match=f"{CONFIG_NAME} is corrupt"):
        LinformerForMaskedLM.from_pretrained(path)


def test_directory_without_manifest_loads_and_only_a_required_one_fails(mlm_dir):
    model, path = mlm_dir
    assert verify_manifest(path) is False
    state_equal(LinformerForMaskedLM.from_pretrained(path), model)
    with pytest.raises(IntegrityError, match="no manifest.json: the checkpoint is incomplete"):
        verify_manifest(path, required=True)


def test_a_save_interrupted_between_its_two_files_loads_whole_under_the_weights_config(
    tmp_path, monkeypatch, caplog
):
    # The new weights beside the old config.json (a kill between the two renames) loaded
    # silently when the shapes agreed (a relu model's weights run as gelu); then they were
    # refused: the previous model was lost. The weights carry their config: the new model
    # loads whole.
    LinformerForMaskedLM(tiny(activation="gelu")).save_pretrained(tmp_path)
    written = files.atomic_write

    def killed_before_the_config(path, write):
        if path.name == CONFIG_NAME:
            raise KeyboardInterrupt  # the process ends here
        written(path, write)

    monkeypatch.setattr(hub, "atomic_write", killed_before_the_config)
    new = perturbed(LinformerForMaskedLM(tiny(activation="relu")))
    with pytest.raises(KeyboardInterrupt):
        new.save_pretrained(tmp_path)
    monkeypatch.undo()
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["config"]["activation"] == "gelu"
    loaded = LinformerForMaskedLM.from_pretrained(tmp_path)
    assert loaded.config.activation == "relu"
    state_equal(loaded, new)
    assert "(a save interrupted between the two files): using the config saved in the weights" in (
        caplog.text
    )
    # a config.json edited by hand (another dropout) keeps its save's id and loads; files
    # saved before the id existed load as before; weights with an id but no config (saved
    # before the config went into them) beside another save's config.json are refused
    other = tmp_path / "other"
    LinformerForMaskedLM(tiny(activation="relu")).save_pretrained(other)
    meta = json.loads((other / CONFIG_NAME).read_text())
    (other / CONFIG_NAME).write_text(
        json.dumps({**meta, "config": {**meta["config"], "dropout": 0.3}})
    )
    assert LinformerForMaskedLM.from_pretrained(other).config.dropout == 0.3
    tensors = hub.read_weights(other)
    save_file(tensors, other / WEIGHTS_NAME, {"format": "pt", hub.SAVE_ID: "an older save"})
    with pytest.raises(ValueError, match="were written by different saves .*: save the model"):
        LinformerForMaskedLM.from_pretrained(other)
    del meta[hub.SAVE_ID]
    (other / CONFIG_NAME).write_text(json.dumps(meta))
    save_file(tensors, other / WEIGHTS_NAME, {"format": "pt"})  # no ids
    assert LinformerForMaskedLM.from_pretrained(other).config.activation == "relu"


def test_a_save_killed_mid_write_leaves_a_folder_the_next_save_removes(tmp_path):
    # A killed save left its temporary weights (in full) beside the model, for good.
    model = LinformerForMaskedLM(tiny())
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead = tmp_path / f".{WEIGHTS_NAME}.{files._writer(int(gone.stdout))}.x1y2abcd.tmp"
    alive = tmp_path / f".{WEIGHTS_NAME}.{files._writer(os.getppid())}.x3y4abcd.tmp"  # running
    # another machine's save (a shared file system), whose process ids are not ours
    elsewhere = tmp_path / f".{WEIGHTS_NAME}.0badc0de-{gone.stdout.strip()}.x5y6abcd.tmp"
    # a killed save of a version that did not name the host (this one's)
    earlier = tmp_path / f".{WEIGHTS_NAME}.{gone.stdout.strip()}.x7y8abcd.tmp"
    # not atomic_write's of this file: a user's dot-folder, a live save of a sibling file
    # named model.safetensors.<digits>
    others = [
        tmp_path / f".{WEIGHTS_NAME}.{gone.stdout.strip()}.tmp",
        tmp_path / f".{WEIGHTS_NAME}.4194000.{files._writer(int(gone.stdout))}.ab12cd34.tmp",
    ]
    for folder in (dead, alive, elsewhere, earlier, *others):
        folder.mkdir()
        (folder / ".tmpA1b2C3").write_bytes(b"half of the weights")
    model.save_pretrained(tmp_path)
    assert not dead.exists() and alive.exists() and elsewhere.exists()
    assert not earlier.exists() and all(folder.exists() for folder in others)
    state_equal(LinformerForMaskedLM.from_pretrained(tmp_path), model)


def test_from_pretrained_keeps_a_float64_model_float64_when_asked(tmp_path):
    # It built every model in float32 and cast the file into it: 1/3 came back 0.33333334.
    model = perturbed(LinformerForSequenceClassification(tiny(), num_labels=3)).double()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 100, (2, 10))
    for dtype in ("auto", torch.float64):
        again = LinformerForSequenceClassification.from_pretrained(tmp_path, dtype=dtype).eval()
        assert all(
            t.dtype == torch.float64 for t in again.state_dict().values() if t.is_floating_point()
        )
        assert torch.equal(again(ids).logits, model(ids).logits)
    plain = LinformerForSequenceClassification.from_pretrained(tmp_path)  # as transformers
    assert next(plain.parameters()).dtype == torch.float32
    bf16 = LinformerModel.from_pretrained(tmp_path, dtype=torch.bfloat16)  # a new head too
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    for bad in ("float64", torch.int64):
        with pytest.raises(ValueError, match='dtype must be a floating torch dtype or "auto"'):
            LinformerModel.from_pretrained(tmp_path, dtype=bad)


def test_an_interrupted_figure_save_leaves_the_earlier_figure(tmp_path):
    # bench's and lra's plots were written in place: a Ctrl-C inside the PNG writer left a
    # 124-byte file that no viewer opens, in place of the last run's figure.
    path = tmp_path / "plot.png"
    path.write_bytes(b"the earlier figure")

    class Interrupted:
        def savefig(self, file, format, dpi):
            Path(file).write_bytes(b"\x89PNG half")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        files.save_figure(Interrupted(), path)
    assert path.read_bytes() == b"the earlier figure"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_weights_that_are_not_numbers_load_with_a_warning_naming_them(tmp_path):
    model = LinformerModel(tiny())
    with torch.no_grad():
        model.embeddings.tokens.weight[3, 1] = float("nan")
    model.save_pretrained(tmp_path)  # a diverged run's: it loaded without a word
    with pytest.warns(UserWarning, match=r"1 weights hold nan or inf \(embeddings.tokens.weight\)"):
        again = LinformerModel.from_pretrained(tmp_path)
    assert again.embeddings.tokens.weight[3, 1].isnan()  # loaded, to be looked into


def test_a_config_no_machine_here_could_hold_is_named_with_its_file(mlm_dir):
    _, path = mlm_dir
    meta = json.loads((path / CONFIG_NAME).read_text())
    meta["config"]["vocab_size"] = 10**13  # failed in the allocator, naming no file
    (path / CONFIG_NAME).write_text(json.dumps(meta))
    named = rf"^{path / CONFIG_NAME}: a model of vocab_size 10000000000000, .* GiB: more than"
    with pytest.raises(ValueError, match=named):
        LinformerForMaskedLM.from_pretrained(path, verify=False)


def test_a_callers_own_bad_argument_is_not_blamed_on_the_config(mlm_dir):
    _, path = mlm_dir  # it was prefixed with config.json's path, as if the file were wrong
    with pytest.raises(ValueError, match=r"^pooling must be one of cls, mean, last; got 'bogus'"):
        LinformerForSequenceClassification.from_pretrained(path, keep_head=False, pooling="bogus")


def test_a_float8_model_loads_its_weights_checked_in_float32(tmp_path):
    model = LinformerModel(tiny()).to(torch.float8_e4m3fn)  # isfinite has no float8 kernel
    model.save_pretrained(tmp_path)
    again = LinformerModel.from_pretrained(tmp_path, dtype="auto")
    assert next(again.parameters()).dtype == torch.float8_e4m3fn


def test_saving_to_or_loading_from_an_empty_path_is_refused():
    with pytest.raises(ValueError, match=r"^path is empty \(''\); name a directory"):
        LinformerModel(tiny()).save_pretrained("")  # it wrote into the working directory
    with pytest.raises(ValueError, match=r"^path is empty \(''\); name a checkpoint folder"):
        LinformerModel.from_pretrained("")  # it read the working directory
