import pytest
import torch

from linformer_kit import LinformerConfig, LinformerForCausalLM, LinformerForMaskedLM
from linformer_kit.cli import main
from linformer_kit.data.tokenizer import TOKENIZER_NAME, train_tokenizer
from linformer_kit.training import generate_texts

TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int\n    y: int\n"] * 20


@pytest.fixture
def checkpoint(tmp_path):
    tokenizer = train_tokenizer(TEXTS, 300)
    torch.manual_seed(0)
    cfg = LinformerConfig(
        vocab_size=tokenizer.vocab_size, max_seq_len=64, dim=16, depth=1, num_heads=2,
        proj_dim=4, causal=True, block_size=8,
    )  # fmt: skip
    model = LinformerForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    tokenizer.save(tmp_path / TOKENIZER_NAME)
    return tmp_path, model.eval(), tokenizer


def test_generate_prints_the_prompt_and_the_greedy_continuation(checkpoint, capsys):
    path, model, tokenizer = checkpoint
    main(["generate", str(path), "--prompt", "def add", "--max-new-tokens", "12",
          "--temperature", "0"])  # fmt: skip
    ids = tokenizer.encode_batch(["def add"])[0]
    want = model.generate(torch.tensor([ids]), 12, temperature=0)[0].tolist()
    if tokenizer.sep_id in want[len(ids) :]:  # the text ends there
        want = want[: want.index(tokenizer.sep_id, len(ids))]
    out = capsys.readouterr().out
    assert out == tokenizer.tokenizer.decode(want) + "\n"
    assert out.startswith("def add")
    # the library function the command prints
    texts = generate_texts(path, ["def add", "class"], max_new_tokens=12, temperature=0)
    assert texts[0] == out[:-1] and texts[1].startswith("class")
    with pytest.raises(ValueError, match="no prompt given"):  # max() of nothing before
        generate_texts(path, [])


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_generate_continues_several_prompts_each_as_if_alone(checkpoint, capsys, temperature):
    # Sampling (temperature 1) drew every row from one generator: a prompt's text depended on
    # the others beside it; each now has its own, seeded with --seed.
    path, _, _ = checkpoint
    prompts = ["def add", "class Point:\n    x", "y", "def mul"]  # lengths 2-7, two of one
    argv = ["generate", str(path), "--max-new-tokens", "10", "--temperature", temperature]
    alone = []
    for prompt in prompts:
        main([*argv, "--prompt", prompt])
        alone.append(capsys.readouterr().out)
    main([*argv, *(arg for prompt in prompts for arg in ("--prompt", prompt))])
    blocks = [f"==> prompt {i + 1} <==\n{text}" for i, text in enumerate(alone)]
    assert capsys.readouterr().out == "\n".join(blocks)
    with pytest.raises(SystemExit, match=r"prompt '' encodes to no tokens"):
        main([*argv, "--prompt", "def", "--prompt", ""])


def test_generate_by_default_adds_as_many_tokens_as_the_model_has_room_for(checkpoint, capsys):
    # The default of 64 new tokens was refused for any prompt of a max_seq_len-64 model.
    path, model, tokenizer = checkpoint
    ids = tokenizer.encode_batch(["def add"])[0]
    main(["generate", str(path), "--prompt", "def add", "--temperature", "0"])
    want = model.generate(torch.tensor([ids]), 64 - len(ids), temperature=0)[0].tolist()
    if tokenizer.sep_id in want[len(ids) :]:
        want = want[: want.index(tokenizer.sep_id, len(ids))]
    assert capsys.readouterr().out == tokenizer.tokenizer.decode(want) + "\n"
    with pytest.raises(SystemExit, match=r"prompt \(\d+\) \+ max_new_tokens \(64\) = \d+ exceeds"):
        main(["generate", str(path), "--prompt", "def add", "--max-new-tokens", "64"])
    # a prompt that fills max_seq_len was refused naming the default 64 the user never gave
    full = "def add(a, b):\n    return a + b\n" * 40
    width = len(tokenizer.encode_batch([full])[0])
    assert width > 64  # longer than the model takes, or as long
    with pytest.raises(SystemExit, match=rf"longest prompt has {width} tokens, which leaves no"):
        main(["generate", str(path), "--prompt", full])


def test_generate_ends_the_text_at_the_separator_pretraining_put_after_each_document(
    checkpoint, capsys, monkeypatch
):
    path, _, tokenizer = checkpoint
    word = tokenizer.encode_batch([" return"])[0][0]
    picks = iter([word, tokenizer.sep_id, word, word])
    calls = []

    def scripted(logits, temperature, top_k, generator=None):
        calls.append(1)
        return torch.full((logits.shape[0],), next(picks))

    monkeypatch.setattr(LinformerForCausalLM, "sample", staticmethod(scripted))
    main(["generate", str(path), "--prompt", "def add", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    # Before, the separator was dropped by decoding and the next document's text glued on.
    assert out == tokenizer.tokenizer.decode(tokenizer.encode_batch(["def add"])[0] + [word]) + "\n"
    assert len(calls) == 2  # generation stopped at the separator


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "{ckpt}", "--prompt", "def"],
        ["evaluate", "{ckpt}", "--data", "{text}"],
        ["finetune", "--init", "{ckpt}", "--data", "{text}", "--eval", "{text}"],
        ["spectrum", "{ckpt}", "--data", "{text}", "--out", "{ckpt}/spectrum"],
        ["attention-map", "{ckpt}", "--text", "def", "--out", "{ckpt}/map.png"],
    ],
    ids=lambda command: command[0],
)
def test_commands_refuse_a_tokenizer_larger_than_the_model(checkpoint, command):
    # Before, evaluate, finetune and the analysis tools failed in the embedding
    # ("index out of range in self") on the first id past the model's vocabulary.
    path, model, tokenizer = checkpoint
    size = tokenizer.vocab_size
    smaller = model.config.replace(vocab_size=size - 10, proj_dim=None)  # the analysis reads it
    LinformerForCausalLM(smaller).save_pretrained(path)
    text = path / "text.txt"
    text.write_text("".join(TEXTS))
    argv = [arg.format(ckpt=path, text=text) for arg in command]
    with pytest.raises(
        SystemExit,
        match=rf"has {size} token ids \(0 to {size - 1}\) but the model only {size - 10}",
    ):
        main(argv)


def test_generate_refuses_a_masked_lm_checkpoint(checkpoint):
    path, model, _ = checkpoint
    LinformerForMaskedLM(model.config.replace(causal=False)).save_pretrained(path)
    # it said "LinformerForCausalLM needs a config with causal=True", not how to get one
    with pytest.raises(SystemExit, match="is a LinformerForMaskedLM: generate continues text wi"):
        main(["generate", str(path), "--prompt", "def"])


def test_generate_names_a_seed_its_generators_cannot_take(checkpoint):
    path, _, _ = checkpoint  # 10**21 said "Overflow when unpacking long long"
    with pytest.raises(
        SystemExit, match=r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\], got 10{21}"
    ):
        main(["generate", str(path), "--prompt", "def", "--seed", str(10**21)])
