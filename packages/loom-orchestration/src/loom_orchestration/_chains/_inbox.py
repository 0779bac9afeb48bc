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
import threading
import weakref
from typing import Any, Final, Literal

import attrs
from loom_kernel import ConflictError, InvalidArgumentError, SchemaError, StoreUnavailableError
from loom_kernel.events import stable_stringify
from loom_kernel.spi import JournalStore, NewRecord, Record

from loom_orchestration._chains._names import INBOX_PREFIX

__all__ = ["Item", "append", "items", "read"]

KIND: Final = "loom.chain_item"
#: The chain inboxes whose parsed items a process keeps.
_KEPT: Final = 256
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
    return read(store, chain)[1]


@attrs.define
class _Parsed:
    """A chain inbox as parsed up to `head`: items never change once written, so a
    reader keeps them and reads only what was appended since (one request on S3 when
    nothing was)."""

    head: int = 0
    items: list[Item] = attrs.Factory(list)
    keys: set[str] = attrs.Factory(set)
    lock: threading.Lock = attrs.Factory(threading.Lock)


#: The chain inboxes this process has parsed, by store (gone with it) and chain.
_parsed: weakref.WeakKeyDictionary[JournalStore, dict[str, _Parsed]] = weakref.WeakKeyDictionary()
_parsed_lock = threading.Lock()


def read(store: JournalStore, chain: str) -> tuple[int, list[Item]]:
    """The chain inbox's head and its items (resends left out), read from where this
    process last read it.

    Raises:
        SchemaError: a record is damaged.
    """
    stream = stream_of(chain)
    with _parsed_lock:
        chains = _parsed.setdefault(store, {})
        parsed = chains.get(chain)
        if parsed is None:
            if len(chains) >= _KEPT:
                chains.pop(next(iter(chains)))
            parsed = chains[chain] = _Parsed()
    with parsed.lock:
        since = parsed.head
    records = store.read(stream, since)  # no lock held over a store call
    decoded = [_decode(record, stream) for record in records]
    with parsed.lock:
        for item in decoded:
            if item.position <= parsed.head:
                continue  # another reader of this process added it meanwhile
            parsed.head = item.position
            if item.key is not None:
                if item.key in parsed.keys:
                    continue
                parsed.keys.add(item.key)
            parsed.items.append(item)
        return parsed.head, list(parsed.items)


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
        InvalidArgumentError: the item, forwarded to a run, would be over the store's
            largest record.
        StoreUnavailableError: the inbox kept moving under every attempt.
    """
    stream = stream_of(chain)
    payload = stable_stringify({"kind": kind, "name": name, "key": key, "value": value}).encode()
    _refuse_too_big(store, name, value)
    for _ in range(_APPEND_ATTEMPTS):
        head, present = read(store, chain)
        if key is not None:
            for item in present:
                if item.key == key:
                    return item.position
        try:  # at the head this read saw: a resend that landed since makes it conflict
            return store.append(stream, head, [NewRecord(KIND, payload, at)])
        except ConflictError:
            continue  # another sender appended first: look for its key again
    raise StoreUnavailableError(f"{stream} kept moving at each of {_APPEND_ATTEMPTS} appends")


def _refuse_too_big(store: JournalStore, name: str | None, value: Any) -> None:
    """Refuse an item the run's inbox could not hold once forwarded (its record is
    the kernel's: ASCII JSON with a `chain:<position>` key), before it is written."""
    limit = store.largest_payload
    if limit is None:
        return
    forwarded = json.dumps({"topic": name, "key": "chain:" + "9" * 15, "message": value})
    if len(forwarded.encode()) > limit:
        raise InvalidArgumentError(
            f"the item is {len(forwarded.encode()):,} bytes forwarded to a run, over the "
            f"store's limit of {limit:,} bytes a record; nothing was written"
        )


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
