"""The training loop: learning, exact resume, accumulation, bf16, schedules, settings."""

import copy
import dataclasses
import importlib
import json
import logging
import math
import os
import shutil
import sys
import types

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters
from train_helpers import tiny_run

from linformer_kit import (
    LinformerConfig,
    LinformerForCausalLM,
    LinformerForMaskedLM,
    LinformerForSequenceClassification,
    LinformerModel,
    files,
    hub,
    native,
)
from linformer_kit.data.cache import PackedBlocks
from linformer_kit.data.tokenizer import train_tokenizer
from linformer_kit.kernel_rule import pinned_kernel
from linformer_kit.training import (
    RunConfig,
    Trainer,
    TrainSettings,
    checkpoint,
    loop,
    lr_factor,
    pretrain,
)
from linformer_kit.training.batches import LMBatches, LMEvaluator, RowSchedule, language_model_loss
from linformer_kit.training.checkpoint import latest_checkpoint, load_checkpoint, restore_rng
from linformer_kit.training.distributed import Distributed, resolve_device
from linformer_kit.training.metrics_log import MetricsLog
from linformer_kit.training.optim import (
    apply_settings,
    build_optimizer,
    build_scheduler,
    load_optimizer_state,
)
from linformer_kit.training.pretrain import _same_setting, build_trainer, prepare_data
from linformer_kit.training.resume import check_resumable
from linformer_kit.training.seq2seq import Seq2SeqBatches


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir):
    return [(r["step"], r["loss"]) for r in records(run_dir) if r["split"] == "train"]


def test_tiny_pretraining_lowers_validation_loss(tmp_path, capsys):
    result = pretrain(tiny_run(tmp_path, max_steps=40, eval_every=20, save_every=20))
    val = [r["val_loss"] for r in result.records if r["split"] == "val"]
    assert len(val) == 2
    # Each validation is printed as it ends (to stderr, above the progress bar).
    printed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("run ")]
    assert [line.split(", ")[0] for line in printed] == [
        f"run step {step}: val_loss {loss:.4g}" for step, loss in zip((20, 40), val)
    ]
    assert val[-1] < val[0] - 0.3
    start = torch.log(torch.tensor(300.0)).item()  # a uniform guess over the vocabulary
    assert val[-1] < start - 1.5


def test_language_model_loss_runs_the_heads_without_logits(monkeypatch):
    """The trainers' loss: a masked LM's with `scored_only` and both LMs' with
    `return_logits=False`, the loss unchanged."""
    config = LinformerConfig(
        vocab_size=50, max_seq_len=16, dim=16, depth=1, num_heads=2, proj_dim=8
    )
    ids = torch.randint(5, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.arange(16) % 4 == 0, ids, -100)
    mlm = LinformerForMaskedLM(config).eval()
    clm = LinformerForCausalLM(config.replace(causal=True, block_size=4)).eval()
    calls = []
    for model in (mlm, clm):
        monkeypatch.setattr(
            model, "forward", lambda m=model, **kw: calls.append(kw) or type(m).forward(m, **kw)
        )
    loss = language_model_loss(mlm, {"input_ids": ids, "labels": labels}, causal=False)
    assert calls[-1]["scored_only"] is True and calls[-1]["return_logits"] is False
    torch.testing.assert_close(loss, type(mlm).forward(mlm, ids, labels=labels).loss)
    loss = language_model_loss(clm, {"input_ids": ids, "labels": ids}, causal=True)
    assert calls[-1]["return_logits"] is False and "scored_only" not in calls[-1]
    torch.testing.assert_close(loss, type(clm).forward(clm, ids, labels=ids).loss)


def test_kill_and_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    full = pretrain(tiny_run(tmp_path / "a", max_steps=12, save_every=4))
    run = tiny_run(tmp_path / "b", max_steps=12, save_every=4)

    real_step = Trainer._train_step

    def killed_at_step_7(self, model):
        if self.step == 7:
            raise KeyboardInterrupt("simulated kill")
        return real_step(self, model)

    monkeypatch.setattr(Trainer, "_train_step", killed_at_step_7)
    with pytest.raises(KeyboardInterrupt):
        pretrain(run)
    monkeypatch.setattr(Trainer, "_train_step", real_step)
    run.train.resume = True
    resumed = pretrain(run)  # continues from step 4 (the last checkpoint before the kill)

    assert train_losses(tmp_path / "b" / "run") == train_losses(tmp_path / "a" / "run")
    finals = [r for r in resumed.records if r["split"] == "val"]
    assert finals[-1]["val_loss"] == full.final["val_loss"]
    a = torch.load(tmp_path / "a/run/last/trainer_state.pt", weights_only=True)
    b = torch.load(tmp_path / "b/run/last/trainer_state.pt", weights_only=True)
    assert a["step"] == b["step"] == 12 and a["data_position"] == b["data_position"]
    assert torch.equal(a["rng"][0], b["rng"][0])


