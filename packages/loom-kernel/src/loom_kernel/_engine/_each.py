"""Store-wide work that one broken run must not stop: try every item, then report."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

from loom_kernel._core import LoomError

__all__ = ["raise_first", "try_each"]

T = TypeVar("T")
R = TypeVar("R")
_log = logging.getLogger("loom")


def try_each(
    items: Iterable[T], action: Callable[[T], R], what: str
) -> tuple[list[R], list[LoomError]]:
    """Run `action` on every item; a LoomError from one is logged and kept, and the
    rest still run.

    Returns:
        The results of the items that succeeded, and the errors of those that did
        not, each in order.
    """
    results: list[R] = []
    failures: list[LoomError] = []
    for item in items:
        try:
            results.append(action(item))
        except LoomError as exc:
            _log.warning("%s %r: %s: %s", what, item, type(exc).__name__, exc)
            failures.append(exc)
    return results, failures


def raise_first(failures: list[LoomError]) -> None:
    """Raise the first of `failures`, if any (after every item was tried)."""
    if failures:
        raise failures[0]
