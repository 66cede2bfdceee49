"""Efficiency benchmarks: training-step comparisons of Linformer against exact attention."""

from .compare import StepComparison, compare_training_steps

__all__ = ["StepComparison", "compare_training_steps"]