def test_a_run_stopped_between_a_best_checkpoint_and_its_link_resumes_with_it_best(
    tmp_path, monkeypatch
):
    run = tiny_run(tmp_path, max_steps=4, eval_every=2, save_every=2, keep_last=1)
    point, stopped = checkpoint._point, []

    def stopped_before_best_moves_to_step_4(link, target):
        if link.name == "best" and target.name == "step-00000004":
            stopped.append(target)  # a Ctrl-C after the checkpoint and `last`
            raise KeyboardInterrupt
        point(link, target)

    monkeypatch.setattr(checkpoint, "_point", stopped_before_best_moves_to_step_4)
    with pytest.raises(KeyboardInterrupt):
        pretrain(run)
    assert stopped, "step 4 was no better than step 2: the run did not reach the stop"
    monkeypatch.setattr(checkpoint, "_point", point)
    assert (tmp_path / "run/best").resolve().name == "step-00000002"
    run.train.resume = True
    pretrain(run)  # at max_steps: nothing to train
    # `best` stayed on step 2, a worse model (and step 4, the best, was pruned at the next
    # save unless a later step beat it)
    assert (tmp_path / "run/best").resolve().name == "step-00000004"
    run.train.max_steps = 6
    pretrain(run)
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").open()]
    losses = {r["step"]: r["val_loss"] for r in records if r["split"] == "val"}
    best = min(losses, key=losses.get)
    assert (tmp_path / "run/best").resolve().name == f"step-{best:08d}"
    assert (tmp_path / "run/last").resolve().name == "step-00000006"
    # a run folder reached through a link: `last` was pointed relative to the link, at
    # nothing
    (tmp_path / "link").symlink_to(tmp_path / "run")
    run.train.output_dir = str(tmp_path / "link")
    pretrain(run)  # at max_steps
    assert os.readlink(tmp_path / "run/last") == "checkpoints/step-00000006"


@pytest.mark.parametrize(
    ("loss", "weights"), [("nan", "finite"), ("nan", "nan"), ("finite", "nan")]
)
def test_a_run_stops_when_its_weights_are_nan_whatever_the_loss_and_before_saving(
    tmp_path, monkeypatch, loss, weights
):
    real_step = Trainer._train_step

    def broken_at_step_3(self, model):
        step_loss, tokens, lr = real_step(self, model)
        if self.step == 2:  # the third step
            if loss == "nan":  # a batch with no scored token has a nan loss
                step_loss = float("nan")
            if weights == "nan":  # the update broke the weights (measured before it: any loss)
                with torch.no_grad():
                    next(self.model.parameters()).fill_(float("nan"))
        return step_loss, tokens, lr

    monkeypatch.setattr(Trainer, "_train_step", broken_at_step_3)
    run = tiny_run(tmp_path, max_steps=4, eval_every=2, save_every=2)
    if weights == "finite":
        assert pretrain(run).final["val_loss"] < 10  # went on to the end
        return
    before = "nan" if loss == "nan" else r"\d"
    message = (
        rf"training diverged at step 3: 1 of \d+ weight tensors .* loss before it was {before}"
    )
    with pytest.raises(ValueError, match=message):
        pretrain(run)
    state = torch.load(tmp_path / "run/last/trainer_state.pt", weights_only=True)
    assert state["step"] == 2  # nothing saved after the weights went bad
    saved = hub.read_weights(tmp_path / "run/last")
    assert all(t.isfinite().all() for t in saved.values())


def test_resume_refuses_another_architecture_and_takes_new_dropout(tmp_path):
    # Weights of the same shapes loaded into a relu model without a word before.
    pretrain(tiny_run(tmp_path, max_steps=2, eval_every=2, save_every=2))
    last = (tmp_path / "run/last").resolve()
    for change, message in [
        (dict(activation="relu"), "activation 'relu' \\(the checkpoint's: 'gelu'\\)"),
        (dict(position="sinusoidal", norm_first=False), "norm_first False .* position"),
    ]:
        run = tiny_run(tmp_path, max_steps=4, eval_every=2, save_every=2, resume=True)
        run.model = dataclasses.replace(run.model, **change)
        with pytest.raises(ValueError, match=rf"--resume continues the model saved in .*{message}"):
            pretrain(run)
        assert (tmp_path / "run/last").resolve() == last  # the run is left as it was
    run = tiny_run(tmp_path, max_steps=4, eval_every=2, save_every=2, resume=True)
    run.model = dataclasses.replace(run.model, dropout=0.0, attention_dropout=0.0)
    assert pretrain(run).steps == 4


