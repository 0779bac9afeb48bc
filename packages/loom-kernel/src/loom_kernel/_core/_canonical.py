"""Canonical JSON (RFC 8785, JCS) and content hashes, written without recursion."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable
from json.encoder import encode_basestring
from typing import Any, Final

from loom_kernel._core._errors import CanonicalJSONError

__all__ = ["DEFAULT_MAX_DEPTH", "MAX_SAFE_INTEGER", "stable_hash", "stable_stringify"]

DEFAULT_MAX_DEPTH: Final = 1000
MAX_SAFE_INTEGER: Final = 2**53 - 1

_quote: Callable[[str], str] = encode_basestring
_SURROGATE = re.compile("[\ud800-\udfff]")

# A path is a linked list (parent, key) built only as deep as the walk goes,
# and turned into text only when an error needs it.
_Path = tuple["_Path", str | int] | None

_EMIT: Final = 0
_VALUE: Final = 1
_LEAVE: Final = 2


def _render_path(path: _Path) -> str:
    keys: list[str | int] = []
    while path is not None:
        path, key = path
        keys.append(key)
    text = "$"
    for key in reversed(keys):
        text += f"[{key}]" if isinstance(key, int) else f"[{_quote(key)}]"
    return text


def _format_float(value: float) -> str:
    """Format a finite float as ECMAScript's Number.prototype.toString does."""
    if value == 0:
        return "0"
    if value.is_integer() and abs(value) <= MAX_SAFE_INTEGER:
        return str(int(value))
    sign = "-" if value < 0 else ""
    text = repr(abs(value))  # shortest round-trip digits, as ECMAScript requires
    mantissa, _, exponent = text.partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0").rstrip("0")
    # value = 0.<digits> x 10**point
    shift = int(exponent) if exponent else 0
    if whole == "0":
        point = shift - (len(fraction) - len(fraction.lstrip("0")))
    else:
        point = shift + len(whole)
    count = len(digits)
    if count <= point <= 21:
        return sign + digits + "0" * (point - count)
    if 0 < point <= 21:
        return sign + digits[:point] + "." + digits[point:]
    if -6 < point <= 0:
        return sign + "0." + "0" * (-point) + digits
    exp = point - 1
    exp_text = f"e+{exp}" if exp >= 0 else f"e-{-exp}"
    if count == 1:
        return sign + digits + exp_text
    return sign + digits[0] + "." + digits[1:] + exp_text


def _format_int(value: int, path: _Path) -> str:
    """Write an int as the double JSON readers will take it for, if that loses nothing.

    JSON numbers are IEEE-754 doubles (RFC 8785 3.2.2.3). Beyond 2**53 an int is
    accepted only when the double's canonical text is the int's own digits, so the
    text reads back as the same int and re-canonicalising it gives the same bytes.
    """
    text = str(value)
    if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
        return text
    try:
        as_double = _format_float(float(value))
    except OverflowError:
        as_double = None
    if as_double != text:
        raise CanonicalJSONError(
            _render_path(path),
            f"integer {value} has no IEEE-754 double with the same digits; store it as a string",
        )
    return text


def _format_string(value: str, path: _Path) -> str:
    if _SURROGATE.search(value) is not None:
        raise CanonicalJSONError(_render_path(path), "string holds a lone surrogate")
    return _quote(value)


def _utf16_key(key: str) -> bytes:
    return key.encode("utf-16-be", "surrogatepass")


def stable_stringify(value: Any, *, max_depth: int = DEFAULT_MAX_DEPTH) -> str:
    """Write a JSON value as canonical JSON (RFC 8785).

    Keys are sorted by UTF-16 code units, numbers are formatted as ECMAScript does,
    strings are minimally escaped and there is no whitespace. The walk is iterative,
    so depth is limited only by `max_depth`, never by Python's recursion limit.
    An int beyond +/-(2**53 - 1) is accepted only where a double has exactly its
    digits (2**53 and 10**21 are; 2**53 + 1 is not), since readers take numbers as doubles.

    Args:
        value: None, bool, int (see below), finite float, str, list,
            tuple or dict with str keys, nested to at most `max_depth` containers.
        max_depth: the deepest nesting of lists and dicts accepted.

    Returns:
        The canonical JSON text.

    Raises:
        CanonicalJSONError: naming the path and the reason when the value has a cycle,
            a non-finite float, an integer no double writes with the same digits, a
            non-str key, a lone surrogate, nesting deeper than `max_depth`, or
            something that is not JSON.
    """
    out: list[str] = []
    active: set[int] = set()
    stack: list[tuple[Any, ...]] = [(_VALUE, value, 0, None)]
    push = stack.append
    pop = stack.pop
    emit = out.append
    while stack:
        item = pop()
        tag = item[0]
        if tag == _EMIT:
            emit(item[1])
            continue
        if tag == _LEAVE:
            active.discard(item[1])
            continue
        _, node, depth, path = item
        if node is None:
            emit("null")
        elif node is True:
            emit("true")
        elif node is False:
            emit("false")
        elif isinstance(node, str):
            emit(_format_string(node, path))
        elif isinstance(node, int):
            emit(_format_int(node, path))
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise CanonicalJSONError(_render_path(path), f"{node!r} is not a JSON number")
            emit(_format_float(node))
        elif isinstance(node, dict | list | tuple):
            if depth >= max_depth:
                raise CanonicalJSONError(
                    _render_path(path), f"nested deeper than max_depth={max_depth}"
                )
            marker = id(node)
            if marker in active:
                raise CanonicalJSONError(_render_path(path), "the value refers to itself (a cycle)")
            active.add(marker)
            push((_LEAVE, marker))
            if isinstance(node, dict):
                _push_object(node, depth, path, push)
            else:
                _push_array(node, depth, path, push)
        else:
            raise CanonicalJSONError(
                _render_path(path), f"{type(node).__name__} is not a JSON value"
            )
    return "".join(out)


def _push_object(
    node: dict[Any, Any], depth: int, path: _Path, push: Callable[[tuple[Any, ...]], None]
) -> None:
    for key in node:
        if not isinstance(key, str):
            raise CanonicalJSONError(
                _render_path(path), f"key {key!r} is a {type(key).__name__}, not a str"
            )
    keys = sorted(node, key=_utf16_key)
    push((_EMIT, "}"))
    for index in range(len(keys) - 1, -1, -1):
        key = keys[index]
        child: _Path = (path, key)
        push((_VALUE, node[key], depth + 1, child))
        prefix = "{" if index == 0 else ","
        push((_EMIT, prefix + _format_string(key, child) + ":"))
    if not keys:
        push((_EMIT, "{"))


def _push_array(
    node: list[Any] | tuple[Any, ...],
    depth: int,
    path: _Path,
    push: Callable[[tuple[Any, ...]], None],
) -> None:
    push((_EMIT, "]"))
    for index in range(len(node) - 1, -1, -1):
        push((_VALUE, node[index], depth + 1, (path, index)))
        if index:
            push((_EMIT, ","))
    push((_EMIT, "["))


def stable_hash(value: Any, *, max_depth: int = DEFAULT_MAX_DEPTH) -> str:
    """Return ``"sha256:<hex>"`` of the value's canonical JSON, UTF-8 encoded.

    Raises:
        CanonicalJSONError: as stable_stringify does.
    """
    text = stable_stringify(value, max_depth=max_depth)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()
