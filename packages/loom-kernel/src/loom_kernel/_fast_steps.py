"""Typed decoding of STEP_COMPLETED payloads with msgspec (the optional `fast` extra).

A journal is mostly completed steps, all written in one shape by
`encode_step_completed`. msgspec decodes a joined array of them straight into
structs, checking every field's type, about three times faster than parsing to
dicts and checking by hand. Any payload that does not fit exactly (an older
schema's shape, an extra or missing field, a wrong type, a number out of range)
fails the whole batch, and the caller takes the general path instead, so the
fold's result never depends on which path ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

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

    class _StepData(msgspec.Struct, forbid_unknown_fields=True):
        index: int
        name: str
        result: Any
        attempts: int

    class _StepEnvelope(msgspec.Struct, forbid_unknown_fields=True):
        v: str
        d: _StepData

    _decoder = msgspec.json.Decoder(list[_StepEnvelope])

    decode_steps = _decoder.decode  # its errors are ValueErrors
