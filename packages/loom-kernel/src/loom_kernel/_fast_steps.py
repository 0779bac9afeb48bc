"""Typed decoding of STEP_COMPLETED payloads with msgspec (the optional `fast` extra).

A journal is mostly completed steps, all written in one shape by
`encode_step_completed`. msgspec decodes a joined array of them straight into
structs, checking every field's type, about three times faster than parsing to
dicts and checking by hand. Any payload that does not fit exactly (an older
schema's shape, an extra or missing field, a wrong type, a number out of range)
fails the whole batch, and the caller takes the general path instead, so the
fold's result never depends on which path ran. So does a step written under
another schema version: the general path runs its upcasters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

__all__ = ["StepEnvelope", "decode_steps"]


class StepPayload(Protocol):
    """The `d` of a STEP_COMPLETED envelope."""

    @property
    def index(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def result(self) -> Any: ...
    @property
    def attempts(self) -> int: ...


class StepEnvelope(Protocol):
    """A decoded STEP_COMPLETED payload: its schema version and its data."""

    @property
    def v(self) -> str: ...
    @property
    def d(self) -> StepPayload: ...


#: Decodes b"[payload,payload,...]" of STEP_COMPLETED records, or raises ValueError
#: (msgspec's DecodeError); None when msgspec is not installed.
decode_steps: Callable[[bytes], Sequence[StepEnvelope]] | None

try:
    import msgspec
except ImportError:  # pragma: no cover - the kernel alone does not install it
    decode_steps = None
else:
    from loom_kernel._events import EVENT_SCHEMA

    # gc=False: these are read once and dropped, and cannot be part of a cycle.
    class _StepData(msgspec.Struct, forbid_unknown_fields=True, gc=False):
        index: int
        name: str
        result: Any
        attempts: int

    class _StepEnvelope(msgspec.Struct, forbid_unknown_fields=True, gc=False):
        v: Literal[EVENT_SCHEMA]  # type: ignore[valid-type]
        d: _StepData

    _decoder = msgspec.json.Decoder(list[_StepEnvelope])

    decode_steps = _decoder.decode  # its errors are ValueErrors
