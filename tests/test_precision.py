"""The bf16 probe and its warning: measured, said once, before the run, on every CPU."""

import json
import logging
import os
import platform
import subprocess
import sys

import pytest
import torch
from train_helpers import tiny_run

from linformer_kit import precision
from linformer_kit.training.loop import Trainer
from linformer_kit.training.pretrain import pretrain

EMULATE_AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the AVX2 cap is an x86 setting")
def test_probe_finds_no_native_bf16_on_an_avx2_cpu():
    # The ISA caps make any x86 CPU compute like an AVX2-only one: bf16 matmuls emulated.
    code = (
        "import json; from linformer_kit import bf16_support; "
        "print(json.dumps(bf16_support().to_dict()))"
    )
    env = {**os.environ, **EMULATE_AVX2}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert found["native"] is False and found["capability"] == "AVX2"
    assert found["slowdown"] > precision.SLOW_FACTOR


def test_probe_is_measured_once_per_process():
    # "cpu", "cpu:0" and a torch.device were three probes, which could disagree.
    first = precision.bf16_support()
    for device in ("cpu", "cpu:0", torch.device("cpu")):
        assert precision.bf16_support(device) is first
    assert precision.bf16_support("cpu").capability == torch.backends.cpu.get_cpu_capability()


def test_warning_names_the_slowdown_and_the_fp32_way_once(bf16_is, caplog):
    bf16_is(False)
    with caplog.at_level(logging.WARNING, logger="linformer_kit.precision"):
        for _ in range(3):
            precision.warn_if_bf16_is_slow("cpu", "--precision fp32")
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "no native bf16 (torch CPU capability AVX2)" in message
    assert "measured 80x slower than float32" in message
    assert "For full speed use --precision fp32." in message


def test_native_bf16_says_nothing(bf16_is, caplog):
    bf16_is(True)
    with caplog.at_level(logging.WARNING):
        precision.bf16_autocast("cpu", enabled=True, alternative="--precision fp32")
    assert not caplog.records


def test_fp32_runs_never_probe(monkeypatch):
    monkeypatch.setattr(precision, "bf16_support", lambda device: pytest.fail("probed"))
    with precision.bf16_autocast("cpu", enabled=False, alternative="--precision fp32"):
        assert not torch.is_autocast_enabled("cpu")


def test_bf16_pretraining_warns_before_the_first_step(tmp_path, bf16_is, caplog, monkeypatch):
    bf16_is(False)
    step = Trainer._train_step

    def logged_step(self, model):
        logging.getLogger("test").info("a training step")
        return step(self, model)

    monkeypatch.setattr(Trainer, "_train_step", logged_step)
    with caplog.at_level(logging.INFO):
        pretrain(tiny_run(tmp_path, max_steps=2, precision="bf16", eval_every=2))
    messages = [r.getMessage() for r in caplog.records]
    warned = [i for i, m in enumerate(messages) if "no native bf16" in m]
    steps = [i for i, m in enumerate(messages) if m == "a training step"]
    assert len(warned) == 1 and len(steps) == 2 and warned[0] < steps[0]


def test_cpu_features_name_what_decides_matmul_speed():
    features = precision.cpu_features()
    assert features["capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(features["flags"]) <= precision.MATMUL_FLAGS


def test_cpu_features_tell_core_generations_apart(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    block = "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    cpuinfo.write_text(block + "flags\t\t: fma avx2 sse2\n\n" + block.replace("17", "99"))
    features = precision.cpu_features(cpuinfo)
    assert (features["family"], features["model_number"]) == (25, 17)  # the first block's
    assert features["model"] == "AMD EPYC" and features["flags"] == ["avx2", "fma"]
    cpuinfo.write_text("vendor_id\t: x\ncpu family\t: \n")  # a VM that hides them
    features = precision.cpu_features(cpuinfo)
    assert features["family"] is None and features["model_number"] is None
