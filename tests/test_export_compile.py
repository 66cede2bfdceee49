"""torch.export and torch.compile give the eager results (forward, and backward for compile)."""

import pytest
import torch
import torch._dynamo.testing

from linformer_kit import (
    LinformerEncoder,
    LinformerForCausalLM,
    LinformerForMaskedLM,
    LinformerModel,
    linformer_tiny,
    native,
)
from linformer_kit.kernel_rule import use_kernel

KINDS = ["exact", "linear", "conv", "pool", "random", "adaptive"]
B, N, DIM = 3, 20, 32


def tiny(name="linear", **changes):
    kind = dict(proj_dim=None) if name == "exact" else dict(projection=name)
    base = dict(vocab_size=100, max_seq_len=64, dim=DIM, depth=2, num_heads=4, proj_dim=16)
    return linformer_tiny(**{**base, "dropout": 0.0, "attention_dropout": 0.0, **kind, **changes})


def encoder_inputs(seed=0, lengths=(N, N // 2, 5)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), N, DIM, generator=gen)
    mask = torch.arange(N)[None, :] < torch.tensor(lengths)[:, None]
    return x, mask


@pytest.mark.parametrize("name", KINDS)
def test_exported_encoder_matches_eager(name):
    encoder = LinformerEncoder(tiny(name)).eval()
    x, mask = encoder_inputs()
    program = torch.export.export(encoder, (x, mask))
    exported = program.module()
    torch.testing.assert_close(exported(x, mask)[0], encoder(x, mask)[0], rtol=1e-5, atol=1e-6)
    # New inputs of the same shape: neither the data nor the mask was baked in as a constant.
    x2, mask2 = encoder_inputs(seed=1, lengths=(7, N, 1))
    torch.testing.assert_close(exported(x2, mask2)[0], encoder(x2, mask2)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_cls", [LinformerModel, LinformerForMaskedLM])
def test_exported_model_matches_eager(model_cls):
    model = model_cls(tiny()).eval()
    ids = torch.randint(0, 100, (B, N), generator=torch.Generator().manual_seed(0))
    _, mask = encoder_inputs()
    program = torch.export.export(model, (ids, mask))
    got, expected = program.module()(ids, mask), model(ids, mask)
    assert type(got) is type(expected)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state)


def forward_backward(encoder, run, x, mask):
    """Output, input gradient and parameter gradients of a fixed linear read-out of `run`
    (the encoder itself or a compiled version of it)."""
    encoder.zero_grad()
    x = x.clone().requires_grad_()
    out = run(x, mask)[0]
    (out * torch.linspace(-1.0, 1.0, DIM, device=out.device)).sum().backward()
    params = {n: p.grad.clone() for n, p in encoder.named_parameters()}
    return out.detach(), x.grad, params


def assert_compiled_matches_eager(encoder, backend):
    """`encoder` compiled with `backend` gives its eager output and gradients (1e-4), on
    the encoder's device."""
    device = next(encoder.parameters()).device
    x, mask = (t.to(device) for t in encoder_inputs())
    out, x_grad, grads = forward_backward(encoder, encoder, x, mask)
    compiled = torch.compile(encoder, backend=backend)
    c_out, c_x_grad, c_grads = forward_backward(encoder, compiled, x, mask)
    close = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c_out, out, **close)
    torch.testing.assert_close(c_x_grad, x_grad, **close)
    for name in grads:
        torch.testing.assert_close(c_grads[name], grads[name], **close, msg=name)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_encoder_matches_eager(backend):
    torch._dynamo.reset()
    assert_compiled_matches_eager(LinformerEncoder(tiny(depth=1)), backend)


@pytest.mark.parametrize("checkpointing", ["layer", "attention"])
@pytest.mark.parametrize("pinned", [None, "sdpa"])
def test_compiled_encoder_with_checkpointing_matches_eager(checkpointing, pinned):
    # Checkpointing's recomputation under the forward's kernel pin (`checkpointed`) gave
    # checkpoint a nested context_fn, which dynamo refuses: every compiled run with
    # checkpointing failed at its first step.
    torch._dynamo.reset()
    encoder = LinformerEncoder(tiny(depth=2, checkpointing=checkpointing)).train()
    with use_kernel(pinned):
        assert_compiled_matches_eager(encoder, "aot_eager")


def test_compiled_training_with_attention_dropout_does_not_recompile_for_every_length():
    # With dropout on CPU attention takes the explicit kernel, whose loop over blocks of
    # rows depends on N; under torch.compile it runs one block, so a new length costs at
    # most one recompile (to a dynamic shape), not one graph per length. Through AOT
    # autograd, which traces the backward too: the kernel's C++ backward once read its
    # gradient's strides as ints, fixing N in every graph.
    if native.cpu_ops() is None:  # built in eager mode first, as a training script would
        pytest.skip("no C++ compiler here: the compiled kernel cannot be built")
    torch._dynamo.reset()
    config = tiny(max_seq_len=256, depth=1, dropout=0.1, attention_dropout=0.1)
    encoder = LinformerEncoder(config).train()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(encoder, backend=counter)
    for n in range(40, 140, 10):
        compiled(torch.randn(2, n, DIM, requires_grad=True))[0].sum().backward()
    assert counter.frame_count <= 2


def test_the_loss_without_logits_compiles_one_graph_for_all_lengths_and_scores_the_same():
    # The chunked loss (return_logits=False) looped over chunks of B x N rows in Python:
    # dynamo pinned the row count, one graph per length (a causal LM's and a seq2seq
    # model's training under --compile). Compiled it now makes one chunk.
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = tiny(max_seq_len=256, depth=1, causal=True, block_size=8)
    model = LinformerForCausalLM(config).train()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    for n in (40, 56, 72):  # the old code: a graph each
        ids = torch.randint(0, 100, (2, n))
        loss = compiled(ids, labels=ids, return_logits=False).loss
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        eager = model(ids, labels=ids, return_logits=False).loss
        eager.backward()
        torch.testing.assert_close(loss, eager)
        for compiled_grad, p in zip(grads, model.parameters(), strict=True):
            torch.testing.assert_close(compiled_grad, p.grad)
        model.zero_grad()
    assert counter.frame_count <= 2


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16 autocast"])
def test_compiled_training_with_dropout_runs_the_compiled_cpu_kernels_as_eager_does(bf16):
    # The C++ dropout, attention and feed-forward kernels are custom ops with fake kernels:
    # torch.compile traces them as graph nodes, with no graph break, and (aot_eager draws the
    # seeds from the same generator as eager) the same masks give the same outputs and
    # gradients. Under bf16 autocast the attention kernel runs in bf16 (its logsumexp
    # float32, as the fake kernel says) and the feed-forward block as PyTorch's modules.
    if native.cpu_ops() is None:
        pytest.skip("no C++ compiler here: the compiled kernels cannot be built")
    torch._dynamo.reset()
    encoder = LinformerEncoder(tiny(depth=1, dropout=0.1, attention_dropout=0.2)).train()
    x, mask = encoder_inputs()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with autocast:
        explained = torch._dynamo.explain(encoder)(x, mask)
    assert explained.graph_break_count == 0
    ops = {str(node.target) for graph in explained.graphs for node in graph.graph.nodes}
    kernels = {"attention_forward", "dropout_forward"}
    kernels |= set() if bf16 else {"feedforward_forward"}
    assert {f"linformer_kit.{name}" for name in kernels} <= ops
    compiled = torch.compile(encoder, backend="aot_eager")
    results = []
    for run in (encoder, compiled):
        torch.manual_seed(7)
        with autocast:
            results.append(forward_backward(encoder, run, x, mask))
    (out, x_grad, grads), (c_out, c_x_grad, c_grads) = results
    close = dict(rtol=1e-2, atol=1e-2) if bf16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c_out, out, **close)
    torch.testing.assert_close(c_x_grad, x_grad, **close)
    for name in grads:
        torch.testing.assert_close(c_grads[name], grads[name], **close, msg=name)


