"""DDP with 2 CPU processes (gloo): both ranks hold identical weights, every sharing mode."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import weakref

import pytest
import torch
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from train_helpers import ends_within, pretrain_cli, process_alive, tiny_run, write_classification

from linformer_kit import files, hub
from linformer_kit.cli import main
from linformer_kit.data import prepare_pretraining_data
from linformer_kit.data.classification import load_classification
from linformer_kit.data.tokenizer import load_tokenizer
from linformer_kit.masked_lm import LinformerForMaskedLM
from linformer_kit.training.distributed import setup_distributed, teardown_distributed
from linformer_kit.training.pretrain import build_trainer, prepare_data, pretrain


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_group(rank, world_size, port):
    """The environment torchrun gives process `rank` of `world_size`, one thread."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)


def worker(rank, world_size, port, run, out):
    join_group(rank, world_size, port)
    dist = setup_distributed("cpu")
    try:
        train_and_save(run, dist, out / f"rank{rank}.pt")
        dist.barrier()
    finally:
        teardown_distributed()


def train_and_save(run, dist, path):
    """Trains and saves this rank's weights; the trainer, which holds the DDP wrapper, is
    gone when this returns (a wrapper alive at the interpreter's exit can abort it)."""
    trainer = build_trainer(run, prepare_data(run, dist), dist)
    trainer.fit()
    torch.save(trainer.model.state_dict(), path)


@pytest.mark.parametrize(
    ("sharing", "checkpointing", "compile", "pooler"),
    [
        ("layerwise", "none", "", False),
        ("headwise", "none", "", False),
        ("layerwise", "layer", "", False),
        ("layerwise", "none", "aot_eager", False),  # the DDP wrapper compiled (DDPOptimizer)
        # a converted BERT's pooler, which no task head uses: trainable, DDP stopped at
        # step 2 ("parameters that were not used in producing loss")
        ("kv", "none", "", True),
    ],
)
def test_two_gloo_processes_train_to_identical_weights(
    tmp_path, sharing, checkpointing, compile, pooler
):
    run = tiny_run(tmp_path, max_steps=6, eval_every=3, save_every=3, log_every=1, compile=compile)
    run.model = run.model.replace(sharing=sharing, checkpointing=checkpointing, pooler=pooler)
    prepare_pretraining_data(run.data, run.model.max_seq_len)  # build the cache once
    mp.spawn(worker, args=(2, free_port(), run, tmp_path), nprocs=2, join=True)

    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    rank1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert rank0.keys() == rank1.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name

    config = hub.read_config(tmp_path / "run" / "last")["config"]
    torch.manual_seed(run.train.seed)
    initial = LinformerForMaskedLM(config).state_dict()
    projections = [n for n in rank0 if ".proj" in n and n.endswith("weight")]
    assert projections, "the model should have learned projections"
    assert all(not torch.equal(rank0[n], initial[n]) for n in projections)

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if '"train"' in line]
    assert steps == list(range(1, 7))  # written once, by rank 0
    state = torch.load(tmp_path / "run/last/trainer_state.pt", weights_only=True)
    assert len(state["rng"]) == 2  # both ranks' RNG states, for an exact resume


def refused_worker(rank, world_size, port, run, out):
    join_group(rank, world_size, port)
    dist = setup_distributed("cpu")
    try:
        build_trainer(run, prepare_data(run, dist), dist).fit()
    except ValueError as err:
        (out / f"rank{rank}.txt").write_text(str(err))
    finally:
        teardown_distributed()


def test_every_rank_of_a_job_refused_its_run_folder_stops(tmp_path):
    # Rank 0 holds the folder for the job. Refused, it stopped; the other ranks waited at
    # their first collective for the process group's timeout (30 minutes).
    run = tiny_run(tmp_path, max_steps=2, eval_every=2, save_every=2)
    prepare_pretraining_data(run.data, run.model.max_seq_len)
    with files.exclusive(tmp_path / "run", "training run"):
        job = mp.spawn(refused_worker, args=(2, free_port(), run, tmp_path), nprocs=2, join=False)
        for process in job.processes:
            process.join(120)
        alive = [p for p in job.processes if p.is_alive()]
        for process in alive:
            process.kill()
    assert not alive, "a rank waited on"
    for rank in (0, 1):
        refusal = (tmp_path / f"rank{rank}.txt").read_text()
        assert "is in use by another training run (pid" in refusal


