"""Records a stage holds, saved as their positions and read again on restore.

A record of a planned source is named by its *position*: the shard's index and
the record's index in it, packed into one int (:func:`pack`: the shard in the
high bits, the record in the low :data:`RECORD_BITS`), which is what an
iterator's ``position`` attribute gives for the item it returned last. A
stage that holds items between steps (a ``.shuffle(n)`` buffer, MixedLoader's
undelivered micro-batch tails) keeps their positions beside them in a numpy
array and saves that array (:func:`encode_positions`: two int32 or int64
columns, shard and record, base64 through the codec: about 11 bytes per held
record), not the items. On restore the items are made again from their
positions by the pipeline's :class:`Records`: the source reads each record
again by index through its format's range read, a ``.map`` applies its ``fn``
again (with the same :func:`~shardkit.seeding.record_seed`), a ``.filter``
checks that the record still passes. So a map's output must be a function of
its input and that seed; see :mod:`shardkit.pipeline.mapping` for what is
detected when it is not.

The re-read records must be the ones that were read: a state holding
positions also holds a short digest of the identity (size, mtime, inode,
ETag...: :func:`shardkit.io.identity.identity`) of each shard its positions
name (:func:`held_identities`), and a restore refuses a shard whose identity
changed (:func:`check_identities`). A file system that reports no identity
beyond the size is not checked (nothing binds to such a file anywhere in
shardkit).

Held records that mostly follow one another in their shards (MixedLoader's
undelivered micro-batches over a pipeline without a shuffle buffer) are
smaller as *runs* (:func:`encode_runs`: an ``[k, 3]`` array of (shard, first
record, length)), a few bytes a run whatever its length.

Where items cannot be read again (a wrapped plain iterable, a ``.batch``,
``interleave`` or ``.pack`` below the holding stage, column batches) the
stage keeps the data form: the items themselves, encoded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardkit.errors import StateError
from shardkit.stateful.codec import decode, encode, short

#: Bits of a packed position that hold the record index (the shard index is above them).
RECORD_BITS = 32
_RECORD_MASK = (1 << RECORD_BITS) - 1
#: The largest record index a position holds; a shard with more records keeps the data form.
MAX_RECORD = _RECORD_MASK
_INT32_MAX = 2**31 - 1


def pack(shard: int, record: int) -> int:
    """One int naming record ``record`` of shard ``shard``."""
    return (shard << RECORD_BITS) | record


def unpack(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The shard and record index of each packed position."""
    positions = np.asarray(positions, dtype=np.int64)
    return positions >> RECORD_BITS, positions & _RECORD_MASK


class Records:
    """How the items of a pipeline are made again from the positions of their records.

    The source's implementation reads records by index; each stage above it
    that keeps one item per record (``.map``, ``.filter``, ``.shuffle``)
    wraps its input's. ``Pipeline.records()`` returns None where items
    cannot be made again.
    """

    def fetch(self, positions: np.ndarray) -> list[Any]:
        """The items at ``positions`` (packed, :func:`pack`), in that order.

        Raises:
            StateError: a record cannot be read as it was (missing, now corrupt,
                or an item a stage above no longer makes).
        """
        raise NotImplementedError

    def shard_identity(self, shard: int) -> tuple[str, str | None]:
        """The url of shard ``shard`` and the identity of its file now (None: none known)."""
        raise NotImplementedError


def encode_positions(positions: np.ndarray) -> Any:
    """Packed positions as plain data: an ``[n, 2]`` array of (shard, record), int32 where they fit."""
    shards, records = unpack(positions)
    table = np.stack([shards, records], axis=1) if len(positions) else np.zeros((0, 2), np.int64)
    fits = not len(positions) or int(table.max()) <= _INT32_MAX
    return encode(table.astype("<i4" if fits else "<i8"))


def decode_positions(data: Any, where: str) -> np.ndarray:
    """The packed positions :func:`encode_positions` made ``data`` from.

    Raises:
        StateError: ``data`` is not an ``[n, 2]`` array of non-negative ints with records below 2**32.
    """
    table = _int_table(data, "positions", ("shard", "record"), "n", where)
    if len(table) and (int(table.min()) < 0 or int(table[:, 1].max()) > MAX_RECORD or int(table[:, 0].max()) >= 2**31):
        raise StateError(f"{where}: state['positions'] holds a negative or out-of-range shard or record index")
    return (table[:, 0] << RECORD_BITS) | table[:, 1]


def _int_table(data: Any, key: str, columns: tuple[str, ...], rows: str, where: str) -> np.ndarray:
    """``state[key]`` decoded as an int64 table of one column per name in ``columns`` (``rows`` names
    its row count in the message), or a StateError naming the key."""
    try:
        table = decode(data)
    except StateError as error:
        raise StateError(f"{where}: state['{key}'] is not an encoded array of {key}: {error}") from None
    if (
        type(table) is not np.ndarray
        or table.ndim != 2
        or table.shape[1] != len(columns)
        or table.dtype.kind not in "iu"
    ):
        raise StateError(
            f"{where}: state['{key}'] must be an [{rows}, {len(columns)}] integer array of ({', '.join(columns)}), "
            f"got {short(table)}"
        )
    return table.astype(np.int64)


