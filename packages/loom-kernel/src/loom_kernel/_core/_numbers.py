"""Numbers from callers: a float or an int, never a bool, and finite as a float."""

from __future__ import annotations

from math import isfinite

__all__ = ["finite_number"]


def finite_number(value: object) -> bool:
    """Whether `value` is an int or float (not a bool) with a finite float value.

    An int too large for a float (10**400) is not: it cannot be compared with float
    limits or turned into a wait or a timestamp without an OverflowError.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return isfinite(value)
    except OverflowError:
        return False
