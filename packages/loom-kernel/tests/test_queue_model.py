"""A hypothesis model of one queue partition: adds, takes by two workers (some on a
stale fold, which the exact-head append refuses), dones, wakes while driven,
compactions and a moving clock. After every step the partition, folded afresh and
incrementally, equals the model, and no take ever went past a limit."""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from loom_kernel import ConflictError, MemoryStore, Queue, Rate
from loom_kernel._coordination import QueueBook, QueueFold, pick

IDS = [f"r{i}" for i in range(8)]
KEYS = [None, "a", "b"]


@attrs.define
class _Run:
    priority: int
    seq: int
    key: str | None


class QueueModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = MemoryStore()
        self.now = 1_000.0
        self.waiting: dict[str, _Run] = {}
        # run -> (where it waited, take, at, where its wake while driven had it wait)
        self.active: dict[str, tuple[_Run, int, float, _Run | None]] = {}
        self.admitted: list[float] = []
        self.stale: QueueFold | None = None

    @initialize(
        cap=st.one_of(st.none(), st.integers(1, 4)),
        per_key=st.one_of(st.none(), st.integers(1, 2)),
        rate=st.one_of(st.none(), st.builds(Rate, st.integers(1, 5), st.sampled_from([5.0, 30.0]))),
    )
    def setup(self, cap: int | None, per_key: int | None, rate: Rate | None) -> None:
        self.queue = Queue("m", concurrency=cap, per_key=per_key, rate=rate)
        self.books = [QueueBook(self.store, lambda: self.now, [self.queue]) for _ in range(2)]

    def _fresh(self) -> QueueFold:
        return QueueBook(self.store, lambda: self.now, [self.queue]).read("m", 0)

    @rule(run=st.sampled_from(IDS), priority=st.integers(-2, 2), key=st.sampled_from(KEYS))
    def add(self, run: str, priority: int, key: str | None) -> None:
        place = self.queue.place(run, priority, key)
        self.books[0].add(place, run, "f", "")
        position = self.store.head("queues/m/0")
        if run in self.active:
            item, take, at, again = self.active[run]
            self.active[run] = (item, take, at, again or _Run(priority, position, key))
        elif run not in self.waiting:
            self.waiting[run] = _Run(priority, position, key)

    @rule(book=st.integers(0, 1), free=st.integers(0, 4), stale=st.booleans())
    def take(self, book: int, free: int, stale: bool) -> None:
        fold = self.stale if stale and self.stale is not None else self.books[book].read("m", 0)
        cap, rate = self.queue.share(0)
        chosen = pick(fold, cap=cap, per_key=self.queue.per_key, rate=rate, now=self.now, free=free)
        if not chosen:
            return
        moved = fold.head != self.store.head("queues/m/0")
        try:
            take = self.books[book].take("m", 0, fold, chosen, f"w{book}")
        except ConflictError:
            assert moved, "refused although the fold was current"
            return
        assert not moved, "a take on a stale fold landed"
        assert chosen == self._model_pick(free)
        for run in chosen:
            self.active[run] = (self.waiting.pop(run), take, self.now, None)
            self.admitted.append(self.now)
        self._check_limits()

    def _model_pick(self, free: int) -> list[str]:
        queue = self.queue
        room = free
        if queue.concurrency is not None:
            room = min(room, queue.concurrency - len(self.active))
        if queue.rate is not None:
            recent = [at for at in self.admitted if at > self.now - queue.rate.per]
            room = min(room, queue.rate.limit - len(recent))
        keys = Counter(item.key for item, *_ in self.active.values() if item.key)
        chosen: list[str] = []
        for run, item in sorted(self.waiting.items(), key=lambda kv: (kv[1].priority, kv[1].seq)):
            if len(chosen) >= room:
                break
            if (
                item.key is not None
                and queue.per_key is not None
                and keys[item.key] >= queue.per_key
            ):
                continue
            if item.key is not None:
                keys[item.key] += 1
            chosen.append(run)
        return chosen

    def _check_limits(self) -> None:
        queue = self.queue
        if queue.concurrency is not None:
            assert len(self.active) <= queue.concurrency
        if queue.per_key is not None:
            keys = Counter(item.key for item, *_ in self.active.values() if item.key)
            assert all(count <= queue.per_key for count in keys.values())
        if queue.rate is not None:
            recent = [at for at in self.admitted if at > self.now - queue.rate.per]
            assert len(recent) <= queue.rate.limit

    @precondition(lambda self: bool(self.active))
    @rule(data=st.data(), requeue=st.booleans(), unused=st.booleans(), wrong_take=st.booleans())
    def done(self, data: Any, requeue: bool, unused: bool, wrong_take: bool) -> None:
        run = data.draw(st.sampled_from(sorted(self.active)))
        item, take, at, again = self.active[run]
        given = take + 1000 if wrong_take else take  # a done of an older admission
        self.books[1].done("m", 0, run, given, requeue=requeue, unused=unused)
        if wrong_take:
            return
        del self.active[run]
        if unused:
            self.admitted.remove(at)
        self._wait_again(run, item, again, requeue=requeue)

    def _wait_again(self, run: str, item: _Run, again: _Run | None, *, requeue: bool) -> None:
        """A done: let go running, the run waits at its old place; woken while driven,
        at its wake's place."""
        if requeue:
            self.waiting.setdefault(run, item)
        elif again is not None:
            self.waiting.setdefault(run, again)

    @precondition(lambda self: bool(self.active))
    @rule(data=st.data(), book=st.integers(0, 1), requeue=st.booleans(), free=st.integers(0, 2))
    def finish_and_take(self, data: Any, book: int, requeue: bool, free: int) -> None:
        """A slot's done, then its next take, on the live fold (what a worker's slot
        does): each append folds into it."""
        run = data.draw(st.sampled_from(sorted(self.active)))
        item, take, _at, again = self.active[run]
        writer = self.books[book]
        with writer.holding("m", 0):
            fold = writer.refresh("m", 0)
            writer.append_at("m", 0, fold, [writer.done_record(run, take, requeue=requeue)])
            del self.active[run]
            self._wait_again(run, item, again, requeue=requeue)
            cap, rate = self.queue.share(0)
            chosen = pick(
                fold, cap=cap, per_key=self.queue.per_key, rate=rate, now=self.now, free=free
            )
            assert chosen == self._model_pick(free)
            if not chosen:
                return
            position = writer.take("m", 0, fold, chosen, f"w{book}")
        for chosen_run in chosen:
            self.active[chosen_run] = (self.waiting.pop(chosen_run), position, self.now, None)
            self.admitted.append(self.now)
        self._check_limits()

    @rule()
    def remember_a_fold(self) -> None:
        self.stale = self.books[0].read("m", 0)

    @rule(book=st.integers(0, 1))
    def compact(self, book: int) -> None:
        self.books[book]._compact("m", 0)

    @rule(seconds=st.sampled_from([0.5, 3.0, 10.0, 40.0]))
    def tick(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def folds_match_the_model(self) -> None:
        if not hasattr(self, "queue"):
            return
        expected = sorted(self.waiting.items(), key=lambda kv: (kv[1].priority, kv[1].seq))
        for fold in (self._fresh(), self.books[0].read("m", 0), self.books[1].read("m", 0)):
            assert [item.execution_id for item in fold.line()] == [run for run, _ in expected]
            assert set(fold.active) == set(self.active)
            for run, (item, take, _at, again) in self.active.items():
                assert fold.active[run].take == take
                woken = fold.active[run].again
                assert (woken and (woken.priority, woken.seq, woken.key)) == (
                    again and (again.priority, again.seq, again.key)
                )
                assert fold.active[run].waiting.key == item.key
            if self.queue.rate is not None:
                window = self.now - self.queue.rate.per
                assert [at for at in fold.admitted if at > window] == sorted(
                    at for at in self.admitted if at > window
                )


QueueModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_a_queue_partition_keeps_its_limits = QueueModel.TestCase
