"""Encoder-decoder Linformer: cross-attention against written-out references, padding
invariance on both sides, no future leak in the decoder, incremental generation, independent
lengths, save/load, and a synthetic task learnt in seconds."""

import math

import pytest
import torch

from linformer_kit import (
    LinformerConfig,
    LinformerCrossAttention,
    LinformerForMaskedLM,
    LinformerForSeq2SeqLM,
    LinformerModel,
    Seq2SeqConfig,
    cross_attention,
)
from linformer_kit.data.seq2seq import synthetic_pairs
from linformer_kit.projection import MatrixProjection
from linformer_kit.training.seq2seq import Seq2SeqBatches

BLOCK = 4
KINDS = [("linear", 6), ("random", 6), ("conv", 8), ("pool", 8), ("adaptive", 6), ("exact", None)]


def config(enc_proj=("linear", 8), dec_proj=6, sharing="none", **changes):
    projection, proj_dim = enc_proj
    common = dict(dim=16, num_heads=2, depth=2, dropout=0.0, attention_dropout=0.0)
    encoder = LinformerConfig(
        **common,
        vocab_size=changes.pop("src_vocab", 40),
        max_seq_len=32,
        proj_dim=proj_dim,
        projection="linear" if proj_dim is None else projection,
        sharing=sharing,
    )
    decoder = LinformerConfig(
        **common,
        vocab_size=changes.pop("tgt_vocab", 40),
        max_seq_len=24,
        proj_dim=dec_proj,
        sharing=sharing,
        causal=True,
        block_size=BLOCK,
    )
    return Seq2SeqConfig(encoder=encoder, decoder=decoder, **changes)


def model_for(seed=0, **kwargs):
    torch.manual_seed(seed)
    return LinformerForSeq2SeqLM(config(**kwargs)).double().eval()


def loop_cross_attention(q, k, v, proj_k, proj_v, mask):
    """Float64 reference, one query at a time: softmax(q (E K)^T / sqrt(d)) F V with padded
    memory rows zeroed and E = proj[:n]^T; without a projection, the real keys only."""
    batch, heads, m, d = q.shape
    n = k.shape[2]
    out = torch.zeros_like(q)
    for b in range(batch):
        real = [j for j in range(n) if mask is None or mask[b, j]]
        for h in range(heads):
            if proj_k is None:
                keys, values = k[b, h, real], v[b, h, real]
            else:
                e = (proj_k[h] if proj_k.dim() == 3 else proj_k)[:n]
                f = (proj_v[h] if proj_v.dim() == 3 else proj_v)[:n]
                keys = sum(e[j, :, None] * k[b, h, j] for j in real)  # (K, D)
                values = sum(f[j, :, None] * v[b, h, j] for j in real)
            for i in range(m):
                scores = torch.stack([key @ q[b, h, i] for key in keys]) / math.sqrt(d)
                out[b, h, i] = scores.softmax(0) @ values
    return out


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("projected", [True, False])
def test_cross_attention_matches_a_query_by_query_reference(per_head, masked, projected):
    torch.manual_seed(0)
    q = torch.randn(2, 2, 5, 4, dtype=torch.float64)  # m = 5 queries
    k, v = (torch.randn(2, 2, 11, 4, dtype=torch.float64) for _ in range(2))  # n = 11
    shape = (2, 16, 3) if per_head else (16, 3)
    proj_k, proj_v = (torch.randn(shape, dtype=torch.float64) for _ in range(2))
    mask = torch.tensor([[True] * 11, [True] * 6 + [False] * 5]) if masked else None
    if not projected:
        proj_k = proj_v = None
    got = cross_attention(q, k, v, proj_k, proj_v, key_padding_mask=mask)
    want = loop_cross_attention(q, k, v, proj_k, proj_v, mask)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_a_memory_of_another_batch_is_named():
    # A raw broadcast error before, from inside the attention.
    attention = LinformerCrossAttention(dim=8, num_heads=2, max_seq_len=9)
    with pytest.raises(ValueError, match="the memory holds 2 sequences and x 3"):
        attention(torch.randn(3, 4, 8), torch.randn(2, 9, 8))


