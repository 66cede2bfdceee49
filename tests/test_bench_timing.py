"""The benchmark toolkit's timing: interleaved rounds, the settling call, peak memory in a
fresh process, the ceiling product, module steps and compiled steps.

No wall-clock asserts: structure, counts and files only, on tiny sizes with one repeat.
"""

import dataclasses
import json
import sys
import time

import pytest
import torch
from bench_helpers import OURS, SDPA, SHAPE, tiny_settings
from torch._dynamo.utils import counters

from linformer_kit.bench import (
    BenchSettings,
    Call,
    build_variant,
    default_variants,
    peak_memory,
    run_bench,
    time_interleaved,
    timing,
)
from linformer_kit.bench import timing as timing_module
from linformer_kit.bench.timing import module_step, size_ceiling_matmul
from linformer_kit.kernel_rule import pinned_kernel, use_kernel
from linformer_kit.training.process import in_fresh_process


def test_timing_adds_rounds_until_the_minimum_time():
    times = time_interleaved(
        {"a": lambda: None}, warmup=0, repeats=1, device="cpu", min_seconds=10.0, max_repeats=7
    )
    assert len(times["a"]) == 7


def test_max_repeats_counts_timed_rounds_after_the_warm_up():
    times = time_interleaved(
        {"a": lambda: None}, warmup=2, repeats=1, device="cpu", min_seconds=10.0, max_repeats=7
    )
    assert len(times["a"]) == 7


def test_the_ceiling_probe_keeps_the_faster_of_its_two_calls(monkeypatch):
    drawn = iter([0.2, 0.05])
    monkeypatch.setattr(timing_module, "_seconds", lambda step, device: next(drawn))
    assert size_ceiling_matmul("float32", "cpu", target_s=0.1, start=64) == (64, 0.05)


def test_timing_interleaves_and_rotates_the_order():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    ticks = []
    times = time_interleaved(steps, warmup=1, repeats=2, device="cpu", tick=lambda: ticks.append(1))
    assert {name: len(t) for name, t in times.items()} == {"a": 2, "b": 2, "c": 2}
    # Each call comes twice: an untimed one settles the caches, then the timed one.
    assert calls == list("aabbccbbccaaccaabb")
    assert len(ticks) == 3


def test_timing_on_cpu_times_the_call_after_the_settling_one():
    last = []

    def step(name: str) -> None:
        if not last or last[-1] != name:  # cold: just after another step
            time.sleep(0.05)
        last.append(name)

    times = time_interleaved(
        {n: (lambda n=n: step(n)) for n in "ab"}, warmup=0, repeats=3, device="cpu"
    )
    assert all(t < 0.05 for ts in times.values() for t in ts), times


def test_peak_memory_of_a_fresh_process_is_positive():
    call = Call(
        variant=OURS["kv"],
        shape=dataclasses.replace(SHAPE, seq_len=2048, dim=64),
        scope="attention",
        backward=True,
        dtype="float32",
        device="cpu",
        threads=1,
    )
    # Weights, input and activations of this call: several MiB, far below a GiB.
    assert 2**20 < peak_memory(call) < 2**30


def test_ceiling_matmul_grows_to_the_time_budget_or_stops_at_the_limit():
    # Already slower than the target at the first size: no growth.
    assert size_ceiling_matmul("float32", "cpu", target_s=1e-9, start=64)[0] == 64
    # An unreachable target: the growth stops at the limit.
    size, seconds = size_ceiling_matmul("float32", "cpu", target_s=60.0, start=64, limit=256)
    assert size == 256 and 0 < seconds < 60.0


def test_ceiling_matmul_sizes_above_1024_are_multiples_of_512(monkeypatch):
    # A size such as 2432 (a multiple of 64) ran oneDNN 7 % below 2048 and 2560: the probe
    # read low and every layer's share of the ceiling high. A machine of 1e-11 s per
    # multiply-add (time = size^3 * 1e-11) reaches 0.05 s near 1710.
    monkeypatch.setattr(timing, "matmul_step", lambda size, dtype, device: lambda: size)
    monkeypatch.setattr(timing, "_seconds", lambda step, device: step() ** 3 * 1e-11)
    size, seconds = size_ceiling_matmul("float32", "cpu", target_s=0.1, start=256)
    assert size % 512 == 0 and seconds >= 0.05


