"""One reader's plan: :func:`plan` (its ranges as a list), :func:`plan_intervals` (by
position in its rank's chunk, as resuming asks) and :func:`plan_whole_shards`
(whole shards, when some record count is unknown).

Each checks its arguments, takes the rank's chunk of the stream
(:func:`~shardkit.planning.intervals.rank_span`) and the worker's part of it
(:func:`~shardkit.planning.intervals.worker_span`), and reads the ranges off
the :class:`~shardkit.planning.stream.Stream`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from shardkit.arrays import int64_values, valid_mask
from shardkit.errors import check_int
from shardkit.planning.intervals import BALANCES, Balance, PlanError, rank_span, through, worker_span
from shardkit.planning.ranges import PlannedRanges, Range, WholeShards
from shardkit.planning.stream import Stream
from shardkit.topology import Topology

if TYPE_CHECKING:
    import pyarrow

RecordCounts = Union[np.ndarray, Sequence[Union[int, None]], "pyarrow.Array", "pyarrow.ChunkedArray"]


def plan(
    num_records: RecordCounts,
    topology: Topology,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = False,
    balance: Balance = "pad",
    block_size: int | None = None,
) -> list[Range]:
    """The record ranges one (rank, worker) reads, in reading order.

    Args:
        num_records: the record count of every shard, in shard order. Unknown
            counts (None, or nulls in a pyarrow array) are accepted with
            ``balance="none"`` only: whole shards are then dealt out.
        topology: the reader whose part to return; see :meth:`Topology.current`.
        seed, epoch: select the permutation when ``shuffle`` is true.
        shuffle: permute the shards (and the blocks of large shards).
        block_size: with ``shuffle``, cut shards into blocks of at most this
            many records (default: about ``N / (8 * world_size)``).
        balance: ``"none"`` (every record exactly once), ``"pad"`` (every rank
            reads ``ceil(N / world_size)`` records, repeating a few) or
            ``"drop"`` (every rank reads ``floor(N / world_size)``).

    Raises:
        PlanError: on negative counts, unknown counts with ``"pad"``/``"drop"``,
            a balance that would leave every rank empty, or bad arguments.

    Example:
        Three shards of 100, 50 and 30 records over 2 ranks: each rank reads
        90 records; rank 1 starts inside shard 0.

        >>> from shardkit import Topology, plan
        >>> plan([100, 50, 30], Topology(rank=1, world_size=2))
        [Range(shard=0, start=90, stop=100), Range(shard=1, start=0, stop=50), Range(shard=2, start=0, stop=30)]
        >>> plan([100, 50, 30], Topology(rank=0, world_size=2, worker_id=1, num_workers=2))
        [Range(shard=0, start=45, stop=90)]

        11 records over 2 ranks: ``"pad"`` repeats one record so both read 6.

        >>> [sum(r.stop - r.start for r in plan([5, 5, 1], Topology(rank, 2), balance="pad")) for rank in (0, 1)]
        [6, 6]
    """
    _check_arguments(topology, seed, epoch, balance)
    counts, known = _normalise_counts(num_records)
    if not known:
        if balance != "none":
            raise PlanError(
                f"balance={balance!r} needs the record count of every shard, but "
                f"{int(np.count_nonzero(counts < 0))} of {len(counts)} shards have no count. "
                "Give counts (ShardList(urls, num_records=...), a manifest written by "
                "ShardWriter, or index files from `shardkit index`), count them with a "
                "scanning pass, or use balance='none', which deals out whole shards."
            )
        whole = _deal_whole_shards(counts, topology, seed=seed, epoch=epoch, shuffle=shuffle)
        return whole.ranges_in(slice(None))
    total = int(counts.sum())
    rank_start, rank_size = rank_span(total, topology.world_size, topology.rank, balance)
    worker_offset, worker_size = worker_span(rank_size, topology.num_workers, topology.worker_id)
    if worker_size == 0:
        return []
    stream = Stream.build(
        counts, seed=seed, epoch=epoch, shuffle=shuffle, world_size=topology.world_size, block_size=block_size
    )
    start = rank_start + worker_offset
    return stream.ranges(start, start + worker_size)


def plan_whole_shards(
    num_records: RecordCounts, topology: Topology, *, seed: int = 0, epoch: int = 0, shuffle: bool = False
) -> WholeShards:
    """Whole shards for one reader, as :func:`plan` deals them out when some record count is unknown.

    The shards with a count other than 0 (shuffled with ``(seed, epoch)``
    when ``shuffle``) are dealt round the ranks, then round the rank's
    workers. The result is a :class:`WholeShards`: ``(None, Range)`` pairs
    kept as two numpy arrays, so planning a million shards makes no Python
    object per shard; ``plan()`` returns the same ranges as a list.

    Example:
        >>> from shardkit import Topology
        >>> whole = plan_whole_shards([None, 5, 0, None], Topology(rank=0, world_size=2))
        >>> whole.ranges[:]
        [Range(shard=0, start=0, stop=None), Range(shard=3, start=0, stop=None)]
    """
    _check_arguments(topology, seed, epoch, "none")
    counts, _ = _normalise_counts(num_records)
    return _deal_whole_shards(counts, topology, seed=seed, epoch=epoch, shuffle=shuffle)


def plan_intervals(
    num_records: RecordCounts,
    topology: Topology,
    intervals: Sequence[tuple[int, int]],
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = False,
    balance: Balance = "pad",
    block_size: int | None = None,
    chunk: Sequence[tuple[int, int]] | None = None,
    stream_world_size: int | None = None,
) -> PlannedRanges:
    """The ranges holding positions ``intervals`` of this rank's chunk, in order.

    Positions count records from the start of rank ``topology.rank``'s chunk
    (``0 <= position < rank_span(...)[1]``), which does not depend on the number
    of workers: resuming uses them to say what is left of an epoch. Each range
    comes with the chunk position of its first record. The worker fields of
    ``topology`` are not used; every record count must be known.

    After a resume on another world size the chunk is not the plan's: then
    ``chunk`` gives it as intervals of global stream positions (see
    :func:`split_remaining`), and ``stream_world_size`` the world size the
    epoch's stream was planned for (its blocks depend on it).

    The result is a :class:`PlannedRanges`: a sequence of ``(position,
    Range)`` pairs kept as four numpy arrays, so planning a million shards
    makes no Python object per shard.

    Raises:
        PlanError: on unknown counts, intervals outside the chunk, or the
            errors of :func:`plan`.
    """
    _check_arguments(topology, seed, epoch, balance)
    counts, known = _normalise_counts(num_records)
    if not known:
        raise PlanError(
            "planning by position needs the record count of every shard; give counts "
            "(a manifest, index files) or call count_records() on the dataset"
        )
    total = int(counts.sum())
    if chunk is None:
        rank_start, rank_size = rank_span(total, topology.world_size, topology.rank, balance)
        chunk = [(rank_start, rank_start + rank_size)]
    rank_size = sum(stop - start for start, stop in chunk)
    world_size = topology.world_size if stream_world_size is None else stream_world_size
    stream = Stream.build(counts, seed=seed, epoch=epoch, shuffle=shuffle, world_size=world_size, block_size=block_size)
    parts: list[tuple[np.ndarray, ...]] = []
    for start, stop in intervals:
        if not 0 <= start <= stop <= rank_size:
            raise PlanError(f"interval [{start}, {stop}) is outside this rank's chunk of {rank_size} records")
        pieces = [stream.range_arrays(a, b) for a, b in through(chunk, start, stop)]
        if pieces:
            shard, first, last = (np.concatenate(column) for column in zip(*pieces))
            position = start + np.cumsum(last - first) - (last - first)  # each piece's first record
            parts.append((position, shard, first, last))
    return PlannedRanges(*(np.concatenate(column) for column in zip(*parts))) if parts else PlannedRanges.empty()


def _deal_whole_shards(counts: np.ndarray, topology: Topology, *, seed: int, epoch: int, shuffle: bool) -> WholeShards:
    candidates = np.flatnonzero(counts != 0)
    order = np.random.default_rng([seed, epoch]).permutation(candidates) if shuffle else candidates
    mine = order[topology.rank :: topology.world_size][topology.worker_id :: topology.num_workers]
    return WholeShards(mine.astype(np.int64, copy=False), counts[mine].astype(np.int64, copy=False))


def _normalise_counts(num_records: RecordCounts) -> tuple[np.ndarray, bool]:
    """An int64 array with -1 for unknown counts, and whether all are known."""
    if hasattr(num_records, "to_numpy") and hasattr(num_records, "null_count"):  # pyarrow
        column: Any = num_records
        known_mask, values = valid_mask(column), int64_values(column, -1)
    elif isinstance(num_records, np.ndarray):
        values, known_mask = num_records, None
    else:
        items = list(num_records)
        known_mask = np.array([v is not None for v in items], dtype=bool)
        values = np.array([-1 if v is None else v for v in items])
    values = np.asarray(values)
    if values.ndim != 1:
        raise PlanError(f"num_records must be one-dimensional, got shape {values.shape}")
    if values.size and not np.issubdtype(values.dtype, np.integer):
        if not np.all(np.isfinite(values)) or not np.all(values == np.floor(values)):
            raise PlanError("num_records must hold whole numbers of records")
    counts = values.astype(np.int64, copy=False)
    if known_mask is None:
        known_mask = np.ones(len(counts), dtype=bool)
    negative = np.flatnonzero((counts < 0) & known_mask)
    if len(negative):
        i = int(negative[0])
        raise PlanError(f"num_records[{i}] is {int(counts[i])}: record counts cannot be negative")
    counts = np.where(known_mask, counts, -1)
    return counts, bool(known_mask.all())


def _check_arguments(topology: Topology, seed: int, epoch: int, balance: str) -> None:
    if not isinstance(topology, Topology):
        raise PlanError(f"topology must be a shardkit.Topology, got {type(topology).__name__}")
    if balance not in BALANCES:
        raise PlanError(f"balance must be one of {BALANCES}, got {balance!r}")
    for name, value in (("seed", seed), ("epoch", epoch)):
        check_int(name, int(value) if isinstance(value, np.integer) else value, minimum=0, error=PlanError)
