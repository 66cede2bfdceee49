"""Position extension (`convert --max-seq-len` beyond the checkpoint's table): the learned
table copied block after block, the first positions unchanged, the exact extended model equal
to the original on inputs that fit the original, and long inputs running."""

import pytest
import torch
from hf_helpers import N, write_tiny_bert

from linformer_kit import LinformerModel
from linformer_kit.cli import main
from linformer_kit.interop import convert_hf_model
from linformer_kit.interop.bert import extend_positions

LONG = 2 * N + 40  # two whole copies of the table and part of a third


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_bert(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="module")
def original(tiny):
    return convert_hf_model(tiny, proj_dim=None)


def test_extension_copies_the_table_block_after_block():
    table = torch.randn(5, 3, dtype=torch.float64)
    extended = extend_positions(table, 12)
    assert extended.shape == (12, 3)
    for i in range(12):  # hand-written rule: row i is row i mod 5
        assert torch.equal(extended[i], table[i % 5])
    assert torch.equal(extend_positions(table, 4), table[:4])


def test_first_positions_are_unchanged_and_later_ones_are_copies(tiny, original):
    extended = convert_hf_model(tiny, proj_dim=None, max_seq_len=LONG)
    assert extended.config.max_seq_len == LONG
    learned = original.embeddings.positions.weight
    table = extended.embeddings.positions.weight
    assert torch.equal(table[:N], learned)
    assert torch.equal(table[N : 2 * N], learned) and torch.equal(table[2 * N :], learned[:40])
    others = {k: v for k, v in extended.state_dict().items() if "positions" not in k}
    assert all(torch.equal(v, original.state_dict()[k]) for k, v in others.items())


@pytest.mark.parametrize("seq_len", [N, 23])
def test_exact_extended_model_equals_the_original_on_inputs_it_could_take(tiny, original, seq_len):
    extended = convert_hf_model(tiny, proj_dim=None, max_seq_len=LONG)
    ids = torch.randint(1000, 30000, (3, seq_len))
    mask = torch.ones(3, seq_len, dtype=torch.bool)
    mask[1, seq_len // 2 :] = False  # a padded row too
    with torch.no_grad():
        expected = original(ids, mask).last_hidden_state
        got = extended(ids, mask).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("proj_dim", [None, 8, N + 16])  # N + 16: k past the learned table
def test_a_long_input_runs_and_depends_on_its_late_tokens(tiny, proj_dim):
    model = convert_hf_model(
        tiny, proj_dim=proj_dim, max_seq_len=LONG, init="mean" if proj_dim else None
    )
    ids = torch.randint(1000, 30000, (2, LONG))
    changed = ids.clone()
    changed[:, -5:] = 2000  # tokens past the original table
    with torch.no_grad():
        out = model(ids).last_hidden_state
        other = model(changed).last_hidden_state
    assert out.shape == (2, LONG, 32) and torch.isfinite(out).all()
    assert not torch.allclose(out[:, 0], other[:, 0])  # position 0 sees the late tokens
    with pytest.raises(ValueError, match=f"{LONG + 1}.*{LONG}|{LONG}.*{LONG + 1}"):
        model(torch.randint(1000, 30000, (1, LONG + 1)))


def test_k_is_checked_against_the_extended_length_not_the_learned_table(tiny):
    with pytest.raises(ValueError, match=f"proj_dim must be .*max_seq_len={LONG}.*got {LONG + 1}"):
        convert_hf_model(tiny, proj_dim=LONG + 1, max_seq_len=LONG, init="mean")
    with pytest.raises(ValueError, match=f"max_seq_len={N}\\], got {N + 1}"):
        convert_hf_model(tiny, proj_dim=N + 1, init="mean")  # no extension: the table's N


def test_cli_convert_extends_and_builds_projections_for_the_new_length(tiny, tmp_path, capsys):
    out = tmp_path / "long"
    flags = ["--proj-dim", "8", "--init", "attention", "--calibration-texts", "1"]
    main(["convert", "--from", str(tiny), "--max-seq-len", str(LONG), *flags, "--out", str(out)])
    assert f"max_seq_len {LONG}" in capsys.readouterr().out
    model = LinformerModel.from_pretrained(out)
    assert model.config.max_seq_len == LONG and model.config.proj_dim == 8
    projections = [t for k, t in model.state_dict().items() if ".proj_" in k]
    assert projections and all(t.shape[-2:] == (LONG, 8) for t in projections)
