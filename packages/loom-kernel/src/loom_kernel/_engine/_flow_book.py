"""The flows an engine hosts: each name's versions by code hash, and the newest of each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loom_kernel._core import (
    CodeVersionError,
    ExecutionState,
    InvalidArgumentError,
    UnknownFlowError,
)
from loom_kernel._replay import Flow, code_hash, flow

__all__ = ["FlowBook"]


class FlowBook:
    """The flows registered on one engine."""

    def __init__(self) -> None:
        self._flows: dict[str, dict[str, Flow]] = {}  # name -> code hash -> flow
        self._newest: dict[str, Flow] = {}

    def register(self, item: Flow | Callable[..., Any], *, newest: bool = True) -> Flow:
        """Make a flow startable by name (see `Engine.register`)."""
        registered = item if isinstance(item, Flow) else flow(item)
        versions = self._flows.setdefault(registered.name, {})
        same = versions.get(registered.code_hash)
        if (
            same is not None
            and same.fn is not registered.fn
            and code_hash(same.fn) != code_hash(registered.fn)
        ):
            raise InvalidArgumentError(
                f"flow {registered.name!r} version {registered.version!r} is registered "
                "already with other code: two codes under one version would drive each "
                "other's runs; give the new code a version of its own"
            )
        versions[registered.code_hash] = registered
        if newest or registered.name not in self._newest:
            self._newest[registered.name] = registered
        return registered

    def newest(self, name: str | Flow) -> Flow:
        """The flow new runs of `name` start on: the version registered last (or, given
        a Flow, that registered version of it).

        Raises:
            UnknownFlowError: no version of it is registered.
        """
        key = name.name if isinstance(name, Flow) else name
        found = self._newest.get(key) if isinstance(key, str) else None
        if found is None:
            known = ", ".join(sorted(self._newest)) or "none"
            raise UnknownFlowError(f"no flow named {key!r} is registered (registered: {known})")
        if isinstance(name, Flow):
            return self.version(key, name)
        return found

    def hosts(self, name: str) -> bool:
        """Whether any version of flow `name` is registered."""
        return name in self._newest

    def hosts_code(self, name: str, code: str) -> bool:
        """Whether the version of flow `name` with code hash `code` is registered here
        (any version, when `code` is empty)."""
        return code in self._flows.get(name, {}) if code else name in self._newest

    def hosts_run(self, state: ExecutionState) -> bool:
        """Whether the code a run is pinned to is registered."""
        if state.flow not in self._newest:
            return False
        try:
            self.pinned(state)
        except CodeVersionError:
            return False
        return True

    def pinned(self, state: ExecutionState) -> Flow:
        """The code a run is pinned to (K11); the newest version for a run started by
        name with no code (code hash ""), which its first drive pins to it.

        Raises:
            UnknownFlowError: no version of its flow is registered.
            CodeVersionError: its flow is registered, but not in the version it pins.
        """
        versions = self._flows.get(state.flow)
        if not versions:
            self.newest(state.flow)  # raises UnknownFlowError, naming what is registered
        assert versions is not None
        if not state.code_hash:
            return self.newest(state.flow)
        found = versions.get(state.code_hash)
        if found is None:
            raise CodeVersionError(state.id, state.flow, state.code_hash, sorted(versions))
        return found

    def version(self, name: str, to: Flow | str | None) -> Flow:
        """A registered version of flow `name`: by Flow, by code hash or version, or the
        newest when None.

        Raises:
            InvalidArgumentError: `to` is another flow's, or not a version at all.
            UnknownFlowError: no such version is registered.
        """
        if to is None:
            return self.newest(name)
        versions = self._flows.get(name, {})
        if isinstance(to, Flow):
            if to.name != name:
                raise InvalidArgumentError(
                    f"{to.name!r} {to.code_hash} is another flow than {name!r}: a run moves "
                    "only to a version of its own flow"
                )
            wanted = to.code_hash
        elif isinstance(to, str) and to:
            # A code hash ("version:2", "sha256:..."), else a version ("2", "2024:02").
            wanted = to if to in versions else f"version:{to}"
        else:
            raise InvalidArgumentError(f"a version is a Flow, a code hash or a version, not {to!r}")
        found = versions.get(wanted)
        if found is None:
            have = ", ".join(sorted(versions)) or "none"
            raise UnknownFlowError(
                f"flow {name!r} has no registered version {wanted!r} (registered: {have})"
            )
        return found
