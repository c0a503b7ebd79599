"""Exceptions raised by shardkit."""

from __future__ import annotations


class ShardkitError(Exception):
    """Base class of every error shardkit raises on purpose."""


class CorruptRecordError(ShardkitError):
    """A shard's bytes do not match their framing or checksums.

    The message names the url, the record index, the byte offset and the check
    that failed; the same facts are kept as attributes.
    """

    def __init__(self, url: str, record_index: int, offset: int, reason: str) -> None:
        self.url = url
        self.record_index = record_index
        self.offset = offset
        self.reason = reason
        super().__init__(f"{url}: record {record_index} at byte offset {offset}: {reason}")