def test_resume_refuses_another_split_order_or_world_of_processes(tmp_path, caplog):
    # A changed --val-fraction redrew the split (blocks trained on came to be scored), and
    # --batch-size / --seed moved the data order: accepted without a word.
    pretrain(tiny_run(tmp_path, max_steps=2, eval_every=2, save_every=2))
    for section, change, flag in [
        ("data", dict(val_fraction=0.5), "--val-fraction 0.5 \\(the run's: 0.1\\)"),
        ("train", dict(batch_size=2, seed=5), "--batch-size 2 .*, --seed 5 \\(the run's: 0\\)"),
    ]:
        run = tiny_run(tmp_path, max_steps=4, eval_every=2, save_every=2, resume=True)
        setattr(run, section, dataclasses.replace(getattr(run, section), **change))
        with pytest.raises(ValueError, match=f"--resume continues the pretraining of .*{flag}"):
            pretrain(run)
    checkpoint = latest_checkpoint(tmp_path / "run")
    model = LinformerForMaskedLM.from_pretrained(checkpoint.path)
    with pytest.raises(ValueError, match="was trained by 1 processes: resume it on as many"):
        check_resumable(checkpoint, model, world_size=2)
    # a --max-steps the run has passed ended with status 0 and no word
    run = tiny_run(tmp_path, max_steps=1, eval_every=1, save_every=1, resume=True)
    with caplog.at_level(logging.WARNING):
        assert pretrain(run).steps == 2
    assert "the run is at step 2, max_steps 1: nothing to train" in caplog.text
    # a corpus path relative to where the run started cannot be compared from elsewhere (a
    # warning), but the stdlib for it (a --data forgotten) or another count is refused
    corpus = run.data.data[0]
    assert _same_setting("data", [corpus], ["no/such/corpus"]) is None
    assert _same_setting("data", ["stdlib"], ["no/such/corpus"]) is False
    assert _same_setting("data", [corpus, corpus], ["no/such/corpus"]) is False
    assert _same_setting("data", ["stdlib", corpus + "/"], ["stdlib", corpus]) is True
    # the same corpus spelt otherwise (a tuple, a trailing slash) is the same data
    run = tiny_run(tmp_path, max_steps=3, eval_every=3, save_every=3, resume=True)
    run.data = dataclasses.replace(run.data, data=(run.data.data[0] + "/",))
    assert pretrain(run).steps == 3


def test_a_full_disk_during_a_save_is_named_with_the_way_on(tmp_path, monkeypatch):
    # torch.save on a full disk said "unexpected pos 210560 vs 210448" in a traceback that
    # named neither the disk nor the last intact checkpoint.
    from linformer_kit.cli.overrides import USER_ERRORS
    from linformer_kit.training import checkpoint as checkpoint_module

    pretrain(tiny_run(tmp_path, max_steps=2, eval_every=2, save_every=2))
    run = tiny_run(tmp_path, max_steps=4, eval_every=2, save_every=2, resume=True)

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2 vs 1")

    monkeypatch.setattr(checkpoint_module.torch, "save", full)
    free = types.SimpleNamespace(free=2**20)
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda path: free)
    with pytest.raises(USER_ERRORS, match=r"no room to write checkpoint step-00000004 in .*1 MiB"):
        pretrain(run)
    assert latest_checkpoint(tmp_path / "run").path.name == "step-00000002"  # intact
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))
    free.free = 2**30  # room left: another failure is not taken for a full disk
    with pytest.raises(RuntimeError, match="unexpected pos"):
        pretrain(run)
    free.free = 2**20  # nor, on a nearly full disk, an error that is no write's (a bug)

    def unpicklable(*args, **kwargs):
        raise AttributeError("Can't pickle local object")

    monkeypatch.setattr(checkpoint_module.torch, "save", unpicklable)
    with pytest.raises(AttributeError):
        pretrain(run)


def test_a_run_folder_removed_during_the_run_is_named(tmp_path, monkeypatch):
    # The save failed naming a temporary file inside it ("[Errno 2] No such file or
    # directory: .../checkpoints/.tmp-g689xf1j/.tokenizer.json...tmp")
    from linformer_kit.cli.overrides import USER_ERRORS
    from linformer_kit.training import checkpoint as checkpoint_module

    real_save = checkpoint_module.torch.save

    def removed_first(state, path):
        shutil.rmtree(tmp_path / "run")
        real_save(state, path)

    monkeypatch.setattr(checkpoint_module.torch, "save", removed_first)
    run = tiny_run(tmp_path, max_steps=2, eval_every=2, save_every=2)
    with pytest.raises(USER_ERRORS, match=r"^the run folder .*/run was removed while the run"):
        pretrain(run)


def test_a_run_saved_on_the_cpu_resumes_on_a_gpu(monkeypatch, caplog):
    # A CPU run saves no GPU generator (cuda_rng []): resuming it on a GPU indexed the empty
    # list (IndexError) before the first step. Stand-ins for the GPU's generator.
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: restored.append((s, d)))
    cpu_state, cuda_state = torch.get_rng_state(), torch.tensor([1, 2], dtype=torch.uint8)
    torch.manual_seed(123)
    with caplog.at_level(logging.WARNING):
        restore_rng({"rng": [cpu_state], "cuda_rng": []}, 0, torch.device("cuda", 0))
    assert torch.equal(torch.get_rng_state(), cpu_state) and restored == []
    assert "saved by a run on the CPU" in caplog.text
    state = {"rng": [cpu_state, cpu_state], "cuda_rng": [None, cuda_state]}
    restore_rng(state, 1, torch.device("cuda", 1))
    assert restored == [(cuda_state, torch.device("cuda", 1))]
    restore_rng(state, 1, torch.device("cpu"))  # a GPU run resumed on the CPU
    assert len(restored) == 1


