"""Records <-> events: the schema envelope, version checks and upcasters.

A payload is JSON: {"v": "<schema version written under>", "d": <event fields>}.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any, Final

import attrs
import cattrs

from loom_kernel._errors import InvalidArgumentError, SchemaError
from loom_kernel._events import EVENT_SCHEMA, Event, event_class
from loom_kernel._journal import NewRecord, Record

__all__ = [
    "CONVERTER",
    "Upcaster",
    "decode_event",
    "decode_events",
    "dump_json",
    "encode_event",
    "parse_version",
    "register_upcaster",
]

#: The kernel's one converter: events and user values (attrs classes, dataclasses) go through it.
CONVERTER: Final = cattrs.Converter()

Version = tuple[int, int, int]
Lift = Callable[[dict[str, Any]], dict[str, Any]]


def parse_version(text: object) -> Version:
    """Parse "MAJOR.MINOR.PATCH".

    Raises:
        SchemaError: the text is not a semantic version.
    """
    if isinstance(text, str):
        parts = text.split(".")
        if len(parts) == 3 and all(part.isdigit() for part in parts):
            return int(parts[0]), int(parts[1]), int(parts[2])
    raise SchemaError(f"schema version {text!r} is not MAJOR.MINOR.PATCH")


_CURRENT: Final = parse_version(EVENT_SCHEMA)


@attrs.frozen
class Upcaster:
    """Lifts a kind's payload written under a version older than `before` to the next shape."""

    kind: str
    before: Version
    lift: Lift


_upcasters: list[Upcaster] = []
_upcasters_lock = threading.Lock()


def register_upcaster(kind: str, before: str, lift: Lift) -> None:
    """Register `lift` for records of `kind` written under a schema version older than `before`.

    Upcasters of a kind run in order of `before`, oldest first, each on the output of
    the previous, so a record from any older version reaches the current shape.
    """
    if event_class(kind) is None:
        raise InvalidArgumentError(f"cannot upcast unknown kind {kind!r}")
    upcaster = Upcaster(kind, parse_version(before), lift)
    with _upcasters_lock:
        _upcasters.append(upcaster)
        _upcasters.sort(key=lambda item: item.before)


def dump_json(value: Any) -> str:
    """Compact JSON for journal payloads (not canonical: use stable_stringify for hashing).

    Raises:
        InvalidArgumentError: the value is not JSON (a set, NaN, an object...).
    """
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"value is not JSON: {exc}") from exc


_hooks: dict[type[Any], Callable[[Any, type[Any]], Any]] = {}


def _structure_hook(cls: type[Any]) -> Callable[[Any, type[Any]], Any]:
    hook = _hooks.get(cls)
    if hook is None:
        hook = _hooks[cls] = CONVERTER.get_structure_hook(cls)
    return hook


def encode_event(event: Event, timestamp: float) -> NewRecord:
    """Encode an event as a record written under the current EVENT_SCHEMA."""
    data = CONVERTER.unstructure(event)
    payload = '{"v":"' + EVENT_SCHEMA + '","d":' + dump_json(data) + "}"
    return NewRecord(kind=event.KIND, payload=payload.encode("utf-8"), timestamp=timestamp)


def decode_event(record: Record, stream: str | None = None) -> Event:
    """Decode a stored record into its event, lifting older payloads with the upcasters.

    Raises:
        SchemaError: unknown kind, a newer major version, a payload that is not JSON
            or does not fit the kind; naming the kind, the version and the stream.
    """
    where: dict[str, Any] = {"kind": record.kind, "stream": stream, "position": record.position}
    try:
        envelope = json.loads(record.payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        if event_class(record.kind) is None:
            raise SchemaError("unknown record kind", **where) from None
        raise SchemaError(f"payload is not JSON: {exc}", **where) from exc
    return _from_envelope(record, envelope, stream)


def decode_events(records: list[Record], stream: str | None = None) -> list[Event]:
    """Decode many records; the same result and errors as decode_event on each, faster.

    The payloads are parsed as one JSON array, which costs one parser call instead of
    one per record; if that fails, each record is decoded alone to name the bad one.
    """
    if not records:
        return []
    try:
        joined = b"[" + b",".join(record.payload for record in records) + b"]"
        envelopes = json.loads(joined)
        if len(envelopes) != len(records):
            raise ValueError("a payload held more than one JSON value")
    except ValueError:
        return [decode_event(record, stream) for record in records]
    return [
        _from_envelope(record, envelope, stream)
        for record, envelope in zip(records, envelopes, strict=True)
    ]


_versions: dict[object, Version] = {}


def _version_of(text: object) -> Version:
    try:
        return _versions[text]
    except (KeyError, TypeError):
        version = parse_version(text)
        if isinstance(text, str) and len(_versions) < 64:
            _versions[text] = version
        return version


def _from_envelope(record: Record, envelope: Any, stream: str | None) -> Event:
    where: dict[str, Any] = {"kind": record.kind, "stream": stream, "position": record.position}
    cls = event_class(record.kind)
    if cls is None:
        raise SchemaError("unknown record kind", **where)
    if not isinstance(envelope, dict) or "v" not in envelope or "d" not in envelope:
        raise SchemaError("payload has no schema envelope", **where)
    where["version"] = envelope["v"] if isinstance(envelope["v"], str) else repr(envelope["v"])
    try:
        version = _version_of(envelope["v"])
    except SchemaError as exc:
        raise SchemaError(str(exc), **where) from None
    if version[0] > _CURRENT[0]:
        raise SchemaError(
            f"written under a newer major schema than this kernel's {EVENT_SCHEMA}", **where
        )
    data = envelope["d"]
    if not isinstance(data, dict):
        raise SchemaError("payload data is not an object", **where)
    if version < _CURRENT:
        for upcaster in _upcasters:
            if upcaster.kind == record.kind and version < upcaster.before:
                data = upcaster.lift(data)
    try:
        event: Event = _structure_hook(cls)(data, cls)
    except (cattrs.BaseValidationError, TypeError, ValueError, KeyError) as exc:
        raise SchemaError(f"payload does not fit the kind: {exc}", **where) from exc
    return event
