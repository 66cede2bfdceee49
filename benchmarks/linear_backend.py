"""The table behind `linformer_kit.linear_backend`'s rule: linear maps on torch's BLAS or oneDNN.

Three parts, each timed interleaved (medians of rotated rounds, so every ratio comes from the
same seconds of a shared machine), float32 on CPU:

- `gemm`: one linear map, (rows, in) x (in, out) + bias, with its backward (`train`: the
  input, weight and bias gradients) and without (`inference`), through `F.linear` (`blas`)
  and through `onednn_linear` (`onednn`: in training, the kernels' `matmul` up to
  `MATMUL_MAX_OUTPUTS` outputs, any number with one thread, and oneDNN's 1 x 1 convolution
  beyond; `convolution`: the convolution whatever the size; `matmul`: the matmul form
  whatever the size), at rows 1 ... 16384 and the layers' widths;
- `layer`: the bench's encoder layer and attention layer (dim 256, 4 heads, k 256, kv,
  feed-forward 1024, no dropout, forward + backward) with the backend pinned each way
  (`use_linear_backend`, which also pins the compiled kernels' GEMMs: `sgemm_` or oneDNN's
  micro-kernel, and with them the sequence projection's and, without dropout, the
  attention kernel the rule picks), and oneDNN in its convolution form only;
- `model`: a whole language model's training step (forward, the loss in chunks of rows,
  backward; `benchmarks/lm_loss.py`'s demo causal and masked Linformers, `--models`, names
  separated by ';'), pinned each way.

glibc keeps freed memory (`--no-keep-freed-memory`: its defaults), as `linformer bench`
does while it times. Writes OUT/ab.json and OUT/ab.png (blas time / onednn time, > 1:
oneDNN is faster; `matmul_speedup`: convolution time / onednn time, > 1: the matmul form
pays; `any_size_speedup`: onednn time / matmul time, > 1: the matmul form would pay past
the limit too).

    PYTHONPATH=src python benchmarks/linear_backend.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_loss import MODELS, TINY_MODELS, batch_for, model_and_optimizer
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from linformer_kit import linear_backend
from linformer_kit.bench.flops import Shape
from linformer_kit.bench.timing import module_step, time_interleaved
from linformer_kit.bench.variants import Variant, build_variant
from linformer_kit.linear_backend import onednn_linear, use_linear_backend, use_matmul_form
from linformer_kit.training.compare import machine
from linformer_kit.training.settings import keep_freed_memory

OUT = Path(__file__).parent / "linear_backend"
COMMAND = "PYTHONPATH=src python benchmarks/linear_backend.py"
WAYS = ("blas", "onednn", "convolution", "matmul")


@contextlib.contextmanager
def pinned(way: str) -> Iterator[None]:
    """`use_linear_backend` for blas and onednn; convolution: onednn with its matmul form
    off (`use_matmul_form`); matmul: onednn with the form's output limit lifted (this
    process's `linear_backend.MATMUL_MAX_OUTPUTS`, restored after)."""
    if way in ("blas", "onednn"):
        with use_linear_backend(way):
            yield
        return
    if way == "convolution":
        with use_linear_backend("onednn"), use_matmul_form(False):
            yield
        return
    limit, linear_backend.MATMUL_MAX_OUTPUTS = linear_backend.MATMUL_MAX_OUTPUTS, math.inf
    try:
        with use_linear_backend("onednn"):
            yield
    finally:
        linear_backend.MATMUL_MAX_OUTPUTS = limit


DEMO_LINFORMERS = [name for name in MODELS if name.startswith("demo") and "Linformer" in name]


def gemm_steps(rows: int, sizes: tuple[int, int]) -> dict[str, Callable[[], None]]:
    """(mode way) -> one call of the linear map at this shape."""
    in_features, out_features = sizes
    x = torch.randn(rows, in_features, requires_grad=True)
    weight = torch.randn(out_features, in_features, requires_grad=True)
    bias = torch.randn(out_features, requires_grad=True)
    grad = torch.randn(rows, out_features)
    steps = {}
    for way in WAYS:
        fn = F.linear if way == "blas" else onednn_linear

        def train(fn=fn, way=way) -> None:
            with pinned(way):
                fn(x, weight, bias).backward(grad)

        def inference(fn=fn, way=way) -> None:
            with pinned(way), torch.no_grad():
                fn(x, weight, bias)

        steps[f"train {way}"], steps[f"inference {way}"] = train, inference
    return steps


def each_way(step: Callable[[], None]) -> dict[str, Callable[[], None]]:
    """way -> `step` run with that way pinned."""

    def run(way: str) -> Callable[[], None]:
        def one() -> None:
            with pinned(way):
                step()

        return one

    return {way: run(way) for way in WAYS}


def layer_steps(n: int, scope: str) -> dict[str, Callable[[], None]]:
    """way -> one forward + backward of the bench's layer with the way pinned."""
    shape = Shape(batch_size=1, seq_len=n, dim=256, num_heads=4, proj_dim=256, ffn_dim=1024)
    torch.manual_seed(0)
    module = build_variant(Variant(name="ours", kind="ours", sharing="kv"), shape, scope).train()
    return each_way(module_step(module, torch.randn(1, n, 256, requires_grad=True), backward=True))