def test_two_processes_pretrain_a_masked_lm_as_one_with_two_micro_batches(tmp_path):
    # Masks were seeded by micro-batch and rank: two processes masked other tokens than one
    # process with two micro-batches (weights 5.6e-3 apart after 4 steps in the review).
    def run(name, **train):
        run = tiny_run(tmp_path, max_steps=3, eval_every=3, save_every=3, **train)
        run.train.output_dir = str(tmp_path / name)
        run.model = run.model.replace(dropout=0.0, attention_dropout=0.0)
        return run

    prepare_pretraining_data(run("one").data, 64)
    pretrain(run("one", grad_accum_steps=2))
    mp.spawn(worker, args=(2, free_port(), run("two"), tmp_path), nprocs=2, join=True)
    one, two = hub.read_weights(tmp_path / "one" / "last"), torch.load(tmp_path / "rank0.pt")
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6, msg=name)
    losses = [
        [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").open()
         if '"train"' in line]
        for name in ("one", "two")
    ]  # fmt: skip
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def cli_worker(rank, world_size, port, argv):
    join_group(rank, world_size, port)
    main(argv)


def test_two_processes_fine_tune_as_one_with_two_micro_batches(tmp_path, monkeypatch):
    # Batches of texts of different lengths: the logged tokens were rank 0's padded count
    # times the number of processes (464 against 488 after two steps in the review).
    model = ["--max-seq-len", "64", "--dim", "32", "--depth", "1", "--num-heads", "2"]
    no_dropout = ["--dropout", "0", "--attention-dropout", "0"]  # one process's draws or two's
    init = pretrain_cli(tmp_path, "--max-steps", "1", *model, *no_dropout, files=2)
    monkeypatch.setenv("LINFORMER_CACHE", str(tmp_path / "cache"))
    argv = ["finetune", "--init", str(init / "last"), "--max-steps", "3", "--batch-size", "2",
            "--log-every", "1", "--eval-every", "3", "--warmup-steps", "1", "--threads", "1",
            "--data", str(write_classification(tmp_path / "train.jsonl", 12, seed=0)),
            "--eval", str(write_classification(tmp_path / "valid.jsonl", 5, seed=1))]  # fmt: skip
    main([*argv, "--grad-accum-steps", "2", "--output-dir", str(tmp_path / "one")])
    mp.spawn(cli_worker, args=(2, free_port(), [*argv, "--output-dir", str(tmp_path / "two")]),
             nprocs=2, join=True)  # fmt: skip

    def logged(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["split"], r.get("tokens")) for r in map(json.loads, lines)]

    assert logged("two") == logged("one")
    # the real tokens of the 12 examples the 3 steps read: padding counted made tokens/s
    # 64 % high in a review
    tokenizer = load_tokenizer(init / "last")
    examples = load_classification(tmp_path / "train.jsonl", tokenizer, max_seq_len=64)
    assert [r[2] for r in logged("one") if r[1] == "train"][-1] == sum(map(len, examples.ids))
    assert len({r[2] for r in logged("one")}) == 4  # steps of differing lengths, val: None
    one, two = (hub.read_weights(tmp_path / run / "last") for run in ("one", "two"))
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6, msg=name)


def test_teardown_frees_an_unreferenced_ddp_wrapper_before_the_group_goes(tmp_path):
    # A wrapper in a reference cycle would otherwise outlive the group until the
    # interpreter's exit, where gloo's threads can abort the process.
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        wrapper = DistributedDataParallel(torch.nn.Linear(4, 2))
        wrapper.cycle = [wrapper]
        group_alive_when_freed = []
        weakref.finalize(
            wrapper, lambda: group_alive_when_freed.append(torch.distributed.is_initialized())
        )
        del wrapper
        teardown_distributed()
        assert group_alive_when_freed == [True]
        assert not torch.distributed.is_initialized()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


WORKER = """
import time
from linformer_kit.training import distributed
distributed.LAUNCHER_POLL_S = 0.05
distributed.setup_distributed("cpu")
print("joined", flush=True)
time.sleep(120)
"""


def test_a_torchrun_worker_stops_when_its_launcher_is_killed(tmp_path):
    # torchrun forwards the signals it gets, but killed (SIGKILL, out of memory) its workers
    # trained on to the end, holding the run folder that a rerun with --resume needs.
    log = tmp_path / "worker.log"
    launcher = textwrap.dedent(f"""
        import subprocess, sys, time
        env = dict(__import__("os").environ, TORCHELASTIC_RUN_ID="job", WORLD_SIZE="1")
        with open({str(log)!r}, "w") as log:
            worker = subprocess.Popen([sys.executable, "-c", {WORKER!r}], env=env,
                                      stdout=log, stderr=subprocess.STDOUT)
        print(worker.pid, flush=True)
        time.sleep(120)
    """)
    job = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    worker = int(job.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while "joined" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_alive(worker), log.read_text()
        job.send_signal(signal.SIGKILL)
        job.wait()
        assert ends_within(worker, 10), "the worker trained on without its launcher"
        assert f"torchrun (pid {job.pid}) is gone: this process stops" in log.read_text()
    finally:
        if process_alive(worker):
            os.kill(worker, signal.SIGKILL)
        job.kill()
