import numpy as np
import pytest
import torch

from linformer_kit import LinformerConfig, linformer_base, linformer_small, linformer_tiny
from linformer_kit.checks import check_finite_non_negative
from linformer_kit.config import proj_dim_schedule
from linformer_kit.training.settings import TrainSettings


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dim": 0}, r"dim must be an integer >= 1, got 0"),
        ({"dim": 30, "num_heads": 4}, r"dim \(30\) must be divisible by num_heads \(4\)"),
        ({"proj_dim": 0}, r"proj_dim must be an integer in \[1, max_seq_len=64\], got 0"),
        ({"proj_dim": 65}, r"proj_dim must be an integer in \[1, max_seq_len=64\], got 65"),
        ({"proj_dim": [8, 8, 8]}, r"one k per layer: got 3 values for depth 2"),
        ({"proj_dim": [16, 8]}, r"sharing='layerwise'.*cannot have a different k per layer"),
        ({"projection": "pool", "proj_dim": 12}, r"proj_dim \(12\) must divide max_seq_len \(64\)"),
        (
            {"projection": "fft"},
            r"projection must be one of linear, conv, pool, random, adaptive; got 'fft'",
        ),
        ({"sharing": "all"}, r"sharing must be one of none, headwise, kv, layerwise; got 'all'"),
        ({"activation": "tanh"}, r"activation must be one of gelu, relu"),
        ({"position": "rope"}, r"position must be one of learned, sinusoidal"),
        ({"checkpointing": "full"}, r"checkpointing must be one of none, layer, attention"),
        ({"dropout": 1.0}, r"dropout must be a float in \[0, 1\), got 1.0"),
        ({"attention_dropout": -0.1}, r"attention_dropout must be a float in \[0, 1\)"),
        ({"pad_token_id": 100}, r"pad_token_id must be an integer in \[0, 100\), got 100"),
        ({"pad_token_id": True}, r"pad_token_id must be an integer in \[0, 100\), got True"),
        ({"norm_first": "no"}, r"norm_first must be True or False, got 'no'"),
        ({"pooler": 1}, r"pooler must be True or False, got 1"),
        ({"layer_norm_eps": "1e-5"}, r"layer_norm_eps must be a finite number > 0, got '1e-5'"),
        ({"init_std": 0.0}, r"init_std must be a finite number > 0, got 0.0"),
        # nan and inf passed `<= 0`: a traceback in the init, or training that diverged
        ({"init_std": float("nan")}, r"init_std must be a finite number > 0, got nan"),
        ({"layer_norm_eps": float("inf")}, r"layer_norm_eps must be a finite number > 0, got inf"),
        ({"dropout": True}, r"dropout must be a float in \[0, 1\), got True"),
        ({"type_vocab_size": -1}, r"type_vocab_size must be an integer >= 0"),
        ({"ffn_dim": 0}, r"ffn_dim must be an integer >= 1"),
    ],
)
def test_bad_values_are_named_with_allowed_range(changes, message):
    base = dict(vocab_size=100, max_seq_len=64, dim=32, depth=2, num_heads=4, proj_dim=16)
    with pytest.raises(ValueError, match=message):
        LinformerConfig(**{**base, **changes})


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        LinformerConfig(100)  # type: ignore[misc]


def test_per_layer_k_allowed_without_layerwise_sharing():
    cfg = linformer_tiny(proj_dim=[32, 16], sharing="headwise")
    assert cfg.proj_dims == [32, 16]


def test_round_trip_and_unknown_fields():
    cfg = linformer_tiny(proj_dim=[32, 16], sharing="kv", position="sinusoidal")
    assert LinformerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown LinformerConfig fields \['hidden'\]"):
        LinformerConfig.from_dict({**cfg.to_dict(), "hidden": 3})
    # replace (and from_pretrained's config_overrides) gave dataclasses' TypeError, no list
    with pytest.raises(ValueError, match=r"unknown LinformerConfig fields \['hiden'\]; known"):
        cfg.replace(hiden=3)


def test_presets_and_derived_fields():
    base = linformer_base()
    assert (base.dim, base.depth, base.num_heads, base.head_dim) == (768, 12, 12, 64)
    assert base.hidden_ffn_dim == 3072 and not base.norm_first
    assert linformer_small().max_seq_len == 4096
    assert linformer_tiny(proj_dim=None).is_exact
    with pytest.raises(ValueError, match="got 0"):
        linformer_tiny(depth=0)


def test_proj_dim_schedule_is_non_increasing_between_the_bounds():
    dims = proj_dim_schedule(256, 64, 12, multiple_of=32)
    assert dims[0] == 256 and dims[-1] == 64 and len(dims) == 12
    assert all(a >= b for a, b in zip(dims, dims[1:]))
    assert all(k % 32 == 0 for k in dims)
    assert proj_dim_schedule(128, 128, 3) == [128, 128, 128]
    with pytest.raises(ValueError, match="1 <= multiple_of <= last <= first"):
        proj_dim_schedule(64, 128, 4)
    # a multiple above `last` gave k above `first`: (4, 2) in multiples of 8 was [8, 8, 8]
    with pytest.raises(ValueError, match="got depth=3, first=4, last=2, multiple_of=8"):
        proj_dim_schedule(4, 2, 3, multiple_of=8)
    assert min(proj_dim_schedule(100, 10, 5, multiple_of=8)) == 8  # rounded down, as it says
    # a str or None failed in a comparison; multiple_of 2.5 gave floats the config refused
    for args, named in [(("256", 64, 4), "first"), ((256, 64, None), "depth")]:
        with pytest.raises(ValueError, match=rf"^{named} must be an integer >= 1, got"):
            proj_dim_schedule(*args)
    with pytest.raises(ValueError, match=r"^multiple_of must be an integer >= 1, got 2.5"):
        proj_dim_schedule(256, 64, 4, multiple_of=2.5)


def test_numbers_of_any_kind_pass_the_numeric_checks_and_other_types_are_named():
    # numpy scalars and 0-d tensors passed the range checks before they were typed, and a
    # string or None from a hand-edited run_config.json was a TypeError
    for value in (np.float32(0.7), np.int64(1), torch.tensor(0.7), 0.5, 2):
        check_finite_non_negative("temperature", value)
    TrainSettings(lr=np.float32(1e-3), beta2=np.float32(0.98), weight_decay=np.float32(0.01))
    for value in ("0.1", None, True):
        with pytest.raises(ValueError, match="weight_decay must be a finite number >= 0"):
            TrainSettings(weight_decay=value)
