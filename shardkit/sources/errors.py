"""What sources raise, and the messages of the counts they refuse to make up.

:class:`DatasetError` is an argument a source cannot work with; :class:`BalanceError` is
``balance="pad"``/``"drop"`` under ``on_error="skip"`` with nothing sound to stand in for
skipped records, or a record count too far from the file to make up (:data:`MADE_UP_MISSING`).
The message builders live here, beside the allowance they quote, so that every reader of a
range words the same refusal the same way.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from shardkit.errors import CorruptRecordError, ShardkitError, redact, redact_url
from shardkit.formats.base import MAX_EXPANSION, RecordBound
from shardkit.stateful import StateError


class DatasetError(ShardkitError, ValueError):
    """A source was given arguments it cannot work with."""


class BalanceError(ShardkitError, RuntimeError):
    """Records were skipped under ``on_error="skip"`` and nothing readable is left to stand in for them."""


MADE_UP_MISSING: Final = 4096
"""Records a range may lack, beyond the ones it read, and still be made up under ``"pad"``/``"drop"``.

A shard that ends cleanly short of its planned count is a sound file its count does not describe. A few
records short is damage or a stale count, and repeats keep the ranks in step; a count far above the
records there (``num_records=10**12`` on 5) would have the readers repeat stand-ins practically without
end, so past this allowance the count is taken as wrong (:class:`BalanceError`). So is a count above what
the file's size can hold (:func:`~shardkit.formats.base.max_records`) when the framing breaks and the rest
of the range is lost. Made-up samples are then bounded by ``max(MADE_UP_MISSING, records read)`` per
range whatever the count says, except for an honest count (within its file's bound, or a format with none)
on a shard whose framing breaks early: that range is made up to its end, as the contract says."""


def _unknown_counts(owner: object) -> StateError:
    return StateError(
        f"{owner!r}: resuming needs the record count of every shard, and some are unknown; "
        "call count_records() (or give counts: a manifest, index files) before iterating"
    )


def _count_taken_as_wrong(
    error: CorruptRecordError, missing: int, read: int, exceeded: _Exceeded | None = None
) -> BalanceError:
    """The error that stops ``"pad"``/``"drop"`` from making up ``missing`` records a count lies about
    (``exceeded``: the count is also more than the file's size can hold, which the message adds)."""
    beyond = "" if exceeded is None else f"; {_beyond_size(exceeded)}"
    return BalanceError(
        f"{_plain_message(error)}{beyond}. Making up {missing} records in their place (on_error='skip') would repeat "
        f"stand-ins far past the {read} records this range read (the allowance is {MADE_UP_MISSING}), so the "
        "count is taken as wrong: fix the manifest or num_records=, or recount (count_records(), "
        "shardkit index URL)"
    )


class _Exceeded(NamedTuple):
    """A planned count above the :class:`~shardkit.formats.base.RecordBound` of its file, and the
    ``lost`` records of a range that were to be made up for it."""

    planned: int
    bound: RecordBound
    lost: int


def _beyond_size(exceeded: _Exceeded) -> str:
    """The count, the file's size and the most records that size can hold, in words."""
    size, compression, most = exceeded.bound
    inflated = "" if compression is None else f" ({compression}, inflating up to {MAX_EXPANSION[compression]}:1)"
    return (
        f"its record count says {exceeded.planned}, but a file of {size} bytes{inflated} holds at most {most} records"
    )


def _count_beyond_size(url: str, exceeded: _Exceeded) -> BalanceError:
    """The error that stops ``"pad"``/``"drop"`` from making up the lost rest of a range after the
    framing broke, when the count is more than the file can hold (see :func:`~shardkit.formats.base.max_records`)."""
    return BalanceError(
        f"{redact_url(url)}: {_beyond_size(exceeded)}, so the count is taken as wrong. Making up the {exceeded.lost} "
        f"records of this range it lost (on_error='skip') would repeat stand-ins far past the allowance "
        f"({MADE_UP_MISSING}): fix the manifest or num_records=, or recount (count_records(), shardkit index URL)"
    )


def _plain_message(error: Exception) -> str:
    """The error's message without the details line a DataLoader worker adds to a CorruptRecordError."""
    return redact(str(error.args[0]) if isinstance(error, CorruptRecordError) and error.args else str(error))
