"""Whole models, bf16 and training on a GPU (skipped without one), against float64 or the
CPU: bf16 SDPA cut into query chunks, the attention layer under CUDA autocast, a compiled
encoder, and pretraining on the device, whose saved model the CPU loads.

    python -m pytest tests/test_cuda_models.py   # on a machine with a GPU
"""

import pytest
import torch
import torch.nn.functional as F
from reference import grads
from test_cuda import padded_layer
from test_export_compile import assert_compiled_matches_eager, tiny
from train_helpers import tiny_run

from linformer_kit import LinformerEncoder, LinformerForMaskedLM
from linformer_kit.cut_sdpa import sdpa
from linformer_kit.kernel_rule import choose_splits, use_kernel
from linformer_kit.kernels import dot_product_attention
from linformer_kit.training import pretrain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = torch.device("cuda")


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 products in fp32, as the float64 comparisons assume."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def relative_errors(got, want):
    return [((g.double() - w).norm() / w.norm()).item() for g, w in zip(got, want)]


def test_bf16_sdpa_cut_as_the_rule_cuts_it_is_as_close_as_one_call():
    # bf16 (flash) is cut from n 65536: B 1, H 4, k 256, head_dim 64. The chunks' output and
    # gradients are as far from float64 as one uncut bf16 call's (rounding, not the cut).
    torch.manual_seed(0)
    q = torch.randn(1, 65536, 4, 64, device=GPU, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(1, 4, 256, 64, device=GPU, dtype=torch.bfloat16) for _ in "kv")
    call = dict(dtype=q.dtype, backward=True, causal=False, queries=65536, keys=256, groups=4)
    splits = choose_splits(device=GPU, **call)
    assert splits > 1
    reference = grads(F.scaled_dot_product_attention, *(t.double() for t in (q, k, v)))
    cut = relative_errors(grads(lambda *t: sdpa(*t, splits=splits), q, k, v), reference)
    whole = relative_errors(grads(F.scaled_dot_product_attention, q, k, v), reference)
    ruled = relative_errors(grads(dot_product_attention, q, k, v), reference)
    for c, r, w in zip(cut, ruled, whole):
        assert c <= 1.5 * w + 1e-3 and r <= 1.5 * w + 1e-3, (cut, ruled, whole)


@pytest.mark.parametrize("kernel", [None, "explicit", "sdpa"])
def test_the_layer_under_cuda_autocast_is_within_bf16_rounding_of_float64(kernel):
    # The attention layer (k 256, n 16384, padding) under torch.autocast("cuda", bf16) on
    # the rule's kernel or a pinned one: output and input gradient within 2 % (relative
    # norm) of the same layer in float64; the padded positions change nothing.
    layer, x, mask = padded_layer()

    def run(t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return layer(t, mask)[0]

    with use_kernel(kernel):
        out, grad_x = grads(run, x)
    assert out.dtype == torch.bfloat16
    wide = layer.double()
    want = grads(lambda t: wide(t, mask)[0], x.double())
    assert max(relative_errors((out, grad_x), want)) < 2e-2
    layer.float()
    changed = x.clone()
    changed[1, 12000:] = 7.0
    with use_kernel(kernel):
        changed_out = grads(run, changed)[0]
    torch.testing.assert_close(changed_out[1, :12000], out[1, :12000], rtol=0, atol=1e-2)


def test_a_compiled_encoder_on_a_gpu_gives_its_eager_output_and_gradients():
    torch._dynamo.reset()
    assert_compiled_matches_eager(LinformerEncoder(tiny(depth=2)).to(GPU), "inductor")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pretraining_on_a_gpu_learns_and_saves_a_model_the_cpu_loads(tmp_path, precision):
    pytest.importorskip("tokenizers")  # (a GPU image may lack the package's own dependencies)
    run = tiny_run(
        tmp_path, max_steps=40, eval_every=20, save_every=20, device="cuda", precision=precision
    )
    result = pretrain(run)
    val = [r["val_loss"] for r in result.records if r["split"] == "val"]
    assert len(val) == 2 and val[-1] < val[0] - 0.3
    on_cpu = LinformerForMaskedLM.from_pretrained(tmp_path / "run" / "best").eval()
    on_gpu = LinformerForMaskedLM.from_pretrained(tmp_path / "run" / "best").to(GPU).eval()
    ids = torch.randint(5, 300, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = on_cpu(ids).logits
        got = on_gpu(ids.to(GPU)).logits.cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
