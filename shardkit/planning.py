"""Who reads what: a pure plan from shard record counts to record ranges.

The plan is a function of the record counts, the :class:`~shardkit.Topology`
and ``(seed, epoch, shuffle, balance)`` only — no I/O, no global state — so
every rank and every worker computes the same global picture and takes its own
part of it without talking to the others.

How it works (all vectorised with numpy):

1. **The stream.** The shards' records are laid end to end in one global
   stream of ``N`` records. Without shuffling the shards keep their order. With
   shuffling, shards larger than a *block* (about ``N / (8 * world_size)``
   records) are cut into blocks, and the blocks are permuted with a generator
   seeded from ``(seed, epoch)``: identical on every rank, different each
   epoch, and long contiguous ranges stay long.
2. **Ranks.** Rank ``r`` gets a contiguous chunk of the stream. ``"none"``
   splits ``N`` as evenly as possible; ``"pad"`` gives every rank
   ``ceil(N / R)`` records, wrapping round to the start of the stream for the
   few (fewer than ``R``) missing ones, as ``DistributedSampler`` does;
   ``"drop"`` gives every rank ``floor(N / R)`` and leaves out the last
   ``N mod R`` records of the stream.
3. **Workers.** Each rank's chunk is split evenly over its workers, worker
   ``w`` getting ``C // W + (w < C % W)`` records. Under ``"pad"`` and
   ``"drop"`` every rank has the same ``C``, so worker ``w`` reads the same
   number of records on every rank, and so emits the same number of batches —
   the condition for DDP not to hang at the end of an epoch.

A shard is therefore split only where a reader's span begins or ends inside
it (or, when shuffling, into blocks): whole shards and long sequential reads
are the rule, and no reader is left empty while there are records for it.

**Sample-level shuffling** (what the datasets' ``shuffle=True`` does) takes
two more steps. The plan is called with ``block_size=SHUFFLE_BLOCK``: blocks
are at most that many records, so each reader's part of the stream is a run
of many small blocks from all over the dataset (the stream still depends on
the world size only, never on the number of workers). The reader then
cuts its part into windows of ``SHUFFLE_WINDOW`` consecutive positions,
reads a window sequentially (one sequential read per block) and yields it
in the order :func:`window_order` gives, seeded from ``(seed, epoch, rank,
first position of the window)``. A window holds about ``window / block``
blocks from random places, so neighbours in the output are rarely from the
same block (measured on 32 x 4,096 records: 0.05% of neighbours adjacent in
storage, jump entropy 0.97 of a uniform permutation's, 0.96x the throughput
of ``shuffle=False``; see ``benchmarks/shuffle.py``). Smaller blocks shuffle
better but cost one more read each (an open and an index lookup); a larger
window shuffles better but holds more samples. Memory: one window of samples per reader.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Union, overload

import numpy as np

from shardkit.errors import ShardkitError, check_int
from shardkit.topology import Topology

if TYPE_CHECKING:
    import pyarrow

Balance = Literal["none", "pad", "drop"]
BALANCES: tuple[str, ...] = ("none", "pad", "drop")

#: With shuffling, shards are cut into blocks of about ``N / (BLOCKS_PER_RANK * R)``
#: records so that the pieces of a few large shards are dealt out at random too.
BLOCKS_PER_RANK = 8

#: Largest block (records) when the datasets shuffle samples: small enough that a
#: window holds blocks from many places, large enough that a block is a sequential read.
SHUFFLE_BLOCK = 512

#: Records a reader gathers and permutes at once when the datasets shuffle samples:
#: the memory cost of ``shuffle=True`` is this many samples per reader.
SHUFFLE_WINDOW = 4096

_BATCH = 4096  # ranges converted to Python objects at a time when a plan is iterated

RecordCounts = Union[np.ndarray, Sequence[Union[int, None]], "pyarrow.Array", "pyarrow.ChunkedArray"]


class PlanError(ShardkitError, ValueError):
    """The plan's inputs cannot give a correct plan; the message says why and what to do."""


class Range(NamedTuple):
    """Records ``[start, stop)`` of shard ``shard``.

    ``stop`` is None only when the shard's record count is unknown (the plan
    then hands out whole shards): read the shard to its end.

    Example:
        >>> from shardkit import Range
        >>> shard, start, stop = Range(shard=2, start=0, stop=30)
        >>> stop - start
        30
    """

    shard: int
    start: int
    stop: int | None


_EMPTY = np.zeros(0, np.int64)


