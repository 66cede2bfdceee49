"""The compiled CPU feed-forward kernel (csrc/feedforward.cpp, `encoder.FeedForward`): outputs
and every gradient equal the PyTorch modules' own (Linear -> GELU / ReLU -> Linear) on any
number of rows, block cut and thread count, its float32 GEMMs on either library (`sgemm_` or
oneDNN's micro-kernel, in tiles past 256); without grad nothing is kept; where it does not
apply (bf16 weights, autocast on few rows) the modules run; a double backward and bad input
are clear errors. Under torch.compile: `test_export_compile.py`."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils import prune

from linformer_kit import native
from linformer_kit.encoder import FeedForward
from linformer_kit.linear_backend import use_linear_backend


@pytest.fixture(autouse=True)
def compiled():
    if native.cpu_ops() is None:
        pytest.skip("no C++ compiler here: the compiled kernel cannot be built")


def modules_path(ffn, x):
    """The block as PyTorch's modules compute it (the reference)."""
    return ffn.down(ffn.act(ffn.up(x)))


def outputs_and_grads(ffn, x, grad, forward):
    """The output and the gradients of x and every parameter, from a fresh backward."""
    x = x.detach().requires_grad_()
    ffn.zero_grad(set_to_none=True)
    out = forward(x)
    out.backward(grad)
    return [out.detach(), x.grad] + [p.grad for p in ffn.parameters()]


