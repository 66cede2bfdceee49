"""Whole models: outputs, heads, losses, masks, variants, checkpointing, training, bf16."""

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from script_helpers import BENCHMARKS, load_script

from linformer_kit import (
    LinformerForCausalLM,
    LinformerForMaskedLM,
    LinformerForSequenceClassification,
    LinformerModel,
    linformer_tiny,
    native,
)
from linformer_kit.embeddings import masked_mean
from linformer_kit.input_checks import check_device
from linformer_kit.kernel_rule import pinned_kernel, use_kernel

B, N, VOCAB, DIM, DEPTH = 3, 20, 100, 32, 2
KINDS = ["exact", "linear", "conv", "pool", "random", "adaptive"]


def tiny(**changes):
    base = dict(vocab_size=VOCAB, max_seq_len=64, dim=DIM, depth=DEPTH, num_heads=4, proj_dim=16)
    return linformer_tiny(**{**base, "dropout": 0.0, "attention_dropout": 0.0, **changes})


def kind(name):
    """Config fields of a projection kind, or of exact attention."""
    return dict(proj_dim=None) if name == "exact" else dict(projection=name)


def inputs(seed=0, lengths=(N, N // 2, 5)):
    """Token ids (B, N) and a key_padding_mask for rows of the given real lengths."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB // 2, (len(lengths), N), generator=gen)
    mask = torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]
    return ids, mask


def mlm_labels(ids, seed=0, rate=0.3):
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(ids.shape, generator=gen) < rate
    return torch.where(keep, ids, torch.full_like(ids, -100))


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_output_shapes():
    ids, mask = inputs()
    out = LinformerModel(tiny(pooler=True))(ids, mask)
    assert out.last_hidden_state.shape == (B, N, DIM)
    assert out.pooler_output.shape == (B, DIM)
    assert out.hidden_states is None and out.attentions is None
    assert LinformerModel(tiny())(ids).pooler_output is None
    mlm = LinformerForMaskedLM(tiny())(ids, mask)
    assert mlm.logits.shape == (B, N, VOCAB) and mlm.loss is None
    assert mlm.last_hidden_state.shape == (B, N, DIM)
    clf = LinformerForSequenceClassification(tiny(), num_labels=5)(ids, mask, labels=ids[:, 0] % 5)
    assert clf.logits.shape == (B, 5) and clf.loss.shape == ()


def test_hidden_states_and_attentions():
    ids, mask = inputs()
    model = LinformerModel(tiny()).eval()
    out = model(ids, mask, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == DEPTH + 1
    assert all(h.shape == (B, N, DIM) for h in out.hidden_states)
    torch.testing.assert_close(out.hidden_states[0], model.embeddings(ids))
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state)
    assert len(out.attentions) == DEPTH
    assert all(a.shape == (B, 4, N, 16) for a in out.attentions)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(B, 4, N))


def test_mlm_loss_ignores_minus_100():
    ids, mask = inputs()
    labels = mlm_labels(ids)
    out = LinformerForMaskedLM(tiny())(ids, mask, labels=labels)
    scored = labels != -100
    assert 0 < scored.sum() < scored.numel()
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits[scored], labels[scored]))


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(["exact", "linear"]),
    rate=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_scored_only_head_matches_the_full_head(name, rate, seed):
    """`scored_only` runs the LM head at the labelled positions alone: the same loss (nan
    for no scored position, as the full head's mean over nothing), those positions' logits
    and the same gradients; padded rows included."""
    model = LinformerForMaskedLM(tiny(**kind(name)))
    ids, mask = inputs(seed)
    labels = mlm_labels(ids, seed, rate)
    full = model(ids, mask, labels=labels)
    full.loss.backward()
    expected = grads(model)
    model.zero_grad()
    scored = model(ids, mask, labels=labels, scored_only=True)
    chosen = labels != -100
    assert scored.logits.shape == (int(chosen.sum()), VOCAB)
    torch.testing.assert_close(scored.logits, full.logits[chosen])
    torch.testing.assert_close(scored.loss, full.loss, equal_nan=True)
    if chosen.any():
        scored.loss.backward()
        torch.testing.assert_close(grads(model), expected)
    torch.testing.assert_close(scored.last_hidden_state, full.last_hidden_state)


@pytest.mark.parametrize("rate", [0.0, 0.05, 0.3, 0.5, 1.0])
def test_scored_only_head_rows_are_a_multiple_of_64(rate):
    """The head runs on the S scored rows and unscored ones up to a multiple of 64 rows (all
    B x N at most): the loss and the returned logits are the scored rows' alone."""
    model = LinformerForMaskedLM(tiny()).eval()
    ids = torch.randint(2, VOCAB // 2, (3, 64), generator=torch.Generator().manual_seed(1))
    labels = mlm_labels(ids, 1, rate)
    seen = []
    model.head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    scored = model(ids, labels=labels, scored_only=True)
    count = int((labels != -100).sum())
    assert seen == [min(ids.numel(), -(-count // 64) * 64)]
    full = model(ids, labels=labels)
    torch.testing.assert_close(scored.logits, full.logits[labels != -100])
    torch.testing.assert_close(scored.loss, full.loss, equal_nan=True)


@pytest.mark.parametrize("scored_only", [False, True])
@pytest.mark.parametrize("name", ["exact", "linear"])
def test_masked_lm_loss_without_logits_equals_the_full_logits_loss(name, scored_only):
    """`return_logits=False` (the trainers' call): the decoder and loss in chunks of rows,
    the same loss and gradients (decoder bias included), no logits."""
    model = LinformerForMaskedLM(tiny(**kind(name))).double()
    ids, mask = inputs(2)
    labels = mlm_labels(ids, 2, 0.4)
    full = model(ids, mask, labels=labels, scored_only=scored_only)
    full.loss.backward()
    expected = grads(model)
    model.zero_grad()
    out = model(ids, mask, labels=labels, scored_only=scored_only, return_logits=False)
    assert out.logits is None
    torch.testing.assert_close(out.loss, full.loss)
    out.loss.backward()
    assert "decoder_bias" in expected
    torch.testing.assert_close(grads(model), expected)


def test_the_mlm_head_script_times_both_ways_on_one_batch(tmp_path, monkeypatch):
    script = load_script(BENCHMARKS / "mlm_head.py")
    fields = dict(vocab_size=VOCAB, max_seq_len=N, dim=DIM, depth=1, num_heads=4, proj_dim=8)
    monkeypatch.setattr(script, "MODELS", {"tiny": (fields, 2)})
    script.main(["--repeats", "2", "--threads", "1", "--memory-steps", "0", "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "ab.json").read_text())["rows"]
    assert [len(row["times_ms"][way]) for way in ("full", "scored")] == [2, 2]
    assert row["speedup"] == row["median_ms"]["full"] / row["median_ms"]["scored"]
    assert row["eval_loss"]["scored"] == pytest.approx(row["eval_loss"]["full"], rel=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(scored_only=True), "scored_only=True needs labels"),
        (dict(return_logits=False), "return_logits=False needs labels"),
        (dict(labels=torch.zeros(B, N - 1, dtype=torch.long)), r"shape \(3, 20\), got \(3, 19\)"),
    ],
)
def test_masked_lm_rejects_bad_labels(kwargs, message):
    ids, mask = inputs()
    with pytest.raises(ValueError, match=message):
        LinformerForMaskedLM(tiny())(ids, mask, **kwargs)


def test_decoder_is_tied_to_token_embeddings():
    model = LinformerForMaskedLM(tiny()).eval()
    tokens = model.linformer.embeddings.tokens.weight
    assert not any(p.shape == tokens.shape for p in model.parameters() if p is not tokens)
    ids, mask = inputs()  # ids < VOCAB // 2, so row VOCAB - 1 only feeds the decoder
    out = model(ids, mask)
    delta = torch.randn(DIM)
    with torch.no_grad():
        tokens[-1] += delta
    new = model(ids, mask).logits
    torch.testing.assert_close(new[..., :-1], out.logits[..., :-1])
    expected = out.logits[..., -1] + model.head(out.last_hidden_state) @ delta
    torch.testing.assert_close(new[..., -1], expected, rtol=1e-4, atol=1e-4)
    model(ids, mask, labels=ids).loss.backward()
    assert tokens.grad[-1].abs().sum() > 0  # gradient from the decoder alone


@pytest.mark.parametrize(
    "pooling, causal",
    [("cls", False), ("mean", False), ("last", False), ("last", True), ("mean", True)],
)
def test_classifier_ignores_padding(pooling, causal):
    config = tiny(causal=True, block_size=4) if causal else tiny()
    model = LinformerForSequenceClassification(config, num_labels=3, pooling=pooling)
    model = model.double().eval()
    ids, mask = inputs()
    padded = model(ids, mask).logits
    for row, n in enumerate(mask.sum(1).tolist()):
        alone = model(ids[row : row + 1, :n]).logits[0]
        torch.testing.assert_close(padded[row], alone, rtol=0, atol=1e-10)
    if pooling != "cls":  # without the mask the padding is averaged in, or is the last
        assert not torch.allclose(model(ids).logits[2], padded[2])
    # Left padding: the first real token is pooled (it was the padding's output before).
    left = model(ids.flip(1), mask.flip(1)).logits
    torch.testing.assert_close(left[2], model(ids[2:, :5].flip(1)).logits[0], rtol=0, atol=1e-10)
    # Every real token counts (a causal model's first token has seen itself only)
    changed = ids.clone()
    changed[2, 1:5] = ids[2, 1:5] + 1
    assert not torch.allclose(model(changed, mask).logits[2], padded[2])


def test_a_causal_model_pools_its_last_token_and_warns_of_the_first(tmp_path):
    config = tiny(causal=True, block_size=4)
    assert LinformerForSequenceClassification(config).pooling == "last"
    assert LinformerForSequenceClassification(tiny()).pooling == "cls"
    # warned of, not refused: a classifier an earlier version saved so still loads
    with pytest.warns(UserWarning, match="pooling 'cls' takes the first real token, which a "
                      "causal model lets attend to itself only: use 'last'"):  # fmt: skip
        LinformerForSequenceClassification(config, pooling="cls").save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="pooling 'cls'"):
        assert LinformerForSequenceClassification.from_pretrained(tmp_path).pooling == "cls"
    # BERT's pooler reads the first position: a pad under left padding, and a token that
    # has seen only itself
    with pytest.warns(UserWarning, match=r"pooler=True \(BERT's pooler, on the first "
                      r"position\) with causal=True"):  # fmt: skip
        tiny(causal=True, block_size=4, pooler=True)


def scatter_rows(ids, lengths, where):
    """Rows of `ids`'s first `lengths` tokens put at random places of a width-N row (padding
    before, between and after them, in order), with their mask."""
    gen = torch.Generator().manual_seed(where)
    padded, mask = torch.zeros_like(ids), torch.zeros(ids.shape, dtype=torch.bool)
    for row, n in enumerate(lengths):
        cols = torch.randperm(N, generator=gen)[:n].sort().values
        padded[row, cols], mask[row, cols] = ids[row, :n], True
    return padded, mask


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("sharing", ["headwise", "kv", "layerwise"])
def test_padding_anywhere_changes_no_real_output(name, sharing):
    # Before, left or inner padding moved the real tokens to other positions and other rows
    # of E: outputs 2-4 away from the unpadded ones (right padding was exact).
    model = LinformerModel(tiny(**kind(name), sharing=sharing, pooler=True)).double().eval()
    ids, _ = inputs()
    lengths = (N, 13, 5)
    for where in range(3):
        padded, mask = scatter_rows(ids, lengths, where)
        out = model(padded, mask, output_hidden_states=True, output_attentions=True)
        for row, n in enumerate(lengths):
            alone = model(ids[row : row + 1, :n], output_hidden_states=True, output_attentions=True)
            real = mask[row]
            torch.testing.assert_close(
                out.pooler_output[row], alone.pooler_output[0], rtol=0, atol=1e-10
            )
            for got, want in zip(out.hidden_states, alone.hidden_states, strict=True):
                torch.testing.assert_close(got[row, real], want[0], rtol=0, atol=1e-10)
            for got, want in zip(out.attentions, alone.attentions, strict=True):
                got = got[row][:, real]  # (H, n, M): the real queries' rows
                if name == "exact":
                    got = got[..., real]  # and the real keys' columns
                torch.testing.assert_close(got[..., : want.shape[-1]], want[0], rtol=0, atol=1e-10)


def test_regression_uses_mse():
    ids, mask = inputs()
    labels = torch.tensor([0.5, -1.0, 2.0])
    out = LinformerForSequenceClassification(tiny(), num_labels=1)(ids, mask, labels=labels)
    assert out.logits.shape == (B, 1)
    torch.testing.assert_close(out.loss, F.mse_loss(out.logits[:, 0], labels))


@pytest.mark.parametrize("kwargs", [dict(num_labels=0), dict(num_labels=2.5), dict(pooling="max")])
def test_classifier_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        LinformerForSequenceClassification(tiny(), **kwargs)


def test_too_long_input_names_both_lengths():
    with pytest.raises(ValueError, match=r"65.*64"):
        LinformerModel(tiny())(torch.zeros(1, 65, dtype=torch.long))


def test_token_types():
    ids, mask = inputs()
    with pytest.raises(ValueError, match="type_vocab_size"):
        LinformerModel(tiny())(ids, mask, token_type_ids=torch.zeros_like(ids))
    model = LinformerModel(tiny(type_vocab_size=2)).eval()
    zeros, ones = model(ids, mask, torch.zeros_like(ids)), model(ids, mask, torch.ones_like(ids))
    torch.testing.assert_close(model(ids, mask).last_hidden_state, zeros.last_hidden_state)
    assert not torch.allclose(zeros.last_hidden_state, ones.last_hidden_state)


@pytest.mark.parametrize(
    "changes",
    [
        dict(position="sinusoidal"),
        dict(norm_first=False),
        dict(activation="relu"),
        dict(position="sinusoidal", norm_first=False, activation="relu", proj_dim=None),
    ],
    ids=["sinusoidal", "post-ln", "relu", "all-exact"],
)
def test_variants_run_and_backprop(changes):
    model = LinformerForMaskedLM(tiny(**changes))
    ids, mask = inputs()
    model(ids, mask, labels=mlm_labels(ids)).loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.isfinite().all(), name


@pytest.mark.parametrize("checkpointing", ["layer", "attention"])
@pytest.mark.parametrize("block", ["none", "sdpa pinned", "kernels off"])
def test_activation_checkpointing_matches_plain_training(checkpointing, block):
    # The README's pattern, a pin around the forward and backward after it, failed with
    # checkpointing: the recomputation ran outside the block, on the other kernel.
    ids, mask = inputs()
    labels = mlm_labels(ids)
    contexts = {
        "none": contextlib.nullcontext,
        "sdpa pinned": lambda: use_kernel("sdpa"),
        "kernels off": native.kernels_off,
    }

    def loss_and_grads(level, state=None):
        model = LinformerForMaskedLM(tiny(dropout=0.2, attention_dropout=0.2, checkpointing=level))
        if state is not None:
            model.load_state_dict(state)
        torch.manual_seed(0)
        with contexts[block]():
            loss = model(ids, mask, labels=labels).loss
        loss.backward()
        assert pinned_kernel() is None and not native.switched_off()  # nothing left pinned
        return model.state_dict(), loss, grads(model)

    state, loss, expected = loss_and_grads("none")
    _, ckpt_loss, got = loss_and_grads(checkpointing, state)
    torch.testing.assert_close(ckpt_loss, loss)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name)


def test_eval_is_deterministic_and_train_is_not():
    model = LinformerForMaskedLM(tiny(dropout=0.3, attention_dropout=0.3))
    ids, mask = inputs()
    assert not torch.equal(model(ids, mask).logits, model(ids, mask).logits)
    model.eval()
    torch.testing.assert_close(model(ids, mask).logits, model(ids, mask).logits, rtol=0, atol=0)


def test_tiny_mlm_overfits_a_fixed_batch():
    torch.manual_seed(0)
    model = LinformerForMaskedLM(tiny())
    ids, mask = inputs()
    labels = mlm_labels(ids, rate=0.5)
    masked = torch.where(labels != -100, torch.ones_like(ids), ids)  # token 1 plays [MASK]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(50):
        loss = model(masked, mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def fully_masked_inputs():
    ids, mask = inputs()
    mask[1] = False
    return ids, mask


@pytest.mark.parametrize("name", KINDS)
def test_bf16_autocast_matches_fp32(name):
    model = LinformerForMaskedLM(tiny(**kind(name)))
    ids, mask = inputs()
    labels = mlm_labels(ids)
    reference = model(ids, mask, labels=labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, mask, labels=labels)
    assert out.logits.dtype == torch.bfloat16 and out.loss.isfinite()
    out.loss.backward()
    assert all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
    torch.testing.assert_close(out.logits.float(), reference.logits, rtol=0.02, atol=0.02)
    close = dict(rtol=0.02, atol=0.05)
    torch.testing.assert_close(out.last_hidden_state, reference.last_hidden_state, **close)
    torch.testing.assert_close(out.loss, reference.loss, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", KINDS)
def test_fully_masked_row_gives_no_nan(name, dtype):
    model = LinformerForMaskedLM(tiny(**kind(name)))
    ids, mask = fully_masked_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = model(ids, mask, labels=mlm_labels(ids))
    assert out.logits.isfinite().all() and out.loss.isfinite()
    out.loss.backward()
    for param_name, param in model.named_parameters():
        if param.grad is not None:
            assert param.grad.isfinite().all(), param_name


def test_mean_pooling_never_lets_nan_in_padding_through():
    hidden = torch.randn(2, 5, 4)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    clean = masked_mean(hidden, mask)
    hidden[1, 2:] = float("nan")
    torch.testing.assert_close(masked_mean(hidden, mask), clean)
    torch.testing.assert_close(clean[1], hidden[1, :2].mean(0))


@pytest.mark.parametrize("causal", [False, True])
def test_inputs_that_do_not_fit_are_named_before_they_are_read(causal):
    # Before, a (2, 9) mask for (2, 10) ids dropped the last token (gathered by it), a
    # (1, 10) mask dropped the second row, a float mask failed in `~`, an empty batch in a
    # reshape, and wrong token types in the embedding.
    model = LinformerModel(tiny(causal=causal, block_size=4, type_vocab_size=2)).eval()
    ids = torch.randint(2, VOCAB, (2, 10))
    for mask in (torch.ones(2, 9, dtype=torch.bool), torch.ones(1, 10, dtype=torch.bool),
                 torch.ones(2, 10), torch.ones(2, 1, 10, dtype=torch.bool)):  # fmt: skip
        with pytest.raises(ValueError, match=r"key_padding_mask must be a bool tensor of shape"):
            model(ids, mask)
    for empty, message in [
        (ids[:0], r"input_ids must be \(batch >= 1, seq_len\), got shape \(0, 10\)"),
        (ids[:, :0], "sequence length 0 holds no token; inputs may have any length from 1 to 64"),
    ]:
        with pytest.raises(ValueError, match=message):
            model(empty)
    with pytest.raises(ValueError, match=r"token_type_ids must have input_ids' shape \(2, 10\)"):
        model(ids, token_type_ids=torch.zeros(2, 9, dtype=torch.long))


def test_ids_and_labels_out_of_range_are_named_with_the_range():
    # Before: torch's "index out of range in self" (IndexError) from the embedding, and
    # "Target 103 is out of bounds" from cross_entropy on the logits path.
    config = tiny(type_vocab_size=2)
    ids = torch.randint(2, VOCAB, (2, 10))
    model = LinformerModel(config).eval()
    for value in (VOCAB, -1):
        with pytest.raises(ValueError, match=rf"input_ids must lie in \[0, {VOCAB}\); got {value}"):
            model(ids.index_fill(1, torch.tensor([3]), value))
    with pytest.raises(ValueError, match=r"token_type_ids must lie in \[0, 2\); got 2"):
        model(ids, token_type_ids=torch.full_like(ids, 2))
    labels = ids.index_fill(1, torch.tensor([4]), VOCAB + 3)
    in_range = rf"labels must lie in \[0, {VOCAB}\) or equal ignore_index -100; got {VOCAB + 3}"
    for head in (
        LinformerForMaskedLM(config),
        LinformerForCausalLM(tiny(causal=True, block_size=4)),
    ):
        for return_logits in (True, False):
            with pytest.raises(ValueError, match=in_range):
                head(ids, labels=labels, return_logits=return_logits)
    classifier = LinformerForSequenceClassification(config, num_labels=4).eval()
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\) or equal .* got 4"):
        classifier(ids, labels=torch.tensor([1, 4]))
    # float ids and labels: the embedding's and cross_entropy's dtype errors named neither
    for dtype in (torch.float32, torch.uint8):  # uint8 passed, to the embedding's error
        named = rf"^input_ids must be an int64 \(or int32\) tensor, got dtype {dtype}"
        with pytest.raises(ValueError, match=named):
            model(ids.to(dtype))
    with pytest.raises(
        ValueError, match=r"^labels must be an int64 \(or int32\) tensor, got dtype torch.float32"
    ):
        classifier(ids, labels=torch.tensor([1.0, 2.0]))
    # -100 still scores nothing, as in F.cross_entropy
    one = classifier(ids[:1], labels=torch.tensor([2])).loss
    torch.testing.assert_close(classifier(ids, labels=torch.tensor([2, -100])).loss, one)


def test_a_float64_classifier_scores_its_loss_in_float64():
    ids = torch.randint(2, VOCAB, (3, 10))
    for num_labels in (1, 3):
        labels = torch.randn(3, dtype=torch.float64) if num_labels == 1 else torch.tensor([0, 2, 1])
        model = LinformerForSequenceClassification(tiny(), num_labels=num_labels).double().eval()
        out = model(ids, labels=labels)
        assert out.loss.dtype == torch.float64  # was float32
        logits = out.logits.detach()
        if num_labels == 1:
            want = ((logits.squeeze(-1) - labels) ** 2).mean()
        else:
            want = -torch.log_softmax(logits, -1)[torch.arange(3), labels].mean()
        torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=1e-12)


def test_classifier_labels_shaped_as_the_logits_score_the_same_and_others_are_named():
    # Regression labels (B, 1) broadcast against (B,) to a (B, B) mean: wrong loss, no error.
    ids = torch.randint(2, VOCAB, (3, 10))
    for num_labels, labels in [(1, torch.randn(3)), (4, torch.tensor([0, 3, 1]))]:
        model = LinformerForSequenceClassification(tiny(), num_labels=num_labels).eval()
        flat = model(ids, labels=labels).loss
        assert torch.equal(model(ids, labels=labels[:, None]).loss, flat)
        with pytest.raises(ValueError, match=r"labels must have shape \(batch,\) = \(3,\)"):
            model(ids, labels=labels[:1])
    model = LinformerForSequenceClassification(tiny(), num_labels=1).eval()
    out = model(ids)
    assert model(ids, labels=out.logits.detach()).loss == 0  # was 0.004 with (B, 1) labels


def test_int32_labels_score_as_int64_ones_on_every_head():
    # int32 ids ran, int32 labels failed in cross_entropy ("expected ... Long or Byte")
    ids = torch.randint(2, VOCAB, (2, 10))
    for model in (
        LinformerForMaskedLM(tiny()),
        LinformerForCausalLM(tiny(causal=True, block_size=4)),
    ):
        model.eval()
        want = model(ids, labels=ids).loss
        torch.testing.assert_close(model(ids, labels=ids.int()).loss, want)
    classifier = LinformerForSequenceClassification(tiny(), num_labels=3).eval()
    labels = torch.tensor([0, 2])
    want = classifier(ids, labels=labels).loss
    torch.testing.assert_close(classifier(ids, labels=labels.int()).loss, want)


def test_ids_on_another_device_than_the_model_are_named():
    # meta ids into a CPU model gave nan outputs without a word
    model = LinformerModel(tiny()).eval()
    ids = torch.randint(2, VOCAB, (2, 10), device="meta")
    with pytest.raises(ValueError, match=r"^input_ids are on meta, the model on cpu: move one"):
        model(ids)
    # the other way round a hook brings offloaded weights (accelerate's) to the inputs
    check_device(torch.zeros(1, dtype=torch.long), torch.empty(1, device="meta"))


def test_inputs_that_are_not_tensors_are_named():
    # "'list' object has no attribute 'dim'" named no argument
    ids = torch.randint(2, VOCAB, (2, 10))
    model = LinformerModel(tiny()).eval()
    for args, named in [
        ((ids.tolist(),), "input_ids must be a torch.Tensor of token ids, got list"),
        ((ids.numpy(),), "input_ids must be a torch.Tensor of token ids, got ndarray"),
        ((ids, [[True] * 10] * 2), "key_padding_mask must be a torch.Tensor of bools, got list"),
        (
            (ids, None, [[0] * 10] * 2),
            "token_type_ids must be a torch.Tensor of segment ids, got list",
        ),  # noqa: E501
    ]:
        with pytest.raises(TypeError, match=rf"^{named}$"):
            model(*args)
    # labels: "'list' object has no attribute 'shape'" (or 'flatten'), after the backbone ran
    classifier = LinformerForSequenceClassification(tiny(), num_labels=3).eval()
    with pytest.raises(TypeError, match=r"^labels must be a torch.Tensor of class ids"):
        classifier(ids, labels=[0, 1])
    with pytest.raises(TypeError, match=r"^labels must be a torch.Tensor of token ids"):
        LinformerForMaskedLM(tiny()).eval()(ids, labels=ids.tolist())
    causal = LinformerForCausalLM(tiny(causal=True, block_size=4)).eval()
    with pytest.raises(
        TypeError, match=r"^input_ids must be a torch.Tensor of token ids, got list"
    ):
        causal.generate(ids.tolist(), 3)
