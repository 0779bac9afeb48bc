"""What a gate waits for, written in its recorded name, and what woke it.

A plain `ctx.suspend(on)` records `on` itself. A receive records
`loom.receive:<topic as JSON>`, and a wait for the first of several things records
`loom.first:<{"gates": [...], "topics": [...]} as canonical JSON>`: the name alone says
what may wake the gate, so a resume or a send can be judged against the journal, and
a replay whose code waits for something else is a divergence (the names differ).

What woke a gate is its recorded resume payload: a message as
`{"topic", "position", "message"}`, a named resume of a `loom.first` gate as
`{"gate", "value"}`, and a deadline as the timer's resume key on that gate.
"""

from __future__ import annotations

import json
from typing import Any, Final, Literal

import attrs

from loom_kernel._core import MAX_ID_LENGTH, InvalidArgumentError, is_name, stable_stringify

__all__ = [
    "FIRST_PREFIX",
    "RECEIVE_PREFIX",
    "RESERVED_RESUME_KEYS",
    "TIMER_GATE",
    "Message",
    "Wait",
    "Woken",
    "first_gate",
    "gate_payload",
    "message_key",
    "message_payload",
    "receive_gate",
    "timer_resume_key",
    "validate_topic",
    "wait_of",
]

#: The gate name a sleep parks at.
TIMER_GATE: Final = "loom.timer"
RECEIVE_PREFIX: Final = "loom.receive:"
FIRST_PREFIX: Final = "loom.first:"
_MESSAGE_KEY: Final = "loom.inbox:"
#: Resume keys only the kernel writes: a timer's (`timer:<gate>`) and a message's.
RESERVED_RESUME_KEYS: Final = ("loom.", "timer:")


@attrs.frozen
class Wait:
    """What a parked gate accepts.

    Attributes:
        gates: the names an `engine.resume(..., on=name)` may deliver to.
        topics: the inbox topics a message may wake it on (None: the default topic).
        named: whether a resume's payload is recorded with the gate it went to (a
            `loom.first` gate); a plain gate records the payload itself.
    """

    gates: tuple[str, ...]
    topics: tuple[str | None, ...] = ()
    named: bool = False


@attrs.frozen
class Message:
    """A message in a run's inbox.

    Attributes:
        position: its place in the inbox (1, 2, ...): the send order.
        topic: its topic (None: the default topic).
        key: its dedupe key, if it was sent with one.
        message: the message (JSON).
        sent_at: when it was sent, by the sender's clock.
    """

    position: int
    topic: str | None
    key: str | None
    message: Any
    sent_at: float


@attrs.frozen
class Woken:
    """What ended a wait (`ctx.wait_first`).

    Attributes:
        kind: "gate" (a resume), "message" (a send) or "timeout" (the deadline).
        name: the gate's name, or the message's topic (None for the default topic);
            None for a timeout.
        value: the resume's payload or the message; None for a timeout.
    """

    kind: Literal["gate", "message", "timeout"]
    name: str | None = None
    value: Any = None


def validate_topic(topic: object) -> str | None:
    """A topic: None (the default topic) or a non-empty str of at most 200 characters."""
    if topic is None:
        return None
    if not is_name(topic):
        raise InvalidArgumentError(
            f"a topic is None or a non-empty str of at most {MAX_ID_LENGTH} characters "
            f"(UTF-8, so no lone surrogate), not {topic!r}"
        )
    return topic


def receive_gate(topic: str | None) -> str:
    """The recorded name of a receive on `topic`."""
    return RECEIVE_PREFIX + json.dumps(topic)


def first_gate(gates: tuple[str, ...], topics: tuple[str | None, ...]) -> str:
    """The recorded name of a wait for the first of `gates` and `topics`."""
    return FIRST_PREFIX + stable_stringify({"gates": list(gates), "topics": list(topics)})


def wait_of(on: str) -> Wait | None:
    """What a gate of that recorded name accepts; None for a timer (a sleep)."""
    if on == TIMER_GATE:
        return None
    try:
        if on.startswith(RECEIVE_PREFIX):
            return Wait((), (validate_topic(json.loads(on.removeprefix(RECEIVE_PREFIX))),))
        if on.startswith(FIRST_PREFIX):
            spec = json.loads(on.removeprefix(FIRST_PREFIX))
            if not isinstance(spec["gates"], list) or not isinstance(spec["topics"], list):
                raise TypeError("gates and topics are lists")
            if not all(isinstance(gate, str) and gate for gate in spec["gates"]):
                raise TypeError("a gate is a non-empty str")
            gates = tuple(spec["gates"])
            topics = tuple(validate_topic(topic) for topic in spec["topics"])
            return Wait(gates, topics, named=True)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise InvalidArgumentError(f"a damaged gate name {on!r}: {exc}") from None
    return Wait((on,))


def timer_resume_key(gate: int) -> str:
    """The dedupe key of the resume that wakes timer gate number `gate`."""
    return f"timer:{gate}"


def message_key(position: int) -> str:
    """The dedupe key of the resume that hands inbox message `position` to a gate."""
    return f"{_MESSAGE_KEY}{position}"


def message_payload(topic: str | None, position: int, message: Any) -> dict[str, Any]:
    """The recorded resume payload of a gate a message woke."""
    return {"topic": topic, "position": position, "message": message}


def gate_payload(gate: str, value: Any) -> dict[str, Any]:
    """The recorded resume payload of a `loom.first` gate a named resume woke."""
    return {"gate": gate, "value": value}


def consumed_positions(resume_keys: list[str]) -> set[int]:
    """The inbox positions a run has consumed, from its resume keys."""
    return {
        int(key[len(_MESSAGE_KEY) :])
        for key in resume_keys
        if key.startswith(_MESSAGE_KEY) and key[len(_MESSAGE_KEY) :].isdigit()
    }
