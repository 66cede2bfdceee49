"""The feed-forward kernel's bfloat16 form (csrc/feedforward_bf16.cpp): bf16 rows with float32
weights, rounding where CPU bf16 autocast's three modules round. Checked against a float64
reference that rounds at the same places (nearly every element the same bits), on odd widths,
any row count and thread count; `FeedForward` under autocast takes it from
`BF16_KERNEL_MIN_ROWS` rows and the modules below. With the kernels' GEMMs pinned off MKL
(as on AMD CPUs); skipped where the build has no AVX-512 BF16 (`native.bf16_feedforward`)."""

import json

import pytest
import torch
import torch.nn.functional as F

from linformer_kit import native
from linformer_kit.encoder import BF16_KERNEL_MIN_ROWS, FeedForward
from linformer_kit.linear_backend import use_linear_backend


@pytest.fixture
def ops():
    """The kernels with their GEMMs pinned off MKL (oneDNN's float micro-kernel, AVX-512
    BF16's dot products for bf16), as they run on an AMD CPU."""
    ops = native.cpu_ops()
    if ops is None:
        pytest.skip("no C++ compiler here: the compiled kernels cannot be built")
    with use_linear_backend("onednn"):
        if not native.bf16_feedforward():
            pytest.skip("the feed-forward kernel's bf16 form needs AVX-512 BF16")
        yield ops


def rounded(t):
    """t rounded to bfloat16 and back to float64 (where the kernel and autocast round)."""
    return t.to(torch.bfloat16).double()


def reference(x, w1, b1, w2, b2, grad, activation):
    """Output and gradients (x, w1, b1, w2, b2) in float64, rounded to bf16 where the kernel
    and autocast round: the weights and biases, H, A = act(H), Y, dH = dA * act'(H) and dX;
    the weight gradients' sums exact."""
    x, grad = x.double(), grad.double()
    w1r, w2r = rounded(w1), rounded(w2)
    h = rounded(x @ w1r.T + rounded(b1)).requires_grad_()
    act = F.gelu if activation == "gelu" else torch.relu
    a = act(h)
    (slope,) = torch.autograd.grad(a.sum(), h)
    h, a = h.detach(), rounded(a.detach())
    y = rounded(a @ w2r.T + rounded(b2))
    dh = rounded((grad @ w2r) * slope)
    return y, rounded(dh @ w1r), dh.T @ x, dh.sum(0), grad.T @ a, grad.sum(0)


def same_bits_fraction(got, wanted):
    return (got.double() == wanted).double().mean().item()


def relative_error(got, wanted):
    return ((got.double() - wanted).norm() / wanted.norm()).item()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("rows", "dim", "hidden", "activation"),
    [(1, 8, 16, "gelu"), (300, 40, 70, "gelu"), (257, 33, 65, "relu"), (1100, 64, 300, "gelu")],
)
def test_outputs_and_gradients_round_where_the_modules_round(
    ops, rows, dim, hidden, activation, threads
):
    # odd widths: the dot products' pairs split across rows (A packed); 1100 rows: several
    # blocks of 128 (forward) and 256 (backward) rows, the last one short
    torch.manual_seed(rows)
    x = (torch.randn(rows, dim) * 2).bfloat16()
    grad = torch.randn(rows, dim).bfloat16()
    w1, b1 = torch.randn(hidden, dim) / dim**0.5, torch.randn(hidden) * 0.1
    w2, b2 = torch.randn(dim, hidden) / hidden**0.5, torch.randn(dim) * 0.1
    code = 0 if activation == "gelu" else 1
    torch.set_num_threads(threads)  # (the conftest's same_threads restores it)
    y, hidden_kept = ops.feedforward_forward(x, w1, b1, w2, b2, code, True)
    got = (y, *ops.feedforward_backward(grad, x, w1, w2, hidden_kept, code, [True, True]))
    wanted = reference(x, w1, b1, w2, b2, grad, activation)
    assert y.dtype == got[1].dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for t in got[2:])
    # float32 sums round to the other side of a bf16 value now and then (about one element in
    # a thousand, 1e-4 of the norm); rounding H, A or dH elsewhere would change many more
    for name, a, b in zip(["y", "x"], got[:2], wanted[:2]):
        assert same_bits_fraction(a, b) >= 0.995, name
        assert relative_error(a, b) < 1e-3, name
    for name, a, b in zip(["w1", "b1", "w2", "b2"], got[2:], wanted[2:]):
        assert relative_error(a, b) < 2e-4, name


def test_only_the_gradients_asked_for_are_made(ops):
    torch.manual_seed(0)
    x, grad = torch.randn(50, 16).bfloat16(), torch.randn(50, 16).bfloat16()
    w1, b1, w2, b2 = torch.randn(32, 16), torch.randn(32), torch.randn(16, 32), torch.randn(16)
    _, kept = ops.feedforward_forward(x, w1, b1, w2, b2, 0, True)
    both = ops.feedforward_backward(grad, x, w1, w2, kept, 0, [True, True])
    for needs in ([True, False], [False, True], [False, False]):
        got = ops.feedforward_backward(grad, x, w1, w2, kept, 0, needs)
        for i, (a, b) in enumerate(zip(got, both)):
            if needs[min(i, 1)]:
                assert torch.equal(a, b)
            else:
                assert a.numel() == 0


