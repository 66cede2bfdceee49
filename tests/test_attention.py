import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linformer_kit import (
    LinformerConfig,
    LinformerEncoder,
    LinformerEncoderLayer,
    LinformerModel,
    LinformerSelfAttention,
    attention,
    count_projection_matrices,
    linformer_base,
)
from linformer_kit import attention as attention_module
from linformer_kit.projection import build_projection

SHARINGS = ["none", "headwise", "kv", "layerwise"]
KINDS = ["linear", "conv", "pool", "random", "adaptive"]


def tiny(**changes):
    base = dict(
        vocab_size=50,
        max_seq_len=24,
        dim=16,
        depth=2,
        num_heads=2,
        proj_dim=6,
        dropout=0.0,
        attention_dropout=0.0,
    )
    return LinformerConfig(**{**base, **changes})


@settings(max_examples=60, deadline=None)
@given(
    sharing=st.sampled_from(SHARINGS),
    projection=st.sampled_from(KINDS + ["exact"]),
    lengths=st.lists(st.integers(1, 16), min_size=1, max_size=3),
    pad=st.integers(0, 8),
    seed=st.integers(0, 2**16),
)
def test_padding_invariance_over_sharing_and_kinds(sharing, projection, lengths, pad, seed):
    torch.manual_seed(seed)
    proj_dim = None if projection == "exact" else 6
    cfg = tiny(
        sharing=sharing,
        projection="linear" if proj_dim is None else projection,
        proj_dim=proj_dim,
        norm_first=seed % 2 == 0,
    )
    model = LinformerModel(cfg).double().eval()
    width = max(lengths) + pad
    ids = torch.randint(0, 50, (len(lengths), width))
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    padded = model(ids, mask).last_hidden_state
    for row, n in enumerate(lengths):
        alone = model(ids[row : row + 1, :n]).last_hidden_state[0]
        torch.testing.assert_close(padded[row, :n], alone, atol=1e-10, rtol=0)


@pytest.mark.parametrize("projection", KINDS)
@pytest.mark.parametrize("module", ["attention", "layer", "encoder"])
def test_the_modules_take_padding_anywhere(module, projection, monkeypatch):
    # The modules projected positions as they were: 3 pads in front took rows 0-2 of E and
    # F (max|diff| 0.16-1.22 against the 6 tokens alone); LinformerModel reorders itself,
    # and tells the stack so (no second copy per layer).
    torch.manual_seed(0)
    cfg = tiny(projection=projection, depth=1 if module == "layer" else 2)
    encoder = LinformerEncoder(cfg).double().eval()
    run = {"attention": encoder.layers[0].attn, "layer": encoder.layers[0], "encoder": encoder}
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    noise = torch.randn(2, 9, 16, dtype=torch.float64)
    for where in ([0, 1, 2], [0, 4, 8], [2, 3, 7]):  # left, spread, inner
        keep = torch.ones(9, dtype=torch.bool)
        keep[where] = False
        padded = noise.clone()
        padded[:, keep] = x
        out = run[module](padded, keep.expand(2, 9))[0]
        torch.testing.assert_close(out[:, keep], run[module](x)[0], atol=1e-10, rtol=0)
    model = LinformerModel(cfg).eval()
    monkeypatch.setattr(attention, "real_tokens_first", lambda *a: pytest.fail("reordered again"))
    model(torch.randint(0, 50, (2, 9)), torch.arange(9)[None, :] > torch.tensor([[2], [0]]))


