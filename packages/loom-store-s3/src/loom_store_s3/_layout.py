"""Where everything lives in the bucket: key names that keep stream-name order.

Under the store's prefix P (empty, or ending in '/'):

    P!layout.json                      the layout descriptor (format, shard count)
    P!SS/j/<stream>!R<start>           a batch of records: positions start+1 ...
    P!SS/j/<stream>!F<floor>           a trim floor marker
    P!SS/d/<stream>!                   the deleted-streams index, for listings

SS is the stream's shard (two hex digits of a hash of its name), so a store's
writes spread over several key prefixes. '!' is not an id character and sorts
below every id character, so within a shard keys sort in stream-name order, one
stream's keys never interleave with another's, and no stream id (nor any other
store's prefix) can produce a key inside this layout.
"""

from __future__ import annotations

import hashlib
from typing import Final

__all__ = ["FORMAT", "MAX_SHARDS", "Layout"]

#: The layout and batch format this code writes; a bucket from a newer one is refused.
FORMAT: Final = 1
MAX_SHARDS: Final = 256
_END: Final = "!"
_PAST_END: Final = '"'  # the character after '!': a key bound past all of one stream's keys
_POSITION_DIGITS: Final = 20  # 2**64 has 20 digits: zero-padding keeps numeric order


class Layout:
    """Key names for one store: a prefix in a bucket and a shard count."""

    def __init__(self, prefix: str, shards: int) -> None:
        self.root = prefix + _END
        self.shards = shards

    @property
    def descriptor_key(self) -> str:
        return self.root + "layout.json"

    def shard(self, stream: str) -> int:
        if self.shards == 1:
            return 0
        digest = hashlib.blake2b(stream.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") % self.shards

    def journal_root(self, shard: int) -> str:
        return f"{self.root}{shard:02x}/j/"

    def deleted_root(self, shard: int) -> str:
        return f"{self.root}{shard:02x}/d/"

    def stream_dir(self, stream: str) -> str:
        """The prefix of every key of one stream's journal."""
        return self.journal_root(self.shard(stream)) + stream + _END

    def batch_key(self, stream: str, start: int) -> str:
        return f"{self.stream_dir(stream)}R{start:0{_POSITION_DIGITS}d}"

    def floor_key(self, stream: str, floor: int) -> str:
        return f"{self.stream_dir(stream)}F{floor:0{_POSITION_DIGITS}d}"

    def deleted_key(self, stream: str) -> str:
        return self.deleted_root(self.shard(stream)) + stream + _END

    @staticmethod
    def parse_entry(stream_dir: str, key: str) -> tuple[str, int] | None:
        """('R' or 'F', number) for a key inside a stream's directory, None for others."""
        tail = key[len(stream_dir) :]
        if len(tail) != 1 + _POSITION_DIGITS or tail[0] not in "RF" or not tail[1:].isdigit():
            return None
        return tail[0], int(tail[1:])

    @staticmethod
    def name_from_prefix(root: str, common_prefix: str) -> str:
        """The stream name of a listing's common prefix '<root><name>!'."""
        return common_prefix[len(root) : -len(_END)]

    @staticmethod
    def after_stream(root: str, stream: str) -> str:
        """A StartAfter key past every key of `stream`, before any greater name's keys."""
        return root + stream + _PAST_END

    @staticmethod
    def end_marker() -> str:
        return _END
