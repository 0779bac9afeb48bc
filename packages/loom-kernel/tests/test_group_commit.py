"""The group commit every store may share (`_spi/_group_commit.py`), on its own: a
follower whose group decided it finds the verdict even when its wake is lost."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from loom_kernel import StoreUnavailableError
from loom_kernel._spi import _group_commit as _group
from loom_kernel._spi._group_commit import GroupCommit, PendingAppend


def test_a_follower_taken_into_a_group_finds_its_verdict_with_its_wake_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three appends: A commits alone while B and C queue; B is handed the lead and
    takes C into its group; C's wake is lost (an interrupt in B's thread just after
    the verdicts): C still returns, by looking again, with its group's verdict."""
    monkeypatch.setattr(_group, "LOOK_AGAIN", 0.01)
    first_in, let_first_go = threading.Event(), threading.Event()
    groups: list[list[str]] = []

    def commit(appends: list[PendingAppend]) -> None:
        groups.append([append.stream for append in appends])
        if appends[0].stream == "a":
            first_in.set()
            assert let_first_go.wait(10)

    commits = GroupCommit(commit)
    wake = _group._wake

    def losing_cs_wake(append: PendingAppend) -> None:
        if append.stream != "c":
            wake(append)

    monkeypatch.setattr(_group, "_wake", losing_cs_wake)
    ended = _a_then_b_and_c(commits, first_in, let_first_go)
    assert groups == [["a"], ["b", "c"]]
    assert ended == {"a": "landed", "b": "landed", "c": "landed"}
    assert not commits.leading


def test_a_follower_of_a_group_whose_commit_was_interrupted_is_told_to_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """B leads a group holding C and its commit is interrupted before any verdict: B's
    caller gets the interrupt, C's a StoreUnavailableError (landed or not, unknown),
    never a "landed" for a write that may be lost."""
    monkeypatch.setattr(_group, "LOOK_AGAIN", 0.01)
    first_in, let_first_go = threading.Event(), threading.Event()

    def commit(appends: list[PendingAppend]) -> None:
        if appends[0].stream == "a":
            first_in.set()
            assert let_first_go.wait(10)
        else:
            raise KeyboardInterrupt  # in B's thread, before any verdict

    commits = GroupCommit(commit)
    ended = _a_then_b_and_c(commits, first_in, let_first_go)
    assert ended["a"] == "landed"
    assert isinstance(ended["b"], KeyboardInterrupt)
    assert isinstance(ended["c"], StoreUnavailableError)
    assert "the group's commit was interrupted" in str(ended["c"])
    assert not commits.leading


def _a_then_b_and_c(
    commits: GroupCommit, first_in: threading.Event, let_first_go: threading.Event
) -> dict[str, Any]:
    """Submit A, and once its commit is in (`first_in`), B and C, which queue; then let
    A's commit go on (`let_first_go`): how each append ended ("landed" or its error)."""
    ended: dict[str, Any] = {}

    def submit(stream: str) -> None:
        try:
            commits.submit(PendingAppend(stream, 0, []))
            ended[stream] = "landed"
        except BaseException as exc:  # any ending is recorded
            ended[stream] = exc

    threads = {name: threading.Thread(target=submit, args=(name,), daemon=True) for name in "abc"}
    threads["a"].start()
    assert first_in.wait(10)
    for name in "bc":
        threads[name].start()
        while not any(queued.stream == name for queued in commits._queue):
            threading.Event().wait(0.001)
    let_first_go.set()
    for thread in threads.values():
        thread.join(10)
    return ended