def test_a_drop_in_attention_module_in_a_model_keeps_its_own_signature():
    # A module of (x, key_padding_mask, return_attention) got right_padded=True: TypeError.
    class Plain(torch.nn.Module):
        def forward(self, x, key_padding_mask=None, return_attention=False):
            return x * key_padding_mask[..., None], None

    model = LinformerModel(tiny()).eval()
    for layer in model.encoder.layers:
        layer.attn = Plain()
    mask = torch.arange(9)[None, :] > torch.tensor([[2], [0]])
    assert model(torch.randint(0, 50, (2, 9)), mask).last_hidden_state.shape == (2, 9, 16)


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("projection", KINDS)
@pytest.mark.parametrize("sharing", ["headwise", "kv", "layerwise"])
def test_projecting_the_input_first_is_exactly_equal(projection, sharing, masked, monkeypatch):
    # Outputs and every gradient; unmasked, `MatrixProjection.project_ones` takes E's column
    # sums instead of a GEMM with ones, and the input (19) is shorter than max_seq_len (24).
    torch.manual_seed(0)
    model = LinformerModel(tiny(projection=projection, sharing=sharing)).double().eval()
    for p in model.parameters():  # non-zero biases so the (E 1) b term is exercised
        torch.nn.init.normal_(p, std=0.3)
    seq_len = 20 if masked else 19
    ids = torch.randint(0, 50, (3, seq_len))
    mask = torch.arange(20)[None, :] < torch.tensor([20, 11, 3])[:, None] if masked else None
    attn = model.encoder.layers[0].attn
    assert attn.projects_input_first(seq_len)
    weights = torch.randn(3, seq_len, model.config.dim, dtype=torch.float64)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = model(ids, mask).last_hidden_state
        (out * weights).sum().backward()
        return out, [p.grad for p in model.parameters() if p.grad is not None]

    fast, fast_grads = run()
    monkeypatch.setattr(LinformerSelfAttention, "projects_input_first", lambda self, n: False)
    slow, slow_grads = run()
    torch.testing.assert_close(fast, slow, atol=1e-10, rtol=0)
    assert len(fast_grads) == len(slow_grads)
    for a, b in zip(fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0)


def test_a_projection_that_is_no_module_is_named():
    # a kind's name failed in an attribute lookup ("'str' object has no attribute ...")
    with pytest.raises(TypeError, match=r"^proj_k must be a SequenceProjection .* got str$"):
        LinformerSelfAttention(dim=16, num_heads=2, max_seq_len=8, proj_k="linear")


def test_order_is_chosen_by_flop_count():
    attn = LinformerSelfAttention(
        dim=64,
        num_heads=4,
        max_seq_len=1024,
        proj_k=build_projection(projection="linear", max_seq_len=1024, proj_dim=256),
    )
    assert attn.projects_input_first(1024)
    assert not attn.projects_input_first(64)  # k > n: projecting first would add rows
    per_head = build_projection(projection="linear", max_seq_len=1024, proj_dim=8, num_heads=4)
    assert not LinformerSelfAttention(
        dim=64, num_heads=4, max_seq_len=1024, proj_k=per_head
    ).projects_input_first(1024)


@pytest.mark.parametrize("masked", [False, True])
def test_exact_path_matches_torch_multihead_attention(masked):
    torch.manual_seed(0)
    dim, heads, n = 16, 4, 9
    ours = LinformerSelfAttention(dim=dim, num_heads=heads, max_seq_len=32).double().eval()
    peer = torch.nn.MultiheadAttention(dim, heads, batch_first=True).double().eval()
    with torch.no_grad():
        peer.in_proj_weight.copy_(torch.cat([ours.to_q.weight, ours.to_k.weight, ours.to_v.weight]))
        peer.in_proj_bias.copy_(torch.cat([ours.to_q.bias, ours.to_k.bias, ours.to_v.bias]))
        peer.out_proj.weight.copy_(ours.to_out.weight)
        peer.out_proj.bias.copy_(ours.to_out.bias)
    x = torch.randn(2, n, dim, dtype=torch.float64)
    mask = torch.tensor([[True] * n, [True] * 5 + [False] * 4]) if masked else None
    expected, _ = peer(x, x, x, key_padding_mask=None if mask is None else ~mask)
    torch.testing.assert_close(ours(x, mask)[0], expected, atol=1e-10, rtol=0)


def test_identity_projections_reproduce_the_exact_model_at_full_length():
    torch.manual_seed(0)
    exact = LinformerModel(tiny(proj_dim=None, max_seq_len=12)).double().eval()
    lin = LinformerModel(tiny(proj_dim=12, max_seq_len=12, sharing="headwise")).double().eval()
    lin.load_state_dict(exact.state_dict(), strict=False)
    with torch.no_grad():
        for layer in lin.encoder.layers:
            layer.attn.proj_k.weight.copy_(torch.eye(12))
            layer.attn.proj_v.weight.copy_(torch.eye(12))
    ids = torch.randint(0, 50, (2, 12))
    torch.testing.assert_close(
        lin(ids).last_hidden_state, exact(ids).last_hidden_state, atol=1e-10, rtol=0
    )


