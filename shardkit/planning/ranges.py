"""What a plan returns: :class:`Range` (records ``[start, stop)`` of one shard), and the
array-backed sequences of them, :class:`PlannedRanges` and :class:`WholeShards`.

A plan of a million shards as Python objects took seconds (a Range per shard
per reader); these sequences hold int64 arrays, built in milliseconds, and
make a Range only when one is asked for.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple, overload

import numpy as np

_BATCH = 4096  # ranges converted to Python objects at a time when a plan is iterated


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


#: An empty int64 array: the columns of an empty plan (never written to).
EMPTY = np.zeros(0, np.int64)


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
        return cls(EMPTY, EMPTY, EMPTY, EMPTY)

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
    """:func:`~shardkit.planning.intervals.union` of the intervals ``[start[i], stop[i])``, vectorised."""
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
