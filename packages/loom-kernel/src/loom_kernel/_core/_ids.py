"""Stream-id rules, enforced in one place before any store sees an id."""

from __future__ import annotations

import re
from typing import Final, TypeGuard

from loom_kernel._core._errors import InvalidIdError

__all__ = [
    "ID_ALPHABET",
    "MAX_ID_LENGTH",
    "event_key_refusal",
    "has_utf8",
    "is_name",
    "validate_prefix",
    "validate_stream_id",
]

MAX_ID_LENGTH = 200
ID_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.~:@+=/"
_ALLOWED = re.compile(r"[A-Za-z0-9\-_.~:@+=/]*")


def is_name(value: object) -> TypeGuard[str]:
    """Whether `value` can be a topic, an event key or a queue key: a non-empty str of
    at most MAX_ID_LENGTH characters with a UTF-8 form (no lone surrogate), since the
    journal records it as UTF-8."""
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_LENGTH and has_utf8(value)


def has_utf8(text: str) -> bool:
    """Whether `text` has a UTF-8 form (a lone surrogate has none); str's own encode,
    whatever a subclass makes of it."""
    try:
        str.encode(text)
    except UnicodeEncodeError:
        return False
    return True


def _check_characters(value: str) -> None:
    if _ALLOWED.fullmatch(value) is None:
        bad = next(ch for ch in value if ch not in ID_ALPHABET)
        raise InvalidIdError(value, f"character {bad!r} is not allowed (allowed: {ID_ALPHABET})")


def validate_stream_id(value: object) -> str:
    """Check a stream id and return it unchanged (see `_validate_stream_id` for the rules).

    Raises:
        InvalidIdError: naming the rule the id breaks.
    """
    if type(value) is str and value in _recently_valid:
        return value
    checked = _validate_stream_id(value)
    if len(_recently_valid) >= _REMEMBERED:
        _recently_valid.clear()
    _recently_valid.add(checked)
    return checked


# The rules are pure, and every store operation checks its id, so ids seen valid
# recently are remembered (measured: checking is a fifth of an engine step's own time).
_REMEMBERED: Final = 4096
_recently_valid: set[str] = set()


def _validate_stream_id(value: object) -> str:
    """Check a stream id and return it unchanged.

    Rules: a str of 1 to MAX_ID_LENGTH characters from ID_ALPHABET; segments separated
    by '/' are never empty, '.' or '..'; no leading or trailing '/'.

    Raises:
        InvalidIdError: naming the rule the id breaks.
    """
    if not isinstance(value, str):
        raise InvalidIdError(value, f"must be a str, not {type(value).__name__}")
    if not value:
        raise InvalidIdError(value, "must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidIdError(value, f"longer than {MAX_ID_LENGTH} characters")
    _check_characters(value)
    if value.startswith("/"):
        raise InvalidIdError(value, "must not start with '/'")
    for segment in value.split("/"):
        if segment == "":
            raise InvalidIdError(value, "has an empty segment ('//' or a trailing '/')")
        if segment in (".", ".."):
            raise InvalidIdError(value, f"has a {segment!r} segment")
    return value


def validate_prefix(value: object) -> str:
    """Check a listing prefix: empty, or a leading part of some valid stream id.

    A prefix may end with '/' or stop inside a segment; it follows the same charset,
    length and segment rules for its complete segments.

    Raises:
        InvalidIdError: naming the rule the prefix breaks.
    """
    if not isinstance(value, str):
        raise InvalidIdError(value, f"prefix must be a str, not {type(value).__name__}")
    if value == "":
        return value
    if len(value) > MAX_ID_LENGTH:
        raise InvalidIdError(value, f"prefix longer than {MAX_ID_LENGTH} characters")
    _check_characters(value)
    if value.startswith("/"):
        raise InvalidIdError(value, "prefix must not start with '/'")
    complete = value.split("/")[:-1]
    for segment in complete:
        if segment == "":
            raise InvalidIdError(value, "prefix has an empty segment ('//')")
        if segment in (".", ".."):
            raise InvalidIdError(value, f"prefix has a {segment!r} segment")
    return value


def event_key_refusal(key: object) -> str:
    """Why `key` cannot name an event (see `is_name`)."""
    return (
        f"an event key is a non-empty str of at most {MAX_ID_LENGTH} characters (UTF-8, "
        f"so no lone surrogate), not {key!r}"
    )