@pytest.mark.parametrize(("sharing", "count"), list(zip(SHARINGS, [288, 24, 12, 1])))
def test_sharing_counts_match_the_paper(sharing, count):
    model = LinformerModel(linformer_base(sharing=sharing, vocab_size=10, dim=96, ffn_dim=8))
    assert count_projection_matrices(model) == count
    projections = {id(p) for name, p in model.named_parameters() if "proj_" in name}
    assert len(projections) == {"none": 24}.get(sharing, count)  # per-head: one (H, n, k) tensor
    layers = model.encoder.layers
    if sharing == "layerwise":
        assert all(layer.attn.proj_k.weight is layers[0].attn.proj_k.weight for layer in layers)
    if sharing in ("kv", "layerwise"):
        assert all(layer.attn.proj_k is layer.attn.proj_v for layer in layers)


def test_per_layer_k_builds_each_layer_with_its_own_k():
    model = LinformerModel(tiny(proj_dim=[8, 4], sharing="kv"))
    ks = [layer.attn.proj_k.weight.shape[-1] for layer in model.encoder.layers]
    assert ks == [8, 4]


def test_too_long_input_is_rejected_with_both_numbers():
    model = LinformerModel(tiny())
    with pytest.raises(ValueError, match=r"sequence length 25 exceeds max_seq_len 24"):
        model(torch.zeros(1, 25, dtype=torch.long))


@pytest.mark.parametrize("proj_dim", [None, 6])
def test_attention_dropout_only_in_training_and_once_on_the_weights(monkeypatch, proj_dim):
    # Dropout is the kernel's, on the attention weights (each weight dropped once: the
    # kernels' tests); the module passes its p to the kernel in training, 0 in eval, and
    # drops nothing else: a second dropout on the output, or dropout moved off the weights
    # onto it, passed the check that eval is deterministic and training is not.
    torch.manual_seed(0)
    proj = proj_dim and build_projection(projection="linear", max_seq_len=16, proj_dim=proj_dim)
    attn = LinformerSelfAttention(dim=16, num_heads=2, max_seq_len=16, proj_k=proj, dropout=0.5)
    x = torch.randn(2, 10, 16)
    calls = []

    def recorded(q, k, v, mask, dropout_p):
        calls.append((dropout_p, real_attend(q, k, v, mask, dropout_p)))
        return calls[-1][1]

    real_attend = attention_module.attend
    monkeypatch.setattr(attention_module, "attend", recorded)
    attn.eval()
    assert torch.equal(attn(x)[0], attn(x)[0])
    assert [p for p, _ in calls] == [0.0, 0.0]
    attn.train()
    out = attn(x)[0]
    assert calls[-1][0] == 0.5 and torch.equal(out, attn._merge(calls[-1][1]))
    assert not torch.allclose(out, attn(x)[0])


@pytest.mark.parametrize(("proj_dim", "width"), [(None, 10), (6, 6)])
def test_returned_attention_is_the_matrix_sdpa_applied(proj_dim, width):
    torch.manual_seed(0)
    model = LinformerModel(tiny(proj_dim=proj_dim, projection="pool", max_seq_len=24)).eval()
    ids = torch.randint(0, 50, (2, 10))
    mask = torch.tensor([[True] * 10, [True] * 3 + [False] * 7])
    out = model(ids, mask, output_attentions=True)
    assert len(out.attentions) == 2
    weights = out.attentions[0]  # pool: 4 positions per block, 3 blocks reach into n = 10
    assert weights.shape == (2, 2, 10, width if proj_dim is None else 3)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 10))
    assert (weights[1, :, :, 1:] == 0).all() if proj_dim else (weights[1, :, :, 3:] == 0).all()
    # P @ V reproduces the layer's attention output (before the output projection).
    attn = model.encoder.layers[0].attn
    x = model.embeddings(ids)
    x = model.encoder.layers[0].attn_norm(x)
    captured = {}
    attn.to_out.register_forward_hook(lambda m, inp, o: captured.update(inp=inp[0]))
    attn(x, mask)
    v, _ = attn.proj_v(attn.to_v(x).view(2, 10, 2, 8), mask)
    expected = torch.matmul(weights, v.transpose(1, 2)).transpose(1, 2).reshape(2, 10, 16)
    torch.testing.assert_close(captured["inp"], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("projection", [*KINDS, "exact"])
def test_nan_in_padded_positions_never_reaches_real_outputs(projection):
    torch.manual_seed(0)
    proj = build_projection(
        projection="linear" if projection == "exact" else projection,
        max_seq_len=12,
        proj_dim=None if projection == "exact" else 4,
    )
    attn = LinformerSelfAttention(dim=8, num_heads=2, max_seq_len=12, proj_k=proj).double()
    x = torch.randn(2, 10, 8, dtype=torch.float64)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, 7:] = False
    clean = attn(x, mask)[0]
    x[0, 7:] = float("nan")  # e.g. padding left as torch.empty
    got = attn(x, mask)[0]
    torch.testing.assert_close(got[mask], clean[mask], atol=1e-12, rtol=0)


