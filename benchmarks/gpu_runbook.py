"""Issue 17's GPU measurements as one prepared call on a lent GPU machine, sized to its
budget (15 minutes of device time a session, the machine's start included; 10 minutes a
command): the steps run in order of priority, each as its own process, each stopped at
the deadline (`--budget-s`, 540 s by default), and whatever they wrote is packed into
OUT/results.tar.gz beside OUT/log.txt (the device tool returns at most 8 files).

1. `kernels.py`: the SDPA-vs-explicit table the CUDA rule of `kernel_rule.choose_kernel` is
   read from (fp32 and bf16, B 1 and 8, n 1024-65536, k 64 / 256 / 1024, head_dim 64);
2. `linformer bench --peers`, B 1: the 1.2x-the-faster-peer and 50 %-of-the-bf16-ceiling
   targets (fp32 and bf16, attention and encoder layer, headwise / kv / layerwise, exact
   SDPA beside, n 4096-65536), ours on the rule's kernel and pinned to the explicit one
   (`--kernel rule,explicit`; pinned SDPA is the eager rule on a GPU since SDPA is cut
   into query chunks), so that the layers say what the rule gains and where a new table
   would move it; should that step fail, it runs again on the rule's kernel alone;
3. the same at B 8 (no exact baseline);
4. `kernels_compile.py`: does torch.compile of a whole encoder pay on the GPU?
5. and 6. the same at n = 16384 with the explicit kernel pinned, then SDPA: whether Inductor
   compiles the explicit kernel's dropout mask (`dropout.dropout_bits`, reordered for it)
   and whether compiled training on it beats compiled SDPA;
7. `kernels.py` in fp16 (n 4096-65536) and 8. for exact causal attention (fp32 and bf16,
   n 1024-8192): the cells the CUDA rule had left to SDPA unmeasured;
9. and 10. `kernels_compile.py` at n = 16384 under bf16 autocast on each kernel (the
   first such pair had graph breaks in its explicit run, since fixed), and 11. and 12. at
   B 8, n = 4096 with the default dropout (a cell the compiled CUDA rule gives the
   explicit kernel unmeasured);
13. `linformer bench --peers --compile inductor,reduce-overhead`, B 1, n = 4096, the
   encoder layer (kv), fp32: the B 1 peer target with ours and the peers also compiled,
   with and without CUDA graphs (eager at B 1 every variant is bound by kernel launches),
   ours on the rule's kernel and pinned to the explicit one: under CUDA graphs ours on
   SDPA cut took 2.06 ms a step, on the explicit kernel 1.82, against lucidrains' 1.91
   (`cuda/bench-b1-compiled-run6/`; before the cut 1.79 against 1.64); in the
   eager profile (`cuda/profile/`, before SDPA's queries were cut into chunks) our SDPA
   layer's kernels took 1.79 ms, 1.0 of it SDPA's backward, and the explicit kernel's
   layer's 1.17 ms in 92 launches, which graphs make cheap (as in 2, on the rule's kernel
   alone should the pinned run fail);
14. `kernels_split.py`: the table of SDPA cut into query chunks behind
   `kernel_rule.choose_splits`, and of the explicit kernel's backward cut behind
   `choose_reduction_splits` (about 140 s);
15. `kernels_profile.py`, B 1, n = 4096, eager, compiled and under CUDA graphs: each
   variant's kernels and host time, ours kv and headwise. In the ninth call, compiled,
   ours on the rule's kernel (explicit then) ran 1.06 ms of kernels a step, on SDPA 0.81,
   lucidrains 1.15; under CUDA graphs ours' step took 1.29 ms against lucidrains' 1.23
   (`cuda/bench-b1-compiled-run9/`), 0.23 ms beyond its kernels against 0.08: where do
   they go? (`reduce-overhead` is profiled since, with Inductor's CUDA-graph counts.)
16. and 17. `kernels_compile.py` at n = 8192 on each kernel: the compiled cell between
   the rule's explicit (n 4096) and SDPA (n 16384) measurements;
18. `kernels_feedforward_sums.py --threads 16`, on the machine's CPU (no GPU involved; it
   builds the CPU kernels first, and stops with a message where it cannot): the CPU
   feed-forward kernel's weight-gradient rule (rows < 2 x threads x dim: GEMMs over all
   rows) with 16 threads (`cuda/feedforward-sums/`);
19. `lm_loss.py`: the language models' loss in chunks of rows (`return_logits=False`)
   against full logits, on the GPU (`cuda/lm-loss/`: `losses.GPU_CHUNK_ELEMENTS`);
20. `kernels_split_layers.py`: the layers' steps with SDPA cut as the rule cuts it, uncut,
   and in 4 and 32 chunks (`cuda/split-layers/`, made by hand, behind bf16's cut from
   n = 65536);
21. `linformer bench --compile inductor`, B 8, n 16384 and 32768, the encoder layer (kv)
   in bf16: does Inductor's fusion pass the 36 % of the bf16 ceiling that bounds the eager
   op sequence (`benchmarks/roofline.py`; eager measured 15-20 %)? No peers, no memory.
22. `train_compile.py`: `linformer pretrain --compile` of the demo's masked LMs, eager,
   Inductor and CUDA graphs, 60 steps each: does the whole training step gain what the
   compiled encoder gained (1.35x, 3.6x with CUDA graphs), validation and checkpoints
   included? (On the CPU it did not: `benchmarks/train_compile/`.)
23. step 13 with `--compile reduce-overhead,reduce-overhead+autograd`: under CUDA graphs
   a step's host time (0.2-0.3 ms of ours' 1.12 at B 1, n 4096, against lucidrains' 1.21)
   includes an AccumulateGrad call per parameter tensor; with "+autograd" compiled
   autograd captures the whole backward, the accumulation included, for ours and the
   peers alike (`training.settings.compiled_backward`). Does the B 1 target (1.2x) come
   within reach, as the kernels' GPU time (1.39x less than lucidrains') says it could?
24. `train_compile.py` the same way: do whole training runs gain from it?
25. `kernels_profile.py` under `reduce-overhead+autograd` (ours kv and the peers): where a
   replayed step's host time goes with the backward captured whole, against step 15's
   `reduce-overhead` profile.

Steps 5-25 get what steps 1-4 (about 400 s) leave of the budget. `--steps` runs only the
named steps (still in this order), e.g. `--steps
compile-explicit,compile-sdpa,kernels-fp16,kernels-causal` (no peer wheels needed). Steps
1-22 have run on an H200 (`benchmarks/kernels/cuda/`). The ninth call (`cuda/log-run9.txt`)
ran 1, 2, 3, 15, then 4, 13 and 21, settled, in about 480 s of commands: `--steps
kernels,bench-b1,bench-b8,profile` (378 s; the peer wheels needed), then `--steps
compile,bench-b1-compiled,bench-b8-bf16-compiled` (107 s). The tenth session's two calls
(`cuda/log-run10.txt`, the machine up in about 30 s each) ran 14, 13, 15 (eager, then
`--compile reduce-overhead` alone) and 22 by hand, each with its own `timeout`, then
`tests/test_cuda.py` and 13 with attention dropout 0.1 (`--attention-dropout 0.1 --kernel
rule,sdpa --compile reduce-overhead`: the compiled band's explicit kernel lost under CUDA
graphs). Next: 23-25 (new, never run on a GPU: `--steps
bench-b1-autograd,train-autograd,profile-autograd`, the peer wheels needed), then the
compiled steps 5, 6, 9-12, 16 and 17 (the fourth to sixth calls, before SDPA was cut into
chunks).

The GPU image has torch but not the peers: carry their wheels, and pytest's (whether the
image has it was not checked). Here, once, in the repo root:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux2014_x86_64 -d .whl \\
        linformer==0.2.3 linformer-pytorch==0.19.3 pytest pluggy iniconfig packaging

then one device call with `carry: [".whl"]`, `timeout_s: 600`, the GPU-only tests first
(`tests/test_cuda.py`, 3 s on an H200; `tests/test_cuda_models.py`, new on 2026-11-29 and
never run on a GPU: bf16 SDPA cut, the layer under CUDA autocast, a compiled encoder and
pretraining on the device, which skips without `tokenizers` in the image):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    PYTHONPATH=src:/tmp/site python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \\
        tests/test_cuda_models.py;
    PYTHONPATH=/tmp/site python3 benchmarks/gpu_runbook.py --out $OUT

`--smoke` runs the same steps on CPU at tiny sizes, compiling with the `aot_eager` backend,
in about 3.5 minutes on a 2-core Zen 4. So that the runbook still works when a GPU is lent,
the tests parse every step's arguments, at either size, with its program's parser, and run
five steps, one of each kind, through `--smoke`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def steps(smoke: bool) -> list[tuple[str, list[str]]]:
    """(name, argv) of each step, in order of priority; `smoke`: CPU, tiny sizes."""
    device = ["--device", "cpu" if smoke else "cuda"]
    python = [sys.executable]
    if smoke:
        kernels = "--dtype float32 --batch 1 --n 64 --k 16 --head-dim 8 --min-seconds 0"
        shape = "--dtype float32 --n 64 --dim 32 --num-heads 2 --proj-dim 16 --warmup 0 "
        shape += "--repeats 1 --min-time-s 0 --no-memory --scope attention --sharing kv"
        # aot_eager: the smoke checks the plumbing, not Inductor's C++ builds (slow on CPU)
        compiled = shape + " --compile aot_eager"
        compile_n = long_n = short_n = mid_n = ["--n", "64", "--backend", "aot_eager"]
        batch = "2"
        split = "--dtype float32 --batch 1 --n 128 --k 8 --head-dim 4 --max-splits 2 "
        split += "--min-seconds 0"
        profile = "--n 64 --dim 32 --proj-dim 16 --scope attention --steps 1 --warmup 1 "
        profile += "--compile aot_eager"
        fp16 = kernels.replace("float32", "float16")
        causal = "--dtype float32 --batch 1 --n 64 --head-dim 8 --min-seconds 0"
        sums = "--threads 2 --dim 8 --rows 32,64 --repeats 1"
        lm_loss = "--tiny --repeats 1 --threads 1 --memory-steps 1"
        layers = "--dtype float32 --shapes 1x128 --dim 16 --k 8 --repeats 1"
        fused = shape.replace("attention", "layer") + " --compile aot_eager --batch-size 2"
        train = "--tiny --compile aot_eager --steps 2 --rounds 1 --models mlm/linformer"
        autograd = compiled.replace("aot_eager", "aot_eager,aot_eager+autograd")
        train_autograd = train.replace("aot_eager", "aot_eager+autograd")
        profile_autograd = profile.replace("aot_eager", "aot_eager+autograd")
    else:
        kernels = "--dtype float32,bfloat16 --batch 1,8 --n 1024,4096,8192,16384,32768,65536 "
        kernels += "--k 64,256,1024 --head-dim 64 --min-seconds 1"
        shape = "--dtype float32,bfloat16 --n 4096,8192,16384,32768,65536 --warmup 2 "
        shape += "--repeats 10 --min-time-s 1 --memory-budget-gb 60 --scope attention,layer "
        shape += "--sharing headwise,kv,layerwise"
        compiled = "--dtype float32 --n 4096 --warmup 2 --repeats 10 --min-time-s 1 --no-memory "
        compiled += "--scope layer --sharing kv --compile inductor,reduce-overhead"
        compile_n, long_n, short_n, batch = [], ["--n", "16384"], ["--n", "4096"], "8"
        mid_n, split = ["--n", "8192"], ""
        profile = "--n 4096 --batch 1 --sharing kv,headwise --compile inductor,reduce-overhead"
        fp16 = "--dtype float16 --batch 1,8 --n 4096,16384,65536 --k 64,256,1024 --head-dim 64 "
        fp16 += "--min-seconds 1"
        causal = "--dtype float32,bfloat16 --batch 1,8 --n 1024,4096,8192 --head-dim 64 "
        causal += "--min-seconds 1"
        sums = "--threads 16 --dim 256,768 --rows 2048,8192,32768 --repeats 7"
        lm_loss = "--repeats 10 --memory-steps 5"
        layers = "--cuts 1,4,32"
        fused = "--dtype bfloat16 --n 16384,32768 --batch-size 8 --warmup 2 --repeats 10 "
        fused += "--min-time-s 1 --no-memory --memory-budget-gb 60 --scope layer --sharing kv "
        fused += "--compile inductor"
        train = "--compile inductor,reduce-overhead --steps 60 --rounds 1"
        autograd = compiled.replace(
            "inductor,reduce-overhead", "reduce-overhead,reduce-overhead+autograd"
        )
        train_autograd = "--compile reduce-overhead,reduce-overhead+autograd --steps 60 --rounds 1"
        profile_autograd = "--n 4096 --batch 1 --sharing kv --compile reduce-overhead+autograd"
    own = [*python, "-m", "linformer_kit.cli", "bench", *device]  # ours and exact only
    cli = [*own, "--peers"]
    bench = [*cli, *shape.split()]
    pinned = ["--kernel", "rule,explicit"]
    compile = [*python, str(BENCHMARKS / "kernels_compile.py"), *device]
    table = [*python, str(BENCHMARKS / "kernels.py"), *device]
    bf16 = [*compile, *long_n, "--autocast", "bf16"]
    b8 = [*compile, *short_n, "--batch", batch]
    return [
        ("kernels", [*table, *kernels.split()]),
        ("bench-b1", [*bench, "--exact", "sdpa", *pinned]),
        ("bench-b8", [*bench, "--exact", "", "--batch-size", batch, *pinned]),
        ("compile", [*compile, *compile_n]),
        ("compile-explicit", [*compile, *long_n, "--kernel", "explicit"]),
        ("compile-sdpa", [*compile, *long_n, "--kernel", "sdpa"]),
        ("kernels-fp16", [*table, *fp16.split()]),
        ("kernels-causal", [*table, "--causal", *causal.split()]),
        ("compile-bf16-explicit", [*bf16, "--kernel", "explicit"]),
        ("compile-bf16-sdpa", [*bf16, "--kernel", "sdpa"]),
        ("compile-b8-explicit", [*b8, "--kernel", "explicit"]),
        ("compile-b8-sdpa", [*b8, "--kernel", "sdpa"]),
        ("bench-b1-compiled", [*cli, *compiled.split(), "--exact", "", *pinned]),
        ("kernels-split", [*python, str(BENCHMARKS / "kernels_split.py"), *device, *split.split()]),
        ("profile", [*python, str(BENCHMARKS / "kernels_profile.py"), *device, *profile.split()]),
        ("compile-8192-explicit", [*compile, *mid_n, "--kernel", "explicit"]),
        ("compile-8192-sdpa", [*compile, *mid_n, "--kernel", "sdpa"]),
        (
            "feedforward-sums",
            [*python, str(BENCHMARKS / "kernels_feedforward_sums.py"), *sums.split()],
        ),
        ("lm-loss", [*python, str(BENCHMARKS / "lm_loss.py"), *device, *lm_loss.split()]),
        (
            "split-layers",
            [*python, str(BENCHMARKS / "kernels_split_layers.py"), *device, *layers.split()],
        ),
        ("bench-b8-bf16-compiled", [*own, *fused.split(), "--exact", ""]),
        ("train-compile", [*python, str(BENCHMARKS / "train_compile.py"), *device, *train.split()]),
        ("bench-b1-autograd", [*cli, *autograd.split(), "--exact", "", *pinned]),
        (
            "train-autograd",
            [*python, str(BENCHMARKS / "train_compile.py"), *device, *train_autograd.split()],
        ),
        (
            "profile-autograd",
            [*python, str(BENCHMARKS / "kernels_profile.py"), *device, *profile_autograd.split()],
        ),
    ]


STEPS = tuple(name for name, _ in steps(smoke=True))  # the same names at either size


def run_steps(
    work: Path, log: Path, *, smoke: bool, budget_s: float, only: tuple[str, ...] = STEPS
) -> list[str]:
    """Runs the steps named in `only`, each into work/NAME, until the budget is spent;
    returns one line per step: done, failed (its exit status), stopped at the deadline, or
    not started. A bench step that fails with several kernels pinned runs again on the
    rule's kernel alone, into work/NAME-rule."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    deadline, lines = time.monotonic() + budget_s, []
    with log.open("a") as out:
        for name, argv in steps(smoke):
            if name not in only:
                continue
            left = deadline - time.monotonic()
            if left < 5:
                lines.append(f"{name}: not started (budget spent)")
                continue
            argv = [*argv, "--out", str(work / name)]
            out.write(f"\n== {name}: {' '.join(argv)}\n")
            out.flush()
            began = time.monotonic()
            status = _run(argv, out, env, deadline)
            kernel = argv.index("--kernel") if "--kernel" in argv else None
            if status.startswith("failed") and kernel and "," in argv[kernel + 1]:
                fallback = [*argv]
                fallback[kernel + 1], fallback[-1] = "rule", str(work / f"{name}-rule")  # --out
                out.write(f"\n== {name} again, on the rule's kernel alone: {' '.join(fallback)}\n")
                out.flush()
                status += ", then on the rule's kernel alone: " + _run(fallback, out, env, deadline)
            lines.append(f"{name}: {status} in {time.monotonic() - began:.0f} s")
    return lines


