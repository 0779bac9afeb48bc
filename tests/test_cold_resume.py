"""A long run parked on S3 is snapshotted (its journal left whole), so a cold resume
by another process reads the snapshot and a few records, not a request per record;
on stores whose reads are cheap no snapshot is written."""

from __future__ import annotations

from typing import Any

from loom_kernel import Context, Engine, MemoryStore, Status, flow
from loom_store_s3.testing import RequestCounter, S3Server


@flow(name="cold.parked")
def parked(ctx: Context, count: int) -> Any:
    total = 0
    for index in range(count):
        total += ctx.step(f"s{index}", lambda index=index: index)
    extra = ctx.suspend("go")
    return [total, extra]


def test_a_cold_resume_of_a_long_parked_run_reads_its_snapshot(moto_server: S3Server) -> None:
    client = moto_server.client()
    store = moto_server.store(client=client)
    run = Engine(store, [parked], listeners=[]).start("cold.parked", 600)
    assert store.head(f"snap/{run.id}") == 1, "one snapshot, written as it parked"
    assert store.head(f"ex/{run.id}") == 602, "the journal is whole"
    requests = RequestCounter(client)
    cold = Engine(moto_server.twin(store, client=client), [parked], listeners=[])
    done = cold.resume(run.id, 7, on="go")
    assert done.status is Status.COMPLETED
    assert done.result == [sum(range(600)), 7]
    assert sum(requests.take().values()) < 30, "not a request per record"
    assert len(cold.history(run.id)) == 604


def test_a_run_parked_on_a_store_with_cheap_reads_gets_no_snapshot() -> None:
    store = MemoryStore()
    run = Engine(store, [parked], listeners=[]).start("cold.parked", 600)
    assert store.head(f"snap/{run.id}") == 0
