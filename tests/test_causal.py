"""Causal Linformer: no future leak, equality with written-out references, refused kinds,
incremental generation and save/load of LinformerForCausalLM."""

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from reference import causal_block_attention
from torch.utils._python_dispatch import TorchDispatchMode

from linformer_kit import (
    CausalState,
    LinformerConfig,
    LinformerForCausalLM,
    LinformerModel,
    LinformerSelfAttention,
    causal,
    causal_attention,
)
from linformer_kit.projection import build_projection

SHARINGS = ["none", "headwise", "kv", "layerwise"]
CAUSAL_KINDS = [("linear", 6), ("random", 6), ("exact", None)]
BLOCK = 4


def tiny(**changes):
    base = dict(
        vocab_size=50,
        max_seq_len=32,
        dim=16,
        depth=2,
        num_heads=2,
        proj_dim=6,
        causal=True,
        block_size=BLOCK,
        dropout=0.0,
        attention_dropout=0.0,
    )
    return LinformerConfig(**{**base, **changes})


def model_for(sharing, kind, seed=0):
    torch.manual_seed(seed)
    projection, proj_dim = kind
    cfg = tiny(sharing=sharing, projection="linear" if proj_dim is None else projection)
    return LinformerModel(cfg.replace(proj_dim=proj_dim)).double().eval()


# Left padding, a hole and right padding; n = 11 is not a multiple of the block size.
MASK = torch.tensor(
    [[True] * 11, [False, False] + [True] * 6 + [False, True, False]], dtype=torch.bool
)


@pytest.mark.parametrize("kind", CAUSAL_KINDS, ids=lambda k: k[0])
@pytest.mark.parametrize("sharing", SHARINGS)
def test_jacobian_of_earlier_outputs_wrt_later_inputs_is_zero(sharing, kind):
    model = model_for(sharing, kind)
    x = torch.randn(2, 11, 16, dtype=torch.float64)

    def encode(x):
        return model.encoder(x, MASK)[0]

    jac = torch.autograd.functional.jacobian(encode, x)  # (B, N, C, B, N, C)
    for i in range(11):
        for b in range(2):
            later = jac[b, i, :, b, i + 1 :]
            assert torch.count_nonzero(later) == 0, f"output {i} of row {b} sees the future"
    assert torch.count_nonzero(jac[0, 10, :, 0, :10]) > 0  # the test can see a dependency


@pytest.mark.parametrize("kind", CAUSAL_KINDS, ids=lambda k: k[0])
@pytest.mark.parametrize("sharing", SHARINGS)
def test_changing_the_future_leaves_earlier_outputs_bitwise_equal(sharing, kind):
    model = model_for(sharing, kind)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (2, 11), generator=gen)
    before = model(ids, MASK).last_hidden_state
    for cut in range(1, 11):
        changed, mask = ids.clone(), MASK.clone()
        changed[:, cut:] = torch.randint(0, 50, (2, 11 - cut), generator=gen)
        mask[:, cut:] = torch.rand(2, 11 - cut, generator=gen) < 0.7  # padding moves too
        after = model(changed, mask).last_hidden_state
        assert torch.equal(after[:, :cut], before[:, :cut]), f"change at {cut} leaked back"


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_causal_linformer_matches_a_position_by_position_reference(per_head, masked, block_size):
    torch.manual_seed(block_size)
    q, k, v = (torch.randn(2, 2, 11, 4, dtype=torch.float64) for _ in range(3))
    shape = (2, 20, 5) if per_head else (20, 5)
    proj_k, proj_v = (
        torch.randn(shape, dtype=torch.float64),
        torch.randn(shape, dtype=torch.float64),
    )
    mask = MASK if masked else None
    got = causal_attention(q, k, v, proj_k, proj_v, block_size=block_size, key_padding_mask=mask)
    want = causal_block_attention(q, k, v, proj_k, proj_v, block_size, mask)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("masked", [False, True])
def test_exact_causal_path_equals_a_masked_softmax(masked):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 4, dtype=torch.float64) for _ in range(3))
    mask = MASK[:, :9] if masked else torch.ones(2, 9, dtype=torch.bool)
    got = causal_attention(q, k, v, key_padding_mask=mask if masked else None)
    allowed = torch.ones(9, 9, dtype=torch.bool).tril() & mask[:, None, None, :]  # (B, 1, N, N)
    scores = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~allowed, float("-inf"))
    want = (scores.softmax(-1).nan_to_num() @ v) * mask[:, None, :, None]  # padded rows: 0
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(got, causal_block_attention(q, k, v, key_padding_mask=mask))


