"""linear_cross_entropy: the chunked head + loss against F.cross_entropy of the full logits."""

import functools
import json
import weakref
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from script_helpers import BENCHMARKS, load_script

from linformer_kit import LinformerConfig, LinformerForCausalLM, losses, native
from linformer_kit.linear_backend import use_linear_backend
from linformer_kit.losses import chunk_rows, linear_cross_entropy


def case(seed, lead, dim, vocab, rate, bias, dtype=torch.float64):
    """hidden (*lead, dim), weight, bias and targets with a `rate` share scored."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, dim, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, dim, generator=gen, dtype=dtype).requires_grad_()
    b = torch.randn(vocab, generator=gen, dtype=dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, lead, generator=gen)
    targets[torch.rand(lead, generator=gen) >= rate] = -100
    return hidden, weight, b, targets


def reference(hidden, weight, targets, bias=None):
    logits = F.linear(hidden, weight, bias).flatten(0, -2)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, targets.flatten(), ignore_index=-100)


def loss_and_grads(fn, hidden, weight, bias, targets):
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    loss = fn(hidden, weight, targets, bias)
    return loss, torch.autograd.grad(loss, inputs) if loss.requires_grad else None


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lead=st.sampled_from([(0,), (1,), (7,), (3, 13), (2, 50)]),
    dim=st.integers(1, 12),
    vocab=st.integers(1, 70),
    rate=st.sampled_from([0.0, 0.2, 1.0]),
    bias=st.booleans(),
    rows=st.integers(1, 40),
)
def test_equals_cross_entropy_of_the_full_logits(seed, lead, dim, vocab, rate, bias, rows):
    """Loss and every gradient equal the full logits' in float64, for any chunking, shape
    and share of ignored rows (none scored: nan loss, zero gradients, as F.cross_entropy)."""
    hidden, weight, b, targets = case(seed, lead, dim, vocab, rate, bias)
    chunked = functools.partial(linear_cross_entropy, rows_per_chunk=rows)
    loss, grads = loss_and_grads(chunked, hidden, weight, b, targets)
    expected, expected_grads = loss_and_grads(reference, hidden, weight, b, targets)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, equal_nan=True)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("gemm", ["blas", "onednn"])
def test_float32_matches_the_float64_reference(gemm, monkeypatch):
    # "onednn": the logits on oneDNN's matmul, the gradients' GEMMs on the kernels' (AMD)
    hidden, weight, b, targets = case(1, (2, 300), 48, 1000, 0.7, True, torch.float32)
    chunked = functools.partial(linear_cross_entropy, rows_per_chunk=64)
    ops = native.cpu_ops()
    if ops is None and gemm == "onednn":
        pytest.skip("no C++ compiler here: the kernels cannot be built")
    calls = []
    spied = [(torch.ops.mkldnn, "_linear_pointwise")]
    spied += [(ops, "matmul"), (ops, "matmul_add_")] if ops is not None else []
    for owner, name in spied:
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, n=name, f=real: calls.append(n) or f(*a))
    with use_linear_backend(gemm):
        loss, grads = loss_and_grads(chunked, hidden, weight, b, targets)
    assert set(calls) == ({name for _, name in spied} if gemm == "onednn" else set())
    wide = [t.detach().double().requires_grad_() for t in (hidden, weight, b)]
    expected, expected_grads = loss_and_grads(reference, wide[0], wide[1], wide[2], targets)
    assert loss.dtype == torch.float32 and [g.dtype for g in grads] == [torch.float32] * 3
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


def test_gradcheck():
    hidden, weight, b, targets = case(2, (9,), 4, 6, 0.6, True)
    assert torch.autograd.gradcheck(
        lambda h, w, c: linear_cross_entropy(h, w, targets, c, rows_per_chunk=4),
        (hidden, weight, b),
    )


def test_a_second_order_gradient_is_a_clear_error_not_a_wrong_answer():
    # a penalty reaching a weight through the hidden states alone (x @ w0) got second-order
    # gradients missing the loss's own terms, without a word
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w0 = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    loss = linear_cross_entropy(x @ w0, weight, torch.randint(0, 7, (6,)), rows_per_chunk=2)
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="linear_cross_entropy's backward is not diff"):
        torch.autograd.grad(grad.square().sum(), w0)
    # and the loss keeps none of its inputs' memory (the gradients are made in forward)
    hidden = x @ w0
    kept = weakref.ref(hidden)
    loss = linear_cross_entropy(hidden, weight, torch.randint(0, 7, (6,)), rows_per_chunk=2)
    del hidden
    assert kept() is None
    loss.backward()


def test_under_bf16_autocast_it_rounds_as_the_full_logits_do():
    """Under autocast the GEMMs run in bf16 and the softmax in float32, as F.linear and
    F.cross_entropy on upcast logits do: far nearer that path than float32's, and float32
    results."""
    hidden, weight, _, targets = case(3, (512,), 64, 700, 0.8, False, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = loss_and_grads(linear_cross_entropy, hidden, weight, None, targets)
        expected, expected_grads = loss_and_grads(reference, hidden, weight, None, targets)
    wide, wide_grads = loss_and_grads(reference, hidden, weight, None, targets)  # float32
    assert loss.dtype == torch.float32 and [g.dtype for g in grads] == [torch.float32] * 2
    assert (loss - expected).abs() < 0.1 * (wide - expected).abs()
    for got, want, other in zip(grads, expected_grads, wide_grads):
        assert (got - want).norm() < 0.5 * (other - want).norm()  # bf16 partial sums


def test_computes_gradients_only_where_asked():
    """Without grad mode, or for inputs that do not require grad, the forward pass skips
    those gradients' GEMMs."""
    hidden, weight, b, targets = case(4, (30,), 8, 20, 0.5, True)
    seen = []
    real = losses._LinearCrossEntropy.forward

    def spy(ctx, *args):
        seen.append(args[5])  # needs
        return real(ctx, *args)

    with mock.patch.object(losses._LinearCrossEntropy, "forward", staticmethod(spy)):
        with torch.no_grad():
            loss = linear_cross_entropy(hidden, weight, targets, b)
        linear_cross_entropy(hidden, weight.detach(), targets, b)
    assert seen == [(False, False, False), (True, False, True)]
    torch.testing.assert_close(loss, reference(hidden, weight, targets, b).detach())