class PlannedRanges(Sequence[tuple[int, Range]]):
    """What :func:`plan_intervals` returns: ``(position, Range)`` pairs held as four int64 arrays.

    Reading a million shards' plan as Python objects took seconds (a Range
    per shard per reader); the arrays are built in milliseconds, and an item
    is made only when it is asked for. ``plan.positions[i]`` and
    ``plan.ranges[i]`` index the columns alone; iterating yields pairs, so it
    reads like the list it replaces.
    """

    __slots__ = ("first", "position", "shard", "stop")

    def __init__(self, position: np.ndarray, shard: np.ndarray, first: np.ndarray, stop: np.ndarray) -> None:
        self.position, self.shard, self.first, self.stop = position, shard, first, stop

    @classmethod
    def empty(cls) -> PlannedRanges:
        return cls(_EMPTY, _EMPTY, _EMPTY, _EMPTY)

    def __len__(self) -> int:
        return len(self.shard)

    @overload
    def __getitem__(self, index: int) -> tuple[int, Range]: ...

    @overload
    def __getitem__(self, index: slice) -> PlannedRanges: ...

    def __getitem__(self, index: int | slice) -> tuple[int, Range] | PlannedRanges:
        if isinstance(index, slice):
            return PlannedRanges(self.position[index], self.shard[index], self.first[index], self.stop[index])
        return int(self.position[index]), self.ranges[index]

    def __iter__(self) -> Iterator[tuple[int, Range]]:
        for begin in range(0, len(self), _BATCH):  # converted a batch at a time: one C loop per column
            chunk = slice(begin, begin + _BATCH)
            columns = (self.shard[chunk].tolist(), self.first[chunk].tolist(), self.stop[chunk].tolist())
            yield from zip(self.position[chunk].tolist(), itertools.starmap(Range, zip(*columns)))

    def __repr__(self) -> str:
        return f"PlannedRanges({len(self)} ranges)"

    def range_at(self, index: int) -> Range:
        return Range(int(self.shard[index]), int(self.first[index]), int(self.stop[index]))

    def ranges_in(self, index: slice) -> list[Range]:
        columns = (self.shard[index].tolist(), self.first[index].tolist(), self.stop[index].tolist())
        return list(itertools.starmap(Range, zip(*columns)))

    def remaining(self, index: int, done: int) -> list[tuple[int, int]]:
        """The positions of ranges ``index:`` not read yet, ``done`` records of range ``index`` being read,
        as :func:`union` gives them: what a reader's state saves, without a Python object per range."""
        start = self.position[index:].copy()
        if len(start):
            start[0] += done
        stop = self.position[index:] + (self.stop[index:] - self.first[index:])
        return _union_arrays(start, stop)

    @property
    def positions(self) -> Sequence[int]:
        """The chunk position of each range's first record, indexed lazily."""
        return _Column(self.position)

    @property
    def ranges(self) -> Sequence[Range]:
        """The ranges alone, indexed lazily (a slice is a list)."""
        return _RangeColumn(self)


def _union_arrays(start: np.ndarray, stop: np.ndarray) -> list[tuple[int, int]]:
    """:func:`union` of the intervals ``[start[i], stop[i])``, vectorised."""
    keep = stop > start
    start, stop = start[keep], stop[keep]
    if not len(start):
        return []
    order = np.argsort(start, kind="stable")
    start, stop = start[order], np.maximum.accumulate(stop[order])
    new = np.ones(len(start), dtype=bool)
    new[1:] = start[1:] > stop[:-1]  # touching or overlapping intervals join, as union() joins them
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(start)) - 1
    return list(zip(start[first].tolist(), stop[last].tolist()))


class _Column(Sequence[int]):
    """A read-only int64 array seen as a sequence of Python ints."""

    __slots__ = ("_values",)

    def __init__(self, values: np.ndarray) -> None:
        self._values = values

    def __len__(self) -> int:
        return len(self._values)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._values[index].tolist() if isinstance(index, slice) else int(self._values[index])


class _RangeColumn(Sequence[Range]):
    """The ranges of a :class:`PlannedRanges` or :class:`WholeShards`, made one at a time when indexed."""

    __slots__ = ("_plan",)

    def __init__(self, plan: PlannedRanges | WholeShards) -> None:
        self._plan = plan

    def __len__(self) -> int:
        return len(self._plan)

    @overload
    def __getitem__(self, index: int) -> Range: ...

    @overload
    def __getitem__(self, index: slice) -> list[Range]: ...

    def __getitem__(self, index: int | slice) -> Range | list[Range]:
        if isinstance(index, slice):  # a reader's look-ahead: a few ranges, once per range
            return self._plan.ranges_in(index)
        return self._plan.range_at(index)