def model_steps(name: str, tiny: bool) -> dict[str, Callable[[], None]]:
    """way -> one training step (no optimiser) of `lm_loss`'s model `name`, pinned."""
    fields, batch = (TINY_MODELS if tiny else MODELS)[name]
    model, _ = model_and_optimizer(fields, "cpu")
    inputs = batch_for(fields, batch, "cpu")
    return each_way(lambda: model(**inputs, return_logits=False).loss.backward())


def medians(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each step, timed interleaved."""
    times = time_interleaved(steps, warmup=2, repeats=repeats, device="cpu")
    return {name: round(statistics.median(t) * 1e3, 4) for name, t in times.items()}


def timings(ms: dict[str, float], prefix: str = "") -> dict[str, float]:
    """Each way's milliseconds (the steps named prefix + way) and the three ratios."""
    blas, onednn, convolution, matmul = (ms[prefix + way] for way in WAYS)
    return dict(
        blas_ms=blas,
        onednn_ms=onednn,
        convolution_ms=convolution,
        matmul_ms=matmul,
        onednn_speedup=round(blas / onednn, 3),
        matmul_speedup=round(convolution / onednn, 3),
        any_size_speedup=round(onednn / matmul, 3),
    )


def plot(result: dict, path: Path) -> None:
    """Left: one linear map's speed-up on oneDNN by rows per width; middle: its matmul
    form's over the convolution (training); right: the layers' both ways, by n."""
    fig = Figure(figsize=(15, 4.2))
    left, middle, right = fig.subplots(1, 3)
    for sizes in sorted({tuple(r["sizes"]) for r in result["gemm"]}):
        for mode, style in (("train", "-"), ("inference", ":")):
            rows = [r for r in result["gemm"] if tuple(r["sizes"]) == sizes and r["mode"] == mode]
            label = f"{mode} {sizes[0]}->{sizes[1]}"
            left.plot([r["rows"] for r in rows], [r["onednn_speedup"] for r in rows], style,
                      marker="o", label=label)  # fmt: skip
            if mode == "train":
                middle.plot([r["rows"] for r in rows], [r["matmul_speedup"] for r in rows],
                            marker="o", label=label)  # fmt: skip
    left.set(xscale="log", xlabel="rows", ylabel="blas time / onednn time", title="one linear map")
    middle.set(xscale="log", xlabel="rows", ylabel="convolution time / onednn time",
               title="one linear map, with gradients: matmul form")  # fmt: skip
    for scope in sorted({r["scope"] for r in result["layer"]}):
        rows = [r for r in result["layer"] if r["scope"] == scope]
        ways = (
            ("onednn", "-", "blas / onednn"),
            ("matmul", "--", "conv / onednn"),
            ("any_size", ":", "onednn / matmul at any size"),
        )
        for key, style, what in ways:
            right.plot([r["n"] for r in rows], [r[f"{key}_speedup"] for r in rows], style,
                       marker="o", label=f"{scope}: {what}")  # fmt: skip
    right.set(xscale="log", xlabel="n", title="the bench's layer, kv, k 256, fwd+bwd")
    for ax in (left, middle, right):
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"float32, {result['threads']} threads, {result['machine']['cpu']['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    """Times both parts and writes ab.json and ab.png."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64,128,256,512,2048,8192,16384")
    parser.add_argument("--sizes", default="256x256,256x1024,1024x256,768x768", help="in x out")
    parser.add_argument(
        "--n", default="1024,2048,4096,8192,16384", help="the layers' sequence lengths"
    )
    parser.add_argument("--scope", default="layer,attention")
    parser.add_argument(
        "--models", default=";".join(DEMO_LINFORMERS), help="; separated (empty: none)"
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a quick smoke run (tests)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="glibc keeps freed memory (training.keep_freed_memory), as the bench times",
    )
    args = parser.parse_args(argv)
    kept = args.keep_freed_memory and keep_freed_memory()
    if args.tiny:
        args.rows, args.sizes, args.n, args.repeats = "16,256", "32x64", "256", 3
        args.models = ";".join(TINY_MODELS)
    torch.set_num_threads(args.threads)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    shapes = [(r, s) for s in sizes for r in map(int, args.rows.split(","))]
    result = {
        "command": " ".join([COMMAND, *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine(),
        "threads": args.threads,
        "freed_memory_kept": kept,
        "gemm": [],
        "layer": [],
        "model": [],
    }
    for rows, size in tqdm(shapes, desc="linear maps"):
        ms = medians(gemm_steps(rows, size), args.repeats)
        for mode in ("train", "inference"):
            row = dict(mode=mode, rows=rows, sizes=size) | timings(ms, f"{mode} ")
            result["gemm"].append(row)
    cells = [(s, n) for s in args.scope.split(",") for n in map(int, args.n.split(","))]
    for scope, n in tqdm(cells, desc="layers"):
        ms = medians(layer_steps(n, scope), args.repeats)
        result["layer"].append(dict(scope=scope, n=n) | timings(ms))
        tqdm.write(json.dumps(result["layer"][-1]))
    for name in tqdm([m for m in args.models.split(";") if m], desc="models"):
        ms = medians(model_steps(name, args.tiny), max(3, args.repeats // 3))
        result["model"].append(dict(model=name) | timings(ms))
        tqdm.write(json.dumps(result["model"][-1]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "ab.png")
    print("wrote", args.out / "ab.json", args.out / "ab.png")


if __name__ == "__main__":
    main()