def _run(argv: list[str], out: IO[str], env: dict[str, str], deadline: float) -> str:
    """Runs one step's process into `out` until the deadline: done, failed or stopped."""
    try:
        code = subprocess.run(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env,
            timeout=max(1.0, deadline - time.monotonic()),
        ).returncode  # fmt: skip
    except subprocess.TimeoutExpired:
        return "stopped at the deadline"
    return "done" if code == 0 else f"failed (exit status {code})"


def main(argv: list[str] | None = None) -> None:
    """Runs the runbook and packs its results into OUT."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results.tar.gz, log.txt")
    parser.add_argument("--budget-s", type=float, default=540.0, help="all steps together")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")
    parser.add_argument(
        "--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)}"
    )
    args = parser.parse_args(argv)
    only = tuple(name for name in args.steps.split(",") if name)
    unknown = [name for name in only if name not in STEPS]
    if unknown:
        parser.error(f"--steps: unknown {', '.join(unknown)}; the steps are {', '.join(STEPS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "log.txt"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "results"
        work.mkdir()
        lines = run_steps(work, log, smoke=args.smoke, budget_s=args.budget_s, only=only)
        with tarfile.open(args.out / "results.tar.gz", "w:gz") as tar:
            tar.add(work, arcname="results")
    with log.open("a") as out:
        out.write("\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