def test_an_optimizer_state_without_the_unrun_pooler_loads():
    # Runs that froze a task model's pooler by hand (or saved between 22ca9c4 and e9b6f91)
    # kept it out of their optimizer's groups; build_optimizer keeps it in.
    config = LinformerConfig(
        vocab_size=50, max_seq_len=16, dim=16, depth=1, num_heads=2, proj_dim=8, pooler=True
    )
    model = LinformerForSequenceClassification(config)
    trained = [p for p in model.parameters() if p.requires_grad]  # the pooler left out
    earlier = torch.optim.AdamW(
        [
            {"params": [p for p in trained if p.dim() >= 2]},
            {"params": [p for p in trained if p.dim() < 2]},
        ]
    )
    model(torch.randint(0, 50, (2, 16)), labels=torch.tensor([0, 1])).loss.backward()
    earlier.step()
    optimizer = build_optimizer(model, TrainSettings())
    load_optimizer_state(optimizer, earlier.state_dict(), model)
    assert [len(g["params"]) for g in optimizer.param_groups] == [
        len(g["params"]) for g in earlier.param_groups
    ]
    assert set(optimizer.state) == set(earlier.state)


def test_validation_scores_blocks_spread_over_the_whole_split():
    # The split keeps corpus order: the first max_batches x batch_size blocks were the
    # corpus's first files.
    seen = []

    batches = types.SimpleNamespace(
        blocks=range(100),
        label_rows=lambda rows, seeds: {"rows": torch.tensor(rows)},
        scored=lambda batch: len(batch["rows"]),
        loss=lambda model, batch: seen.extend(batch["rows"].tolist()) or torch.tensor(0.0),
    )
    LMEvaluator(batches, batch_size=4, max_batches=2)(None, torch.device("cpu"))
    assert seen == [0, 12, 25, 37, 50, 62, 75, 87]
    seen.clear()
    LMEvaluator(batches, batch_size=32)(None, torch.device("cpu"))  # all: each once, in order
    assert seen == list(range(100))


def test_a_block_read_twice_in_a_step_is_masked_twice(tmp_path):
    # Seeded by (step, row), a corpus of fewer blocks than a step's rows gave each copy of a
    # block the same mask: the copies added nothing.
    trainer = _trainer(tmp_path, batch_size=512)
    batches = trainer.batches
    rows = batches.schedule.rows(0, 0, 0)
    assert len(set(rows)) < len(rows)  # the corpus has fewer blocks than the batch
    inputs = batches.micro_batch(0, 0, 0)["input_ids"]
    first: dict[int, int] = {}
    repeats = [(first[row], i) for i, row in enumerate(rows) if first.setdefault(row, i) != i]
    assert repeats and all(not torch.equal(inputs[a], inputs[b]) for a, b in repeats)


def test_masked_validation_scores_the_same_tokens_at_any_batch_size(tmp_path):
    # Masks were seeded by batch: the scored tokens, and the perplexity (797-807 in a review
    # of one checkpoint), moved with --batch-size.
    trainer = _trainer(tmp_path)
    model, batches = trainer.model.eval(), trainer.evaluator.batches
    scores = [LMEvaluator(batches, size)(model, torch.device("cpu")) for size in (1, 3, 8)]
    assert scores[1]["val_loss"] == pytest.approx(scores[0]["val_loss"], rel=1e-6)
    assert scores[2]["val_loss"] == pytest.approx(scores[0]["val_loss"], rel=1e-6)
    for score in scores:  # the mean loss's (the summed loss's at batch size 1 alone)
        assert score["val_ppl"] == pytest.approx(math.exp(score["val_loss"]))


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path):
    # Two runs into one --output-dir mixed their checkpoints and metrics without a word, or
    # one removed the other's checkpoint as it was written ("No such file ... .tmp-...")
    run = tiny_run(tmp_path, max_steps=2, eval_every=2, save_every=2)
    with files.exclusive(tmp_path / "run", "training run"):  # as another process would
        held = rf"{tmp_path / 'run'} is in use by another training run \(pid {os.getpid()} on "
        with pytest.raises(ValueError, match=held):
            pretrain(run)
    assert pretrain(run).steps == 2  # let go: it runs


def test_a_resume_refuses_a_checkpoint_a_run_that_ended_since_has_gone_past(tmp_path, monkeypatch):
    # pretrain found the checkpoint to resume from before the Trainer held the folder: a run
    # of it that ended in between left newer checkpoints, and the resume went on from the one
    # found, its saves overwriting the newer ones' steps
    run = tiny_run(tmp_path, max_steps=4, eval_every=2, save_every=2)
    pretrain(run)
    found = checkpoint.load_checkpoint(checkpoint.step_dir(run.train.output_dir, 2))
    module = importlib.import_module("linformer_kit.training.pretrain")  # not the function
    monkeypatch.setattr(module, "latest_checkpoint", lambda _: found)
    run.train.resume, run.train.max_steps = True, 6
    with pytest.raises(ValueError, match="newest checkpoint is step-00000004, not step-00000002"):
        pretrain(run)
    newest = checkpoint.step_dir(run.train.output_dir, 4)
    (newest / "model.safetensors").write_bytes(b"torn")  # a newer one that fails its check
    assert pretrain(run).steps == 6  # is no newer run's: the one found is resumed


