"""The CUDA side of the kernel rule against the H200 tables it was read from: the uncut and
cut tables, the explicit kernel, and the rule under torch.compile."""

import ast
import json
import re
from unittest import mock

import pytest
import torch
from script_helpers import BENCHMARKS
from test_kernel_rule import MODES, pick
from test_kernels import CPU

from linformer_kit.kernel_rule import choose_splits

CUDA = BENCHMARKS / "kernels" / "cuda"
CUDA_TABLES = [
    CUDA / name / "table.json" for name in ("", "table-mid", "table-fp16", "table-causal")
]
GPU = torch.device("cuda")


def NOT_ON_A_GPU() -> bool:  # noqa: N802 (a constant callable)
    pytest.fail("the rule asked whether the compiled CPU kernel runs, for a GPU call")


def cut(dtype, mode, *, queries, keys, groups, causal=False):
    """`choose_splits` for a call of a GPU table's mode."""
    return choose_splits(device=GPU, dtype=dtype, backward=MODES[mode][1], causal=causal,
                         queries=queries, keys=keys, groups=groups)  # fmt: skip


def test_the_cuda_rule_loses_nowhere_the_h200_uncut_tables_measured_by_more_than_a_tie():
    # benchmarks/kernels.py --device cuda (H200), SDPA uncut against explicit: wherever the
    # rule runs SDPA uncut (inference, n 1024, exact causal, fp16, bf16 below n 65536) its
    # kernel takes at most 12 % longer than the faster one, and where the explicit kernel
    # wins by more than 25 % the rule takes it; except fp16 at n = 65536, B H M <= 1024,
    # left to SDPA (explicit 1.23-1.44x there, as bf16's corner, which the bf16 layer
    # benches did not confirm). The cut calls are the next test's.
    rows = [r for table in CUDA_TABLES for r in json.loads(table.read_text())["rows"]]
    assert len(rows) == 144 + 72 + 54 + 36
    assert {r["n"] for r in rows} >= {1024, 4096, 8192, 16384, 32768, 65536}
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16", "float16"}
    uncut = 0
    for row in rows:
        causal = row["k"] == "n"
        dtype, keys = getattr(torch, row["dtype"]), row["n"] if causal else row["k"]
        shape = dict(queries=row["n"], keys=keys, groups=4 * row["batch"], causal=causal)
        if cut(dtype, row["mode"], **shape) > 1:
            continue
        uncut += 1
        picked = pick(GPU, dtype, row["mode"], **shape, compiled=NOT_ON_A_GPU)
        loss = row[f"{picked}_ms"] / min(row["sdpa_ms"], row["explicit_ms"])
        corner = row["dtype"] == "float16" and row["n"] == 65536 and 4 * row["batch"] * keys <= 1024
        assert loss <= 1.12 or corner, (row, picked, loss)
        assert picked == "explicit" or row["explicit_speedup"] < 1.25 or corner, row
    assert uncut >= 200


SPLIT_TABLE = CUDA / "split" / "table.json"


def test_the_cuda_cut_beats_one_call_and_the_explicit_kernel_where_the_h200_measured():
    # benchmarks/kernels_split.py --device cuda (H200; fp32, bf16; B 1, 8; n 1024-65536;
    # k 64-1024; fwd+bwd with and without dropout): at every shape the rule's cut takes at
    # most as long as one call, within 10 % (fp32) and 21 % (bf16 at n 65536) of the
    # best cut measured (bf16 below n 65536 runs uncut, up to 1.43x the best cut of one
    # call at B 1, n 16384: the layers' steps, launch-bound there, ran faster uncut, see
    # test_split_attention.py), and SDPA so cut is never more than 2.5 % slower
    # than the explicit kernel (the eager CUDA rule's SDPA everywhere; 0.98x at B 8,
    # n >= 16384, k 1024 without dropout). Never cutting fails it (B 1, n 16384, k 256:
    # 4.45 ms uncut against 2.15 explicit), as does cutting at n 1024.
    rows = json.loads(SPLIT_TABLE.read_text())["rows"]
    assert len(rows) == 2 * 2 * 4 * 3 * 2
    for row in rows:
        dtype = getattr(torch, row["dtype"])
        shape = dict(queries=row["n"], keys=row["k"], groups=4 * row["batch"])
        ms = row["sdpa_ms"][str(cut(dtype, row["mode"], **shape))]
        assert pick(GPU, dtype, row["mode"], **shape, compiled=NOT_ON_A_GPU) == "sdpa"
        assert ms <= row["sdpa_ms"]["1"], row
        if dtype == torch.float32 or row["n"] >= 65536:
            best = min(row["sdpa_ms"].values())
            assert ms <= (1.1 if dtype == torch.float32 else 1.21) * best, row
        assert ms <= 1.025 * row["explicit_ms"], row


