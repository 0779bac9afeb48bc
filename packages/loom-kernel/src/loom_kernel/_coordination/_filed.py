"""The run index's batches of ended runs, decoded for a listing.

A listing of 100,000 ended runs reads 100,000 entries. Where msgspec is installed (the
kernel's `fast` extra) a batch is decoded and checked in one typed call, several times
quicker than parsing it and checking each entry by hand. The typed decoder accepts
only what the checks by hand accept, so a batch it refuses is handed back (None) to
the general path, which accepts it or names the damage exactly as without msgspec.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Protocol

__all__ = ["Filed", "decode_filed"]


class Filed(Protocol):
    """An entry of a batch: an ended run as the index filed it. A field the entry did
    not hold is None (its generation: 1; when it was closed: NaN, a value JSON cannot
    hold, for the batch's own time)."""

    @property
    def id(self) -> str: ...
    @property
    def flow(self) -> str: ...
    @property
    def at(self) -> float: ...
    @property
    def generation(self) -> int: ...
    @property
    def started(self) -> float | None: ...
    @property
    def parent(self) -> str | None: ...


#: The entries of a batch's JSON, or None where the general path must judge it.
decode_filed: Callable[[bytes], Sequence[Filed] | None]

try:
    import msgspec
except ImportError:  # pragma: no cover - the kernel alone does not install it

    def decode_filed(payload: bytes) -> Sequence[Filed] | None:
        return None

else:
    # gc=False: read once per listing and dropped; they hold no containers.
    class _Filed(msgspec.Struct, array_like=True, gc=False):
        id: str
        flow: str
        at: float = math.nan
        generation: Annotated[int, msgspec.Meta(ge=1)] = 1
        started: float | None = None
        parent: str | None = None

    class _Batch(msgspec.Struct, gc=False):
        runs: list[_Filed]

    _decode_batch: Callable[[bytes], Any] = msgspec.json.Decoder(_Batch).decode

    def decode_filed(payload: bytes) -> Sequence[Filed] | None:
        try:
            entries: Sequence[Filed] = _decode_batch(payload).runs
        except msgspec.DecodeError:
            return None
        return entries