def test_a_validation_batch_with_no_masked_token_leaves_the_loss_a_number():
    # A last batch of separators alone (a run of empty records) has nothing to mask: its nan
    # loss, times 0 tokens, made the whole val_loss nan.
    tokenizer = train_tokenizer(["some text here"] * 10, 300)
    words = np.random.default_rng(0).integers(5, tokenizer.vocab_size, 16)
    tokens = np.concatenate([words, np.full(8, tokenizer.sep_id)]).astype(np.uint16)
    config = LinformerConfig(vocab_size=tokenizer.vocab_size, max_seq_len=8, dim=16, depth=1,
                             num_heads=2, proj_dim=4)  # fmt: skip
    model = LinformerForMaskedLM(config).eval()

    def scored(blocks):
        batches = LMBatches(PackedBlocks(tokens, 8, np.arange(blocks)), tokenizer,
                            RowSchedule(blocks, 2, 1, 1, 0))  # fmt: skip
        return LMEvaluator(batches, batch_size=2)(model, torch.device("cpu"))["val_loss"]

    assert scored(3) == scored(2) and math.isfinite(scored(2))
    # nothing scored at all is not a loss of 0
    tokens = np.full(24, tokenizer.sep_id, dtype=np.uint16)
    assert math.isnan(scored(3))


def test_a_frozen_pooler_keeps_its_place_in_the_optimizer():
    # Frozen (DDP waited for its gradients), the pooler left the optimizer's groups: a run
    # that had trained it could not resume ("a parameter group that doesn't match").
    config = LinformerConfig(
        vocab_size=50, max_seq_len=16, dim=16, depth=1, num_heads=2, proj_dim=8, pooler=True
    )
    for model in (LinformerForMaskedLM(config), LinformerForSequenceClassification(config)):
        assert not model.linformer.pooler.dense.weight.requires_grad
        optimizer = build_optimizer(model, TrainSettings())
        kept = [p for group in optimizer.param_groups for p in group["params"]]
        every = [p for p in model.parameters()]  # what the optimizer held when all trained
        wanted = [p for p in every if p.dim() >= 2] + [p for p in every if p.dim() < 2]
        assert list(map(id, kept)) == list(map(id, wanted))  # the same order: states load
    backbone = LinformerModel(config)  # a pooler the user froze (distill's projections only)
    backbone.pooler.requires_grad_(False)
    groups = build_optimizer(backbone, TrainSettings()).param_groups
    assert not {id(p) for p in backbone.pooler.parameters()} & {
        id(p) for g in groups for p in g["params"]
    }


def test_the_cpu_kernels_are_built_before_the_first_timed_step(tmp_path, monkeypatch):
    # A first build takes about a minute: inside step 1 it made tokens_per_s 100x too low.
    events = []
    real_ops, real_step = native.cpu_ops, Trainer._train_step
    monkeypatch.setattr(native, "cpu_ops", lambda: events.append("build") or real_ops())
    monkeypatch.setattr(
        Trainer, "_train_step", lambda self, model: events.append("step") or real_step(self, model)
    )
    pretrain(tiny_run(tmp_path, max_steps=2, eval_every=2, save_every=2))
    assert events.index("build") < events.index("step")


def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path):
    run = tiny_run(tmp_path, max_steps=4)
    pretrain(run)
    with pytest.raises(ValueError, match="pass --resume"):
        pretrain(run)


def stepped(settings, steps, state=None):
    """An optimizer and schedule of `settings` after `steps` steps, or loaded from `state`."""
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model, settings)
    scheduler = build_scheduler(optimizer, settings)
    if state is not None:
        optimizer.load_state_dict(state[0])
        scheduler.load_state_dict(state[1])
        apply_settings(optimizer, scheduler, settings)
    for _ in range(steps):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
    return optimizer, scheduler


def test_a_resumed_optimizer_takes_the_resumed_runs_lr_decay_and_schedule():
    saved = TrainSettings(max_steps=4, lr=1e-3, warmup_steps=2, weight_decay=0.01, beta2=0.98)
    optimizer, scheduler = stepped(saved, 4)  # linear decay: lr 0 after the last step
    state = (optimizer.state_dict(), scheduler.state_dict())
    same, _ = stepped(saved, 0, state)
    assert [g["lr"] for g in same.param_groups] == [g["lr"] for g in optimizer.param_groups]
    changed = TrainSettings(max_steps=8, lr=2e-3, warmup_steps=2, weight_decay=0.1, beta2=0.95)
    resumed, schedule = stepped(changed, 0, state)
    want = 2e-3 * lr_factor(4, changed)  # 2e-3 * 2 / 3, not the saved run's 0
    assert [g["lr"] for g in resumed.param_groups] == [want, want] == schedule.get_last_lr()
    assert [g["weight_decay"] for g in resumed.param_groups] == [0.1, 0.0]
    assert all(g["betas"] == (0.9, 0.95) for g in resumed.param_groups)
    assert stepped(changed, 1, state)[1].get_last_lr() == [2e-3 * lr_factor(5, changed)] * 2


