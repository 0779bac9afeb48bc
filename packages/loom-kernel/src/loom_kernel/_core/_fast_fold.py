"""The fast fold, and the one home of msgspec (the optional `fast` extra).

A journal is mostly completed steps, all written in one shape: the fields of the
`StepCompleted` event, in order (`STEP_FIELDS`). msgspec decodes a joined array of
them straight into structs built from those fields, checking every field's type,
about three times faster than parsing to dicts and checking by hand. Any payload
that does not fit exactly (an older schema's shape, an extra or missing field, a
wrong type, a number out of range) fails the whole batch, and the caller takes the
general path instead, so the fold's result never depends on which path ran.

msgspec also parses whole journals (`parse_many`) about twice as fast as json.loads,
and reads every integer exactly. Without msgspec both fall back to the standard
library: `parse_many` is json.loads and `step_runs` declines.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from itertools import groupby
from operator import attrgetter, itemgetter
from typing import Any, Final, Literal

import attrs

from loom_kernel._core._events import EVENT_SCHEMA, StepCompleted
from loom_kernel._core._records import Record

__all__ = ["STEP_FIELDS", "STEP_KIND", "decode_step_runs", "parse_many", "step_runs"]

STEP_KIND: Final = StepCompleted.KIND
#: The payload fields of a completed step, in the order they are written.
STEP_FIELDS: Final = tuple(field.name for field in attrs.fields(StepCompleted))

_KIND: Final = itemgetter(1)  # of a Record
_PAYLOAD: Final = itemgetter(2)
_DATA: Final = attrgetter("d")  # of a decoded step envelope

#: Parses JSON bytes (a joined journal, say); its errors are ValueErrors.
parse_many: Callable[[bytes | str], Any]
#: Decodes b"[payload,payload,...]" of STEP_COMPLETED records written under the
#: current schema, or raises ValueError; None without msgspec.
decode_step_runs: Callable[[bytes], Sequence[Any]] | None

try:
    import msgspec
except ImportError:  # pragma: no cover - the kernel alone does not install it
    parse_many = json.loads
    decode_step_runs = None
else:
    parse_many = msgspec.json.decode
    _TYPES: Final[dict[str, Any]] = {"int": int, "str": str, "Any": Any}
    # gc=False: these are read once and dropped, and cannot be part of a cycle.
    _StepData = msgspec.defstruct(
        "_StepData",
        [(field.name, _TYPES[str(field.type)]) for field in attrs.fields(StepCompleted)],
        forbid_unknown_fields=True,
        gc=False,
    )
    _StepEnvelope = msgspec.defstruct(
        "_StepEnvelope",
        [("v", Literal[EVENT_SCHEMA]), ("d", _StepData)],
        forbid_unknown_fields=True,
        gc=False,
    )
    decode_step_runs = msgspec.json.Decoder(list[_StepEnvelope]).decode  # type: ignore[valid-type]


def step_runs(records: list[Record]) -> list[tuple[int, int, Sequence[Any] | None]] | None:
    """`records` cut into runs of one kind, every run of steps decoded by msgspec: each
    run as (start, end, the decoded steps' data, or None for a run of other kinds).

    Returns:
        None when msgspec is missing or any step payload does not fit the current
        schema's shape exactly (the caller then takes the general path, which judges
        it).
    """
    decode = decode_step_runs
    if decode is None:
        return None
    runs: list[tuple[int, int, Sequence[Any] | None]] = []
    position = 0
    for kind, run in groupby(map(_KIND, records)):
        end = position + len(list(run))
        if kind == STEP_KIND:
            try:
                decoded = decode(b"[" + b",".join(map(_PAYLOAD, records[position:end])) + b"]")
            except ValueError:
                return None
            if len(decoded) != end - position:  # a payload held more than one value
                return None
            runs.append((position, end, list(map(_DATA, decoded))))
        else:
            runs.append((position, end, None))
        position = end
    return runs