def test_identity_projection_at_full_length_is_exact_cross_attention():
    torch.manual_seed(0)
    q = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 4, dtype=torch.float64) for _ in range(2))
    eye = torch.eye(9, dtype=torch.float64)
    torch.testing.assert_close(cross_attention(q, k, v, eye, eye), cross_attention(q, k, v))
    exact = LinformerCrossAttention(dim=8, num_heads=2, max_seq_len=9).double()
    identity = MatrixProjection(max_seq_len=9, proj_dim=9).double()
    identity.weight.data = eye
    linformer = LinformerCrossAttention(dim=8, num_heads=2, max_seq_len=9, proj_k=identity)
    linformer.double().load_state_dict(exact.state_dict(), strict=False)
    x, memory = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 9, 8, dtype=torch.float64)
    torch.testing.assert_close(linformer(x, memory), exact(x, memory), atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k[0])
@pytest.mark.parametrize("sharing", ["none", "layerwise"])
def test_source_padding_never_changes_the_decoder(kind, sharing):
    model = model_for(enc_proj=kind, sharing=sharing)
    src, tgt = torch.randint(3, 40, (2, 13)), torch.randint(3, 40, (2, 7))
    alone = model(src, tgt).logits
    padded = torch.cat([src, torch.zeros(2, 9, dtype=torch.long)], 1)
    mask = torch.arange(22) < 13
    out = model(padded, tgt, mask.expand(2, 22)).logits
    torch.testing.assert_close(out, alone, atol=1e-12, rtol=0)
    ragged = mask.expand(2, 22).clone()
    ragged[1, 8:] = False  # row 1 is 8 tokens long: same as running it alone
    out = model(padded, tgt, ragged).logits[1]
    torch.testing.assert_close(out, model(src[1:, :8], tgt[1:]).logits[0], atol=1e-12, rtol=0)
    # Padding before and inside the source too (before, its real tokens met other rows of
    # E in the encoder and the cross-attention), in the forward pass and in generation.
    left = torch.cat([torch.zeros(2, 9, dtype=torch.long), src], 1)
    inner = left.clone()
    inner[1] = torch.cat([src[1, :4], torch.zeros(9, dtype=torch.long), src[1, 4:]])
    for padded in (left, inner):
        mask = padded != 0
        assert mask.sum(1).tolist() == [13, 13]
        out = model(padded, tgt, mask).logits
        torch.testing.assert_close(out, alone, atol=1e-12, rtol=0)
        greedy = model.eval().generate(padded, 6, mask, temperature=0, stop_at_eos=False)
        torch.testing.assert_close(greedy, model.generate(src, 6, temperature=0, stop_at_eos=False))


