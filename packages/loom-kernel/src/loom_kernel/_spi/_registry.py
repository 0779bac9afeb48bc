"""Finding stores by URL scheme: built-ins, `loom.stores` entry points, run-time registrations."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from loom_kernel._core import InvalidArgumentError, NotFoundError
from loom_kernel._spi._journal import JournalStore
from loom_kernel._spi._memory_store import open_memory_store

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = [
    "ENTRY_POINT_GROUP",
    "OpenStore",
    "StoreFactory",
    "installed_stores",
    "open_store",
    "register_store",
    "store_factory",
]

ENTRY_POINT_GROUP = "loom.stores"
OpenStore = Callable[[str], JournalStore]


@attrs.frozen
class StoreFactory:
    """How a store is opened by URL: what a store publishes in the `loom.stores`
    entry-point group (a plain `open(url)` function serves too).

    Attributes:
        open: opens a URL of the store's scheme.
        self_check_url: given a scratch directory, a URL at which `loom stores` can
            check the store with no configuration (a file there, say); None when the
            store needs configuration (credentials, a bucket).
        open_existing: opens a URL of the store's scheme only when the store is there
            already, else raises StoreMisconfiguredError saying what is missing (a
            command that reads, or migrates, must not create a store at a mistyped
            path); None for a store that is never created by opening it.
    """

    open: OpenStore
    self_check_url: Callable[[str], str] | None = None
    open_existing: OpenStore | None = None

    def __call__(self, url: str) -> JournalStore:
        """Open `url`."""
        return self.open(url)


def _factory(found: StoreFactory | OpenStore) -> StoreFactory:
    return found if isinstance(found, StoreFactory) else StoreFactory(found)


# Where to find the stores this project publishes, for the unknown-scheme message.
_KNOWN_DISTRIBUTIONS = {
    "sqlite": "loom-store-sqlite",
    "s3": "loom-store-s3",
    "postgresql": "loom-store-postgres",
    "postgres": "loom-store-postgres",
}
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")
_BUILT_IN: dict[str, StoreFactory] = {
    "memory": StoreFactory(open_memory_store, self_check_url=lambda _scratch: "memory://")
}
_registered: dict[str, StoreFactory] = {}
_lock = threading.Lock()


def register_store(scheme: str, factory: StoreFactory | OpenStore) -> None:
    """Make `open_store` open URLs of `scheme` with `factory` (run-time registration).

    A registration wins over an installed entry point of the same scheme.

    Args:
        scheme: lower-case URL scheme, such as "jsonl".
        factory: a StoreFactory, or a function called with the whole URL that
            returns a JournalStore.
    """
    if not isinstance(scheme, str) or _SCHEME.fullmatch(scheme) is None:
        raise InvalidArgumentError(
            f"a store scheme is lower-case letters and digits, not {scheme!r}"
        )
    if not callable(factory):
        raise InvalidArgumentError("a store factory must be callable")
    with _lock:
        _registered[scheme] = _factory(factory)


def _entry_points() -> dict[str, EntryPoint]:
    # Imported here: importlib.metadata takes a tenth of `import loom_kernel`, and a
    # process that opens no store by URL never needs it.
    from importlib.metadata import entry_points  # noqa: PLC0415

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def installed_stores() -> dict[str, str]:
    """Return each openable scheme and where its factory comes from.

    Returns:
        scheme -> "built-in", "registered" or the distribution that installs it.
    """
    found: dict[str, str] = dict.fromkeys(_BUILT_IN, "built-in")
    for name, ep in _entry_points().items():
        if name not in found:
            found[name] = ep.dist.name if ep.dist is not None else ep.value
    with _lock:
        found.update(dict.fromkeys(_registered, "registered"))
    return dict(sorted(found.items()))


def open_store(url: str, *, create: bool = True) -> JournalStore:
    """Open a store by URL, for example "memory://", "sqlite:///loom.db" or "s3://bucket/prefix".

    Args:
        url: the store's URL.
        create: False to open only a store that exists (`StoreFactory.open_existing`):
            a mistyped path is refused, never created.

    Raises:
        NotFoundError: no store is installed for the URL's scheme; the message names
            the installed schemes and the distribution to install.
        InvalidArgumentError: the URL is malformed for its store.
        StoreMisconfiguredError: with `create=False`, there is no store at the URL.
    """
    if not isinstance(url, str) or "://" not in url:
        raise InvalidArgumentError(f"a store URL looks like scheme://..., not {url!r}")
    factory = store_factory(url.split("://", 1)[0].lower())
    if not create and factory.open_existing is not None:
        return factory.open_existing(url)
    return factory(url)


def store_factory(scheme: str) -> StoreFactory:
    """The factory that opens URLs of `scheme`.

    Raises:
        NotFoundError: no store is installed for it; the message names the installed
            schemes and the distribution to install.
    """
    with _lock:
        factory = _registered.get(scheme)
    if factory is None:
        factory = _BUILT_IN.get(scheme)
    if factory is None:
        ep = _entry_points().get(scheme)
        if ep is not None:
            factory = _factory(ep.load())
    if factory is None:
        installed = ", ".join(installed_stores())
        hint = (
            f"; install the {_KNOWN_DISTRIBUTIONS[scheme]} distribution for it"
            if scheme in _KNOWN_DISTRIBUTIONS
            else ""
        )
        raise NotFoundError(f"no store for scheme {scheme!r} (installed: {installed}){hint}")
    return factory
