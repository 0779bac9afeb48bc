"""The `sqlite:` URL and its options: the forms of the path, the options read from the
query, and the URLs that would be misread, refused before any file is touched."""

from __future__ import annotations

from pathlib import Path

import pytest
from loom_kernel import open_store
from loom_kernel.spi import InvalidArgumentError, NewRecord
from loom_store_sqlite import SqliteOptions, SqliteStore, open_sqlite_store


def _records(count: int, tag: str = "r") -> list[NewRecord]:
    return [NewRecord("k", f"{tag}{i}".encode(), float(i)) for i in range(count)]


def test_url_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    absolute = open_store(f"sqlite://{tmp_path}/a.db")
    assert isinstance(absolute, SqliteStore)
    assert absolute.path == f"{tmp_path}/a.db"
    monkeypatch.chdir(tmp_path)
    relative = open_sqlite_store("sqlite://sub.db")
    relative.append("s", 0, _records(1))
    assert (tmp_path / "sub.db").exists()
    memory = open_sqlite_store("sqlite:///:memory:")
    assert memory.head("s") == 0
    as_sqlalchemy_spells_it = open_sqlite_store(f"sqlite:///{tmp_path}/c.db")
    assert as_sqlalchemy_spells_it.path == f"{tmp_path}/c.db"


def test_url_options() -> None:
    assert SqliteOptions.parse("") == SqliteOptions("full", 10.0)
    assert SqliteOptions.parse("synchronous=NORMAL&timeout=2.5") == SqliteOptions("normal", 2.5)
    # An option given with no value is refused, not read as the default.
    blank = ("synchronous=", "timeout=", "synchronous=&timeout=2")
    for bad in ("synchronous=sometimes", "timeout=soon", "timeout=-1", "cache=big", *blank):
        with pytest.raises(InvalidArgumentError):
            SqliteOptions.parse(bad)
    with pytest.raises(InvalidArgumentError):
        open_sqlite_store("sqlite://")


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///tmp/h#frag.db",
        "sqlite:///tmp/x.db?timeout=nan",
        "sqlite:///tmp/x.db?timeout=inf",
        "sqlite:///tmp/x.db?timeout=1&timeout=2",
        "sqlite:///tmp/x.db?synchronous=full&synchronous=off",
    ],
)
def test_a_url_that_would_be_misread_is_refused(url: str) -> None:
    with pytest.raises(InvalidArgumentError):
        open_store(url)


def test_a_percent_encoded_path_is_decoded(tmp_path: Path) -> None:
    store = open_store(f"sqlite://{tmp_path}/h%23frag.db")
    store.append("s", 0, _records(1))
    assert (tmp_path / "h#frag.db").exists()


def test_timeout_zero_is_valid() -> None:
    assert SqliteOptions.parse("timeout=0") == SqliteOptions("full", 0.0)


@pytest.mark.parametrize("url", ["memory://x", "s3://bucket/p", "sqlitex:///a.db"])
def test_a_url_of_another_scheme_is_refused_by_the_sqlite_opener(url: str) -> None:
    with pytest.raises(InvalidArgumentError, match="not a sqlite store URL"):
        open_sqlite_store(url)


def test_a_store_opened_only_if_it_exists_opens_one_and_creates_none(tmp_path: Path) -> None:
    from loom_kernel.spi import StoreMisconfiguredError

    url = f"sqlite:///{tmp_path}/there.db"
    with open_store(url) as made:
        made.append("s", 0, [NewRecord("k", b"1", 1.0)])
    with open_store(url, create=False) as existing:
        assert existing.head("s") == 1
    missing = tmp_path / "typo.db"
    with pytest.raises(StoreMisconfiguredError, match="no SQLite database at"):
        open_store(f"sqlite:///{missing}", create=False)
    assert not missing.exists(), "nothing created"