def test_left_and_right_padding_never_change_real_outputs():
    torch.manual_seed(0)
    model = LinformerForCausalLM(tiny()).double().eval()
    ids = torch.randint(1, 50, (1, 9))
    alone = model(ids).logits[0]
    pad = torch.zeros(1, 5, dtype=torch.long)
    for padded, mask, real in [
        (torch.cat([pad, ids], 1), torch.arange(14) >= 5, slice(5, 14)),
        (torch.cat([ids, pad], 1), torch.arange(14) < 9, slice(0, 9)),
    ]:
        out = model(padded, mask[None]).logits[0, real]
        torch.testing.assert_close(out, alone, atol=1e-12, rtol=0)
        loss = model(padded, mask[None], labels=padded).loss
        torch.testing.assert_close(loss, model(ids, labels=ids).loss)  # the loss is float32


def test_shifted_loss_scores_the_next_token_and_skips_minus_100():
    torch.manual_seed(0)
    model = LinformerForCausalLM(tiny())
    ids = torch.randint(0, 50, (2, 10))
    labels = ids.clone()
    labels[0, 4] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, 50)
    keep = labels[:, 1:].reshape(-1) != -100
    want = torch.nn.functional.cross_entropy(logits[keep], labels[:, 1:].reshape(-1)[keep])
    torch.testing.assert_close(out.loss, want)
    assert model.linformer.embeddings.tokens.weight.grad is None
    out.loss.backward()
    assert model.linformer.embeddings.tokens.weight.grad is not None  # tied head trains them


@pytest.mark.parametrize("proj_dim", [6, None])
def test_loss_without_logits_equals_the_full_logits_loss(proj_dim):
    """`return_logits=False` (the trainers' call): the same shifted loss and gradients from
    the chunked head, with padding and label -100; no logits; labels required."""
    ids = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, 3] = -100
    grads, losses = [], []
    for return_logits in (True, False):
        torch.manual_seed(0)
        model = LinformerForCausalLM(tiny(proj_dim=proj_dim)).double()
        out = model(ids, MASK, labels=labels, return_logits=return_logits)
        assert (out.logits is None) is not return_logits
        out.loss.backward()
        losses.append(out.loss)
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0])
    assert grads[1].keys() == grads[0].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)
    with pytest.raises(ValueError, match="return_logits=False needs labels"):
        model(ids, return_logits=False)