def test_feed_forward_under_autocast_takes_it_from_the_row_threshold(ops, monkeypatch):
    calls = []
    real = ops.feedforward_forward

    class Spy:
        @staticmethod
        def feedforward_forward(*args):
            calls.append(args[0].dtype)
            return real(*args)

    monkeypatch.setattr("linformer_kit.encoder.native_ops", lambda x: Spy)
    torch.manual_seed(0)
    ffn = FeedForward(dim=16, hidden_dim=64)
    for rows, used in ((BF16_KERNEL_MIN_ROWS - 1, False), (BF16_KERNEL_MIN_ROWS, True)):
        calls.clear()
        x = torch.randn(1, rows, 16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ffn(x)
        assert calls == ([torch.bfloat16] if used else [])
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        out.float().sum().backward()
        assert x.grad.dtype == torch.float32 and ffn.up.weight.grad.dtype == torch.float32
        # against the modules under autocast (each rounds its own way): bf16's precision
        with torch.autocast("cpu", dtype=torch.bfloat16):
            wanted = ffn.down(ffn.act(ffn.up(x)))
        assert relative_error(out, wanted.double()) < 1e-2
        assert same_bits_fraction(out, wanted.double()) >= 0.99  # (rounded as autocast rounds)
        ffn.zero_grad(set_to_none=True)


def test_bf16_rows_need_float32_weights(ops):
    x = torch.randn(3, 4).bfloat16()
    w1, b1, w2, b2 = torch.randn(6, 4), torch.randn(6), torch.randn(4, 6), torch.randn(4)
    with pytest.raises(RuntimeError, match="where Float was due"):
        ops.feedforward_forward(x, w1.bfloat16(), b1, w2, b2, 0, False)
    with pytest.raises(RuntimeError, match="where BFloat16 was due"):
        ops.feedforward_backward(torch.randn(3, 4), x, w1, w2, torch.randn(3, 6), 0, [True, True])


def test_torch_compile_traces_it_as_one_node(ops):
    """Under torch.compile (fullgraph: the rule is Python state, no graph break) the compiled
    block calls the bf16 kernel and gives the eager block's output and gradients."""
    torch.manual_seed(0)
    ffn = FeedForward(dim=16, hidden_dim=32)
    x = torch.randn(1, BF16_KERNEL_MIN_ROWS, 16, requires_grad=True)

    def block(t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return ffn(t)

    results = []
    for run in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        out = run(x)
        out.float().sum().backward()
        results.append([out, x.grad, ffn.up.weight.grad])
        x.grad = None
        ffn.zero_grad(set_to_none=True)
    for got, wanted in zip(*results):
        assert torch.equal(got, wanted)


def test_the_ab_script_times_the_bf16_kernel_against_the_modules(ops, tmp_path, monkeypatch):
    # benchmarks/kernels_feedforward.py --dtype bfloat16: the kernel's bf16 form on bf16 rows
    # below the row threshold too (lowered for the run; restored here), the modules without
    from test_dropout import run_ab_script

    from linformer_kit import encoder

    monkeypatch.setattr(encoder, "BF16_KERNEL_MIN_ROWS", encoder.BF16_KERNEL_MIN_ROWS)
    calls = []
    real = ops.feedforward_forward
    monkeypatch.setattr(ops, "feedforward_forward", lambda *t: calls.append(t[0].dtype) or real(*t))
    args = ("kernels_feedforward.py", encoder, (16, 32), tmp_path, monkeypatch)
    rows, paths, _ = run_ab_script(*args, extra=("--dtype", "bfloat16"))
    assert paths == {True, False} and set(calls) == {torch.bfloat16}
    assert json.loads((tmp_path / "ab.json").read_text())["settings"]["dtype"] == "bfloat16"
    assert all(row["kernel_speedup"]["feed-forward"] > 0 for row in rows)


def test_relu_passes_nan_as_the_modules_do(ops):
    torch.manual_seed(0)
    x = torch.randn(6, 8).bfloat16()
    x[2, 3] = float("nan")
    grad = torch.randn(6, 8).bfloat16()
    w1, b1, w2, b2 = torch.randn(16, 8), torch.randn(16), torch.randn(8, 16), torch.randn(8)
    y, kept = ops.feedforward_forward(x, w1, b1, w2, b2, 1, True)
    dx = ops.feedforward_backward(grad, x, w1, w2, kept, 1, [True, False])[0]
    wanted_y, wanted_dx = reference(x, w1, b1, w2, b2, grad, "relu")[:2]
    assert torch.equal(y.isnan(), wanted_y.isnan()) and y[2].isnan().all()
    assert torch.equal(dx.isnan(), wanted_dx.isnan()) and not dx.isnan().any()
    assert relative_error(dx, wanted_dx) < 1e-2
