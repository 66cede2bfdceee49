"""Checks of a setting's value: each raises a ValueError naming the setting, the value given
and what is allowed."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any


def check_positive(name: str, value: Any) -> None:
    """Raises ValueError unless `value` is an integer >= 1, naming `name` and the value."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_non_negative(name: str, value: Any, zero: str = "") -> None:
    """Raises ValueError unless `value` is an integer >= 0, naming `name`, the value and, when
    given, what 0 means (`zero`, e.g. "0 = no limit")."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        meaning = f" ({zero})" if zero else ""
        raise ValueError(f"{name} must be an integer >= 0{meaning}, got {value!r}")


def is_number(value: Any) -> bool:
    """Whether `value` is a real number: an int, a float, a numpy scalar, a 0-d tensor or
    array (a bool, or a string from a hand-edited JSON file, is not: they failed in a
    comparison with a TypeError)."""
    if isinstance(value, numbers.Real):
        return not isinstance(value, bool)
    return getattr(value, "shape", None) == ()  # a 0-d tensor or array


def is_integer(value: Any) -> bool:
    """Whether `value` is an integer: an int, a numpy integer or a 0-d integer tensor (not
    a bool)."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_finite_non_negative(name: str, value: float, zero: str = "") -> None:
    """Raises ValueError unless `value` is a finite number >= 0 (nan and inf refused), naming
    `name`, the value and, when given, what 0 means (`zero`, e.g. "0 = no clipping")."""
    if not is_number(value) or not 0 <= value < math.inf:
        meaning = f" ({zero})" if zero else ""
        raise ValueError(f"{name} must be a finite number >= 0{meaning}, got {value}")


def check_finite_positive(name: str, value: Any) -> None:
    """Raises ValueError unless `value` is a finite number > 0 (nan, inf and bools refused),
    naming `name` and the value."""
    if not is_number(value) or not 0 < value < math.inf:  # nan fails both comparisons
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raises ValueError naming `name`, the wrong `value` and the allowed `choices`."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def check_probability(name: str, value: Any) -> None:
    """Raises ValueError unless `value` is a number in [0, 1), naming `name` and the value."""
    if not is_number(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")


def check_fraction(name: str, value: Any) -> None:
    """Raises ValueError unless `value` is a number in (0, 1), naming `name` and the value."""
    if not is_number(value) or not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")


def check_seed(name: str, value: Any) -> None:
    """Raises ValueError unless `value` is an integer in [-2**63, 2**64 - 1] (what a torch
    generator takes), naming `name` and the value."""
    if not isinstance(value, int) or isinstance(value, bool) or not -(2**63) <= value < 2**64:
        raise ValueError(f"{name} must be an integer in [-2**63, 2**64 - 1], got {value!r}")