def test_bad_arguments_are_named_with_the_allowed_range():
    def build(**changes):
        args = dict(dim=8, num_heads=2, max_seq_len=16)
        return LinformerSelfAttention(**{**args, **changes})

    def proj(kind, k):
        return build_projection(projection=kind, max_seq_len=16, proj_dim=k)

    with pytest.raises(ValueError, match=r"dropout must be a float in \[0, 1\), got 2.0"):
        build(dropout=2.0)
    with pytest.raises(ValueError, match=r"block_size must be an integer >= 1, got 0"):
        build(block_size=0, causal=True)
    with pytest.raises(ValueError, match=r"as many rows: .* give 8 and 4 at max_seq_len 16"):
        build(proj_k=proj("linear", 8), proj_v=proj("pool", 4))
    with pytest.raises(ValueError, match=r"both project or both be exact; got Exact"):
        build(proj_v=proj("linear", 8))
    with pytest.raises(ValueError, match=r"shape \(batch, seq_len, dim=8\), got \(5, 8\)"):
        build()(torch.randn(5, 8))
    for kind, k in [("linear", 0), ("random", 17), ("conv", 0), ("adaptive", 0)]:
        with pytest.raises(
            ValueError, match=rf"proj_dim must be an integer in \[1, max_seq_len=16\], got {k}"
        ):
            proj(kind, k)
    with pytest.raises(ValueError, match=r"sequence length 20 exceeds max_seq_len 16"):
        proj("conv", 4)(torch.randn(1, 20, 1, 8))


@pytest.mark.parametrize(("projection", "keys"), [(None, 10), ("linear", 16), ("pool", 3)])
def test_a_short_input_runs_at_its_own_length(monkeypatch, projection, keys):
    # Invariant 3: any n <= max_seq_len runs without padding to max_seq_len: queries of n rows
    # over n keys (exact), k rows projected from n (linear: E[:n]) or the pooled blocks that
    # reach into n (ceil(n / block)).
    shapes = []
    real_attend = attention_module.attend

    def recorded(q, k, v, mask, dropout_p):
        shapes.append((q.shape[-2], k.shape[-2], v.shape[-2]))
        return real_attend(q, k, v, mask, dropout_p)

    monkeypatch.setattr(attention_module, "attend", recorded)
    proj = projection and build_projection(projection=projection, max_seq_len=64, proj_dim=16)
    attn = LinformerSelfAttention(dim=16, num_heads=2, max_seq_len=64, proj_k=proj)
    assert attn(torch.randn(2, 10, 16))[0].shape == (2, 10, 16)
    assert shapes == [(10, keys, keys)]


@pytest.mark.parametrize("norm_first", [True, False])
def test_an_encoder_layer_drops_each_sublayer_output_once(norm_first):
    # Hand-composed from the dropout's own draws: the post-LN feed-forward's dropout was
    # lost without a test noticing (eval equal, training random either way).
    torch.manual_seed(0)
    proj = build_projection(projection="linear", max_seq_len=12, proj_dim=4)
    layer = LinformerEncoderLayer(
        dim=8, num_heads=2, max_seq_len=12, proj_k=proj, proj_v=proj, ffn_dim=16,
        norm_first=norm_first, dropout=0.5,
    ).train()  # fmt: skip
    drawn = []
    layer.dropout.register_forward_hook(lambda module, args, out: drawn.append((args[0], out)))
    x = torch.randn(2, 12, 8)
    out = layer(x)[0]
    assert len(drawn) == 2
    (attended, kept), (ffn_out, ffn_kept) = drawn
    with torch.no_grad():
        torch.testing.assert_close(attended, layer.attn(layer.attn_norm(x) if norm_first else x)[0])
        mid = x + kept if norm_first else layer.attn_norm(x + kept)
        torch.testing.assert_close(ffn_out, layer.ffn(layer.ffn_norm(mid) if norm_first else mid))
        want = mid + ffn_kept if norm_first else layer.ffn_norm(mid + ffn_kept)
    torch.testing.assert_close(out, want)
    for value, dropped in drawn:  # each a dropout of p = 0.5: zero or doubled
        assert torch.all((dropped == 0) | torch.isclose(dropped, 2 * value))
