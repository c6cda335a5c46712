"""Argument checks shared by the CPAB modules."""
from __future__ import annotations

import math
import operator

import numpy as np

# The step-size guard of the integrators: h * max_c ||A_c,lin||_F may not exceed this. Below
# log 2 it proves that no-slip trajectories never leave the box (see integrate's Notes); at 0.5
# the frozen-cell steps also stay accurate enough to be useful (research notes cpab.md 5.5).
MAX_STEP_NORM = 0.5


def check_count(value, name, minimum=1):
    """An int >= minimum (bools and floats rejected with a TypeError naming the argument)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


# The kernels count integration steps in 32-bit integers; both paths refuse more.
MAX_STEPS = 2 ** 31 - 1


def check_n_steps(value):
    """An integration step count: an int in [1, MAX_STEPS]."""
    value = check_count(value, "n_steps")
    if value > MAX_STEPS:
        raise ValueError(f"n_steps must be <= {MAX_STEPS} (steps are counted in 32-bit integers), "
                         f"got {value}")
    return value


# Above this many steps the guard's error says to scale theta down rather than name a count.
PRACTICAL_STEPS = 10 ** 9


class StepSizeError(ValueError):
    """The step-size guard's error; ``largest`` is the field's max_c ||A_c,lin||_F (+inf where
    it overflows float64), so that a caller can choose a finer n_steps without recomputing it."""

    def __init__(self, message, largest):
        super().__init__(message)
        self.largest = largest


def check_step_size(largest, n_steps, name):
    """Refuse an ``n_steps`` too coarse for fields whose largest ||A_c,lin||_F is ``largest``
    (+inf where the norm overflows float64, NaN where A_c itself does, inf - inf in B theta:
    a finite theta too large for any step count)."""
    if largest <= MAX_STEP_NORM * n_steps:  # False for NaN
        return
    if not math.isfinite(largest):
        raise StepSizeError(f"cpab.{name}: theta is too large: max_c ||A_c,lin||_F overflows "
                            "float64, so no n_steps integrates it; scale theta down", largest)
    need = math.ceil(largest / MAX_STEP_NORM)
    advice = (f"use n_steps >= {need}" if need <= PRACTICAL_STEPS
              else f"that needs n_steps >= {need:.4g}: scale theta down")
    raise StepSizeError(
        f"cpab.{name}: n_steps={n_steps} is too coarse for this theta: h * max_c "
        f"||A_c,lin||_F = {largest / n_steps:.4g} exceeds {MAX_STEP_NORM} (max_c "
        f"||A_c,lin||_F = {largest:.4g}); {advice}", largest)


def broadcast_batch(a, b, names, op):
    """The batch size of two arguments whose batch axes broadcast as NumPy's do: equal sizes,
    or 1 against any size (0 included: 1 with 0 is 0, an empty batch). ``max(a, b)`` would
    make 1 with 0 a batch of 1, which indexes the empty argument out of bounds."""
    if a == b or b == 1:
        return a
    if a == 1:
        return b
    raise ValueError(f"cpab.{op}: {names[0]} and {names[1]} have batch sizes {a} and {b} (they "
                     f"must be equal, or one of them 1)")
