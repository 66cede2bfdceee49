"""The demo's probe and time budget: a slow or busy machine gets a shorter demo, and says so."""

import dataclasses
import logging

import pytest

from linformer_kit.training.compare import ComparisonSettings, fit_to_budget, seconds_per_step

TINY = ComparisonSettings(vocab_size=300, seq_len=64, dim=32, depth=1, proj_dim=16, batch_size=2)


def test_probe_times_a_step_of_both_models():
    assert 0 < seconds_per_step(TINY) < 60


def test_a_run_that_fits_the_budget_is_unchanged():
    settings = ComparisonSettings()
    # 500 steps x 1 s (+10% validation) = 9.2 min < 12 min
    assert fit_to_budget(settings, 1.0) is settings
    unlimited = dataclasses.replace(settings, budget_min=0)
    assert fit_to_budget(unlimited, 100.0) is unlimited


def test_a_slow_machine_runs_fewer_steps_and_says_how_many(caplog):
    settings = ComparisonSettings()
    with caplog.at_level(logging.WARNING):
        fitted = fit_to_budget(settings, 10.0)
    # 12 min / (10 s x 1.1) = 65 steps; warm-up and validation interval shrink to fit.
    assert (fitted.steps, fitted.warmup_steps, fitted.eval_every) == (65, 6, 50)
    assert caplog.messages == [
        "this machine takes 10.00 s per training step of both models (probe), so 500 steps "
        "would take about 92 min, over the 12-min budget: running 65 steps instead "
        "(--budget-min 0 runs all 500)"
    ]


@pytest.mark.parametrize("step_s", [1e3, 1e6])
def test_at_least_one_step_runs(step_s):
    fitted = fit_to_budget(ComparisonSettings(eval_every=50), step_s)
    assert fitted.steps == 1 and fitted.eval_every == 1 and fitted.warmup_steps == 0
