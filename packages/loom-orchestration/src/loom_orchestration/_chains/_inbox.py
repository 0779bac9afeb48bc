"""A chain's inbox: what was sent to the chain by its logical name, in one stream,
`chain-inbox/<chain>`, whichever run was current.

One record per item, in send order: a message (topic, message) or a gate resume
(gate, payload), each with its dedupe key if it has one. A key an earlier item of the
inbox has makes a resend, never delivered (two senders that both looked before
either appended may both land: the reader skips all but the first), so a key is
deduplicated across the whole chain, whichever run each send reached. Items are
never rewritten: each is delivered by forwarding it to the run it belongs to (see
`_routing`), which records it as received.
"""

from __future__ import annotations

import json
from typing import Any, Final, Literal

import attrs
from loom_kernel import ConflictError, SchemaError, StoreUnavailableError
from loom_kernel.events import stable_stringify
from loom_kernel.spi import JournalStore, NewRecord, Record

from loom_orchestration._chains._names import INBOX_PREFIX

__all__ = ["Item", "append", "items"]

KIND: Final = "loom.chain_item"
_APPEND_ATTEMPTS: Final = 64


@attrs.frozen
class Item:
    """One item of a chain's inbox.

    Attributes:
        position: its place in the chain's inbox (1, 2, ...): the send order.
        kind: "message" (for `ctx.receive`) or "resume" (for a gate).
        name: the message's topic, or the gate's name.
        key: its dedupe key, if it was sent with one.
        value: the message, or the resume's payload.
    """

    position: int
    kind: Literal["message", "resume"]
    name: str | None
    key: str | None
    value: Any


def stream_of(chain: str) -> str:
    return INBOX_PREFIX + chain


def items(store: JournalStore, chain: str) -> list[Item]:
    """The chain inbox's items, in send order, resends left out.

    Raises:
        SchemaError: a record is damaged.
    """
    stream = stream_of(chain)
    found: list[Item] = []
    keys: set[str] = set()
    for record in store.read(stream):
        item = _decode(record, stream)
        if item.key is not None:
            if item.key in keys:
                continue
            keys.add(item.key)
        found.append(item)
    return found


def append(
    store: JournalStore,
    chain: str,
    *,
    kind: Literal["message", "resume"],
    name: str | None,
    key: str | None,
    value: Any,
    at: float,
) -> int:
    """Append an item; its position, or the position of the first item sent with
    its key (a resend appends nothing when the first is already there).

    Raises:
        CanonicalJSONError: the value has no JSON form (a key that is not a str, a
            NaN, a set...).
        StoreUnavailableError: the inbox kept moving under every attempt.
    """
    stream = stream_of(chain)
    payload = stable_stringify({"kind": kind, "name": name, "key": key, "value": value}).encode()
    for _ in range(_APPEND_ATTEMPTS):
        present = items(store, chain)
        if key is not None:
            for item in present:
                if item.key == key:
                    return item.position
        head = store.head(stream)
        try:
            return store.append(stream, head, [NewRecord(KIND, payload, at)])
        except ConflictError:
            continue  # another sender appended first: look for its key again
    raise StoreUnavailableError(f"{stream} kept moving at each of {_APPEND_ATTEMPTS} appends")


def _decode(record: Record, stream: str) -> Item:
    try:
        if record.kind != KIND:
            raise ValueError(f"unknown kind {record.kind!r}")
        data = json.loads(record.payload)
        kind, name, key = data["kind"], data["name"], data["key"]
        if kind not in ("message", "resume"):
            raise ValueError(f"unknown item kind {kind!r}")
        if not (name is None or isinstance(name, str)) or not (key is None or isinstance(key, str)):
            raise TypeError("name and key are str or null")
        return Item(record.position, kind, name, key, data["value"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise SchemaError(
            f"a damaged chain inbox item: {exc}",
            kind=record.kind,
            stream=stream,
            position=record.position,
        ) from None
