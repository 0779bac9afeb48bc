"""A chain's name, its runs' ids (`<chain>@<n>`), and the streams it keeps."""

from __future__ import annotations

from typing import Final

from loom_kernel import InvalidIdError
from loom_kernel.spi import MAX_ID_LENGTH, validate_stream_id

__all__ = ["INBOX_PREFIX", "check_chain", "number_of", "run_id"]

#: The chain inboxes: `chain-inbox/<chain>`.
INBOX_PREFIX: Final = "chain-inbox/"
#: The longest run number a chain's ids leave room for (`@` and 9 digits).
_NUMBER_ROOM: Final = 10
#: The longest run id the kernel takes (its `events/` stream is named by it too).
_MAX_RUN_ID: Final = MAX_ID_LENGTH - len("events/")


def check_chain(chain: object) -> str:
    """A chain's name: a valid id with no '@', short enough that its runs' ids (and
    its inbox's stream) are valid ids too.

    Raises:
        InvalidIdError: it is not.
    """
    if not isinstance(chain, str):
        raise InvalidIdError(chain, "a chain's name is a str")
    if "@" in chain:
        raise InvalidIdError(chain, "a chain's name has no '@' (its runs are <chain>@<n>)")
    longest = min(_MAX_RUN_ID - _NUMBER_ROOM, MAX_ID_LENGTH - len(INBOX_PREFIX))
    if len(chain) > longest:
        raise InvalidIdError(chain, f"a chain's name has at most {longest} characters")
    validate_stream_id(chain)
    return chain


def run_id(chain: str, number: int) -> str:
    """The id of a chain's run `number` (1 for the first)."""
    return f"{chain}@{number}"


def number_of(execution_id: str) -> tuple[str, int] | None:
    """The chain and run number an id names, or None for an id of no chain's run."""
    chain, at, number = execution_id.rpartition("@")
    if not at or not chain or not number.isdigit() or number.startswith("0"):
        return None
    return chain, int(number)
