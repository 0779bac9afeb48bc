"""Records <-> events: the schema envelope, version checks and upcasters.

A payload is JSON: {"v": "<schema version written under>", "d": <event fields>}.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs
import cattrs

from loom_kernel._core._errors import InvalidArgumentError, SchemaError
from loom_kernel._core._events import EVENT_SCHEMA, ErrorInfo, Event, QueuePlace, event_class
from loom_kernel._core._fast_fold import STEP_FIELDS, STEP_KIND, parse_many
from loom_kernel._core._records import NewRecord, Record

__all__ = [
    "CONVERTER",
    "PLAIN_TYPES",
    "Upcaster",
    "decode_envelope",
    "decode_event",
    "decode_events",
    "dump_json",
    "encode_event",
    "load_json",
    "parse_envelopes",
    "parse_version",
    "register_upcaster",
    "to_json",
    "to_json_text",
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

#: Reads back JSON text that dump_json wrote: the fast parser gives the same values
#: for it (no NaN or infinity is ever written; integers of any size read exactly).
load_json: Final[Callable[[str], Any]] = parse_many


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


def _compact_chunks() -> Callable[[Any, int], Sequence[str]]:
    """The chunks of json.dumps(value, separators=(",", ":"), ensure_ascii=False,
    allow_nan=False), for `"".join`: `_CHUNKS(value, 0)`.

    The standard library builds its C encoder anew on every call, most of the cost
    of dumping a step's small result; this builds it once, with the same settings, so
    the text is the same byte for byte (property-tested). Without the per-call
    circular-reference markers, a cycle ends in RecursionError, which dump_json
    reports like any other value that is not JSON. Where the C accelerator is
    missing, the standard encoder itself is used.
    """
    reference = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython has it
        return lambda value, _level: (reference.encode(value),)
    chunks_of: Callable[[Any, int], Sequence[str]] = make(
        None,  # no circular-reference markers
        reference.default,
        json.encoder.encode_basestring,
        None,  # indent
        reference.key_separator,
        reference.item_separator,
        False,  # sort_keys
        False,  # skipkeys
        False,  # allow_nan
    )
    return chunks_of


_CHUNKS: Final = _compact_chunks()


def dump_json(value: Any) -> str:
    """Compact JSON for journal payloads (not canonical: use stable_stringify for hashing).

    Raises:
        InvalidArgumentError: the value is not JSON (a set, NaN, an object...).
    """
    try:
        text = "".join(_CHUNKS(value, 0))
        if not text.isascii():
            text.encode("utf-8")  # a lone surrogate has no UTF-8 form: no JSON text either
    except (TypeError, ValueError, RecursionError) as exc:  # UnicodeEncodeError: a ValueError
        raise InvalidArgumentError(f"value is not JSON: {exc}") from exc
    return text


#: Types whose values are JSON data as they are, when they hold only such values.
PLAIN_TYPES: Final = frozenset({dict, list, str, int, float, bool, type(None)})


def to_json_text(value: Any, what: str, *, str_keys: bool = True) -> str:
    """The JSON text of a value, through the kernel's converter (attrs, dataclasses...).

    With `str_keys`, a dict key that is not a str is refused: what a caller hands the
    kernel (an input, a message, a resume payload, a published value) would reach the
    run with `{1: "x"}` turned into `{"1": "x"}` behind its back. A step's or a flow's
    result is written without it: the flow gets that JSON form back on the first run
    as on every replay (and `returns=` rebuilds typed keys), so nothing differs.

    Raises:
        InvalidArgumentError: the value has no JSON form (or, with `str_keys`, holds a
            dict key that is not a str).
    """
    if type(value) in PLAIN_TYPES:
        # Plain JSON needs no trip through the converter (measured: its walk was the
        # largest cost of a step's own work); anything it cannot dump goes the long way.
        try:
            text = dump_json(value)
        except InvalidArgumentError:
            pass
        else:
            if str_keys:
                _refuse_other_keys(value, what)
            return text
    try:
        data = CONVERTER.unstructure(value)
    except Exception as exc:
        raise InvalidArgumentError(f"{what} is not JSON: {exc}") from exc
    try:
        text = dump_json(data)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{what} is not JSON: {exc}") from exc
    if str_keys:
        _refuse_other_keys(data, what)
    return text


_CONTAINERS: Final = frozenset({dict, list, tuple})


def _refuse_other_keys(value: Any, what: str) -> None:
    """Refuse a dict key that is not a str, anywhere in `value` (JSON data, dumped)."""
    if type(value) not in _CONTAINERS:
        return
    stack = [value]
    pop, push = stack.pop, stack.append
    while stack:
        item = pop()
        if type(item) is dict:
            for key, inner in item.items():
                if type(key) is not str:
                    raise InvalidArgumentError(
                        f"{what} is not JSON: a dict key is {key!r} "
                        f"({type(key).__name__}), and JSON's keys are str (it would come "
                        "back as a str, a different key); use str keys"
                    )
                if type(inner) in _CONTAINERS:
                    push(inner)
        else:
            for inner in item:
                if type(inner) in _CONTAINERS:
                    push(inner)


def to_json(value: Any, what: str, *, str_keys: bool = True) -> Any:
    """The JSON form of a value: what a replay will see (tuples become lists, and so on).

    Raises:
        InvalidArgumentError: the value has no JSON form (see `to_json_text`).
    """
    return json.loads(to_json_text(value, what, str_keys=str_keys))


@attrs.frozen
class _Field:
    name: str
    types: tuple[type[Any], ...] | None  # None: any JSON value
    nested: type[Any] | None  # an attrs class (ErrorInfo), built through the converter


_plans: dict[type[Any], tuple[_Field, ...]] = {}
#: How each annotation an event field may carry is read: (the types it may hold, the
#: attrs class it is built as). None: any JSON value, or no class.
_FIELD_TYPES: Final[dict[str, tuple[tuple[type[Any], ...] | None, type[Any] | None]]] = {
    "Any": (None, None),
    "int": ((int,), None),
    "str": ((str,), None),
    "str | None": ((str, type(None)), None),
    "float | None": ((float, int, type(None)), None),
    "ErrorInfo": (None, ErrorInfo),
    "QueuePlace | None": (None, QueuePlace),
}


def _plan(cls: type[Any]) -> tuple[_Field, ...]:
    """How to move an event class's fields to and from JSON without a generic walk.

    Event payload fields typed Any hold JSON data already (the engine makes sure), so
    walking them again through the converter, on every record of every replay, would
    be wasted work; typed fields are checked with isinstance instead.
    """
    plan = _plans.get(cls)
    if plan is None:
        fields = []
        for field in attrs.fields(cls):
            kind = _FIELD_TYPES.get(str(field.type))
            if kind is None:
                raise TypeError(
                    f"event field {cls.__name__}.{field.name} is annotated {field.type!r}, "
                    f"which the codec cannot check; known: {sorted(_FIELD_TYPES)}"
                )
            fields.append(_Field(field.name, *kind))
        plan = _plans[cls] = tuple(fields)
    return plan


def _event_data(event: Event) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for field in _plan(type(event)):
        value = getattr(event, field.name)
        nested = field.nested is not None and value is not None
        data[field.name] = CONVERTER.unstructure(value) if nested else value
    return data


def _build_event(cls: type[Any], data: dict[str, Any]) -> Any:
    values: dict[str, Any] = {}
    for field in _plan(cls):
        if field.name not in data:
            continue  # an attrs default applies, or the constructor names what is missing
        value = data[field.name]
        if field.nested is QueuePlace:
            value = None if value is None else _queue_place(value)
        elif field.nested is not None:
            value = CONVERTER.structure(value, field.nested)
        elif field.types is not None and (
            not isinstance(value, field.types) or isinstance(value, bool)
        ):
            raise TypeError(f"field {field.name!r} holds {value!r}")
        values[field.name] = value
    return cls(**values)


def _queue_place(data: Any) -> QueuePlace:
    """A start's queue place, its field types checked exactly (no coercion)."""
    if type(data) is not dict or not isinstance(data.get("name"), str):
        raise TypeError(f"a queue place is an object with a name, not {data!r}")
    partition, priority, key = data.get("partition", 0), data.get("priority", 0), data.get("key")
    if type(partition) is not int or type(priority) is not int:
        raise TypeError(f"a queue place's partition and priority are ints, not {data!r}")
    if key is not None and not isinstance(key, str):
        raise TypeError(f"a queue place's key is a str or null, not {key!r}")
    return QueuePlace(data["name"], partition, priority, key)