def test_compiled_variants_time_the_same_layers_under_torch_compile(tmp_path):
    # --compile aot_eager: every variant again under torch.compile (aot_eager: no code
    # generation, so the test stays fast), named apart; ours compiled inside its kernel pin.
    names = [v.name for v in default_variants(sharings=("kv",), peers=False,
                                              compiles=(None, "aot_eager"))]  # fmt: skip
    assert names == ["linformer kv", "exact sdpa", "exact naive", "linformer kv [compiled "
                     "aot_eager]", "exact sdpa [compiled aot_eager]",
                     "exact naive [compiled aot_eager]"]  # fmt: skip
    x = torch.randn(SHAPE.batch_size, SHAPE.seq_len, SHAPE.dim)
    for variant in (OURS["kv"], SDPA):
        torch.manual_seed(0)
        eager = build_variant(variant, SHAPE, "layer").eval()
        torch.manual_seed(0)
        built = build_variant(dataclasses.replace(variant, compile="aot_eager"), SHAPE, "layer")
        assert isinstance(built.module, torch._dynamo.eval_frame.OptimizedModule)
        torch.testing.assert_close(built.eval()(x), eager(x))
    settings = tiny_settings(tmp_path, n="64", scope="attention", sharing="kv", exact="sdpa",
                             compile="aot_eager", memory=True, peers=True)  # fmt: skip
    result = run_bench(settings)
    rows = {r["variant"]: r for r in result["rows"]}
    compiled = " [compiled aot_eager]"
    names = ["linformer kv", "exact sdpa", "lucidrains", "linformer-pytorch"]
    assert {name: r["compile"] for name, r in rows.items()} == {
        **{name: None for name in names}, **{name + compiled: "aot_eager" for name in names}
    }  # fmt: skip
    # Each is compared with exact SDPA and the peers under the same setting; compiled rows
    # have no peak memory (the compile's own would count on CPU).
    for setting in ("", compiled):
        ours = rows["linformer kv" + setting]
        ratio = rows["exact sdpa" + setting]["median_ms"] / ours["median_ms"]
        assert ours["speedup_vs_sdpa"] == pytest.approx(ratio)
        assert (ours["peak_mem_mb"] is None) == bool(setting)
        peers = [rows[peer + setting]["median_ms"] for peer in ("lucidrains", "linformer-pytorch")]
        entry = result["summary"]["attention"]["float32"][f"linformer kv{setting} k=16"][64]
        assert entry["speedup_vs_faster_peer"] == pytest.approx(min(peers) / ours["median_ms"])
    assert (tmp_path / "bench" / "peers.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="compile must be one of inductor, reduce-overhead"):
        tiny_settings(tmp_path, compile="aot_eager,tensorrt")
    with pytest.raises(ValueError, match="reduce-overhead records CUDA graphs"):
        tiny_settings(tmp_path, compile="reduce-overhead")


def test_a_compiled_autograd_step_captures_the_backward_and_keeps_the_eager_gradients():
    # --compile aot_eager+autograd: the module compiled as with aot_eager, and each step's
    # backward (the gradients' accumulation included) captured by compiled autograd.
    x = torch.randn(SHAPE.batch_size, SHAPE.seq_len, SHAPE.dim, requires_grad=True)
    grads = {}
    for setting in (None, "aot_eager+autograd"):
        torch.manual_seed(0)
        module = build_variant(dataclasses.replace(OURS["kv"], compile=setting), SHAPE, "layer")
        step = module_step(module.train(), x, backward=True, compile=setting)
        counters.clear()
        for _ in range(2):  # the second call on the captured graph
            step()
        assert (counters["compiled_autograd"]["captures"] > 0) == bool(setting)
        grads[setting] = [x.grad, *(p.grad for p in module.parameters())]
    for eager, compiled in zip(*grads.values(), strict=True):
        torch.testing.assert_close(compiled, eager)


def test_a_compiled_sweep_over_lengths_and_sharings_stays_compiled(tmp_path, monkeypatch):
    # Every compiled module of a class shares dynamo's cache for its methods: past the
    # recompile limit (8) dynamo would run the rest eagerly under "compiled" names, which
    # this sweep reaches at its second n without `compile_limits` and the reset per n. The
    # test makes a hit raise (run_bench sets the same), so a fallback fails it.
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    sharings = "none,headwise,kv,layerwise"
    settings = tiny_settings(tmp_path, n="32,48", sharing=sharings, exact="sdpa",
                             compile="aot_eager")  # fmt: skip
    rows = [r for r in run_bench(settings)["rows"] if r["compile"]]
    assert len(rows) == 2 * 2 * 5  # n x scopes x (4 sharings + exact sdpa)
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in rows)


class _Recorder(torch.nn.Module):
    """A linear layer returning a tuple, recording the kernel pin, autocast and grad mode of
    each call."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.calls: list[tuple] = []

    def forward(self, x):
        self.calls.append(
            (pinned_kernel(), torch.is_autocast_enabled("cpu"), torch.is_inference_mode_enabled())
        )
        return self.linear(x), None


def test_module_step_clears_gradients_and_applies_its_settings():
    module = _Recorder()
    x = torch.randn(2, 3, 8, requires_grad=True)
    step = module_step(module, x, backward=True, kernel="explicit")
    step()
    first = (x.grad.clone(), module.linear.weight.grad.clone())
    step()  # the same fixed gradient again: equal, not accumulated
    torch.testing.assert_close(x.grad, first[0])
    torch.testing.assert_close(module.linear.weight.grad, first[1])
    assert module.calls == [("explicit", False, False)] * 2
    module_step(module, x, backward=True, autocast=torch.bfloat16)()
    assert module.calls[-1] == (None, True, False)
    x.grad = None
    module.zero_grad(set_to_none=True)
    module_step(module, x, backward=False)()
    assert module.calls[-1] == (None, False, True)
    assert x.grad is None and module.linear.weight.grad is None
    with use_kernel("sdpa"):  # no kernel of its own: the pin around it holds
        module_step(module, x, backward=False)()
    assert module.calls[-1] == ("sdpa", False, True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_timing_process_keeps_freed_memory_by_default(tmp_path):
    # In a fresh process: the setting is process-wide and stays.
    settings = tiny_settings(tmp_path, n="32", scope="attention", sharing="kv", exact="")
    settings = dataclasses.replace(settings, keep_freed_memory=BenchSettings().keep_freed_memory)
    result = in_fresh_process(run_bench, settings)
    assert result["freed_memory_kept"] is True
    saved = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert saved["settings"]["keep_freed_memory"] is True and saved["freed_memory_kept"] is True
