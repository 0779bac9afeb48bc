"""Run several actors against one store, one store call at a time, in a chosen order.

Races between engines (two compactions, a drive and a cancel, a writer and a
sweeper) happen between store calls. `Interleaving` makes each actor a thread that
stops before every call it makes to the store and goes on only when the scheduler
picks it; a test picks with hypothesis, so every interleaving of the actors' calls
can be tried and a failing one shrinks to the shortest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from loom_kernel._core._records import NewRecord, Record
from loom_kernel._spi._journal import JournalStore

__all__ = ["Interleaving"]

Choose = Callable[[Sequence[str]], str]


class _Abandoned(BaseException):
    """Ends an actor whose run was given up (the scheduler raised): it never goes on."""


class _Actor:
    def __init__(self, name: str, action: Callable[[], Any]) -> None:
        self.name = name
        self.action = action
        self.go = threading.Event()
        self.waiting = False
        self.done = False
        self.error: BaseException | None = None
        self.result: Any = None


class Interleaving(JournalStore):
    """A store wrapper whose calls from actor threads take turns.

    Calls from any other thread (the test's own setup and checks) go straight through.

    Args:
        store: the store every call goes to.
    """

    def __init__(self, store: JournalStore) -> None:
        self.inner = store
        self.head_is_cheap = store.head_is_cheap  # type: ignore[misc]
        self._actors: dict[threading.Thread, _Actor] = {}  # by thread: idents are reused
        self._changed = threading.Condition()
        self._abandoned = False

    def run(self, actors: dict[str, Callable[[], Any]], choose: Choose) -> dict[str, Any]:
        """Run each actor in its own thread; before each store call, `choose` picks who
        goes next from the names of the actors waiting to make one.

        Returns:
            Each actor's return value, or the exception it raised.
        """
        started = [_Actor(name, action) for name, action in actors.items()]
        threads = [
            threading.Thread(target=self._body, args=(actor,), daemon=True) for actor in started
        ]
        self._abandoned = False
        for thread, actor in zip(threads, started, strict=True):
            thread.start()
            self._actors[thread] = actor
            actor.go.set()  # to its first store call
        try:
            self._schedule(started, choose)
        except BaseException:
            self._abandoned = True  # hypothesis gave up, say: every parked actor ends
            for actor in started:
                actor.go.set()
            raise
        finally:
            for thread in threads:
                thread.join(timeout=60)
            self._actors.clear()
        return {actor.name: actor.error or actor.result for actor in started}

    def _schedule(self, started: list[_Actor], choose: Choose) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(
                    lambda: all(actor.waiting or actor.done for actor in started), timeout=60
                )
                ready = [actor for actor in started if actor.waiting]
                if not ready and not all(actor.done for actor in started):
                    raise AssertionError("an actor neither finished nor reached the store")
            if not ready:
                break
            pick = choose([actor.name for actor in ready])
            chosen = next(actor for actor in ready if actor.name == pick)
            with self._changed:
                chosen.waiting = False
            chosen.go.set()

    def _body(self, actor: _Actor) -> None:
        actor.go.wait()
        actor.go.clear()
        try:
            actor.result = actor.action()
        except BaseException as exc:  # reported to the test, never lost
            actor.error = exc
        finally:
            with self._changed:
                actor.done = True
                self._changed.notify_all()

    def _turn(self) -> None:
        actor = self._actors.get(threading.current_thread())
        if actor is None:
            return
        with self._changed:
            actor.waiting = True
            self._changed.notify_all()
        actor.go.wait()
        actor.go.clear()
        if self._abandoned:
            raise _Abandoned

    def _append(self, stream: str, expected: int, records: tuple[NewRecord, ...]) -> int:
        self._turn()
        return self.inner.append(stream, expected, records)

    def _read(self, stream: str, after: int, limit: int | None) -> list[Record]:
        self._turn()
        return self.inner.read(stream, after, limit)

    def _head(self, stream: str) -> int:
        self._turn()
        return self.inner.head(stream)

    def _streams(self, prefix: str, after: str | None, limit: int | None) -> list[str]:
        self._turn()
        return self.inner.streams(prefix, after, limit)

    def _trim(self, stream: str, before: int) -> None:
        self._turn()
        self.inner.trim(stream, before)

    def _delete(self, stream: str) -> None:
        self._turn()
        self.inner.delete(stream)