def test_the_eager_cuda_rule_is_within_a_tie_of_the_explicit_kernel_in_the_ninth_table():
    # benchmarks/kernels.py --device cuda (H200, ninth call, settled timing): SDPA as the
    # rule runs it (cut where `choose_splits` cuts) against the explicit kernel, fp32 and
    # bf16, B 1 and 8, n 1024-65536, k 64-1024, three modes. The eager rule takes SDPA at
    # all 216 shapes, and the explicit kernel is at most 4 % faster at any (1.02-1.04x:
    # fp32 training without dropout, B 8, k 1024, n >= 16384).
    rows = json.loads((CUDA / "table-run9" / "table.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 6 * 3 * 3
    for row in rows:
        dtype = getattr(torch, row["dtype"])
        shape = dict(queries=row["n"], keys=row["k"], groups=4 * row["batch"])
        assert pick(GPU, dtype, row["mode"], **shape, compiled=NOT_ON_A_GPU) == "sdpa"
        assert row["explicit_speedup"] <= 1.04, row


def test_the_cut_is_a_power_of_two_dividing_n_and_only_where_measured():
    train = dict(dtype=torch.float32, mode="train", keys=256)
    assert cut(**train, queries=16384, groups=4) == 32  # 4 x 32 x 4 blocks of 64 keys = 512
    assert cut(**train, queries=16384, groups=32) == 4
    assert cut(**train, queries=4096 + 8, groups=4) == 8  # 4104 = 8 x 513: 32 does not divide
    assert cut(**train, queries=4097, groups=4) == 1  # odd n: no cut divides it
    assert cut(**train, queries=2048, groups=4) == 1
    assert cut(**train, queries=16384, groups=4096) == 1  # already 16384 blocks
    assert cut(**dict(train, keys=1024), queries=16384, groups=4) == 8
    assert cut(**dict(train, keys=4096), queries=4096, groups=1) == 1  # exact: not measured
    assert cut(**dict(train, dtype=torch.bfloat16), queries=4096, groups=4) == 1
    assert cut(**dict(train, dtype=torch.bfloat16), queries=32768, groups=4) == 1
    assert cut(**dict(train, dtype=torch.bfloat16), queries=65536, groups=4) == 32
    for dtype in (torch.float16, torch.float64):
        assert cut(**dict(train, dtype=dtype), queries=16384, groups=4) == 1
    assert cut(**dict(train, mode="inference"), queries=16384, groups=4) == 1
    assert cut(**train, queries=16384, groups=4, causal=True) == 1
    kw = dict(dtype=torch.float32, backward=True, causal=False, queries=16384, keys=256, groups=4)
    assert choose_splits(device=CPU, **kw) == 1


def compiled_ms(run) -> dict:
    """A kernels_compile.py run's rows (training, inference): its compile.json, or the
    `training {...}` / `inference {...}` lines of its log where the JSON did not come back
    from the GPU machine."""
    if (run / "compile.json").exists():
        result = json.loads((run / "compile.json").read_text())
        assert result["kernel"] in run.name and not result["graph_breaks"], run.name
        assert f"--n {result['seq_len']} " in result["command"] + " ", run.name
        return result["rows"]
    lines = (run / "log.txt").read_text().splitlines()
    return {
        mode: ast.literal_eval(line.removeprefix(mode + " "))
        for line in lines
        for mode in ("training", "inference")
        if line.startswith(mode + " {")
    }


def test_the_cuda_rule_under_torch_compile_takes_the_kernel_compiled_training_ran_faster():
    # benchmarks/kernels_compile.py --device cuda --kernel explicit|sdpa (H200), SDPA cut:
    # a 2-layer encoder (H 4, k 256, dropout 0.1) compiled on each kernel, fp32, at five
    # shapes. The rule's kernel is the faster compiled one within 1 % (B 8, n 16384: 37.9
    # against 37.7 ms, where SDPA's lower memory decides) or the files' 0.1 ms (inference at
    # B 1, n 8192: 1.5 against 1.4), in training and inference; explicit only at B 1,
    # n 4096 (3.5 against 4.0 ms; at n 8192 6.5 against 4.8). The pre-cut pairs of
    # `compiled/` (explicit 1.06-1.94x then) no longer apply.
    # The B 8, n 4096 explicit run is the pre-cut one (`compiled/`): the cut leaves it alone.
    runs = sorted((CUDA / "compiled-split").glob("n*-sdpa"))  # nN-bB-p0.1-sdpa
    assert len(runs) == 5
    for run in runs:
        shape = re.fullmatch(r"n(\d+)-b(\d+)-p0.1-sdpa", run.name)
        assert shape, run.name
        n, batch = int(shape[1]), int(shape[2])
        explicit = run.with_name(run.name.replace("sdpa", "explicit"))
        if not explicit.exists():
            explicit = CUDA / "compiled" / explicit.name
        rows = {"explicit": compiled_ms(explicit), "sdpa": compiled_ms(run)}
        for mode, table_mode in (("training", "train dropout 0.1"), ("inference", "inference")):
            ms = {kernel: rows[kernel][mode]["compiled_ms"] for kernel in rows}
            with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
                picked = pick(GPU, torch.float32, table_mode, queries=n, keys=256,
                              groups=4 * batch, compiled=NOT_ON_A_GPU)  # fmt: skip
            # (+ 1e-9: the files' times are rounded to 0.1 ms)
            assert ms[picked] <= max(1.01 * min(ms.values()), min(ms.values()) + 0.1 + 1e-9), (
                run.name,
                mode,
                picked,
                ms,
            )


def test_the_cuda_rule_off_its_tables_and_under_torch_compile():
    for mode in MODES:
        assert pick(GPU, torch.float32, mode, compiled=NOT_ON_A_GPU) == "sdpa"
        assert pick(CPU, torch.float16, mode) == "sdpa"
    # Eager: SDPA for every dtype, length and batch (cut in training) ...
    kw = dict(queries=65536, keys=64, groups=1, compiled=NOT_ON_A_GPU)
    for dtype in (torch.float16, torch.float64, torch.float32, torch.bfloat16):
        for mode in MODES:
            assert pick(GPU, dtype, mode, **kw) == "sdpa"
    # ... and under torch.compile but in fp32 training with dropout at 4096 <= n < 8192,
    # B H M <= 1024.
    dropout = "train dropout 0.1"
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        short = dict(kw, queries=4096, keys=256, groups=4)
        assert pick(GPU, torch.float32, dropout, **short) == "explicit"
        assert pick(GPU, torch.float32, dropout, **dict(short, queries=8191)) == "explicit"
        for other in (dict(queries=8192), dict(queries=2048), dict(groups=8)):
            assert pick(GPU, torch.float32, dropout, **dict(short, **other)) == "sdpa"
        for mode in ("train", "inference"):
            assert pick(GPU, torch.float32, mode, **short) == "sdpa"
        assert pick(GPU, torch.float32, dropout, **short, causal=True) == "sdpa"
        for dtype in (torch.float16, torch.float64, torch.bfloat16):
            assert pick(GPU, dtype, dropout, **short) == "sdpa"


def test_the_compiled_cuda_rule_without_dropout_takes_the_kernel_of_less_gpu_work():
    # benchmarks/kernels_profile.py --device cuda --n 4096 --batch 1 --compile inductor
    # (H200, ninth call): one encoder layer, fp32 training without dropout, compiled on each
    # kernel. SDPA cut did less GPU work (0.81 against 1.06 ms, 0.87 against 1.13) and its
    # step was no slower (2.68 against 2.88 ms, 2.71 against 3.02), in kv and headwise
    # sharing alike, so the compiled rule keeps SDPA there.
    profile = json.loads((CUDA / "profile" / "profile-b1-run9.json").read_text())
    assert profile["shape"]["seq_len"] == 4096 and profile["shape"]["batch_size"] == 1
    variants = profile["variants"]
    for sharing in ("kv", "headwise"):
        sdpa, explicit = (
            variants[f"linformer {sharing} [{kernel}] [compiled inductor]"]
            for kernel in ("sdpa", "explicit")
        )
        assert sdpa["wall_ms"] < explicit["wall_ms"], sharing
        # its kernels' time less the two spans a step that mark the compiled graphs, which
        # kernels_profile.py counted as kernels then
        spans = [sum(t["ms_per_step"] for t in row["top"] if t["name"].startswith("## "))
                 for row in (sdpa, explicit)]  # fmt: skip
        assert sdpa["kernel_ms_per_step"] - spans[0] < explicit["kernel_ms_per_step"] - spans[1]
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        shape = dict(queries=4096, keys=256, groups=4, compiled=NOT_ON_A_GPU)
        assert pick(GPU, torch.float32, "train", **shape) == "sdpa"