def test_an_unscored_row_never_reaches_the_loss():
    """A non-finite logit in an ignored row leaves the loss finite, as F.cross_entropy."""
    hidden, weight, _, targets = case(5, (6,), 4, 9, 1.0, False)
    hidden = hidden.detach().clone()
    hidden[2] = float("inf")
    targets[2] = -100
    torch.testing.assert_close(
        linear_cross_entropy(hidden, weight.detach(), targets),
        reference(hidden, weight.detach(), targets),
    )


def test_zero_width_hidden_gives_log_vocab_size():
    targets = torch.tensor([1, 2, -100])
    loss = linear_cross_entropy(torch.zeros(3, 0), torch.zeros(7, 0), targets)
    torch.testing.assert_close(loss, torch.tensor(7.0).log())


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(targets=torch.zeros(5, dtype=torch.long)), r"targets of its leading shape"),
        (dict(hidden=torch.randn(6, 7)), r"hidden \(\.\.\., 8\)"),
        (dict(bias=torch.zeros(9)), r"bias must have shape \(10,\)"),
        (dict(targets=torch.tensor([0, 1, 10, 2, 3, 4])), r"\[0, 10\) .* got 10"),
        (dict(targets=torch.tensor([0, -1, 1, 2, 3, 4])), r"ignore_index -100; got -1"),
        (dict(rows_per_chunk=0), r"rows_per_chunk must be an integer >= 1, got 0"),
        # these reached torch's op schema (a TypeError naming no argument of ours)
        (dict(rows_per_chunk=2.5), r"rows_per_chunk must be an integer >= 1, got 2.5"),
        (dict(ignore_index="pad"), r"ignore_index must be an integer, got 'pad'"),
    ],
)
def test_bad_inputs_raise(change, message):
    args = dict(hidden=torch.randn(6, 8), weight=torch.randn(10, 8), targets=torch.arange(6))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(**args)


