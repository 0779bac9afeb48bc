"""A run's id and the names of its streams: its journal `ex/<id>`, its snapshot
`snap/<id>`, its inbox `inbox/<id>` and its published values `events/<id>`.
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
