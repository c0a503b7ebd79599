"""Sample-level shuffling: a window of a reader's records, read in order and yielded permuted."""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from shardkit.planning import positions_union, take, window_order
from shardkit.sources.ranges import _RangeIterator
from shardkit.stateful import MAX_RECORD, RECORD_BITS, State, StateError


class _WindowIterator:
    """Sample-level shuffling over a :class:`_RangeIterator`: read a window, yield it permuted.

    The reader's positions (``intervals``, in reading order) are cut into
    windows of ``size`` consecutive positions. A window is read sequentially
    (one read per block of the shuffled stream) into memory and yielded in
    the order :func:`~shardkit.planning.window_order` gives for its first
    position; then the next window is read. A window's content is a pure
    function of where it starts, so the state is positions only:
    ``remaining`` (the unyielded positions of the window and everything
    after it, what a merge needs) and ``window``: ``{"from": the positions
    from the window's start on, "yielded": samples of it yielded}``. Resuming
    reads the window again and skips what was yielded: the same order.

    Memory: one window, ``size`` samples. A record skipped under
    ``on_error="skip"`` (with ``balance="none"``) leaves its window one sample
    short; its position counts as read.
    """

    def __init__(
        self, ranges: _RangeIterator, intervals: Sequence[Sequence[int]], size: int, *, seed: int, skip: int = 0
    ) -> None:
        self._ranges = ranges
        self._size = size
        self._seed = seed
        self._from = [(int(a), int(b)) for a, b in intervals if b > a]
        self._rest = self._from
        self._window: list[Any] = []  # samples of the current window, in reading order
        self._positions: list[int] = []  # their positions
        self._packed: list[int] | None = []  # their records' packed positions (stateful.positions); None: unknown
        self._order: list[int] = []  # the order to yield them in
        self._yielded = 0
        self._carry: tuple[list[Any], list[int]] = ([], [])  # samples read past the window's end
        self._fill()
        if skip > len(self._window):
            raise StateError(
                f"the state says {skip} samples of the current window were yielded, but the window holds "
                f"{len(self._window)}; the state is not of this dataset, or it was edited"
            )
        self._yielded = skip

    def _fill(self) -> None:
        """Read the next window from the ranges' current position and permute it.

        The window is the first ``size`` positions of ``self._from``; samples are
        read in batches (a C-level loop: this is every sample's path) and their
        positions found from the window's start and the ranges' log of skipped
        records. A sample read past the window's end is carried to the next one.
        """
        head, self._rest = take(self._from, self._size)
        want = sum(b - a for a, b in head)
        end = head[-1][1] if head else 0  # positions are read in increasing order: the window is all below
        samples, positions = self._carry
        self._carry = ([], [])
        ranges = self._ranges
        if head:  # skips before the window no longer matter
            ranges.skips = [(p, n) for p, n in ranges.skips if p + n > head[0][0]]
        last = not self._rest  # read the ranges to their end: the last range's end checks and counts run
        with _collection_paused():
            while want and (last or not positions or positions[-1] < end - 1):
                read = list(itertools.islice(ranges, max(1, want - len(samples))))
                if not read:
                    break
                samples += read
                positions = self._positions_of(len(samples), ranges.skips)
        inside = bisect.bisect_left(positions, end)
        self._carry = (samples[inside:], positions[inside:])
        first = head[0][0] if head else 0
        order = window_order(inside, seed=self._seed, epoch=ranges.epoch, rank=ranges.topology.rank, first=first)
        self._window, self._order, self._positions = samples[:inside], order.tolist(), positions[:inside]
        self._packed = self._records_of(self._positions)
        self._yielded = 0

    def _records_of(self, positions: list[int]) -> list[int] | None:
        """The packed (shard, record) of each chunk position, from the plan's ranges (None: not known)."""
        planned = self._ranges._planned
        if planned is None or not positions:
            return None if planned is None else []
        chunk = np.asarray(positions, dtype=np.int64)
        index = np.searchsorted(planned.position, chunk, side="right") - 1
        records = planned.first[index] + chunk - planned.position[index]
        if int(index.min()) < 0 or int(records.max()) > MAX_RECORD:
            return None
        return ((planned.shard[index] << RECORD_BITS) | records).tolist()

    @property
    def position(self) -> int | None:
        """The packed position of the record of the sample returned last (see :mod:`shardkit.stateful.positions`)."""
        packed = self._packed
        return None if packed is None or not self._yielded else packed[self._order[self._yielded - 1]]

    def _positions_of(self, count: int, skips: list[tuple[int, int]]) -> list[int]:
        """Positions of the first ``count`` samples read from the window's start, given the records skipped."""
        skipped = sum(records for _, records in skips)
        span, _ = take(self._from, count + skipped)
        positions = np.concatenate([np.arange(a, b) for a, b in span]) if span else np.zeros(0, np.int64)
        if skipped:
            gone = np.concatenate([np.arange(p, p + n) for p, n in skips])
            positions = positions[~np.isin(positions, gone)]
        return positions[:count].tolist()

    def __iter__(self) -> _WindowIterator:
        return self

    def __next__(self) -> Any:
        while self._yielded == len(self._window):  # a loop: windows of skipped records only are empty
            if not self._rest:
                raise StopIteration
            self._from = self._rest
            self._fill()
        sample = self._window[self._order[self._yielded]]
        self._yielded += 1
        return sample

    def remaining(self) -> list[list[int]]:
        """Positions not yielded yet: the window's unyielded ones and all after it."""
        unyielded = np.asarray(self._positions, dtype=np.int64)[self._order[self._yielded :]]
        return positions_union(unyielded, self._rest)

    def state_dict(self) -> State:
        """The ranges' node, with the positions from the window's start as ``remaining`` and how much of the
        window was yielded: what is left follows from them (:meth:`_RangeIterator.left_of`), so the node stays a
        few intervals long, not one per sample the permuted window has yielded."""
        state = self._ranges.state_dict()
        state[_RangeIterator.REMAINING] = [list(i) for i in self._from]
        window, _ = take(self._from, self._size)
        first, end = (window[0][0], window[-1][1]) if window else (0, 0)
        state[_RangeIterator.WINDOW] = {
            _RangeIterator.WINDOW_YIELDED: self._yielded,
            _RangeIterator.WINDOW_SKIPPED: [[p, n] for p, n in self._ranges.skips if p < end and p + n > first],
        }
        return state


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a window is read.

    Every object made then is kept (the window's samples), so collections
    would only scan and promote them: measured, they cost a third of the
    reading time with a few thousand decoded Examples per window. Reference
    counting still frees everything else; the collector resumes (if it was
    on) after. The pause is process-wide: in a DataLoader worker only the
    reading runs; with ``num_workers=0`` other threads' cycles wait for it.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
