"""DDP with 2 CPU processes (gloo): both ranks hold identical weights, every sharing mode."""

import json
import os
import socket
import weakref

import pytest
import torch
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from train_helpers import tiny_run

from linformer_kit import hub
from linformer_kit.data import prepare_pretraining_data
from linformer_kit.masked_lm import LinformerForMaskedLM
from linformer_kit.training.distributed import setup_distributed, teardown_distributed
from linformer_kit.training.pretrain import build_trainer, prepare_data


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker(rank, world_size, port, run, out):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
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