_ENVELOPE_HEAD: Final = '{"v":"' + EVENT_SCHEMA + '","d":'


def _envelope(kind: str, data_json: str, timestamp: float) -> NewRecord:
    """The record of an event whose data is already JSON text, under the current schema."""
    payload = _ENVELOPE_HEAD + data_json + "}"
    return NewRecord(kind=kind, payload=payload.encode("utf-8"), timestamp=timestamp)


def encode_event(event: Event, timestamp: float) -> NewRecord:
    """Encode an event as a record written under the current EVENT_SCHEMA."""
    return _envelope(event.KIND, dump_json(_event_data(event)), timestamp)


#: A step's record as JSON, in pieces between its fields (STEP_FIELDS order), each
#: field already JSON text: joined once, so a large result is copied once, not per
#: concatenation.
_STEP_PIECES: Final = (
    _ENVELOPE_HEAD + "{" + ",".join(f'"{name}":\0' for name in STEP_FIELDS) + "}}"
).split("\0")
_NAMES_KEPT: Final = 4096
_name_json: dict[str, str] = {}


def encode_step_completed(
    index: int, name: str, result_json: str, attempts: int, timestamp: float
) -> NewRecord:
    """encode_event(StepCompleted(...)), byte for byte, from a result already dumped to JSON.

    The engine has the step result's JSON text in hand (it made it to check the result
    is JSON), so the hot path does not dump it a second time.
    """
    name_json = _name_json.get(name)
    if name_json is None:
        name_json = dump_json(name)
        if len(_name_json) < _NAMES_KEPT:  # flows reuse a few names; keep their JSON
            _name_json[name] = name_json
    index_is, name_is, result_is, attempts_is, end = _STEP_PIECES
    pieces = (index_is, str(index), name_is, name_json, result_is, result_json, attempts_is)
    payload = "".join((*pieces, str(attempts), end))
    return NewRecord(STEP_KIND, payload.encode("utf-8"), timestamp)


