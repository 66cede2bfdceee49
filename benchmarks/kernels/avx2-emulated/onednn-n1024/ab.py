"""Scratch A/B behind `ab.json` (run under the AVX2-emulation variables it names): ours'
attention layer (kv, layerwise; attention dropout 0 and 0.1) at n = argv[1] with every GEMM
on oneDNN's AVX2 code (`use_linear_backend("onednn")`) against the machine's routing (MKL's
`sgemm_`), and the two peers, timed interleaved in one process; prints median ms as JSON.
argv[2] the scope (default attention; layer: the encoder layer) and argv[3] the library
pinned against the machine's routing (default onednn): on a real AVX2-only AMD EPYC (Zen 3,
`zen3-avx2/gemm-ab/`) it ran `ab.py N SCOPE blas`, the machine's routing there being the
attention side on oneDNN (`native.kernel_gemm`) and pinned every GEMM on `sgemm_`.

    PYTHONPATH=src python benchmarks/kernels/avx2-emulated/onednn-n1024/ab.py 1024
"""

import json
import statistics
import sys

import torch

from linformer_kit.bench.flops import Shape
from linformer_kit.bench.timing import module_step, time_interleaved
from linformer_kit.bench.variants import Variant, build_variant
from linformer_kit.linear_backend import use_linear_backend
from linformer_kit.training.settings import keep_freed_memory


def timed_step(variant: Variant, shape: Shape, backend: str | None = None):  # noqa: ANN201
    torch.manual_seed(0)
    module = build_variant(variant, shape, SCOPE).train()
    x = torch.randn(1, shape.seq_len, shape.dim, requires_grad=True)
    step = module_step(module, x, backward=True)

    def run() -> None:
        with use_linear_backend(backend):
            step()

    return run


SCOPE = sys.argv[2] if len(sys.argv) > 2 else "attention"
PINNED = sys.argv[3] if len(sys.argv) > 3 else "onednn"


def main() -> None:
    torch.set_num_threads(2)
    keep_freed_memory()
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    shape = Shape(batch_size=1, seq_len=n, dim=256, num_heads=4, proj_dim=256, ffn_dim=1024)
    steps = {
        f"{sharing} p{p} {backend or 'rule'}": timed_step(
            Variant(name=sharing, kind="ours", sharing=sharing, attention_dropout=p),
            shape,
            backend,
        )
        for sharing in ("kv", "layerwise")
        for p in (0.0, 0.1)
        for backend in (None, PINNED)
    }
    for peer in ("lucidrains", "linformer-pytorch"):
        steps[peer] = timed_step(Variant(name=peer, kind=peer, sharing="headwise"), shape)
    times = time_interleaved(steps, warmup=3, repeats=25, device="cpu")
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    json.dump(medians, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