class WholeShards(Sequence[tuple[None, Range]]):
    """What :func:`plan_whole_shards` returns: ``(None, Range(shard, 0, count))`` pairs held as two int64 arrays.

    The plan when some record count is unknown: whole shards, read to their
    end (``stop`` None where the count is unknown, -1 in ``counts``). There are
    no positions without counts, hence the None. As :class:`PlannedRanges`,
    an item is made only when it is asked for: a million shards take
    milliseconds to plan, not the seconds a Range per shard took.
    """

    __slots__ = ("counts", "shard")

    def __init__(self, shard: np.ndarray, counts: np.ndarray) -> None:
        self.shard, self.counts = shard, counts

    def __len__(self) -> int:
        return len(self.shard)

    @overload
    def __getitem__(self, index: int) -> tuple[None, Range]: ...

    @overload
    def __getitem__(self, index: slice) -> WholeShards: ...

    def __getitem__(self, index: int | slice) -> tuple[None, Range] | WholeShards:
        if isinstance(index, slice):
            return WholeShards(self.shard[index], self.counts[index])
        return None, self.range_at(index)

    def __iter__(self) -> Iterator[tuple[None, Range]]:
        for begin in range(0, len(self), _BATCH):
            yield from zip(itertools.repeat(None), self.ranges_in(slice(begin, begin + _BATCH)))

    def __repr__(self) -> str:
        return f"WholeShards({len(self)} shards)"

    def range_at(self, index: int) -> Range:
        count = int(self.counts[index])
        return Range(int(self.shard[index]), 0, None if count < 0 else count)

    def ranges_in(self, index: slice) -> list[Range]:
        counts = [None if c < 0 else c for c in self.counts[index].tolist()]
        return list(map(Range, self.shard[index].tolist(), itertools.repeat(0), counts))

    @property
    def positions(self) -> Sequence[None]:
        """No positions without counts: None for every range."""
        return [None] * len(self)

    @property
    def ranges(self) -> Sequence[Range]:
        """The ranges alone, indexed lazily (a slice is a list)."""
        return _RangeColumn(self)


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
    stream = _Stream.build(
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
    stream = _Stream.build(
        counts, seed=seed, epoch=epoch, shuffle=shuffle, world_size=world_size, block_size=block_size
    )
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


def through(chunk: Sequence[Sequence[int]], start: int, stop: int) -> list[tuple[int, int]]:
    """Positions ``[start, stop)`` of a chunk (intervals of stream positions laid end to end) as stream intervals."""
    out: list[tuple[int, int]] = []
    for a, b in chunk:
        length = b - a
        if stop <= 0:
            break
        if start < length:
            out.append((a + max(start, 0), a + min(stop, length)))
        start, stop = start - length, stop - length
    return [(a, b) for a, b in out if b > a]


def split_remaining(
    remaining: Sequence[Sequence[int]], total: int, world_size: int, rank: int, balance: Balance
) -> list[tuple[int, int]]:
    """Rank ``rank``'s part of what is left of an epoch, on a new world of ``world_size`` ranks.

    ``remaining`` are sorted, disjoint intervals of global stream positions
    (``0 <= position < total``) not delivered yet, as a gathered state holds
    them. Their ``n`` positions, in order, are split as :func:`rank_span`
    splits a stream: ``"none"`` as evenly as possible (each position once);
    ``"pad"`` ``ceil(n / world_size)`` per rank, the last ranks repeating the
    first few remaining positions; ``"drop"`` ``floor(n / world_size)`` per
    rank, leaving out the last ``n mod world_size``. A repeat is returned as
    ``position + total``, which the stream reads as the same record (it wraps)
    and a later gather knows not to owe again.

    Example:
        >>> [split_remaining([(2, 5), (8, 10)], 10, 2, r, "pad") for r in (0, 1)]
        [[(2, 5)], [(8, 10), (12, 13)]]
    """
    merged = union(remaining)
    count = sum(stop - start for start, stop in merged)
    if count == 0:
        return []
    if balance == "drop" and count < world_size:
        return []  # nothing is left that every rank could have a share of: all ranks end the epoch
    start, size = rank_span(count, world_size, rank, balance)
    out: list[tuple[int, int]] = []
    lap = 0
    while size > 0:  # under "pad" the part may wrap round to the first remaining positions
        offset = start % count if lap == 0 else 0
        for a, b in merged:
            if size == 0:
                break
            if offset >= b - a:
                offset -= b - a
                continue
            take_here = min(size, b - a - offset)
            shift = total if lap or start >= count else 0  # a repeat: past the stream's end, wrapping
            out.append((a + offset + shift, a + offset + take_here + shift))
            size -= take_here
            offset = 0
        lap += 1
    return out


def window_order(size: int, *, seed: int, epoch: int, rank: int, first: int) -> np.ndarray:
    """The order in which a reader yields a window of ``size`` records whose first
    position in rank ``rank``'s chunk is ``first``: a permutation of ``range(size)``.

    A function of the window's identity only, so a resumed reader that reads the
    window again yields it in the same order (and a state can say how much of it
    was yielded with one number).
    """
    return np.random.default_rng([seed, epoch, rank, first, 0x5348]).permutation(size)


def take(intervals: Sequence[Sequence[int]], count: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The first ``count`` positions of ``intervals`` (in order) and the rest, both as intervals."""
    head: list[tuple[int, int]] = []
    rest: list[tuple[int, int]] = []
    for start, stop in intervals:
        start, stop = int(start), int(stop)
        take_here = max(0, min(count, stop - start))
        if take_here:
            head.append((start, start + take_here))
            count -= take_here
        if start + take_here < stop:
            rest.append((start + take_here, stop))
    return head, rest


def union(intervals: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint, non-empty ``(start, stop)`` intervals covering the same positions."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted((int(a), int(b)) for a, b in intervals if b > a):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def share(intervals: Sequence[Sequence[int]], num_workers: int, worker_id: int) -> list[tuple[int, int]]:
    """Worker ``worker_id``'s part of the positions in ``intervals``.

    The positions, in order, are split as :func:`worker_span` splits a chunk:
    worker ``w`` gets the ``w``-th run of ``n // num_workers`` (or one more)
    of them, so the parts are disjoint, cover every position and differ in
    size by at most one.
    """
    merged = union(intervals)
    total = sum(stop - start for start, stop in merged)
    offset, size = worker_span(total, num_workers, worker_id)
    out: list[tuple[int, int]] = []
    for start, stop in merged:
        length = stop - start
        if offset >= length:
            offset -= length
            continue
        take = min(size, length - offset)
        if take <= 0:
            break
        out.append((start + offset, start + offset + take))
        size -= take
        offset = 0
    return out


def rank_span(total: int, world_size: int, rank: int, balance: Balance) -> tuple[int, int]:
    """``(start, size)`` of rank ``rank``'s chunk of a ``total``-record stream.

    Positions at or past ``total`` (only under ``"pad"``) wrap round to the
    start of the stream.
    """
    if balance == "none":
        base, extra = divmod(total, world_size)
        return rank * base + min(rank, extra), base + (rank < extra)
    if balance == "pad":
        per_rank = -(-total // world_size)
    elif balance == "drop":
        per_rank = total // world_size
        if per_rank == 0 and total > 0:
            raise PlanError(
                f"balance='drop' with {total} records over world_size={world_size} ranks "
                "leaves every rank empty; use balance='pad' (repeats records) or "
                "balance='none' (unequal ranks), or run on fewer ranks"
            )
    else:  # pragma: no cover - validated by the caller
        raise PlanError(f"unknown balance {balance!r}")
    return rank * per_rank, per_rank


def worker_span(rank_size: int, num_workers: int, worker_id: int) -> tuple[int, int]:
    """``(offset, size)`` of worker ``worker_id``'s part of a rank's chunk."""
    base, extra = divmod(rank_size, num_workers)
    return worker_id * base + min(worker_id, extra), base + (worker_id < extra)


def reader_counts(total: int, world_size: int, num_workers: int, balance: Balance) -> np.ndarray:
    """Records each reader gets, as an int64 array of shape ``(world_size, num_workers)``."""
    if balance not in BALANCES:
        raise PlanError(f"balance must be one of {BALANCES}, got {balance!r}")
    out = np.empty((world_size, num_workers), dtype=np.int64)
    for rank in range(world_size):
        _, size = rank_span(total, world_size, rank, balance)
        for worker in range(num_workers):
            out[rank, worker] = worker_span(size, num_workers, worker)[1]
    return out


class _Stream:
    """The global record stream: blocks of shards laid end to end.

    Block ``k`` of the stream is block ``order[k]`` of the unshuffled blocks
    (``order`` is None when not shuffled); only the stream ends are computed for
    every block, the rest only for the blocks one reader touches.
    """

    def __init__(self, shard: np.ndarray, first: np.ndarray, end: np.ndarray, order: np.ndarray | None) -> None:
        self._shard = shard  # shard index of each unshuffled block
        self._first = first  # first record (within its shard) of each unshuffled block
        self._order = order
        self.end = end  # stream position just past each block of the stream
        self.total = int(end[-1]) if len(end) else 0

    @classmethod
    def build(
        cls, counts: np.ndarray, *, seed: int, epoch: int, shuffle: bool, world_size: int, block_size: int | None = None
    ) -> _Stream:
        nonempty = np.flatnonzero(counts)
        sizes = counts[nonempty]
        if not shuffle:
            return cls(nonempty, np.zeros(len(nonempty), np.int64), np.cumsum(sizes), None)
        block = max(1, -(-int(sizes.sum()) // (BLOCKS_PER_RANK * world_size)))
        if block_size is not None:
            block = min(block, block_size)
        if int(sizes.max(initial=0)) <= block:  # every shard is one block
            shard, first, length = nonempty, np.zeros(len(nonempty), np.int64), sizes
        else:
            pieces = -(-sizes // block)
            shard = np.repeat(nonempty, pieces)
            first = (np.arange(len(shard), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * block
            length = np.minimum(block, counts[shard] - first)
        order = np.random.default_rng([seed, epoch]).permutation(len(shard))
        return cls(shard, first, np.cumsum(length[order]), order)

    def _blocks(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard index and first record of stream blocks ``lo:hi``."""
        index = slice(lo, hi) if self._order is None else self._order[lo:hi]
        return self._shard[index], self._first[index]

    def ranges(self, start: int, stop: int) -> list[Range]:
        """The ranges covering stream positions ``[start, stop)``, wrapping past the end."""
        shard, first, last = self.range_arrays(start, stop)
        return [Range(*r) for r in zip(shard.tolist(), first.tolist(), last.tolist())]

    def range_arrays(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`ranges` as three int64 arrays: shard, first record, record just past the last."""
        shards, firsts, lasts = [], [], []
        while start < stop:
            position = start % self.total
            take = min(stop - start, self.total - position)
            piece_shard, piece_first, piece_last = self._cover(position, position + take)
            shards.append(piece_shard)
            firsts.append(piece_first)
            lasts.append(piece_last)
            start += take
        if not shards:
            return _EMPTY, _EMPTY, _EMPTY
        shard, first, last = (np.concatenate(parts).astype(np.int64, copy=False) for parts in (shards, firsts, lasts))
        # Join neighbours that continue each other in the same shard.
        keep = np.ones(len(shard), dtype=bool)
        keep[1:] = (shard[1:] != shard[:-1]) | (first[1:] != last[:-1])
        last = np.maximum.reduceat(last, np.flatnonzero(keep)) if len(last) else last
        return shard[keep], first[keep], last

    def _cover(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo = int(np.searchsorted(self.end, start, side="right"))
        hi = int(np.searchsorted(self.end, stop, side="left")) + 1
        end = self.end[lo:hi]
        block_start = np.concatenate(([self.end[lo - 1] if lo > 0 else 0], end[:-1]))
        shard, first = self._blocks(lo, hi)
        begin = np.maximum(block_start, start) - block_start + first
        finish = np.minimum(end, stop) - block_start + first
        return shard, begin, finish


def _deal_whole_shards(counts: np.ndarray, topology: Topology, *, seed: int, epoch: int, shuffle: bool) -> WholeShards:
    candidates = np.flatnonzero(counts != 0)
    order = np.random.default_rng([seed, epoch]).permutation(candidates) if shuffle else candidates
    mine = order[topology.rank :: topology.world_size][topology.worker_id :: topology.num_workers]
    return WholeShards(mine.astype(np.int64, copy=False), counts[mine].astype(np.int64, copy=False))


def _normalise_counts(num_records: RecordCounts) -> tuple[np.ndarray, bool]:
    """An int64 array with -1 for unknown counts, and whether all are known."""
    if hasattr(num_records, "to_numpy") and hasattr(num_records, "null_count"):  # pyarrow
        column: Any = num_records
        known_mask = np.asarray(column.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        values = np.asarray(column.fill_null(-1).to_numpy(zero_copy_only=False))
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


__all__ = [
    "BALANCES",
    "SHUFFLE_BLOCK",
    "SHUFFLE_WINDOW",
    "Balance",
    "PlanError",
    "PlannedRanges",
    "Range",
    "WholeShards",
    "plan",
    "plan_intervals",
    "plan_whole_shards",
    "rank_span",
    "reader_counts",
    "share",
    "split_remaining",
    "take",
    "through",
    "union",
    "window_order",
    "worker_span",
]