@pytest.mark.parametrize("kind", CAUSAL_KINDS, ids=lambda k: k[0])
@pytest.mark.parametrize("sharing", ["none", "layerwise"])
@pytest.mark.parametrize("prompt", [1, BLOCK, 2 * BLOCK + 3])
def test_incremental_generation_equals_the_full_pass_at_every_step(sharing, kind, prompt):
    torch.manual_seed(prompt)
    projection, proj_dim = kind
    cfg = tiny(sharing=sharing, projection=projection if proj_dim else "linear")
    model = LinformerForCausalLM(cfg.replace(proj_dim=proj_dim)).double().eval()
    ids = torch.randint(0, 50, (2, prompt))
    steps = 3 * BLOCK + 2  # crosses several block boundaries
    tokens = model.generate(ids, steps, temperature=0)
    rerun = ids
    for _ in range(steps):
        rerun = torch.cat([rerun, model(rerun).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(tokens, rerun)
    states = model.init_states()
    parts = [model(tokens[:, :prompt], states=states).logits]
    parts += [
        model(tokens[:, i : i + 1], states=states).logits for i in range(prompt, tokens.shape[1])
    ]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(parts, 1), model(tokens).logits, atol=1e-12, rtol=0)
    if proj_dim is not None:  # the state stays k summary rows plus an open block
        assert all(s.keys.shape[2] < BLOCK and s.key_sums.shape[2] == 6 for s in states)


def test_generation_states_that_are_not_the_models_are_named():
    # [] and [CausalState()] gave an IndexError, [None, None] an AttributeError, and the
    # states of two models (four for two layers) were taken without a word
    model = LinformerForCausalLM(tiny()).eval()
    ids = torch.randint(0, 50, (2, 3))
    for states in ([], [CausalState()], [None, None], model.init_states() * 2, "states"):
        with pytest.raises(ValueError, match=r"^states must be a list of 2 CausalStates, one"):
            model(ids, states=states)


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    torch.manual_seed(0)
    model = LinformerForCausalLM(tiny()).eval()
    ids = torch.randint(0, 50, (2, 3))
    greedy = model.generate(ids, 6, temperature=0)
    assert torch.equal(model.generate(ids, 6, temperature=0.7, top_k=1), greedy)
    draws = [
        model.generate(ids, 6, temperature=1.5, generator=torch.Generator().manual_seed(3))
        for _ in range(2)
    ]
    assert torch.equal(draws[0], draws[1])
    assert torch.equal(draws[0][:, :3], ids)


def test_a_row_that_produced_the_end_token_is_padded_and_generation_stops_when_all_have():
    torch.manual_seed(0)
    model = LinformerForCausalLM(tiny()).eval()
    ids = torch.randint(0, 50, (2, 3))
    free = model.generate(ids, 8, temperature=0)
    eos = int(free[0, 5])  # the first row's third greedy token becomes the end token
    stopped = model.generate(ids, 8, temperature=0, eos_token_id=eos)
    ended = [(row[3:] == eos).nonzero()[0, 0].item() + 3 if (row[3:] == eos).any() else None
             for row in free]  # fmt: skip
    width = max(e + 1 if e is not None else free.shape[1] for e in ended)
    assert stopped.shape[1] == width  # stops once every row has ended, not before
    for row, end in enumerate(ended):
        last = end if end is not None else width - 1
        assert torch.equal(stopped[row, : last + 1], free[row, : last + 1])  # same until eos
        assert (stopped[row, last + 1 :] == model.config.pad_token_id).all()  # padding after


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_prompts_of_different_lengths_generate_as_each_alone(side):
    torch.manual_seed(0)
    model = LinformerForCausalLM(tiny()).eval()  # blocks of 4: prompts cross boundaries
    prompts = [torch.randint(1, 50, (n,)) for n in (3, 11, 3, 7)]
    width, pad = 11, model.config.pad_token_id
    ids = torch.full((4, width), pad)
    mask = torch.zeros(4, width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        cols = slice(width - len(prompt), width) if side == "left" else slice(0, len(prompt))
        ids[row, cols], mask[row, cols] = prompt, True
    alone = [model.generate(p[None], 6, temperature=0)[0] for p in prompts]
    eos = int(alone[1][13])  # the second row ends at its third new token
    got = model.generate(ids, 6, temperature=0, key_padding_mask=mask, eos_token_id=eos)
    assert torch.equal(got[:, :width], ids)  # the prompts as given, padding included
    for row, want in enumerate(alone):
        new = want[len(prompts[row]) :]
        if (new == eos).any():  # as generate ends a text alone: padding after its eos
            end = int((new == eos).nonzero()[0, 0]) + 1
            new = torch.cat([new[:end], torch.full((len(new) - end,), pad)])
        assert torch.equal(got[row, width:], new[: got.shape[1] - width]), row
    # Sampling draws each length's rows together, from one generator: reproducible.
    draw = [
        model.generate(ids, 4, key_padding_mask=mask, generator=torch.Generator().manual_seed(1))
        for _ in range(2)
    ]
    assert torch.equal(draw[0], draw[1]) and draw[0].shape == (4, width + 4)
    # With one generator per row, each row's draws are those of its prompt alone.
    seeded = [torch.Generator().manual_seed(1) for _ in range(4)]
    got = model.generate(ids, 4, key_padding_mask=mask, generator=seeded)
    for row, prompt in enumerate(prompts):
        want = model.generate(prompt[None], 4, generator=torch.Generator().manual_seed(1))
        assert torch.equal(got[row, width:], want[0, len(prompt) :]), row
    with pytest.raises(ValueError, match=r"one per row \(4\); got 2 items"):
        model.generate(ids, 4, key_padding_mask=mask, generator=seeded[:2])
    # A prompt's real length counts against max_seq_len, not the padded width.
    model.generate(F.pad(ids, (21, 0), value=pad), 21, key_padding_mask=F.pad(mask, (21, 0)))
    with pytest.raises(ValueError, match=r"prompt \(11\) \+ max_new_tokens \(22\) = 33"):
        model.generate(ids, 22, key_padding_mask=mask)
    with pytest.raises(ValueError, match="key_padding_mask: prompt 2 has no real token"):
        model.generate(ids, 2, key_padding_mask=mask & (torch.arange(4) != 2)[:, None])
    with pytest.raises(ValueError, match="key_padding_mask must be a bool tensor"):
        model.generate(ids, 2, key_padding_mask=mask.long())


def test_a_tiny_temperature_samples_the_most_likely_token_instead_of_failing():
    torch.manual_seed(0)
    model = LinformerForCausalLM(tiny()).eval()
    ids = torch.randint(0, 50, (2, 3))
    greedy = model.generate(ids, 5, 0.0)
    for temperature in (1e-45, 1e-300, 5e-324):  # 0 in float32 below 7e-46: 0 / 0 was nan
        assert torch.equal(model.generate(ids, 5, temperature=temperature), greedy)


def test_generation_refuses_more_than_max_seq_len():
    model = LinformerForCausalLM(tiny())
    with pytest.raises(
        ValueError, match=r"prompt \(30\) \+ max_new_tokens \(3\) = 33 exceeds max_seq_len 32"
    ):
        model.generate(torch.zeros(1, 30, dtype=torch.long), 3)
    prompt = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0, got nan"):
        model.generate(prompt, 3, temperature=float("nan"))
    with pytest.raises(ValueError, match=r"top_k must be an integer >= 1, got 0"):
        model.generate(prompt, 0, top_k=0)  # checked before any work, even for no tokens
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 0, got 2.0"):
        model.generate(prompt, 2.0)
    for ids in (prompt[0], prompt[:0], prompt[:, :0]):  # an empty batch: a traceback in max()
        with pytest.raises(ValueError, match=r"input_ids must be \(batch >= 1, N >= 1\) token"):
            model.generate(ids, 2)
    with pytest.raises(ValueError, match=r"eos_token_id must be in \[0, 49\], got 50"):
        model.generate(prompt, 2, eos_token_id=50)  # it never ended a text
    for generator in (3, "s", [3]):  # an int was "object of type 'int' has no len()"
        with pytest.raises(ValueError, match=r"generator must be a torch.Generator or one per row"):
            model.generate(prompt, 2, generator=generator)
    ids = torch.zeros(2, 10, dtype=torch.long)
    with pytest.raises(ValueError, match=r"labels must have the scored ids' shape \(2, 10\)"):
        model(ids, labels=ids[:, :9])


def test_the_functional_core_refuses_inconsistent_projections_and_blocks():
    q = torch.randn(1, 2, 12, 4, dtype=torch.float64)
    e16, e8 = torch.randn(16, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    shared = causal_attention(q, q, q, e16, block_size=4)  # proj_k alone: E = F
    torch.testing.assert_close(shared, causal_attention(q, q, q, e16, e16, block_size=4))
    with pytest.raises(ValueError, match="proj_v needs proj_k"):
        causal_attention(q, q, q, None, e16)
    with pytest.raises(ValueError, match=r"sequence length 12 exceeds max_seq_len 8"):
        causal_attention(q, q, q, e16, e8)  # F has rows for 8 positions only
    with pytest.raises(ValueError, match=r"same k: got 3 and 2"):
        causal_attention(q, q, q, e16, e16[:, :2])
    # a per-head projection of other heads was re-read as 2 heads of another k
    for heads in (3, 1):
        per_head = torch.randn(heads, 16, 3, dtype=torch.float64)
        with pytest.raises(
            ValueError, match=rf"shape \({heads}, 16, 3\) has {heads} heads; the inputs have 2"
        ):
            causal_attention(q, q, q, per_head, block_size=4)
    for block_size in (0, -1):
        with pytest.raises(
            ValueError, match=rf"block_size must be an integer >= 1, got {block_size}"
        ):
            causal_attention(q, q, q, e16, block_size=block_size)


def test_save_and_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = LinformerForCausalLM(tiny(sharing="kv")).eval()
    model.save_pretrained(tmp_path)
    loaded = LinformerForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 50, (2, 13))
    assert loaded.config == model.config
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert torch.equal(
        loaded.generate(ids, 5, temperature=0), model.generate(ids, 5, temperature=0)
    )


def test_config_refuses_kinds_that_cannot_be_causal_and_bad_values():
    base = dict(max_seq_len=32, proj_dim=8, causal=True, block_size=8)
    for projection in ("conv", "pool", "adaptive"):
        with pytest.raises(ValueError, match=f"causal=True cannot use projection='{projection}'"):
            LinformerConfig(**base, projection=projection)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        LinformerConfig(**base | {"block_size": 0})
    with pytest.raises(ValueError, match="causal must be True or False"):
        LinformerConfig(**base | {"causal": 1})


@pytest.mark.parametrize("projection", ["conv", "pool", "adaptive"])
def test_attention_refuses_kinds_that_cannot_be_causal(projection):
    proj = build_projection(projection=projection, max_seq_len=32, proj_dim=8)
    with pytest.raises(ValueError, match="causal attention needs a matrix projection"):
        LinformerSelfAttention(dim=16, num_heads=2, max_seq_len=32, proj_k=proj, causal=True)


def test_exact_causal_attention_returns_its_lower_triangular_weights():
    torch.manual_seed(0)
    model = LinformerModel(tiny(proj_dim=None)).eval()
    ids = torch.randint(0, 50, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    layer = model.encoder.layers[0].attn
    seen = []
    layer.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    out = model(ids, key_padding_mask=mask, output_attentions=True)
    q, k = (lin(seen[0]).view(2, 9, 2, 8).transpose(1, 2) for lin in (layer.to_q, layer.to_k))
    scores = (q @ k.transpose(-1, -2)) / 8**0.5  # the reference: a hand-masked softmax
    allowed = torch.ones(9, 9, dtype=torch.bool).tril() & mask[:, None, None, :]
    want = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    torch.testing.assert_close(out.attentions[0], want)
    assert (out.attentions[0].triu(1) == 0).all()  # no weight on a later position


def test_misuse_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="needs a config with causal=True"):
        LinformerForCausalLM(tiny(causal=False))
    model = LinformerModel(tiny())
    with pytest.raises(ValueError, match="return_attention is not available"):
        model(torch.zeros(1, 5, dtype=torch.long), output_attentions=True)
    exact = LinformerModel(tiny(proj_dim=None)).eval()
    with pytest.raises(ValueError, match="return_attention is not available"):
        exact(
            torch.zeros(1, 5, dtype=torch.long), output_attentions=True, states=[CausalState()] * 2
        )
    bidirectional = LinformerModel(tiny(causal=False))
    with pytest.raises(ValueError, match="a generation state needs causal attention"):
        bidirectional(torch.zeros(1, 5, dtype=torch.long), states=[CausalState(), CausalState()])
    causal = LinformerModel(tiny()).eval()  # a state of 2 rows continued with 3 (torch.cat's error)
    states = [CausalState(), CausalState()]
    causal(torch.zeros(2, 5, dtype=torch.long), states=states)
    with pytest.raises(ValueError, match="the generation state holds a batch of 2, the input 3"):
        causal(torch.zeros(3, 1, dtype=torch.long), states=states)


@pytest.mark.parametrize("checkpointing", ["layer", "attention"])
def test_activation_checkpointing_gives_the_same_gradients(checkpointing):
    ids = torch.randint(0, 50, (2, 11))
    grads = []
    for mode in ("none", checkpointing):
        torch.manual_seed(0)
        model = LinformerForCausalLM(tiny(checkpointing=mode)).double()
        model(ids, MASK, labels=ids).loss.backward()
        grads.append(model.linformer.embeddings.tokens.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("projected", [True, False])
def test_a_fully_padded_row_gives_zeros_not_nan(dtype, projected):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 7, 4, dtype=dtype) for _ in range(3))
    proj = torch.randn(8, 3, dtype=dtype) if projected else None
    mask = torch.tensor([[True] * 7, [False] * 7])
    out = causal_attention(q, k, v, proj, proj, block_size=3, key_padding_mask=mask)
    assert torch.isfinite(out).all()
    assert torch.count_nonzero(out[1]) == 0


def test_causal_attention_takes_as_many_queries_as_keys_and_any_block_size():
    q = torch.randn(2, 4, 8, 16)
    e = torch.randn(32, 4)
    # exact: SDPA aligned the mask top-left for 5 queries over 8 keys, without a word
    for proj in (None, e):
        with pytest.raises(
            ValueError, match=r"^causal attention takes as many queries as keys: got 5 and 8"
        ):
            causal_attention(q[:, :, :5], q, q, proj)
    # a block longer than the sequence is one block (10**12 went to the allocator)
    torch.testing.assert_close(
        causal_attention(q, q, q, e, block_size=10**12), causal_attention(q, q, q, e, block_size=8)
    )


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("block_size", [1, 2])
def test_more_blocks_than_a_scan_chunk_match_the_reference(per_head, block_size):
    # Past SCAN_CHUNK blocks the prefix sums are summed chunk by chunk (75 and 150 blocks:
    # a whole chunk, a part one and, at 150, a chunk level of its own).
    assert 150 // block_size > causal.SCAN_CHUNK
    torch.manual_seed(block_size)
    q, k, v = (torch.randn(1, 2, 150, 3, dtype=torch.float64) for _ in range(3))
    shape = (2, 150, 4) if per_head else (150, 4)
    proj_k, proj_v = (torch.randn(shape, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(1, 150, dtype=torch.bool)
    mask[0, 140:] = False
    got = causal_attention(q, k, v, proj_k, proj_v, block_size=block_size, key_padding_mask=mask)
    want = causal_block_attention(q, k, v, proj_k, proj_v, block_size, mask)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


def test_causal_linformer_never_makes_an_n_by_n_tensor():
    # The prefix sums were one (M, M) triangle by the M = N / block_size block products:
    # N x N at block_size 1 (and M^2 work at any block size).
    n = 2048
    q, k, v = (torch.randn(1, 1, n, 2, requires_grad=True) for _ in range(3))
    proj = torch.randn(n, 2, requires_grad=True)
    with LargestTensor() as seen:
        causal_attention(q, k, v, proj, proj, block_size=1).sum().backward()
    assert seen.numel <= 2 * causal.SCAN_CHUNK * n, f"a tensor of {seen.numel} elements"


@pytest.mark.parametrize("projected", [False, True])
def test_causal_attention_drops_attention_weights_in_training_only(projected):
    # causal_attention's dropout_p reached the exact path only: the Linformer blocks trained
    # without attention dropout.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 4) for _ in range(3))
    proj = torch.randn(12, 3) if projected else None
    plain = causal_attention(q, k, v, proj, proj, block_size=4)
    dropped = causal_attention(q, k, v, proj, proj, block_size=4, dropout_p=0.5)
    assert not torch.allclose(dropped, plain)
    proj_dim = 3 if projected else None
    proj_k = build_projection(projection="linear", max_seq_len=12, proj_dim=proj_dim)
    attn = LinformerSelfAttention(
        dim=8, num_heads=2, max_seq_len=12, proj_k=proj_k, causal=True, block_size=4, dropout=0.5
    )
    x = torch.randn(2, 12, 8)
    attn.eval()
    assert torch.equal(attn(x)[0], attn(x)[0])
    attn.train()
    assert not torch.allclose(attn(x)[0], attn(x)[0])


def test_generation_makes_no_logits_for_the_prompt():
    # The prompt's (B, N, vocab_size) logits were made to read the last row: 0.5 GB a row
    # for 4096 tokens of a 30k vocabulary.
    torch.manual_seed(0)
    model = LinformerForCausalLM(tiny(vocab_size=1000, max_seq_len=64)).eval()
    prompt = torch.randint(3, 1000, (1, 60))
    with LargestTensor() as seen:
        model.generate(prompt, max_new_tokens=2)
    assert seen.numel < 60 * 1000 / 2, f"a tensor of {seen.numel} elements"


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampling_draws_from_the_softmax_at_the_temperature(temperature, monkeypatch):
    # Tested at 0, 1 and with top_k 1 only: a temperature applied twice went unseen.
    logits = torch.randn(3, 7)
    drawn, real = [], torch.multinomial

    def recorded(probs, *args, **kwargs):
        drawn.append(probs)
        return real(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", recorded)
    LinformerForCausalLM.sample(logits, temperature, None)
    torch.testing.assert_close(drawn[0], (logits.double() / temperature).softmax(-1))
    LinformerForCausalLM.sample(logits, temperature, 3)
    kept = logits.masked_fill(logits < logits.topk(3).values[:, -1:], float("-inf"))
    torch.testing.assert_close(drawn[1], (kept.double() / temperature).softmax(-1))
