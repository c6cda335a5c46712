"""Argument checks shared by the CPAB modules."""
from __future__ import annotations

import operator

import numpy as np


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