def test_target_padding_left_or_right_never_changes_real_outputs():
    model = model_for()
    src, tgt = torch.randint(3, 40, (1, 10)), torch.randint(3, 40, (1, 9))
    alone = model(src, tgt, labels=tgt)
    pad = torch.zeros(1, 5, dtype=torch.long)
    for padded, mask, real in [
        (torch.cat([pad, tgt], 1), torch.arange(14) >= 5, slice(5, 14)),
        (torch.cat([tgt, pad], 1), torch.arange(14) < 9, slice(0, 9)),
    ]:
        out = model(src, padded, decoder_padding_mask=mask[None], labels=padded)
        torch.testing.assert_close(out.logits[0, real], alone.logits[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(out.loss, alone.loss, atol=1e-12, rtol=0)


@pytest.mark.parametrize("share", [False, True])
def test_loss_without_logits_equals_the_full_logits_loss(share, monkeypatch):
    """`return_logits=False` (the trainer's call, `Seq2SeqBatches.loss`): the same loss and
    gradients with padding on both sides and label -100; no logits; labels required."""
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(3, 40, (2, 10), generator=gen)
    tgt = torch.randint(3, 40, (2, 9), generator=gen)
    labels = tgt.clone()
    labels[0, 4] = -100
    batch = dict(input_ids=src, decoder_input_ids=tgt, labels=labels)
    batch["key_padding_mask"] = torch.arange(10) < torch.tensor([[10], [7]])
    batch["decoder_padding_mask"] = torch.arange(9) >= torch.tensor([[0], [2]])
    full, chunked = model_for(share_embeddings=share), model_for(share_embeddings=share)
    calls = []
    forward = chunked.forward
    monkeypatch.setattr(chunked, "forward", lambda *a, **kw: calls.append(kw) or forward(*a, **kw))
    losses = [full(**batch).loss, Seq2SeqBatches(None, None).loss(chunked, batch)]
    assert calls[-1]["return_logits"] is False
    torch.testing.assert_close(losses[1], losses[0])
    for got, want in zip(
        torch.autograd.grad(losses[1], list(chunked.parameters())),
        torch.autograd.grad(losses[0], list(full.parameters())),
    ):
        torch.testing.assert_close(got, want)
    assert chunked(**batch, return_logits=False).logits is None
    with pytest.raises(ValueError, match="return_logits=False needs labels"):
        chunked(src, tgt, return_logits=False)


@pytest.mark.parametrize("dec_proj", [6, None])
def test_no_future_leak_in_the_decoder(dec_proj):
    model = model_for(dec_proj=dec_proj)
    memory = model.encode(torch.randint(3, 40, (1, 12)))
    x = torch.randn(1, 11, 16, dtype=torch.float64)

    def decode(x):
        for layer in model.decoder.layers:
            x = layer(x, memory)
        return x

    jac = torch.autograd.functional.jacobian(decode, x, vectorize=True)  # (B, M, C, B, M, C)
    for i in range(11):
        assert torch.count_nonzero(jac[:, i, :, :, i + 1 :]) == 0, f"output {i} sees the future"
    assert torch.count_nonzero(jac[0, 10, :, 0, :10]) > 0  # the test can see a dependency
    gen = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(3, 40, (2, 12), generator=gen), torch.randint(3, 40, (2, 11))
    before = model(src, tgt).logits
    for cut in range(1, 11):
        changed = tgt.clone()
        changed[:, cut:] = torch.randint(3, 40, (2, 11 - cut), generator=gen)
        assert torch.equal(model(src, changed).logits[:, :cut], before[:, :cut]), cut


def test_decoder_states_that_are_not_the_models_are_named():
    # one layer's state for a two-layer decoder gave an IndexError, None an AttributeError
    model = model_for()
    src, tgt = torch.randint(3, 40, (2, 12)), torch.randint(3, 40, (2, 1))
    depth = len(model.decoder.layers)
    for states in (model.init_states()[:1], [None] * depth):
        with pytest.raises(ValueError, match=rf"^states must be a list of {depth} DecoderLayerS"):
            model(src, tgt, states=states)


@pytest.mark.parametrize("enc_proj", [("linear", 8), ("exact", None)], ids=["linformer", "exact"])
@pytest.mark.parametrize("dec_proj", [6, None])
def test_incremental_generation_equals_rerunning_the_full_model(enc_proj, dec_proj):
    model = model_for(enc_proj=enc_proj, dec_proj=dec_proj)
    src = torch.randint(3, 40, (2, 15))
    mask = torch.ones(2, 15, dtype=torch.bool)
    mask[1, 10:] = False
    steps = 3 * BLOCK + 2  # crosses several decoder blocks
    tokens = model.generate(src, steps, mask, temperature=0, stop_at_eos=False)
    rerun = tokens[:, :1]
    for _ in range(steps):
        logits = model(src, rerun, mask).logits[:, -1]
        rerun = torch.cat([rerun, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(tokens, rerun)
    states = model.init_states()
    memory = model.encode(src, mask)
    parts = [
        model(None, tokens[:, i : i + 1], mask, memory=memory, states=states).logits
        for i in range(tokens.shape[1])
    ]
    full = model(src, tokens, mask).logits
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-12, rtol=0)
    model.config.eos_token_id = eos = int(tokens[1, 3])  # row 1 ends there, row 0 maybe not
    want = tokens.clone()
    for row in want:
        ends = (row[1:] == eos).nonzero()
        if len(ends):
            row[2 + int(ends[0]) :] = model.config.decoder.pad_token_id
    stopped = model.generate(src, steps, mask, temperature=0)
    assert torch.equal(stopped, want[:, : stopped.shape[1]])
    assert stopped.shape[1] == steps + 1 or (stopped[:, 1:] == eos).any(1).all()


def test_a_row_that_ended_is_padded_while_the_others_go_on():
    # Both rows of the greedy test above end at one step: a finished row that kept
    # generating, or `done` set anew each step, went unseen.
    model = model_for()
    src = torch.randint(3, 40, (2, 15))

    def sampled(**kw):
        seeds = [torch.Generator().manual_seed(row) for row in range(2)]
        return model.generate(src, 12, temperature=1.0, generator=seeds, **kw)

    tokens = sampled(stop_at_eos=False)
    ends = [int(t) for t in tokens[1, 1:-2] if int(t) not in tokens[0].tolist()]
    model.config.eos_token_id = eos = ends[0]  # row 1 makes it, row 0 never does
    end = int((tokens[1] == eos).nonzero()[0])
    want = tokens.clone()
    want[1, end + 1 :] = model.config.decoder.pad_token_id
    torch.testing.assert_close(sampled(), want, atol=0, rtol=0)


def test_the_memory_is_projected_once_per_generation_to_k_rows(monkeypatch):
    model = model_for()
    calls = []
    original = LinformerCrossAttention.project_memory

    def counted(self, memory, mask):
        calls.append(memory.shape[1])
        return original(self, memory, mask)

    monkeypatch.setattr(LinformerCrossAttention, "project_memory", counted)
    states = model.init_states()
    memory = model.encode(torch.randint(3, 40, (1, 29)))
    for i in range(6):
        model(None, torch.full((1, 1), 1 + i), memory=memory, states=states)
    assert calls == [29, 29]  # once per decoder layer
    assert all(s.memory.keys.shape[2] == 8 for s in states)  # k rows, whatever n


@pytest.mark.parametrize(("n", "m"), [(32, 1), (3, 24), (17, 5)])
def test_source_and_target_lengths_are_independent(n, m):
    model = model_for()
    out = model(torch.randint(3, 40, (2, n)), torch.randint(3, 40, (2, m)))
    assert out.logits.shape == (2, m, 40) and out.encoder_last_hidden_state.shape == (2, n, 16)
    with pytest.raises(ValueError, match="sequence length 33 exceeds max_seq_len 32"):
        model(torch.randint(3, 40, (1, 33)), torch.randint(3, 40, (1, 4)))
    with pytest.raises(ValueError, match="sequence length 25 exceeds max_seq_len 24"):
        model(torch.randint(3, 40, (1, 4)), torch.randint(3, 40, (1, 25)))


def test_separate_vocabularies_and_shared_embeddings():
    separate = model_for(src_vocab=50, tgt_vocab=30)
    out = separate(torch.randint(0, 50, (2, 9)), torch.randint(0, 30, (2, 4)))
    assert out.logits.shape == (2, 4, 30)
    shared = model_for(share_embeddings=True)
    assert shared.decoder.embeddings.tokens is shared.encoder.embeddings.tokens
    with pytest.raises(ValueError, match="share_embeddings needs one vocabulary"):
        config(src_vocab=50, tgt_vocab=30, share_embeddings=True)


@pytest.mark.parametrize("share", [False, True])
def test_save_and_load_round_trip(tmp_path, share):
    model = model_for(share_embeddings=share, sharing="layerwise")
    model.save_pretrained(tmp_path)
    loaded = LinformerForSeq2SeqLM.from_pretrained(tmp_path).double().eval()
    assert loaded.config == model.config
    src, tgt = torch.randint(3, 40, (2, 13)), torch.randint(3, 40, (2, 6))
    assert torch.equal(loaded(src, tgt).logits, model(src, tgt).logits)
    assert torch.equal(
        loaded.generate(src, 5, temperature=0), model.generate(src, 5, temperature=0)
    )
    # into an encoder's class: 'Seq2SeqConfig' object has no attribute 'vocab_size'
    for cls in (LinformerModel, LinformerForMaskedLM):
        with pytest.raises(ValueError, match=r"is a LinformerForSeq2SeqLM \(an encoder-decoder\): "
                           r"load it with LinformerForSeq2SeqLM.from_pretrained"):  # fmt: skip
            cls.from_pretrained(tmp_path)


def test_generation_refuses_bad_settings_and_empty_sources_before_any_work():
    # A float count ended in a TypeError, True decoded one token, an empty source row was
    # decoded from no memory; the causal LM refused all three.
    model = model_for()
    src = torch.randint(3, 40, (2, 5))
    for temperature in (float("nan"), float("inf"), -1.0):
        with pytest.raises(
            ValueError, match=rf"temperature must be a finite .*, got {temperature}"
        ):
            model.generate(src, 3, temperature=temperature)
    for count in (2.5, True, -1):
        with pytest.raises(ValueError, match=rf"max_new_tokens must be an integer .*, got {count}"):
            model.generate(src, count)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1] = False
    with pytest.raises(ValueError, match="key_padding_mask: source 1 has no real token"):
        model.generate(src, 3, mask)
    with pytest.raises(ValueError, match=r"one per row \(2\); got 3 items"):
        model.generate(src, 3, generator=[torch.Generator()] * 3)
    # a 1-D source with one generator blamed the generator, its length taken for rows
    with pytest.raises(ValueError, match=r"input_ids must be \(batch >= 1, seq_len\), got sh"):
        model.generate(src[0], 3, generator=[torch.Generator()])


def test_sampling_with_a_generator_per_row_gives_each_source_its_own_draws():
    torch.manual_seed(0)
    model = model_for().eval()
    pad = model.config.encoder.pad_token_id
    sources = [torch.randint(3, 40, (n,)) for n in (5, 9, 5)]
    ids = torch.full((3, 9), pad)
    mask = torch.zeros(3, 9, dtype=torch.bool)
    for row, source in enumerate(sources):
        ids[row, 9 - len(source) :], mask[row, 9 - len(source) :] = source, True

    def seeded(count):
        return [torch.Generator().manual_seed(7) for _ in range(count)]

    alone = [model.generate(s[None], 6, generator=seeded(1), stop_at_eos=False)[0] for s in sources]
    batch = model.generate(ids, 6, mask, generator=seeded(3), stop_at_eos=False)
    assert all(torch.equal(batch[row], want) for row, want in enumerate(alone))


def test_config_refuses_mismatched_sides():
    enc = LinformerConfig(max_seq_len=32, dim=16, num_heads=2, proj_dim=8)
    dec = LinformerConfig(
        max_seq_len=16, dim=16, num_heads=2, proj_dim=4, causal=True, block_size=4
    )
    with pytest.raises(ValueError, match="encoder.causal=False and decoder.causal=True"):
        Seq2SeqConfig(encoder=enc, decoder=dec.replace(causal=False))
    with pytest.raises(ValueError, match=r"encoder.dim \(32\) and decoder.dim \(16\)"):
        Seq2SeqConfig(encoder=enc.replace(dim=32), decoder=dec)
    with pytest.raises(ValueError, match=r"eos_token_id must be in \[0, decoder.vocab_size="):
        Seq2SeqConfig(encoder=enc, decoder=dec, eos_token_id=-1)
    with pytest.raises(ValueError, match=r"decoder_start_token_id must be in .* got True"):
        Seq2SeqConfig(encoder=enc, decoder=dec, decoder_start_token_id=True)
    # None: "'NoneType' object has no attribute 'causal'"
    with pytest.raises(TypeError, match=r"^encoder must be a LinformerConfig .* got NoneType$"):
        Seq2SeqConfig(encoder=None, decoder=dec)
    with pytest.raises(ValueError, match="needs a Seq2SeqConfig, got LinformerConfig"):
        LinformerForSeq2SeqLM(enc)
    with pytest.raises(ValueError, match=r"max_new_tokens must be at most 15 \(the decoder's"):
        LinformerForSeq2SeqLM(Seq2SeqConfig(encoder=enc, decoder=dec)).generate(
            torch.ones(1, 4, dtype=torch.long), 16
        )


@pytest.fixture
def one_thread():
    """One intra-op thread: a tiny model's steps only lose time to more (the conftest's
    `same_threads` restores the count)."""
    torch.set_num_threads(1)


def test_a_tiny_linformer_learns_to_copy_in_seconds(one_thread):
    torch.manual_seed(0)
    train = synthetic_pairs("copy", 150 * 32, min_len=3, max_len=8, num_symbols=8, seed=0)
    test = synthetic_pairs("copy", 64, min_len=3, max_len=8, num_symbols=8, seed=1)
    common = dict(vocab_size=11, max_seq_len=16, dim=32, num_heads=2, depth=2, dropout=0.0)
    cfg = Seq2SeqConfig(
        encoder=LinformerConfig(**common, proj_dim=8, projection="pool"),  # n -> k = 8
        decoder=LinformerConfig(**common, proj_dim=None, causal=True),
        share_embeddings=True,
    )
    model = LinformerForSeq2SeqLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(150):
        model(**train.batch(list(range(step * 32, step * 32 + 32)))).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    batch = test.batch(list(range(64)))
    logits = model.eval()(**batch).logits[:, :-1]
    targets, real = batch["labels"][:, 1:], batch["decoder_padding_mask"][:, 1:]
    accuracy = ((logits.argmax(-1) == targets) & real).sum() / real.sum()
    # Chance is 1/8 per symbol; knowing only the lengths (the end token) gives about 0.26.
    assert accuracy > 0.6, f"token accuracy {accuracy:.2f}"


def test_a_source_batch_other_than_the_targets_is_named():
    # SDPA broadcast a memory of batch 1 over a target batch of 2: logits (2, M, vocab).
    model = model_for()
    src, tgt = torch.randint(3, 40, (1, 12)), torch.randint(3, 40, (2, 6))
    with pytest.raises(ValueError, match=r"the source batch \(1\) and the target batch \(2\)"):
        model(src, tgt)
    with pytest.raises(ValueError, match="key_padding_mask must be a bool tensor of shape"):
        model(src.expand(2, 12), tgt, key_padding_mask=torch.ones(1, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask must be a bool tensor of shape"):
        model(src.expand(2, 12), tgt, decoder_padding_mask=torch.ones(2, 5, dtype=torch.bool))


@pytest.mark.parametrize("projected", [False, True])
def test_cross_attention_dropout_only_in_training(projected):
    # Dropout in eval made generation random; dropped in training, it never regularised.
    torch.manual_seed(0)
    proj = MatrixProjection(max_seq_len=9, proj_dim=4) if projected else None
    dropped = LinformerCrossAttention(dim=8, num_heads=2, max_seq_len=9, proj_k=proj, dropout=0.5)
    plain = LinformerCrossAttention(dim=8, num_heads=2, max_seq_len=9, proj_k=proj)
    plain.load_state_dict(dropped.state_dict())
    x, memory = torch.randn(2, 3, 8), torch.randn(2, 9, 8)
    dropped.eval()
    torch.testing.assert_close(dropped(x, memory), plain(x, memory), atol=0, rtol=0)
    dropped.train()
    assert not torch.allclose(dropped(x, memory), plain(x, memory))
