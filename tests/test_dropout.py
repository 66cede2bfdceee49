"""Dropout masks and `dropout.Dropout`. The bits are SplitMix64 outputs laid out by
position, uniform in every lane and independent of how rows are cut, and compile under
Inductor (no 64-bit constant times positions alone); the compiled kernel is optional and
says why it is missing, and its sources compile as C++17 (torch < 2.13); `Dropout` (the
models' nn.Dropout through the compiled CPU kernel) applies the documented mask once,
forward and backward, with the same rescaling, and everywhere the kernel does not apply it
is nn.Dropout itself; the benchmark scripts run what they say."""

import json
import re
import subprocess
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from script_helpers import BENCHMARKS, load_script
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import cpp_extension

from linformer_kit import LinformerConfig, LinformerModel, files, kernels, native
from linformer_kit import dropout as dropout_module
from linformer_kit.dropout import (
    Dropout,
    dropout_bits,
    dropout_seed,
    rescaling,
    threshold,
)

CPU = torch.device("cpu")


@pytest.fixture
def compiled():
    if native.cpu_ops() is None:
        pytest.skip("no C++ compiler here: the compiled dropout kernel cannot be built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 7, 10), (5,), (2, 1, 4, 6)])
def test_training_applies_the_documented_mask_once_forward_and_backward(dtype, shape, compiled):
    # Reference: the seed is the first draw after manual_seed; the input is seen as rows of
    # its last dimension, row r owning SplitMix64 outputs r * ceil(cols / 4) + 1 onwards.
    # bf16 is scaled in float and rounded once: bit for bit the float32 result, rounded.
    p = 0.3
    wide = torch.float32 if dtype == torch.bfloat16 else dtype
    x = torch.randn(shape, dtype=dtype).requires_grad_()
    layer = Dropout(p).train()
    torch.manual_seed(7)
    out = layer(x)
    torch.manual_seed(7)
    seed = dropout_seed(CPU).item()
    rows = x.detach().reshape(-1, shape[-1])
    keep = dropout_bits(rows, seed) >= threshold(p)
    expected = torch.where(keep, rows.to(wide) * rescaling(p), 0).to(dtype).view(shape)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    grad = torch.randn(shape, dtype=dtype)
    out.backward(grad)
    dropped = torch.where(keep.view(shape), grad.to(wide) * rescaling(p), 0).to(dtype)
    torch.testing.assert_close(x.grad, dropped, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_inputs_propagate_as_in_nn_dropout(dtype, compiled):
    # nn.Dropout multiplies by the mask: a dropped inf or nan is nan, not a silent 0 (a
    # select would hide a nan that training should see), in bf16 as in fp32.
    p, x = 0.5, torch.full((16, 40), float("inf"), dtype=dtype)
    x[::2] = float("nan")
    reference = nn.Dropout(p).train()(x)
    assert torch.isnan(reference[1::2]).any() and not (reference == 0).any()
    torch.manual_seed(3)
    out = Dropout(p).train()(x)
    torch.manual_seed(3)
    keep = dropout_bits(x, dropout_seed(CPU).item()) >= threshold(p)
    assert 0 < keep.sum() < keep.numel()
    expected = torch.where(keep, x * rescaling(p), float("nan"))
    torch.testing.assert_close(out, expected, atol=0, rtol=0, equal_nan=True)


def test_dropped_fraction_is_p_and_the_mean_is_kept(compiled):
    p, x = 0.1, torch.ones(256, 1024)
    out = Dropout(p).train()(x)
    count = x.numel()
    assert abs((out == 0).double().mean().item() - p) < 5 * (p * (1 - p) / count) ** 0.5
    assert abs(out.mean().item() - 1.0) < 5 * (p / (1 - p) / count) ** 0.5


def test_gradcheck_under_a_fixed_seed(compiled):
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    layer = Dropout(0.4).train()

    def fn(x):
        torch.manual_seed(0)  # the same mask at every evaluation
        return layer(x) * x  # not linear, so that the second derivative is checked too

    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.parametrize(
    "case", ["eval", "p = 0", "fp16", "inplace", "switched off", "no elements", "a scalar"]
)
def test_where_the_kernel_does_not_apply_it_is_nn_dropout(case, monkeypatch):
    p, dtype, inplace, shape = 0.3, torch.float32, False, (6, 8)
    if case == "p = 0":
        p = 0.0
    elif case == "fp16":
        dtype = torch.float16
    elif case == "inplace":
        inplace = True
    elif case == "switched off":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    elif case == "no elements":
        shape = (0, 8)
    elif case == "a scalar":
        shape = ()
    ours, theirs = Dropout(p, inplace), nn.Dropout(p, inplace)
    for layer in (ours, theirs):
        layer.train(case != "eval")
    x = torch.randn(shape).to(dtype)
    torch.manual_seed(3)
    expected = theirs(x.clone())
    torch.manual_seed(3)
    assert torch.equal(ours(x.clone()), expected)


def test_no_dropout_never_asks_for_the_kernel(monkeypatch):
    # p = 0 (the demo's config) or eval mode must not build the kernel, nor warn where it
    # cannot be built.
    def fail():
        raise AssertionError("the kernel was asked for")

    monkeypatch.setattr(native, "cpu_ops", fail)
    x = torch.randn(3, 5)
    assert torch.equal(Dropout(0.0).train()(x), x)
    assert torch.equal(Dropout(0.5).eval()(x), x)


def test_models_use_it_and_it_is_an_nn_dropout():
    model = LinformerModel(
        LinformerConfig(vocab_size=16, dim=8, depth=1, num_heads=2, max_seq_len=8, proj_dim=4)
    )
    found = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert found and all(type(m) is Dropout for m in found)
    assert repr(Dropout(0.1)) == "Dropout(p=0.1, inplace=False)"


def test_dropout_bits_are_uniform_in_every_lane_and_repeatable():
    # Each of the four 16-bit lanes of a 64-bit word must fall under p's threshold at
    # rate p, and one torch seed must give the same bits.
    def draw(seed):
        torch.manual_seed(seed)
        return dropout_bits(torch.empty(64, 4096), dropout_seed(CPU))

    bits = draw(0)
    assert bits.dtype == torch.int16 and bits.shape == (64, 4096)
    assert torch.equal(bits, draw(0)) and not torch.equal(bits, draw(1))
    p, count = 0.25, bits.numel() // 4
    under = (bits < round(p * 2**16) - 2**15).double()
    for lane in range(4):
        assert abs(under[:, lane::4].mean().item() - p) < 5 * (p * (1 - p) / count) ** 0.5


def splitmix64_reference(seed: int, count: int) -> list[int]:
    """SplitMix64 as published (Steele, Lea & Flood 2014; Vigna's splitmix64.c), in
    Python integers: the generator's first `count` outputs."""
    out, state, mask = [], seed % 2**64, 2**64 - 1
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


@pytest.mark.parametrize("seed", [0, 12345, -(2**63), 2**63 - 1])
def test_dropout_bits_are_splitmix64_outputs_laid_out_by_position(seed):
    # Row r of the call's rows owns outputs r * words_per_row + 1 onwards of the generator
    # seeded with seed * GOLDEN; lane j of a word is bits 16j..16j+15 (int16). Block: rows
    # 2..4 of 5 per matrix, 2 matrices, 6 keys (words of 4 + 2 weights), words_per_row 3
    # (the call's keys were 9..12).
    bits = dropout_bits(torch.empty(2, 3, 6), seed, 2, 5, 3)
    words = splitmix64_reference(seed * 0x9E3779B97F4A7C15, 2 * 5 * 3)
    for g in range(2):
        for i in range(3):
            row = g * 5 + 2 + i
            lanes = [(words[row * 3 + j // 4] >> (16 * (j % 4))) & 0xFFFF for j in range(6)]
            expected = [lane - 2**16 if lane >= 2**15 else lane for lane in lanes]
            assert bits[g, i].tolist() == expected


def test_dropout_bits_do_not_depend_on_how_rows_are_cut():
    whole = dropout_bits(torch.empty(3, 7, 10), 99, 0, 7, 4)
    cut = [dropout_bits(torch.empty(3, n, 10), 99, first, 7, 4) for first, n in [(0, 3), (3, 4)]]
    assert torch.equal(torch.cat(cut, 1), whole)
    fewer_keys = dropout_bits(torch.empty(3, 7, 5), 99, 0, 7, 4)  # a causal block
    assert torch.equal(fewer_keys, whole[..., :5])


def test_dropout_bits_compile_under_inductor_to_the_eager_bits():
    # The explicit kernel's mask on a GPU (and on CPU without the compiled kernels) is these
    # PyTorch ops; under torch.compile Inductor generates their code. (Its C++ code on CPU
    # indexes in int64: the Triton failure below cannot happen here, only a wrong bit.)
    torch._dynamo.reset()
    weights, seed = torch.empty(2, 3, 40), torch.tensor(-(2**62) + 7)
    compiled = torch.compile(dropout_bits, backend="inductor", fullgraph=True)
    assert torch.equal(compiled(weights, seed, 5, 9, 12), dropout_bits(weights, seed, 5, 9, 12))


def test_no_64_bit_constant_multiplies_positions_alone():
    # Inductor (torch 2.11) made a product of positions (aranges) and a constant into an
    # index expression in the Triton kernel's int32 index type: a constant beyond int32 did
    # not compile (pytorch/pytorch#183901). Every such product must involve the seed.
    graph = make_fx(lambda weights, seed: dropout_bits(weights, seed, 5, 9, 12))(
        torch.empty(2, 3, 40), torch.tensor(7)
    ).graph
    seed = next(n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("seed"))

    def involves_seed(node):
        return node is seed or any(involves_seed(n) for n in node.all_input_nodes)

    products = [
        node
        for node in graph.nodes
        if node.target in (torch.ops.aten.mul.Tensor, torch.ops.aten.mul_.Tensor)
        and any(isinstance(a, int) and not -(2**31) <= a < 2**31 for a in node.args)
    ]
    assert len(products) == 3  # GOLDEN and SplitMix64's two multipliers
    assert all(involves_seed(node) for node in products)


def test_the_compiled_kernel_is_optional_and_says_why_it_is_missing(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.cpu_ops() is None
    monkeypatch.delenv(native.ENV_SWITCH)
    monkeypatch.setattr(native, "_loaded", {})

    def no_compiler():
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(native, "_build", no_compiler)
    with pytest.warns(RuntimeWarning, match=r"could not be built \(c\+\+: command not found\)"):
        assert native.cpu_ops() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second build, no second warning
        assert native.cpu_ops() is None
    x = torch.randn(6, 8)
    torch.manual_seed(0)
    out = Dropout(0.3)(x)  # nn.Dropout's mask
    torch.manual_seed(0)
    assert torch.equal(out, nn.Dropout(0.3)(x))


def test_the_kernels_target_this_cpu_unless_the_environment_names_another(monkeypatch):
    monkeypatch.delenv(native.MARCH_SWITCH, raising=False)
    assert native.target_arch() == "native"
    monkeypatch.setenv(native.MARCH_SWITCH, "x86-64-v3")
    assert native.target_arch() == "x86-64-v3"
    assert native._build_tag("x86-64-v3") != native._build_tag("native")  # separate caches
    # Native code is per CPU; a named target is one build that every machine can share.
    tags = {arch: native._build_tag(arch) for arch in ("native", "x86-64-v3")}
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : sse2 avx2")
    assert native._build_tag("native") != tags["native"]
    assert native._build_tag("x86-64-v3") == tags["x86-64-v3"]
    monkeypatch.setenv(native.MARCH_SWITCH, "native -O0")
    with pytest.raises(ValueError, match=r"LINFORMER_KIT_MARCH='native -O0' is not a g\+\+"):
        native.target_arch()


def test_the_build_tag_covers_every_source_file():
    # torch's cache rebuilds on a changed .cpp but not on a changed header: the tag must hash
    # every header, or a machine would load kernels built from an older one.
    assert {p.name for p in native.CSRC.glob("*.h")} == {p.name for p in native.HEADERS}
    assert {p.name for p in native.CSRC.glob("*.cpp")} == {p.name for p in native.SOURCES}


def test_the_build_compiles_for_the_target_it_names(monkeypatch):
    if native.cpu_ops() is None:
        pytest.skip("no compiled kernels on this machine")
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setenv(native.MARCH_SWITCH, "haswell")
    native._build()
    (call,) = calls
    assert "-march=haswell" in call["extra_cflags"]
    assert call["name"] == f"linformer_kit_cpu_{native._build_tag('haswell')}"


@pytest.fixture
def build_folder(monkeypatch, tmp_path):
    """The CPU kernels' build folder in an empty extension cache, and the builds `load` saw
    (it records the call and stops `_build` before anything is registered)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native, "LOCK_SETTLE_S", 0.3)
    name = f"linformer_kit_cpu_{native._build_tag(native.target_arch())}"
    folder = Path(cpp_extension._get_build_directory(name, verbose=False))
    builds = []

    def load(**kwargs):
        builds.append((folder / "lock").exists())  # torch's lock there as the build begins
        raise RuntimeError("built")

    monkeypatch.setattr(cpp_extension, "load", load)
    return folder, builds


def test_a_lock_a_killed_build_left_is_removed(build_folder, caplog):
    # torch marks a build by its folder's `lock` file alone and waits on it without a
    # timeout: a build killed earlier left one that hung every later run (a clean-clone
    # test run for 110 minutes; a warning after 60 s named it, but the wait went on).
    folder, builds = build_folder
    (folder / "lock").touch()
    with pytest.raises(RuntimeError, match="built"):
        native._build()
    assert builds == [False]
    assert f"{folder / 'lock'}: removed, left by a build of the CPU kernels that was killed" in (
        caplog.text
    )


def test_without_proc_a_lock_is_named_after_a_wait_and_left(build_folder, caplog, monkeypatch):
    # Nothing shows where processes run (macOS): a live build's lock cannot be told from a
    # killed one's; after LOCK_WAIT_S a warning names it (it had none after the guard came)
    folder, builds = build_folder
    monkeypatch.setattr(native, "PROC", folder / "no-proc")
    monkeypatch.setattr(native, "LOCK_WAIT_S", 0.2)
    (folder / "lock").touch()
    with pytest.raises(RuntimeError, match="built"):
        native._build()
    assert builds == [True]  # left for torch's own wait
    assert f"{folder / 'lock'}: the CPU kernels' build has waited 0 s for it" in caplog.text


def test_a_live_build_is_waited_for(build_folder, caplog):
    folder, builds = build_folder
    # this library's, holding the build
    release = threading.Event()

    def hold():
        with files.exclusive(folder, "build of the CPU kernels"):
            held.set()
            release.wait(10)

    held = threading.Event()
    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    build = threading.Thread(target=lambda: pytest.raises(RuntimeError, native._build))
    build.start()
    time.sleep(0.5)
    assert builds == []
    release.set()
    for thread in (holder, build):
        thread.join(10)
    assert builds == [False]
    assert "waiting for another build of the CPU kernels (pid" in caplog.text
    # a version's before the hold: torch's lock, and ninja running in the folder longer than
    # the lock's settling time; its lock is its own to remove
    (folder / "lock").touch()
    ninja = subprocess.Popen(["sleep", "1"], cwd=folder)
    lock = folder / "lock"
    threading.Thread(target=lambda: (ninja.wait(), lock.unlink(missing_ok=True))).start()
    with pytest.raises(RuntimeError, match="built"):
        native._build()
    assert ninja.returncode == 0 and builds == [False, False]
    assert "removed, left by" not in caplog.text


def test_a_process_left_in_the_build_folder_is_named_while_the_lock_is_waited_for(
    build_folder, caplog, monkeypatch
):
    # A shell left in the folder beside a killed build's lock kept every later process
    # waiting at its first kernel call, without a word, for as long as it stayed there.
    folder, builds = build_folder
    monkeypatch.setattr(native, "LOCK_WAIT_S", 0.3)
    (folder / "lock").touch()
    shell = subprocess.Popen(["sleep", "1.5"], cwd=folder)
    with pytest.raises(RuntimeError, match="built"):
        native._build()
    assert shell.poll() == 0 and builds == [False]  # waited for it, then the lock was stale
    assert (
        f"{folder / 'lock'}: the CPU kernels' build has waited 0 s for it while pid {shell.pid} "
        f"(sleep) run in its folder" in caplog.text
    )


def test_the_kernels_build_as_cpp17():
    """torch before 2.13 builds extensions with -std=c++17 (torch 2.11's build of these
    sources failed on std::bit_cast): up to torch 2.13 the kernels build so, their own
    -std=c++17 after the one torch puts first."""
    if native.cpu_ops() is None:
        pytest.skip("no compiled kernels on this machine")
    if not native._std_flags():
        pytest.skip(f"torch {torch.__version__} builds them with its own standard")
    name = f"linformer_kit_cpu_{native._build_tag(native.target_arch())}"
    ninja = Path(cpp_extension._get_build_directory(name, verbose=False)) / "build.ninja"
    (cflags,) = [line for line in ninja.read_text().splitlines() if line.startswith("cflags =")]
    assert re.findall(r"-std=(\S+)", cflags)[-1] == "c++17", cflags


def run_ab_script(name, module, n, tmp_path, monkeypatch, extra=()):
    """benchmarks/NAME on tiny n (and `extra` flags); returns its rows, whether
    `module.native_ops` (the compiled kernel's gate) answered None (PyTorch ops) and not
    None in the run, and the dtypes it was asked about."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # they import benchmarks/kernels*.py
    script = load_script(BENCHMARKS / name)
    if native.cpu_ops() is None:
        pytest.skip("no compiled dropout kernel on this machine")
    paths, choose, asked = set(), module.native_ops, set()
    monkeypatch.setattr(
        module,
        "native_ops",
        lambda x, *rest: (
            asked.add(x.dtype) or paths.add(choose(x, *rest) is None) or choose(x, *rest)
        ),
    )
    args = ["--n", ",".join(map(str, n)), "--min-seconds", "0", "--threads", "1", *extra]
    script.main([*args, "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "ab.json").read_text())["rows"]
    assert [row["n"] for row in rows] == list(n)
    return rows, paths, asked


def test_the_fused_script_times_both_mask_paths_against_sdpa(tmp_path, monkeypatch):
    # benchmarks/kernels_fused.py: its "torch ops" variant must really run without the
    # compiled kernel and its "compiled" variant with it.
    rows, paths, _ = run_ab_script("kernels_fused.py", kernels, (16, 32), tmp_path, monkeypatch)
    assert paths == {True, False}
    for row in rows:
        ms = row["median_ms"]
        assert row["compiled_speedup"] == pytest.approx(ms["torch ops"] / ms["compiled"])
        ratio = row["time_vs_sdpa_no_dropout"]["compiled"]
        assert ratio == pytest.approx(ms["compiled"] / ms["sdpa, no dropout"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_dropout_script_times_default_training_against_dropout_free(
    precision, tmp_path, monkeypatch
):
    # benchmarks/kernels_dropout.py: its "PyTorch ops" variant must run the models' dropout
    # without the compiled kernel, the others with it; under --precision bf16 in bf16.
    args = ("kernels_dropout.py", dropout_module, (32, 64), tmp_path, monkeypatch)
    rows, paths, asked = run_ab_script(*args, extra=("--precision", precision))
    assert paths == {True, False}
    assert (torch.bfloat16 in asked) == (precision == "bf16")
    for row in rows:
        assert row["precision"] == precision
        ms, compiled = row["median_ms"], "dropout 0.1, compiled kernel"
        ratio = row["time_vs_no_dropout"][compiled]
        assert ratio == pytest.approx(ms[compiled] / ms["no dropout"])
        assert row["compiled_speedup"] == pytest.approx(
            ms["dropout 0.1, PyTorch ops"] / ms[compiled]
        )
