"""A run's id and the names of its streams: its journal `ex/<id>`, its snapshot
`snap/<id>`, its inbox `inbox/<id>` and its published values `events/<id>`.

A run started with the id of a run that retention deleted (generation 2, 3, ...)
goes on in the same journal and snapshot streams, after the deletion's record, but
its inbox and published values are new streams, `in~<generation>/<id>` and
`ev~<generation>/<id>`: the deleted run's are gone, and a reader that folded them
before can never mistake them for the new run's.
"""

from __future__ import annotations

from typing import Final

from loom_kernel._core._errors import InvalidIdError
from loom_kernel._core._ids import MAX_ID_LENGTH, validate_stream_id

__all__ = [
    "EVENTS_PREFIX",
    "EXECUTION_PREFIX",
    "INBOX_PREFIX",
    "MAX_EXECUTION_ID_LENGTH",
    "SNAPSHOT_PREFIX",
    "events_stream",
    "inbox_stream",
    "new_execution_id",
    "stream_of",
]

INBOX_PREFIX: Final = "inbox/"
EVENTS_PREFIX: Final = "events/"
EXECUTION_PREFIX: Final = "ex/"
SNAPSHOT_PREFIX: Final = "snap/"
#: The longest execution id every stream of its run can be named by.
MAX_EXECUTION_ID_LENGTH: Final = MAX_ID_LENGTH - max(
    len(prefix) for prefix in (EXECUTION_PREFIX, SNAPSHOT_PREFIX, INBOX_PREFIX, EVENTS_PREFIX)
)


def stream_of(execution_id: object) -> str:
    """The journal stream of an execution.

    Raises:
        InvalidIdError: the id is not a str, or not a valid stream id.
    """
    if not isinstance(execution_id, str):
        raise InvalidIdError(execution_id, "an execution id is a str")
    try:
        return validate_stream_id(EXECUTION_PREFIX + execution_id)
    except InvalidIdError as exc:
        raise InvalidIdError(execution_id, exc.reason) from None


def new_execution_id(execution_id: str) -> str:
    """An id for a new run: a valid execution id whose other streams (inbox, events,
    snapshot) can be named too. (Runs started before this check with longer ids are
    still read: only their messages and events cannot be.)

    Raises:
        InvalidIdError: the id is not a valid id, or is too long for those streams.
    """
    stream_of(execution_id)
    if len(execution_id) > MAX_EXECUTION_ID_LENGTH:
        raise InvalidIdError(
            execution_id,
            f"an execution id is at most {MAX_EXECUTION_ID_LENGTH} characters (its inbox, "
            "events and snapshot streams are named by it too)",
        )
    return execution_id


def inbox_stream(execution_id: str, generation: int = 1) -> str:
    """The inbox stream of generation `generation` of a run id.

    Raises:
        InvalidIdError: the name is not a valid stream id (a long id, restarted after
            deletions, may not fit one).
    """
    return _generation_stream(INBOX_PREFIX, "in", execution_id, generation)


def events_stream(execution_id: str, generation: int = 1) -> str:
    """The published-values stream of generation `generation` of a run id.

    Raises:
        InvalidIdError: as `inbox_stream`.
    """
    return _generation_stream(EVENTS_PREFIX, "ev", execution_id, generation)


def _generation_stream(first: str, short: str, execution_id: str, generation: int) -> str:
    if generation == 1:
        return validate_stream_id(first + execution_id)
    if type(generation) is not int or generation < 1:
        raise InvalidIdError(generation, "a generation is an int >= 1")
    try:
        return validate_stream_id(f"{short}~{generation}/{execution_id}")
    except InvalidIdError as exc:
        raise InvalidIdError(
            execution_id, f"{exc.reason} (its run number {generation}'s streams cannot be named)"
        ) from None