def test_numpy_integers_are_integers():
    args = dict(hidden=torch.randn(6, 8), weight=torch.randn(10, 8), targets=torch.arange(6))
    want = linear_cross_entropy(**args, ignore_index=-100, rows_per_chunk=2)
    got = linear_cross_entropy(**args, ignore_index=np.int64(-100), rows_per_chunk=np.int64(2))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("gemm", ["blas", "onednn"])
def test_a_compiled_causal_lm_gives_the_same_loss_and_gradients(gemm, monkeypatch):
    """Two 512-row chunks a call at three batch sizes: recompiles with symbolic shapes, on
    whose slices `out=` arguments once failed; on either GEMM library (oneDNN's: the
    kernels' ops in the graph, one of them adding into the weight gradient in place).
    Compiled, the loss held all rows' logits at once (one chunk): now its chunks too."""
    torch._dynamo.reset()
    made = []  # the rows of each chunk's logits
    real_linear = losses.linear
    monkeypatch.setattr(
        losses, "linear", lambda h, *a: made.append(h.shape[0]) or real_linear(h, *a)
    )
    config = LinformerConfig(
        vocab_size=50,
        max_seq_len=16,
        dim=16,
        depth=1,
        num_heads=2,
        proj_dim=8,
        causal=True,
        block_size=4,
    )
    model = LinformerForCausalLM(config.replace(dropout=0.0, attention_dropout=0.0))
    compiled = torch.compile(model, backend="aot_eager")
    for batch in (40, 36, 34):  # 640, 576, 544 rows
        ids = torch.randint(0, 50, (batch, 16), generator=torch.Generator().manual_seed(0))
        results = []
        for run in (model, compiled):
            with use_linear_backend(gemm):
                loss = run(ids, labels=ids, return_logits=False).loss
                results.append((loss, *torch.autograd.grad(loss, list(model.parameters()))))
        for got, want in zip(results[1], results[0]):
            torch.testing.assert_close(got, want)
    assert max(made) == 512 and sum(made) == 2 * (640 + 576 + 544)  # eager, then compiled


def test_chunk_rows():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert chunk_rows(4096, 4096, cpu) == chunk_rows(4096, 50257, cpu) == 512
    assert chunk_rows(100, 4096, cpu) == 100
    assert chunk_rows(0, 4096, cpu) == 1
    assert chunk_rows(65536, 50257, gpu) == (1 << 26) // 50257
    assert chunk_rows(65536, 1 << 20, gpu) == 512


def test_the_lm_loss_script_times_both_ways(tmp_path):
    script = load_script(BENCHMARKS / "lm_loss.py")
    argv = ["--tiny", "--repeats", "2", "--threads", "1", "--memory-steps", "0"]
    script.main([*argv, "--out", str(tmp_path)])
    result = json.loads((tmp_path / "ab.json").read_text())
    (loss,) = result["loss"]
    assert list(loss["median_ms"]) == ["logits", "chunk 7", "chunk 40"]
    assert loss["default_chunk"] == 40
    assert [row["model"] for row in result["rows"]] == ["tiny causal", "tiny masked"]
    for row in result["rows"]:
        assert [len(row["times_ms"][way]) for way in ("logits", "chunked")] == [2, 2]
        assert row["speedup"] == row["median_ms"]["logits"] / row["median_ms"]["chunked"]
        assert row["eval_loss"]["chunked"] == pytest.approx(row["eval_loss"]["logits"], rel=1e-5)
    assert (tmp_path / "ab.png").stat().st_size > 0
