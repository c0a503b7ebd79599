"""Exceptions raised by shardkit."""

from __future__ import annotations


class ShardkitError(Exception):
    """Base class of every error shardkit raises on purpose."""


class CorruptRecordError(ShardkitError):
    """A shard's bytes do not match their framing or checksums.

    The message names the url, the record index, the byte offset and the check
    that failed; the same facts are kept as attributes. ``framing_intact`` is
    true when only this record's data is bad and the records after it can
    still be found (a data checksum mismatch), false when the framing itself is
    lost (a bad length, a truncated file).
    """

    def __init__(
        self, url: str, record_index: int = -1, offset: int = -1, reason: str = "", *, framing_intact: bool = False
    ) -> None:
        self.url = url
        self.record_index = record_index
        self.offset = offset
        self.reason = reason
        self.framing_intact = framing_intact
        if not reason:  # re-raised by DataLoader from a worker, which passes the message alone
            super().__init__(url)
            return
        super().__init__(f"{url}: record {record_index} at byte offset {offset}: {reason}")

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_corrupt_record_error,
            (self.url, self.record_index, self.offset, self.reason, self.framing_intact),
        )


def _rebuild_corrupt_record_error(
    url: str, record_index: int, offset: int, reason: str, framing_intact: bool
) -> CorruptRecordError:
    return CorruptRecordError(url, record_index, offset, reason, framing_intact=framing_intact)
