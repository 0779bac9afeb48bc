"""The gc walk finds exactly what is reachable, on any graph, without recursion."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from loom_kernel import reachable


def _reference(roots: set[int], edges: dict[int, list[int]]) -> set[int]:
    """Fixed-point closure: grow the set until nothing new is added."""
    found = set(roots)
    while True:
        grown = found | {child for node in found for child in edges.get(node, [])}
        if grown == found:
            return found
        found = grown


graphs = st.dictionaries(st.integers(0, 30), st.lists(st.integers(0, 30), max_size=6), max_size=31)


@given(graphs, st.sets(st.integers(0, 30), max_size=5))
def test_matches_the_reference_closure(edges: dict[int, list[int]], roots: set[int]) -> None:
    assert reachable(roots, lambda node: edges.get(node, [])) == _reference(roots, edges)


@given(st.integers(1, 50))
def test_cycles_and_self_loops_terminate(size: int) -> None:
    edges = {n: [n, (n + 1) % size] for n in range(size)}
    assert reachable([0], edges.__getitem__) == set(range(size))


def test_long_chain_has_no_recursion() -> None:
    length = 200_000
    found = reachable([0], lambda node: [node + 1] if node + 1 < length else [])
    assert len(found) == length


def test_unreachable_nodes_are_left_out() -> None:
    edges = {"live": ["blob-1"], "blob-1": ["blob-2"], "dead": ["blob-3"]}
    assert reachable(["live"], lambda n: edges.get(n, [])) == {"live", "blob-1", "blob-2"}