def decode_event(record: Record, stream: str | None = None) -> Event:
    """Decode a stored record into its event, lifting older payloads with the upcasters.

    Raises:
        SchemaError: unknown kind, a newer major version, a payload that is not JSON
            or does not fit the kind; naming the kind, the version and the stream.
    """
    return decode_envelope(record, _parse_one(record, stream), stream)


def _parse_one(record: Record, stream: str | None) -> Any:
    """A record's payload as JSON, with the standard library's parser."""
    try:
        return json.loads(record.payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        where: dict[str, Any] = {
            "kind": record.kind,
            "stream": stream,
            "position": record.position,
        }
        if event_class(record.kind) is None:
            raise SchemaError("unknown record kind", **where) from None
        raise SchemaError(f"payload is not JSON: {exc}", **where) from exc


def parse_envelopes(records: Sequence[Record], stream: str | None = None) -> list[Any]:
    """Parse many payloads at once; the same errors as decode_event for a bad one.

    The payloads are parsed as one JSON array, which costs one parser call instead of
    one per record. If that fails, each is parsed alone by the standard library's
    parser, which names a bad one; so the fast parser's narrower numbers (msgspec
    refuses 1e400) never change what a journal reads as.
    """
    if not records:
        return []
    try:
        joined = b"[" + b",".join(record.payload for record in records) + b"]"
        envelopes: list[Any] = parse_many(joined)
        if len(envelopes) != len(records):
            raise ValueError("a payload held more than one JSON value")
    except ValueError:
        return [_parse_one(record, stream) for record in records]
    return envelopes


def decode_events(records: list[Record], stream: str | None = None) -> list[Event]:
    """Decode many records; the same result and errors as decode_event on each, faster."""
    envelopes = parse_envelopes(records, stream)
    return [
        decode_envelope(record, envelope, stream)
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


def decode_envelope(record: Record, envelope: Any, stream: str | None) -> Event:
    """Decode a record whose payload was already parsed (see parse_envelopes)."""
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
        event: Event = _build_event(cls, data)
    except (cattrs.BaseValidationError, TypeError, ValueError, KeyError) as exc:
        raise SchemaError(f"payload does not fit the kind: {exc}", **where) from exc
    return event
