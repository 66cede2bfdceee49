"""torch.func through the library: `grad` over `functional_call` and per-sample gradients by
`vmap(grad)` give autograd's gradients. Inside a transform the compiled kernels, the
explicit attention kernel and the chunked loss (autograd Functions, which have no batching
rules) step aside for SDPA, PyTorch's modules and `F.cross_entropy`."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from linformer_kit import LinformerConfig, LinformerForCausalLM, LinformerForMaskedLM
from linformer_kit.dropout import Dropout
from linformer_kit.encoder import LinformerEncoderLayer
from linformer_kit.kernel_rule import use_kernel
from linformer_kit.losses import linear_cross_entropy
from linformer_kit.projection import MatrixProjection


def encoder_layer(seed: int = 0) -> LinformerEncoderLayer:
    torch.manual_seed(seed)
    proj = MatrixProjection(max_seq_len=48, proj_dim=16)
    return LinformerEncoderLayer(
        dim=32, num_heads=4, max_seq_len=48, proj_k=proj, proj_v=proj, ffn_dim=64
    ).train()  # dropout 0: training mode, the same function every call


def call(layer: LinformerEncoderLayer, params: dict, *args: torch.Tensor) -> torch.Tensor:
    """The layer's output with `params`. tie_weights=False: the shared projection is one
    module under two names (attn.proj_k, attn.proj_v), which torch's default tying leaves
    holding the replacement tensor after the call (pytorch/pytorch#164759, torch 2.13); the
    one slot serves both names either way."""
    return functional_call(layer, params, args, tie_weights=False)[0]


def close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kernel", [None, "explicit"])
@pytest.mark.parametrize("padded", [False, True])
def test_grad_over_functional_call_gives_autograds_gradients(kernel, padded):
    layer = encoder_layer()
    x, target = torch.randn(2, 48, 32), torch.randn(2, 48, 32)
    mask = torch.ones(2, 48, dtype=torch.bool)
    if padded:
        mask[1, 30:] = False

    def loss(params: dict) -> torch.Tensor:
        out = call(layer, params, x, mask)
        return ((out - target) * mask[..., None]).square().sum()

    params = {name: p.detach() for name, p in layer.named_parameters()}
    with use_kernel(kernel):  # a pin to the explicit kernel too gives way inside
        got = grad(loss)(params)
        layer.zero_grad()
        loss(dict(layer.named_parameters())).backward()
    close(got, {name: p.grad for name, p in layer.named_parameters()})


def test_per_sample_gradients_by_vmap_of_grad():
    layer = encoder_layer(1)
    x, target = torch.randn(3, 48, 32), torch.randn(3, 48, 32)
    params = {name: p.detach() for name, p in layer.named_parameters()}

    def loss(params: dict, sample: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        out = call(layer, params, sample[None])
        return (out[0] - wanted).square().sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, target)
    for i in range(3):
        layer.zero_grad()
        loss(dict(layer.named_parameters()), x[i], target[i]).backward()
        got = {name: g[i] for name, g in per_sample.items()}
        close(got, {name: p.grad for name, p in layer.named_parameters()})


def test_the_chunked_loss_inside_grad_is_cross_entropy():
    hidden, weight = torch.randn(2, 7, 16), torch.randn(50, 16)
    targets = torch.randint(0, 50, (2, 7))
    targets[0, 3] = -100
    got = grad(lambda w: linear_cross_entropy(hidden, w, targets, rows_per_chunk=3))(weight)
    want = grad(lambda w: F.cross_entropy(F.linear(hidden, w).flatten(0, 1), targets.flatten()))
    torch.testing.assert_close(got, want(weight), atol=1e-5, rtol=1e-5)


def test_dropout_inside_grad_is_torchs():
    drop = Dropout(0.5).train()
    torch.manual_seed(0)
    got = grad(lambda t: drop(t).sum())(torch.randn(4, 64))
    # the gradient is the mask over 1 - p: every element 0 or 2, both present
    assert set(got.unique().tolist()) == {0.0, 2.0}


def language_model(causal: bool) -> LinformerForCausalLM | LinformerForMaskedLM:
    torch.manual_seed(0)
    sizes = {"vocab_size": 64, "dim": 32, "depth": 2, "num_heads": 4, "max_seq_len": 128}
    config = LinformerConfig(
        **sizes, proj_dim=16, dropout=0.0, attention_dropout=0.0, causal=causal
    )
    return (LinformerForCausalLM if causal else LinformerForMaskedLM)(config).train()


def lm_loss(model, params: dict, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss as the trainers ask for it (`return_logits=False`: the chunked loss)."""
    kwargs = {"labels": labels, "return_logits": False}
    return functional_call(model, params, (ids,), kwargs, tie_weights=False).loss


@pytest.mark.parametrize("causal", [False, True])
def test_language_models_under_grad(causal):
    # the masked LM's head at the scored positions, the causal LM's block attention, the
    # loss (chunked outside a transform, F.cross_entropy inside)
    model = language_model(causal)
    ids = torch.randint(0, 64, (2, 128))
    labels = ids.clone() if causal else torch.where(torch.rand(2, 128) < 0.3, ids, -100)
    params = {name: p.detach() for name, p in model.named_parameters()}
    with use_kernel("explicit"):
        got = grad(lambda p: lm_loss(model, p, ids, labels))(params)
        lm_loss(model, dict(model.named_parameters()), ids, labels).backward()
    close(got, {name: p.grad for name, p in model.named_parameters()})


def test_per_sample_gradients_of_a_language_model_with_per_sample_labels():
    # vmapped targets: the loss's data-dependent range check must not run inside vmap
    model = language_model(causal=True)
    ids = torch.randint(0, 64, (3, 128))
    params = {name: p.detach() for name, p in model.named_parameters()}
    one = lambda p, x: lm_loss(model, p, x[None], x[None])  # noqa: E731
    per_sample = vmap(grad(one), in_dims=(None, 0))(params, ids)
    for i in (0, 2):
        model.zero_grad()
        one(dict(model.named_parameters()), ids[i]).backward()
        got = {name: g[i] for name, g in per_sample.items()}
        close(got, {name: p.grad for name, p in model.named_parameters()})