def test_compiled_training_on_the_pytorch_ops_explicit_kernel_matches_eager(
    monkeypatch, explicit_calls
):
    # What a GPU runs under torch.compile in fp32 training from n = 4096 (`kernel_rule`):
    # the PyTorch-ops explicit kernel, its dropout mask by position and the padding mask,
    # as Inductor generates them. Here on CPU with the compiled C++ kernels off and the
    # kernel pinned; Inductor's random ops fall back to eager's, so one seed gives the same
    # masks: the same outputs and gradients.
    from linformer_kit import native
    from linformer_kit.kernel_rule import use_kernel

    monkeypatch.setenv(native.ENV_SWITCH, "0")
    torch._dynamo.reset()
    encoder = LinformerEncoder(tiny(depth=1, attention_dropout=0.2)).train()
    x, mask = encoder_inputs()
    compiled = torch.compile(encoder)
    results = []
    with use_kernel("explicit"), torch._inductor.config.patch(fallback_random=True):
        for run in (encoder, compiled):
            torch.manual_seed(7)
            results.append(forward_backward(encoder, run, x, mask))
    (out, x_grad, grads), (c_out, c_x_grad, c_grads) = results
    assert explicit_calls  # the pinned kernel ran (eager, and once more when traced) ...
    assert not torch.equal(out, encoder(x, mask)[0])  # ... with dropout: new seed, new mask
    close = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c_out, out, **close)
    torch.testing.assert_close(c_x_grad, x_grad, **close)
    for name in grads:
        torch.testing.assert_close(c_grads[name], grads[name], **close, msg=name)