def encode_runs(positions: np.ndarray) -> Any | None:
    """Packed positions as runs of consecutive records of one shard: an ``[k, 3]`` array of
    (shard, first record, length), int32 where they fit; None where that is not smaller than
    :func:`encode_positions` (more runs than two thirds of the positions)."""
    positions = np.asarray(positions, dtype=np.int64)
    if not len(positions):
        return None
    # A packed position + 1 is the next record of its shard, unless it is record 0 of the next shard.
    breaks = np.flatnonzero((np.diff(positions) != 1) | ((positions[1:] & _RECORD_MASK) == 0)) + 1
    if 3 * (len(breaks) + 1) >= 2 * len(positions):
        return None
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [len(positions)]]))
    shards, firsts = unpack(positions[starts])
    table = np.stack([shards, firsts, lengths], axis=1)
    return encode(table.astype("<i4" if int(table.max()) <= _INT32_MAX else "<i8"))


def decode_runs(data: Any, count: int, where: str) -> np.ndarray:
    """The packed positions :func:`encode_runs` made ``data`` from, which must be ``count`` of them.

    Raises:
        StateError: ``data`` is not an ``[k, 3]`` array of (shard, first record, length) runs
            within the bounds of :func:`decode_positions`, or its lengths do not add up to ``count``.
    """
    table = _int_table(data, "runs", ("shard", "first record", "length"), "k", where)
    shards, firsts, lengths = table[:, 0], table[:, 1], table[:, 2]
    if len(table) and (
        int(shards.min()) < 0 or int(shards.max()) >= 2**31 or int(firsts.min()) < 0 or int(lengths.min()) < 1
    ):
        raise StateError(f"{where}: state['runs'] holds a negative shard or record, or a run shorter than 1")
    if len(table) and int((firsts + lengths).max()) - 1 > MAX_RECORD:
        raise StateError(f"{where}: state['runs'] holds a run past record {MAX_RECORD} of its shard")
    if int(lengths.sum()) != count:  # before the runs are laid out: a length is a memory size
        raise StateError(f"{where}: state['runs'] names {int(lengths.sum())} records, but 'count' is {count}")
    offsets = np.arange(count, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat((shards << RECORD_BITS) | firsts, lengths) + offsets


SHARDS = "shards"  #: key of a node's identities: the shards its positions name
DIGESTS = "digests"  #: key of a node's identities: a digest of each shard's identity ("" where none is known)


def _digest(identity: str | None) -> str:
    return "" if identity is None else hashlib.sha256(identity.encode()).hexdigest()[:16]


def held_identities(records: Records, positions: np.ndarray) -> dict[str, list[Any]]:
    """The shards ``positions`` name, with a digest of each one's identity now."""
    shards = np.unique(unpack(positions)[0]).tolist()
    return {SHARDS: shards, DIGESTS: [_digest(records.shard_identity(shard)[1]) for shard in shards]}


def check_identities(records: Records, saved: dict[str, list[Any]], owner: object) -> None:
    """Raise :class:`StateError` naming the first shard whose identity is not the one saved."""
    for shard, digest in zip(saved[SHARDS], saved[DIGESTS]):
        url, identity = records.shard_identity(shard)
        if digest and _digest(identity) != digest:
            raise StateError(
                f"{owner!r}: shard {shard} ({url}) is not the file it was when the state was saved (its size, "
                "modification time or version changed), and the state holds records of it that were read but not "
                "yet delivered, which resuming reads again. Restore the file, or start the epoch afresh"
            )


def check_identities_field(value: Any, where: str) -> dict[str, list[Any]]:
    """A loaded node's identities: ``{"shards": [int], "digests": [str]}`` of equal lengths."""
    if type(value) is not dict or set(value) != {SHARDS, DIGESTS}:
        raise StateError(f"{where}: the identities must be a dict of 'shards' and 'digests', got {short(value)}")
    shards, digests = value[SHARDS], value[DIGESTS]
    if (
        type(shards) not in (list, tuple)
        or type(digests) not in (list, tuple)
        or len(shards) != len(digests)
        or not all(type(s) is int and 0 <= s < 2**31 for s in shards)
        or not all(type(d) is str and len(d) <= 64 for d in digests)
    ):
        raise StateError(f"{where}: the identities must pair shard indices with digest strings, got {short(value)}")
    return value


def merge_identities(parts: Sequence[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """One identities field from several nodes' (a shard's digest must agree wherever it is named)."""
    found: dict[int, str] = {}
    for part in parts:
        for shard, digest in zip(part[SHARDS], part[DIGESTS]):
            if found.setdefault(shard, digest) != digest:
                raise StateError(f"cannot merge states that saw shard {shard} with different identities")
    shards = sorted(found)
    return {SHARDS: shards, DIGESTS: [found[s] for s in shards]}


__all__ = [
    "DIGESTS", "MAX_RECORD", "RECORD_BITS", "Records", "SHARDS", "check_identities", "check_identities_field",
    "decode_positions", "decode_runs", "encode_positions", "encode_runs", "held_identities", "merge_identities", "pack", "unpack",
]  # fmt: skip
