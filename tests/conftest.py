"""Shared fixtures."""

import pytest

from linformer_kit import precision


@pytest.fixture
def bf16_is(monkeypatch):
    """Makes the bf16 probe report native (True) or emulated (False) bf16, whatever this
    machine has, so a test's path and duration do not depend on the CPU it runs on."""

    def pretend(native: bool) -> precision.Bf16Support:
        support = precision.Bf16Support(
            device="cpu",
            native=native,
            slowdown=0.5 if native else 80.0,
            capability="AVX512" if native else "AVX2",
        )
        monkeypatch.setattr(precision, "bf16_support", lambda device="cpu": support)
        monkeypatch.setattr(precision, "_warned", set())
        return support

    return pretend