def test_a_resumed_run_logs_the_lr_it_was_given(tmp_path):
    run = tiny_run(tmp_path, max_steps=4, schedule="constant")
    pretrain(run)
    run.train.resume, run.train.max_steps, run.train.lr = True, 6, 1e-2
    pretrain(run)
    lrs = {r["step"]: r["lr"] for r in records(tmp_path / "run") if r["split"] == "train"}
    # each step's own lr: the first in its warm-up (2 steps), then the run's, then the new one
    assert [lrs[step] for step in range(1, 7)] == [1.5e-3] + [3e-3] * 3 + [1e-2] * 2


def test_a_metrics_line_cut_short_by_a_kill_does_not_stop_the_resume(tmp_path, caplog):
    run = tiny_run(tmp_path, max_steps=4)
    pretrain(run)
    log = tmp_path / "run" / "metrics.jsonl"
    log.write_text(log.read_text()[:-30])  # the last append, torn
    run.train.resume, run.train.max_steps = True, 6
    pretrain(run)
    assert f"{log}:" in caplog.text and "is not a whole record: skipped" in caplog.text
    assert [step for step, _ in train_losses(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]


def test_a_resumed_run_purges_tensorboard_events_past_its_checkpoint(tmp_path, monkeypatch):
    # The events past the checkpoint stayed in TensorBoard beside the re-run steps' own.
    made = []
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = lambda log_dir, purge_step=None: made.append(purge_step) or None
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    MetricsLog(tmp_path, enabled=True, keep_until=None)
    MetricsLog(tmp_path, enabled=True, keep_until=4)
    assert made == [None, 5]


def test_a_resumed_run_keeps_its_tokenizer_and_corpus(tmp_path, caplog):
    caplog.set_level("INFO", logger="linformer_kit")
    run = tiny_run(tmp_path, max_steps=4)
    pretrain(run)
    # A file added to the corpus redrew the split and order without a word: validation
    # scored blocks the run had trained on (35 of 80 in a review)
    new = tmp_path / "corpus" / "new.txt"
    new.write_text("zebra quantum xylophone\n" * 200)
    run.train.resume, run.train.max_steps = True, 6
    with pytest.raises(ValueError, match=r"--resume continues the training of .*step-00000004 "
                       r"on the data it trained on \(num_tokens \d+, sha256 [0-9a-f]{16}\); "
                       r"this run's is other \(num_tokens \d+"):  # fmt: skip
        pretrain(run)
    new.unlink()
    (tmp_path / "corpus" / "doc0.txt").touch()  # the same text: a new cache, the same data
    pretrain(run)  # a BPE trained anew would map other ids
    checkpoints = tmp_path / "run" / "checkpoints"
    tokenizers = {p.parent.name: p.read_text() for p in checkpoints.glob("*/tokenizer.json")}
    assert tokenizers["step-00000006"] == tokenizers["step-00000004"]
    assert "resuming with the run's own tokenizer" in caplog.text
    other = tmp_path / "other.json"
    train_tokenizer(["a wholly other text"] * 50, 300).save(other)
    run.data.tokenizer, run.train.max_steps = str(other), 8
    with pytest.raises(ValueError, match=r"--tokenizer .*other.json is not the tokenizer of"):
        pretrain(run)
    # a new vocabulary size was ignored without a word (the run's tokenizer goes on)
    run.data.tokenizer, vocab_size = "", run.data.vocab_size
    run.data.vocab_size = vocab_size + 100
    named = rf"--vocab-size {vocab_size + 100} \(the run's: {vocab_size}\)"
    with pytest.raises(ValueError, match=rf"tokenizer, split and order; these differ: {named}"):
        pretrain(run)
    run.data.vocab_size = vocab_size
    # The newest checkpoint's tokenizer was read unverified: a damaged one failed the resume
    # (truncated) or tokenised the data before the trainer skipped that checkpoint (altered)
    run.data.tokenizer = ""
    newest = checkpoints / "step-00000006" / "tokenizer.json"
    newest.write_text(newest.read_text()[:50])
    caplog.clear()
    pretrain(run)
    assert f"resuming with the run's own tokenizer, {checkpoints}/step-00000004/" in caplog.text
    assert "skipping a corrupt checkpoint" in caplog.text


def _trainer(tmp_path, **train):
    run = tiny_run(tmp_path, **train)
    run.model = run.model.replace(dropout=0.0, attention_dropout=0.0)
    dist = Distributed(rank=0, world_size=1, device=torch.device("cpu"))
    return build_trainer(run, prepare_data(run, dist), dist)


def _step_gradients(trainer):
    """The gradients the optimiser steps with, and the step's (loss, tokens, lr)."""
    grads, step = {}, trainer.optimizer.step

    def recording(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording
    return grads, trainer._train_step(trainer.model)


@pytest.mark.parametrize("rates", [(0.15, 0.15), (0.01, 0.01)])
def test_gradient_accumulation_gives_the_gradient_of_one_batch_of_all_scored_tokens(
    tmp_path, rates
):
    # Masked micro-batches score different numbers of tokens; their gradients were averaged
    # 1 / G each, so a step's gradient was not that of the whole batch (20 % off here), and
    # a micro-batch scoring nothing made the step's loss nan beside scored ones.
    trainer = _trainer(tmp_path, max_steps=1, batch_size=2, grad_accum_steps=3, clip_grad_norm=0)
    trainer.batches.mlm_probability = rates[0]
    micro = [trainer.batches.micro_batch(0, m, 0) for m in range(3)]
    counts = [trainer.batches.scored(batch) for batch in micro]
    if rates[0] == 0.01:  # find a step where one micro-batch scores nothing, the others some
        step = next(
            s for s in range(500)
            if sorted(trainer.batches.scored(trainer.batches.micro_batch(s, m, 0)) > 0
                      for m in range(3)) == [False, True, True]
        )  # fmt: skip
        trainer.step = step
        micro = [trainer.batches.micro_batch(step, m, 0) for m in range(3)]
        counts = [trainer.batches.scored(batch) for batch in micro]
    assert len(set(counts)) > 1, counts
    reference = copy.deepcopy(trainer.model)
    grads, (loss, tokens, _) = _step_gradients(trainer)
    whole = {k: torch.cat([batch[k] for batch in micro]) for k in micro[0]}
    expected = language_model_loss(reference, whole, causal=False)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    assert tokens == sum(batch["input_ids"].numel() for batch in micro)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("save_every", [1, 100])
def test_best_is_the_lowest_validation_loss_and_pruning_keeps_it_and_keep_last(
    tmp_path, save_every
):
    # Losses that only fell hid `best` taken as the newest score, pruning that kept one
    # checkpoint too many, a best checkpoint pruned away under its link, and (saves rarer
    # than validations) an improvement not saved.
    trainer = _trainer(tmp_path, max_steps=4, eval_every=1, save_every=save_every, keep_last=1)
    scores = iter([1.0, 3.0, 2.0, 4.0])

    def evaluator(model, device):
        return {"val_loss": next(scores)}

    evaluator.key = "val_loss"
    trainer.evaluator = evaluator
    result = trainer.fit()
    run = tmp_path / "run"
    assert result.best_val == 1.0
    assert (run / "best").resolve().name == "step-00000001"
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [
        "step-00000001",
        "step-00000004",
    ]
    state = load_checkpoint(run / "last").state
    assert (state["best"], state["best_step"]) == (1.0, 1)


def test_gradients_are_clipped_to_clip_grad_norm(tmp_path):
    trainer = _trainer(tmp_path, max_steps=1, batch_size=2, clip_grad_norm=1e-3)
    grads, _ = _step_gradients(trainer)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    assert norm.item() == pytest.approx(1e-3, rel=1e-4)


def test_gradient_accumulation_of_seq2seq_pairs_weighs_each_target_token_once():
    pairs = {
        "labels": torch.tensor([[1, 5, 6, 2], [1, 7, 2, 0]]),
        "decoder_padding_mask": torch.tensor([[True] * 4, [True, True, True, False]]),
    }
    batches = Seq2SeqBatches(pairs=None, schedule=None)
    assert batches.scored(pairs) == 3 + 2  # each real position's real successor


def test_the_logged_lr_is_the_one_each_step_ran_at(tmp_path):
    # The lr logged (and shown on the bar) was the next step's: read after the schedule moved.
    trainer = _trainer(tmp_path, max_steps=6, warmup_steps=3, lr=1e-2, log_every=1)
    used, step = [], trainer.optimizer.step

    def recording(*args, **kwargs):
        used.append(trainer.optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording
    trainer.fit()
    logged = [r["lr"] for r in records(tmp_path / "run") if r["split"] == "train"]
    settings = trainer.settings
    assert logged == used == [1e-2 * lr_factor(i, settings) for i in range(6)]


def test_bf16_autocast_trains(tmp_path):
    result = pretrain(tiny_run(tmp_path, max_steps=6, precision="bf16", eval_every=6))
    assert torch.isfinite(torch.tensor(result.final["val_loss"]))


def test_checkpointing_level_comes_from_the_config(tmp_path):
    run = tiny_run(tmp_path, max_steps=4)
    run.model = run.model.replace(checkpointing="layer")
    assert pretrain(run).final["val_loss"] > 0


def test_schedules_warm_up_then_decay():
    linear = TrainSettings(max_steps=10, warmup_steps=2, schedule="linear")
    cosine = TrainSettings(max_steps=10, warmup_steps=2, schedule="cosine")
    assert [lr_factor(s, linear) for s in (0, 1, 2, 6)] == [0.5, 1.0, 1.0, 0.5]
    assert lr_factor(10, linear) == 0.0
    assert lr_factor(6, cosine) == pytest.approx(0.5)
    assert lr_factor(10, cosine) == pytest.approx(0.0)


def test_settings_reject_bad_values():
    with pytest.raises(ValueError, match="schedule must be one of"):
        TrainSettings(schedule="step")
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16"):
        TrainSettings(precision="fp16")
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        TrainSettings(batch_size=0)


def test_devices_are_checked_before_training():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N; got 'gpu'"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")


def test_run_config_round_trips_and_rejects_unknown_fields(tmp_path):
    run = tiny_run(tmp_path)
    run.save(tmp_path / "run_config.json")
    assert RunConfig.load(tmp_path).to_dict() == run.to_dict()
    with pytest.raises(ValueError, match="unknown TrainSettings fields"):
        RunConfig.from_dict({"train": {"learning_rate": 1.0}})


def test_a_compiled_run_trains_as_the_eager_one_and_its_checkpoints_serve_both(tmp_path):
    # aot_eager: dynamo's graphs run by the eager kernels (the wiring, without code generation);
    # +autograd: each backward captured whole by compiled autograd
    settings = {"eager": "", "compiled": "aot_eager", "autograd": "aot_eager+autograd"}
    for name, setting in settings.items():
        run = tiny_run(tmp_path / name, max_steps=4, eval_every=4, save_every=2, compile=setting)
        run.model = run.model.replace(dropout=0.0, attention_dropout=0.0)
        counters.clear()
        pretrain(run)
        assert counters["aot_autograd"]["ok"] >= (1 if setting else 0)  # training graphs
        captures = counters["compiled_autograd"]["captures"]
        assert (captures > 0) == (name == "autograd"), name  # backward graphs captured
    eager = train_losses(tmp_path / "eager/run")
    for name in ("compiled", "autograd"):
        compiled = train_losses(tmp_path / name / "run")
        assert [step for step, _ in compiled] == [1, 2, 3, 4]
        expected = pytest.approx([loss for _, loss in eager], rel=1e-4)
        assert [loss for _, loss in compiled] == expected
    weights = hub.read_weights(tmp_path / "compiled/run/last")
    assert weights.keys() == hub.read_weights(tmp_path / "eager/run/last").keys()
    run.train.max_steps, run.train.resume, run.train.compile = 6, True, ""  # on, eagerly
    assert pretrain(run).steps == 6


def test_compiled_training_with_dropout_trains(tmp_path):
    result = pretrain(tiny_run(tmp_path, max_steps=3, eval_every=3, compile="aot_eager"))
    assert torch.isfinite(torch.tensor(result.final["val_loss"]))


def test_compiled_autograd_is_refused_in_a_job_of_several_processes():
    # DDP's C++ reducer cannot run inside a captured backward; the trainer says so before
    # it builds anything (the model is never touched).
    settings = TrainSettings(compile="aot_eager+autograd")
    two = Distributed(rank=0, world_size=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="compiled autograd does not run with DDP.+'aot_eager'"):
        Trainer(model=None, batches=None, evaluator=None, settings=settings, dist=two)


def test_cuda_graphs_are_refused_off_a_gpu(tmp_path):
    with pytest.raises(ValueError, match="compile must be one of inductor, reduce-overhead"):
        TrainSettings(compile="max-autotune")
    with pytest.raises(ValueError, match="records CUDA graphs: it needs a CUDA device, got 'cpu'"):
        TrainSettings(compile="reduce-overhead", device="cpu")
    with pytest.raises(ValueError, match=r"reduce-overhead\+autograd records CUDA graphs"):
        TrainSettings(compile="reduce-overhead+autograd", device="cpu")
    assert TrainSettings(compile="reduce-overhead", device="cuda:1").compile == "reduce-overhead"
    if not torch.cuda.is_available():  # "auto" resolves to the CPU: the trainer refuses it
        with pytest.raises(ValueError, match="needs a CUDA device, got 'cpu'"):
            pretrain(tiny_run(tmp_path, compile="reduce-overhead"))


@pytest.mark.parametrize("graphs", [False, True])
def test_training_under_cuda_graphs_pins_sdpa(tmp_path, monkeypatch, graphs):
    # The rule's compiled CUDA band picks the explicit kernel, which loses under CUDA graphs
    # (--compile reduce-overhead), where nothing pinned SDPA.
    trainer = _trainer(tmp_path, max_steps=1, grad_accum_steps=2)
    monkeypatch.setattr(loop, "cuda_graphs", lambda setting: graphs)
    seen, loss = [], trainer.loss_fn

    def recording(model, batch):
        seen.append(pinned_kernel())
        return loss(model, batch)

    trainer.loss_fn = recording
    trainer._train_step(trainer.model)
    assert seen == (["sdpa"] * 2 if graphs else [None] * 2)
    assert pinned_kernel() is None  # only around the steps' forward passes