@settings(max_examples=30, deadline=None)
@given(
    rows=st.sampled_from([1, 2, 127, 128, 129, 300, 600]),
    lead=st.sampled_from([(), (2,), (1, 3)]),
    widths=st.sampled_from([(8, 32), (5, 7), (16, 3)]),
    activation=st.sampled_from(["gelu", "relu"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    threads=st.sampled_from([1, 2, 4]),
)
def test_outputs_and_gradients_equal_the_modules(rows, lead, widths, activation, dtype, threads):
    torch.manual_seed(rows)
    dim, hidden = widths
    ffn = FeedForward(dim=dim, hidden_dim=hidden, activation=activation).to(dtype)
    x = torch.randn(*lead, rows, dim, dtype=dtype) * 2
    grad = torch.randn(*lead, rows, dim, dtype=dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = outputs_and_grads(ffn, x, grad, ffn)
    finally:
        torch.set_num_threads(previous)
    wanted = outputs_and_grads(ffn, x, grad, lambda t: modules_path(ffn, t))
    # fp32: two sums of up to 1800 rows, each rounded its own way
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {}
    for name, a, b in zip(["out", "x", "w1", "b1", "w2", "b2"], got, wanted):
        torch.testing.assert_close(a, b, **tolerance, msg=lambda m, name=name: f"{name}: {m}")


def test_gelu_is_exact_erf_gelu_across_its_range():
    """The kernel's float erf (Abramowitz-Stegun, with its own exp) against torch's exact
    GELU in float64, from where it is 0 to where it is x, through the slope's extremes."""
    ffn = FeedForward(dim=1, hidden_dim=1)
    with torch.no_grad():
        ffn.up.weight.fill_(1.0), ffn.up.bias.zero_(), ffn.down.weight.fill_(1.0)
        ffn.down.bias.zero_()
    x = torch.linspace(-12, 12, 4801).unsqueeze(-1).requires_grad_()
    out = ffn(x)
    (slope,) = torch.autograd.grad(out.sum(), x)
    exact = x.detach().double().requires_grad_()
    wanted = torch.nn.functional.gelu(exact)
    (wanted_slope,) = torch.autograd.grad(wanted.sum(), exact)
    # Abramowitz-Stegun's erf is good to 1.5e-7 (times x in GELU), float rounding on top
    torch.testing.assert_close(out.double(), wanted.detach(), atol=6e-7, rtol=1e-6)
    torch.testing.assert_close(slope.double(), wanted_slope, atol=6e-7, rtol=1e-6)


def test_runs_the_kernel_and_keeps_only_the_pre_activation(monkeypatch):
    """The kernel is called (not the modules), with the hidden activations kept only where a
    backward is recorded."""
    ops = native.cpu_ops()
    calls = []
    real = ops.feedforward_forward

    def spy(*args):
        out, hidden = real(*args)
        calls.append(tuple(hidden.shape))
        return out, hidden

    class Ops:
        feedforward_forward = staticmethod(spy)

    monkeypatch.setattr("linformer_kit.encoder.native_ops", lambda x: Ops)
    ffn = FeedForward(dim=4, hidden_dim=6)
    x = torch.randn(2, 3, 4)
    with torch.no_grad():
        ffn(x)
    ffn(x).sum().backward()
    with torch.inference_mode():
        ffn(x)
    assert calls == [(0, 6), (6, 6), (0, 6)]
    assert ffn.up.weight.grad is not None


def test_where_it_does_not_apply_the_modules_run(monkeypatch):
    """bf16 weights, and autocast below `BF16_KERNEL_MIN_ROWS` rows, take the modules' path
    (autocast then casts as it does for nn.Linear; from there, where the kernels multiply
    bf16 on AVX-512 BF16, its bf16 form: `test_feedforward_bf16.py`)."""
    monkeypatch.setattr(
        "linformer_kit.encoder.native_ops", lambda x: pytest.fail("the kernel was used")
    )
    ffn = FeedForward(dim=4, hidden_dim=6)
    x = torch.randn(2, 3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ffn(x)
    assert out.dtype == torch.bfloat16
    ffn.to(torch.bfloat16)(x.bfloat16())


def test_double_backward_is_a_clear_error_not_a_wrong_answer():
    ffn = FeedForward(dim=4, hidden_dim=6).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(ffn(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="feedforward kernel's backward is not differentiable"):
        grad.sum().backward()


def test_bad_input_is_a_clear_error():
    ops = native.cpu_ops()
    x, w1, b1 = torch.randn(3, 4), torch.randn(6, 4), torch.randn(6)
    w2, b2 = torch.randn(4, 6), torch.randn(4)
    with pytest.raises(RuntimeError, match="do not match"):
        ops.feedforward_forward(x, w1, b1, w2.t().contiguous(), b2, 0, False)
    with pytest.raises(RuntimeError, match="activation must be 0"):
        ops.feedforward_forward(x, w1, b1, w2, b2, 2, False)
    with pytest.raises(RuntimeError, match="contiguous CPU tensors of one dtype"):
        ops.feedforward_forward(x.double(), w1, b1, w2, b2, 0, False)
    with pytest.raises(RuntimeError, match="biases"):
        ops.feedforward_forward(x, w1, b2, w2, b1, 0, False)
    with pytest.raises(RuntimeError, match=r"grad \[2, 4\] and hidden \[3, 6\] do not match"):
        ops.feedforward_backward(torch.randn(2, 4), x, w1, w2, torch.randn(3, 6), 0, [True, True])
    with pytest.raises(RuntimeError, match="weight_sums must be -1 .* got 2"):
        ops.feedforward_backward(x, x, w1, w2, torch.randn(3, 6), 0, [True, True], 2)


@pytest.mark.parametrize("weight_sums", [0, 1])
def test_weight_gradients_do_not_depend_on_which_thread_ends_first(weight_sums):
    """Each thread's sums are added in the order of their rows, and the GEMMs over all rows
    are the BLAS's: with four threads the gradients of repeated calls are the same bits."""
    ops = native.cpu_ops()
    torch.manual_seed(0)
    x, grad = torch.randn(4096, 16), torch.randn(4096, 16)
    w1, w2 = torch.randn(64, 16), torch.randn(16, 64)
    _, hidden = ops.feedforward_forward(x, w1, torch.randn(64), w2, torch.randn(16), 0, True)
    args = (grad, x, w1, w2, hidden, 0, [True, True], weight_sums)
    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        runs = [ops.feedforward_backward(*args) for _ in range(8)]
    finally:
        torch.set_num_threads(previous)
    for run in runs[1:]:
        for got, first in zip(run, runs[0]):
            assert torch.equal(got, first)


def backward_of(ops, x, weights, grad, weight_sums):
    """The kernel's five gradients (x, w1, b1, w2, b2) with the weight gradients summed
    `weight_sums`'s way (-1 the rule, 0 each thread's sums, 1 over all rows)."""
    w1, b1, w2, b2 = weights
    _, hidden = ops.feedforward_forward(x, w1, b1, w2, b2, 0, True)
    return ops.feedforward_backward(grad, x, w1, w2, hidden, 0, [True, True], weight_sums)


@pytest.mark.parametrize(
    ("dtype", "gemm"),
    [(torch.float64, "blas"), (torch.float32, "blas"), (torch.float32, "onednn")],
)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [0, 1, 40, 600])
def test_both_ways_of_summing_the_weight_gradients_equal_the_modules(rows, threads, dtype, gemm):
    ops = native.cpu_ops()
    torch.manual_seed(rows)
    ffn = FeedForward(dim=16, hidden_dim=64).to(dtype)
    x = torch.randn(rows, 16, dtype=dtype) * 2
    grad = torch.randn(rows, 16, dtype=dtype)
    wanted = outputs_and_grads(ffn, x, grad, lambda t: modules_path(ffn, t))[1:]
    _, hidden = ops.feedforward_forward(x, *ffn_weights(ffn), 0, True)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {}
    torch.set_num_threads(threads)  # (the conftest's same_threads restores it)
    with use_linear_backend(gemm):
        assert native.kernel_gemm() == gemm  # (the pin reached the kernels)
        for weight_sums in (0, 1, -1):
            for needs in ([True, True], [True, False], [False, True]):
                args = (grad, x, ffn.up.weight, ffn.down.weight, hidden, 0, needs, weight_sums)
                got = ops.feedforward_backward(*args)
                asked = [needs[0]] + [needs[1]] * 4
                for name, a, b, need in zip(["x", "w1", "b1", "w2", "b2"], got, wanted, asked):
                    message = f"weight_sums {weight_sums}, needs {needs}, {name}"
                    if not need:
                        assert a.numel() == 0, message
                        continue
                    torch.testing.assert_close(
                        a, b, **tolerance, msg=lambda m, message=message: f"{message}: {m}"
                    )


@pytest.mark.parametrize("gemm", ["blas", "onednn"])
@pytest.mark.parametrize("rows", [40, 1300])
def test_widths_past_the_gemm_tiles_equal_the_float64_modules(rows, gemm):
    # dim 300, hidden 520: the GEMMs cross oneDNN's 256-wide tiles in every dimension; 40 rows
    # sum the weight gradients over all rows after the loop (`all_rows`: GEMMs threaded over
    # their tiles), 1300 in each thread's sums
    torch.manual_seed(rows)
    ffn = FeedForward(dim=300, hidden_dim=520)
    x, grad = torch.randn(rows, 300), torch.randn(rows, 300)
    torch.set_num_threads(2)
    with use_linear_backend(gemm):
        assert native.kernel_gemm() == gemm  # (the pin reached the kernels)
        got = outputs_and_grads(ffn, x, grad, ffn)
    wide = FeedForward(dim=300, hidden_dim=520).double()
    wide.load_state_dict(ffn.state_dict())
    wanted = outputs_and_grads(wide, x.double(), grad.double(), wide)
    for name, a, b in zip(["out", "x", "w1", "b1", "w2", "b2"], got, wanted):
        torch.testing.assert_close(
            a.double(), b, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_the_weight_gradients_keep_fp32_whatever_the_matmul_precision_setting():
    """Both ways run the kernel's own GEMMs: `torch.set_float32_matmul_precision("medium")`
    (bf16 GEMMs on a CPU with AMX, under `torch.mm`) must not lower the weight gradients of
    the all-rows way only, and so with the row count."""
    ops = native.cpu_ops()
    torch.manual_seed(0)
    x, grad = torch.randn(512, 256), torch.randn(512, 256)
    weights = (torch.randn(1024, 256) / 16, torch.randn(1024), torch.randn(256, 1024) / 32)
    weights += (torch.randn(256),)
    wanted = backward_of(ops, x.double(), [w.double() for w in weights], grad.double(), 0)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        got = backward_of(ops, x, weights, grad, 1)
    finally:
        torch.set_float32_matmul_precision(previous)
    for a, b in zip(got[1:], wanted[1:]):
        torch.testing.assert_close(a, b.float(), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize(
    ("rows", "chosen"), [(31, 1), (32, 0), (40, 1), (63, 1), (64, 0), (600, 0)]
)
def test_the_rule_sums_over_all_rows_only_below_twice_copies_times_width(rows, chosen):
    """Two threads, width 16: below 2 x 2 x 16 = 64 rows the weight gradients come from two
    GEMMs over all rows (1), from there from each thread's sums (0); up to 32 rows (one
    block, so one copy) the line is at 2 x 1 x 16 = 32. The two ways round differently in
    float32, so the rule's bits tell which one ran."""
    ops = native.cpu_ops()
    torch.manual_seed(0)
    x, grad = torch.randn(rows, 16), torch.randn(rows, 16)
    weights = (torch.randn(64, 16), torch.randn(64), torch.randn(16, 64), torch.randn(16))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rule, *ways = (backward_of(ops, x, weights, grad, code) for code in (-1, 0, 1))
    finally:
        torch.set_num_threads(previous)
    other = ways[1 - chosen]
    assert all(torch.equal(a, b) for a, b in zip(rule, ways[chosen]))
    assert not all(torch.equal(a, b) for a, b in zip(rule[1:], other[1:]))


def test_the_ab_script_times_the_kernel_against_the_modules(tmp_path, monkeypatch):
    # benchmarks/kernels_feedforward.py: its "modules" variants must really run without the
    # kernel and its "kernel" variants with it.
    from test_dropout import run_ab_script

    from linformer_kit import encoder

    args = ("kernels_feedforward.py", encoder, (16, 32), tmp_path, monkeypatch)
    rows, paths, _ = run_ab_script(*args)
    assert paths == {True, False}
    for row in rows:
        ms = row["median_ms"]
        for name, speedup in row["kernel_speedup"].items():
            assert speedup == pytest.approx(ms[f"{name}, modules"] / ms[f"{name}, kernel"])
        blocks = {"feed-forward", "feed-forward inference", "encoder layer"}
        assert set(row["kernel_speedup"]) == blocks


@pytest.mark.parametrize("frozen", ["weights", "input"])
def test_only_the_gradients_asked_for_are_computed(frozen):
    """Frozen weights: x's gradient alone (equal to the modules'); an input that needs none:
    the weights' alone."""
    ffn = FeedForward(dim=8, hidden_dim=16).double()
    x = torch.randn(3, 20, 8, dtype=torch.float64, requires_grad=frozen == "weights")
    ffn.requires_grad_(frozen == "input")
    grad = torch.randn(3, 20, 8, dtype=torch.float64)
    tensors = [x] if frozen == "weights" else list(ffn.parameters())
    got = torch.autograd.grad(ffn(x), tensors, grad)
    wanted = torch.autograd.grad(modules_path(ffn, x), tensors, grad)
    for a, b in zip(got, wanted):
        torch.testing.assert_close(a, b)
    ops = native.cpu_ops()
    _, hidden = ops.feedforward_forward(x.detach().reshape(-1, 8), *ffn_weights(ffn), 0, True)
    args = (grad.reshape(-1, 8), x.detach().reshape(-1, 8), ffn.up.weight, ffn.down.weight, hidden)
    grads = ops.feedforward_backward(*args, 0, [frozen == "weights", frozen == "input"])
    assert [g.numel() == 0 for g in grads] == [frozen == "input"] + [frozen == "weights"] * 4


def ffn_weights(ffn):
    return (ffn.up.weight, ffn.up.bias, ffn.down.weight, ffn.down.bias)


def test_fake_kernels_agree_with_the_real_ones():
    ops = native.cpu_ops()
    x, w1, b1 = torch.randn(5, 4), torch.randn(6, 4), torch.randn(6)
    w2, b2 = torch.randn(4, 6), torch.randn(4)
    checks = ("test_schema", "test_faketensor")
    for keep in (False, True):
        torch.library.opcheck(
            ops.feedforward_forward, (x, w1, b1, w2, b2, 0, keep), test_utils=checks
        )
    hidden = ops.feedforward_forward(x, w1, b1, w2, b2, 0, True)[1]
    for needs, weight_sums in (([True, True], -1), ([True, False], 0), ([False, True], 1)):
        args = (torch.randn(5, 4), x, w1, w2, hidden, 0, needs, weight_sums)
        torch.library.opcheck(ops.feedforward_backward, args, test_utils=checks)


def test_where_the_modules_are_changed_or_hooked_they_run():
    """A hook (pruning's is a forward pre-hook), another activation or a replaced layer:
    the kernel would compute something else, so the modules run."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 4)
    ffn = FeedForward(dim=4, hidden_dim=6)
    calls = []
    handle = ffn.up.register_forward_pre_hook(lambda module, args: calls.append(1))
    torch.testing.assert_close(ffn(x), modules_path(ffn, x))
    assert calls == [1, 1]
    handle.remove()
    prune.l1_unstructured(ffn.up, "weight", amount=0.5)
    with torch.no_grad():
        ffn.up.weight_orig.mul_(2.0)
    torch.testing.assert_close(ffn(x), modules_path(ffn, x))
    for act in (torch.nn.Identity(), torch.nn.GELU(approximate="tanh")):
        ffn = FeedForward(dim=4, hidden_dim=6)
        ffn.act = act
        torch.testing.assert_close(ffn(x), ffn.down(act(ffn.up(x))), rtol=0, atol=0)


def test_functorch_transforms_and_forward_ad_get_the_modules():
    """torch.func.jvp / grad and forward-mode AD: the kernel has no rules for them."""
    torch.manual_seed(0)
    ffn = FeedForward(dim=4, hidden_dim=6).double()
    x, tangent = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    got = torch.func.jvp(ffn, (x,), (tangent,))
    wanted = torch.func.jvp(lambda t: modules_path(ffn, t), (x,), (tangent,))
    for a, b in zip(got, wanted):
        torch.testing.assert_close(a, b)
    params = dict(ffn.named_parameters())
    loss = lambda p: torch.func.functional_call(ffn, p, (x,)).square().sum()  # noqa: E731
    grads = torch.func.grad(loss)(params)
    loss(params).backward()
    for name, p in ffn.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        out = fwAD.unpack_dual(ffn(fwAD.make_dual(x, tangent)))
    torch.testing.assert_close(out.tangent, wanted[1])


def test_torch_export_keeps_a_plain_aten_graph():
    ffn = FeedForward(dim=4, hidden_dim=6).eval()
    exported = torch.export.export(ffn, (torch.randn(2, 5, 4),))
    assert "linformer_kit" not in str(exported.graph)


def test_vectorized_jacobian_equals_the_modules():
    # jacobian(vectorize=True) vmaps the backward op: it must have vmap's fallback (plain
    # tensor outputs), as the decoder's no-future-leak test needs.
    ffn = FeedForward(dim=4, hidden_dim=6).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    got = torch.autograd.functional.jacobian(ffn, x, vectorize=True)
    wanted = torch.autograd.functional.jacobian(lambda t: modules_path(ffn, t), x)
    torch.testing.assert_close(got, wanted)


def test_relu_passes_nan_as_the_modules_do():
    """A NaN pre-activation stays NaN through ReLU, and its gradient passes (as torch.relu
    and its backward do): the kernel's output and input gradient have the modules' NaNs."""
    torch.manual_seed(0)
    ffn = FeedForward(dim=8, hidden_dim=16, activation="relu")
    x = torch.randn(5, 8)
    x[2, 3] = float("nan")
    grad = torch.randn(5, 8)
    got = outputs_and_grads(ffn, x, grad, ffn)
    wanted = outputs_and_grads(ffn, x, grad, lambda t: modules_path(ffn, t))
    for name, a, b in zip(["out", "x"], got[:2], wanted[:2]):
        assert torch.equal(a.isnan(), b.isnan()), name
        torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), msg=name)
