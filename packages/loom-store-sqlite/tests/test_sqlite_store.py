"""The store's own hooks: what `loom stores` checks, a delete that frees the records,
a listing that walks live names only."""

from __future__ import annotations

from pathlib import Path

from loom_kernel import open_store
from loom_kernel.spi import NewRecord
from loom_store_sqlite import SqliteStore, open_sqlite_store, sqlite_store_factory
from loom_store_sqlite.testing import raw_connection


def _records(count: int) -> list[NewRecord]:
    return [NewRecord("k", str(i).encode(), float(i)) for i in range(count)]


def test_loom_stores_checks_sqlite_in_its_scratch_directory(tmp_path: Path) -> None:
    assert sqlite_store_factory.self_check_url is not None
    url = sqlite_store_factory.self_check_url(str(tmp_path))
    store = open_store(url)
    assert isinstance(store, SqliteStore)
    store.append("s", 0, _records(1))
    assert (tmp_path / "check.db").exists()


def test_a_delete_frees_the_streams_records_and_keeps_only_its_name(tmp_path: Path) -> None:
    """A deleted stream's records take no space: only its `loom_names` row stays,
    retiring the name at its final head."""
    store = open_sqlite_store(f"sqlite://{tmp_path / 'deleted.db'}")
    store.append("gone", 0, _records(3))
    store.append("kept", 0, _records(2))
    store.delete("gone")
    rows = (
        raw_connection(store)
        .execute(
            "SELECT n.name, COUNT(*) FROM loom_rows AS r "
            "JOIN loom_names AS n ON n.id = r.stream GROUP BY n.name"
        )
        .fetchall()
    )
    assert rows == [("kept", 2)]
    assert raw_connection(store).execute(
        "SELECT floor, deleted FROM loom_names WHERE name = 'gone'"
    ).fetchall() == [(3, 1)]


def test_a_listing_skips_deleted_streams_through_the_live_names_index(tmp_path: Path) -> None:
    store = open_sqlite_store(f"sqlite://{tmp_path / 'live.db'}")
    for number in range(50):
        store.append(f"timers/{number:03d}", 0, _records(1))
        store.delete(f"timers/{number:03d}")  # handled timer buckets, as the engine leaves them
    store.append("timers/live", 0, _records(1))
    assert store.streams("timers/") == ["timers/live"]
    plan = (
        raw_connection(store)
        .execute(
            "EXPLAIN QUERY PLAN SELECT name FROM loom_names WHERE deleted = 0 AND name >= ? "
            "AND name < ? ORDER BY name LIMIT ?",
            ("timers/", "timers0", 100),
        )
        .fetchall()
    )
    assert "loom_live_names" in str(plan), "a listing walks live names only"
