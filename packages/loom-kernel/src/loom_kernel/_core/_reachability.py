"""The gc walk: everything reachable from a set of roots, iteratively and cycle-safe."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

__all__ = ["reachable"]

Node = TypeVar("Node", bound=Hashable)


def reachable(roots: Iterable[Node], refs: Callable[[Node], Iterable[Node]]) -> set[Node]:
    """Return every node reachable from `roots` (the roots included).

    The walk keeps its own stack, so a chain of any length never hits Python's
    recursion limit, and it visits each node once, so cycles and self-references end.

    Args:
        roots: where the walk starts (live executions, say).
        refs: the nodes a node refers to directly (blobs a journal references, say).

    Returns:
        The set of reachable nodes.
    """
    seen: set[Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(child for child in refs(node) if child not in seen)
    return seen
