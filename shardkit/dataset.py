"""Sources: IterableDatasets that split their records by the plan when iteration starts.

``ShardedDataset`` reads shard files with any ``read_fn(url, start, stop)``;
``TFRecordDataset`` is the TFRecord case; ``wrap`` turns a map-style dataset
(one with ``__len__`` and ``__getitem__``) or a plain iterable into a source.

Every source, in every DataLoader worker of every rank, does the same at the
start of ``__iter__``: detect its :class:`~shardkit.Topology`, read the epoch
from shared memory, seed ``random``/numpy/torch for this reader, and take its
part of the :func:`~shardkit.plan`. Nothing about the topology is read in
``__init__``: a dataset built before the process group exists still splits.

Resuming (``state_dict`` / ``load_state_dict``, see :mod:`shardkit.state`):
a planned source saves the positions of its rank's chunk it has not read yet.
The chunk does not depend on the number of workers, so a state merged from
all workers resumes with any number of them, each reading an even part of
what is left. The states of all ranks combine (:func:`shardkit.state.gather`,
:func:`shardkit.state.merge_ranks`) into one global state of stream
positions that loads on any world size: each new rank takes its part of what
is left (:func:`~shardkit.planning.split_remaining`). A ``wrap`` of a plain
iterable saves how many items its reader stepped past and resumes into the
same reader slot only.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import itertools
import logging
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
from torch.utils.data import Dataset, IterableDataset

from shardkit.counting import CountFn, resolve_counts
from shardkit.epoch import SharedEpoch, check_epoch, resume_at
from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.pipeline import Pipeline
from shardkit.planning import (
    BALANCES,
    SHUFFLE_BLOCK,
    SHUFFLE_WINDOW,
    Balance,
    PlannedRanges,
    Range,
    plan,
    plan_intervals,
    rank_span,
    share,
    split_remaining,
    take,
    union,
    window_order,
)
from shardkit.remote import RetryPolicy, prefetch, remote_options
from shardkit.seeding import check_seed, seed_iteration
from shardkit.shardlist import NUM_RECORDS, ShardList
from shardkit.state import State, StateError, applies, check, check_positions, expect_equal, node, own_share, share_of
from shardkit.stats import ReadStats, SharedStats
from shardkit.topology import Topology
from shardkit.trainers import check_dataloader_len

logger = logging.getLogger("shardkit")

OnError = Literal["raise", "skip"]
ReadFn = Callable[[str, int, "int | None"], Iterable[Any]]
DECODERS = ("example", "sequence_example", "raw")
_NOTHING = object()


class DatasetError(ShardkitError, ValueError):
    """A source was given arguments it cannot work with."""


class _Source(Pipeline):
    """What every source shares: seed, balance, explicit rank, the shared epoch."""

    def __init__(self, *, shuffle: bool, seed: int, balance: Balance, rank: int | None, world_size: int | None) -> None:
        if balance not in BALANCES:
            raise DatasetError(f"balance must be one of {BALANCES}, got {balance!r}")
        if (rank is None) != (world_size is None):
            raise DatasetError(
                f"give rank and world_size together or neither (got rank={rank!r}, world_size={world_size!r}); "
                "with neither, they are detected from torch.distributed or RANK/WORLD_SIZE"
            )
        if rank is not None:
            Topology(rank=rank, world_size=world_size)  # type: ignore[arg-type]  # validates
        self.shuffle_shards = bool(shuffle)
        self.balance: Balance = balance
        self.rank = rank
        self.world_size = world_size
        self._seed = check_seed(seed)
        self._epoch = SharedEpoch()  # counts passes until set_epoch is called

    def set_epoch(self, epoch: int) -> None:
        self._epoch.set(check_epoch(epoch))

    @property
    def epoch(self) -> int:
        return self._epoch.effective()

    @property
    def seed(self) -> int:
        return self._seed

    def topology(self) -> Topology:
        if self.rank is None and self._process_group is not None:
            return Topology.current(rank=self._process_group[0], world_size=self._process_group[1])
        return Topology.current(rank=self.rank, world_size=self.world_size)

    _process_group: tuple[int, int] | None = None

    def _load_upstream(self, state: State) -> None:
        """A source has no inputs."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for DataLoader workers (spawn, forkserver): carry this
        process's torch.distributed rank, which a fresh worker process cannot see."""
        state = super().__getstate__()
        if self.rank is None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                state["_process_group"] = (dist.get_rank(), dist.get_world_size())
        return state

    def _start(self) -> tuple[Topology, int]:
        """Detect the reader and seed it for this pass; returns (topology, epoch)."""
        topology, epoch = self.topology(), self.epoch
        seed_iteration(self.seed, epoch, topology)
        return topology, epoch


class BalanceError(ShardkitError, RuntimeError):
    """Records were skipped under ``on_error="skip"`` and nothing readable is left to stand in for them."""


class _Skipped(NamedTuple):
    """Yielded by ``_read`` in place of ``records`` records it could not read (on_error='skip')."""

    records: int


#: Returned by ``TFRecordReader._index_past`` when the bad record was the last of its file.
_SHARD_ENDS = object()


class _BadRecord(NamedTuple):
    """Yielded by :class:`TFRecordReader` in place of one record that is bad while
    the records after it can still be read (a data CRC mismatch, a record that
    does not decode): the dataset raises ``error`` or skips just that record,
    and the same iterator goes on with the next one."""

    error: CorruptRecordError


class _Cursor:
    """Where ``ShardedDataset._read`` is in a range: the next record, records yielded, a record found past the stop."""

    __slots__ = ("position", "read", "past_stop")

    def __init__(self, position: int) -> None:
        self.position = position
        self.read = 0
        self.past_stop = False


class _PlannedSource(_Source):
    """A source whose records are ranges of numbered shards, split by :func:`plan`."""

    _state_kind = "planned"

    def _record_counts(self, topology: Topology, *, required: bool) -> Any:
        """Per-shard record counts for the plan: an int64 array, or, where some
        are unknown and ``required`` is false, a pyarrow array with nulls."""
        raise NotImplementedError

    def _read(self, shard: int, start: int, stop: int | None) -> Iterator[Any]:
        raise NotImplementedError

    def _hint(self, shard: int, start: int, stop: int | None) -> None:
        """One of the next three ranges after the one being opened is ``[start, stop)`` of ``shard``: a ``read_fn``
        with a ``prefetch(url, start, stop)`` method may start fetching it (remote readahead across shards)."""
        prefetch = getattr(getattr(self, "read_fn", None), "prefetch", None)
        if prefetch is not None:
            prefetch(self.shards[shard], start, stop)  # type: ignore[attr-defined]

    def _counts(self, topology: Topology) -> tuple[Any, Balance]:
        """Record counts for the plan and the balance to plan with."""
        required = topology.world_size > 1 and self.balance != "none"
        # Sample-level shuffling plans by position: count (once, cached) where the format can.
        required = required or (self._windowed() and getattr(self, "count_fn", None) is not None)
        counts = self._record_counts(topology, required=required)
        # Unknown counts on one rank: whole shards to the workers, nothing to equalise.
        balance = self.balance if isinstance(counts, np.ndarray) else "none"
        return counts, balance

    def _fingerprint(self, counts: Any) -> dict[str, Any]:
        """What a state must agree on with the dataset it is loaded into.

        Besides the totals, SHA-256 digests (16 hex digits shown) of the shard
        urls in order and of every count: a state of other files with the same
        counts, or of the same files in another order, is refused. Hashing 1M
        urls from their Arrow buffers takes 0.03 s, once per ShardList.
        """
        if not isinstance(counts, np.ndarray):
            raise StateError(
                f"{self!r}: resuming needs the record count of every shard, and some are unknown; "
                "call count_records() (or give counts: a manifest, index files) before iterating"
            )
        import hashlib

        shards = getattr(self, "shards", None)  # a wrap()ped map-style dataset has no files
        return {
            "shards": len(counts),
            "records": int(counts.sum()),
            "urls": None if shards is None else shards.url_digest()[:16],
            "counts": hashlib.sha256(np.ascontiguousarray(counts, dtype="<i8").tobytes()).hexdigest()[:16],
            "seed": self.seed,
            "shuffle": self.shuffle_shards,
            "balance": self.balance,
            **({"window": [self.shuffle_block, self.shuffle_window]} if self._windowed() else {}),
        }

    def load_state_dict(self, state: State) -> None:
        """Resume from ``state`` at the next ``__iter__``; see :meth:`Pipeline.load_state_dict`.

        Raises:
            StateError: the state is of another dataset (shard count, record
                count, seed, shuffle, balance) or another format version.
        """
        check(state, self._state_kind, self)
        counts, _ = self._counts(self.topology())
        expect_equal(self, "dataset", state["fingerprint"], self._fingerprint(counts))
        self._pending = state
        resume_at(self, state["epoch"])  # the next pass reads the state's epoch (unless set_epoch)

    def __len__(self) -> int:
        """Samples this rank yields per epoch (all of its workers together)."""
        check_dataloader_len(self)  # refuses a DataLoader len that would cut the epoch short
        topology = self.topology()
        counts = self._record_counts(topology, required=False)
        if not isinstance(counts, np.ndarray):
            raise self._unknown_length("the record counts of its shards are unknown (call count_records() first)")
        return rank_span(int(counts.sum()), topology.world_size, topology.rank, self.balance)[1]

    #: Records a reader permutes at once under ``shuffle=True`` (memory: this many
    #: samples per reader); 0 keeps shuffling at the level of shards and blocks.
    shuffle_window: int = SHUFFLE_WINDOW

    #: Largest block of the shuffled stream under sample-level shuffling.
    shuffle_block: int = SHUFFLE_BLOCK

    def _windowed(self) -> bool:
        """Whether ``shuffle=True`` shuffles samples here (needs known record counts)."""
        return self.shuffle_shards and self.shuffle_window > 0

    def _open(self, state: State | None) -> Iterator[Any]:
        topology, epoch = self._start()
        counts, balance = self._counts(topology)
        kwargs = {"seed": self.seed, "epoch": epoch, "shuffle": self.shuffle_shards, "balance": balance}
        if not isinstance(counts, np.ndarray):  # no positions without counts: whole shards
            if state is not None:
                self._fingerprint(counts)  # raises, naming the fix
            return _RangeReader(self, [(None, r) for r in plan(counts, topology, **kwargs)], epoch, topology, None)
        windowed = self._windowed()
        if windowed:
            kwargs["block_size"] = self.shuffle_block
        fingerprint = self._fingerprint(counts)
        total = int(counts.sum())
        base, yielded, exact = None, 0, False
        if state is not None and applies(state, epoch, self):
            expect_equal(self, "dataset", state["fingerprint"], fingerprint)
            base = self._base_of(state)
        if base is not None:  # the epoch resumed from a global state: this rank's part of what it left
            chunk = split_remaining(base["remaining"], total, topology.world_size, topology.rank, balance)
            kwargs.update(chunk=chunk, stream_world_size=base["world_size"])
            size = sum(b - a for a, b in chunk)
        else:
            size = rank_span(total, topology.world_size, topology.rank, balance)[1]
        intervals = share([(0, size)], topology.num_workers, topology.worker_id)
        if state is not None and state["rank"] is not None and applies(state, epoch, self):
            intervals, yielded, exact = self._resume_positions(state, topology, size, windowed)
        pieces = plan_intervals(counts, topology, intervals, **kwargs)
        stand_in = None
        if self._makes_up(balance):
            stand_in = functools.partial(self._stand_in, counts, topology, kwargs)
        reader = _RangeReader(self, pieces, epoch, topology, fingerprint, stand_in)
        reader.base = base
        if not windowed:
            return reader
        windows = _WindowReader(reader, intervals, self.shuffle_window, seed=self.seed, skip=yielded)
        if exact:  # the window read again must leave what the state says is left
            expect_equal(self, "remaining positions (for its window)", state["remaining"], windows.remaining())
        return windows

    def _base_of(self, state: State) -> dict[str, Any] | None:
        """The global state (``world_size``, ``remaining``) an epoch resumed from on another world, if any."""
        if state["rank"] is None:
            check_positions(self, state["remaining"], state["fingerprint"]["records"])
            return {"world_size": state["world_size"], "remaining": state["remaining"]}
        return state.get("base")

    def _resume_positions(
        self, state: State, topology: Topology, size: int, windowed: bool
    ) -> tuple[list[tuple[int, int]], int, bool]:
        """This reader's positions from a rank's state: (intervals, window samples yielded, exact window?)."""
        expect_equal(self, "world_size", state["world_size"], topology.world_size)
        expect_equal(self, "rank", state["rank"], topology.rank)
        remaining = state["remaining"]
        check_positions(self, remaining, size)
        own = own_share(state, topology.worker_id, topology.num_workers, self)
        window = state.get("window") if windowed else None
        if window is not None and (own or topology.num_workers == 1):  # exactly where it stopped
            check_positions(self, window["from"], size)
            return [tuple(i) for i in window["from"]], window["yielded"], True
        return (union(remaining) if own else share(remaining, topology.num_workers, topology.worker_id)), 0, False

    def _makes_up(self, balance: Balance) -> bool:
        """Whether records this source skips are replaced by repeats, to keep ranks balanced."""
        return False

    def _stand_in(self, counts: np.ndarray, topology: Topology, kwargs: dict[str, Any]) -> Any:
        """A sample to repeat in place of skipped records when the reader has yielded none yet."""
        raise NotImplementedError

    def _count_padded(self, shard: int) -> None:
        """Count one sample yielded in place of a skipped or missing record of ``shard``."""


class _RangeReader:
    """Reads one reader's ranges in order; the cursor is (range, records done).

    Each range comes with the rank-chunk position of its first record (None
    when record counts are unknown), so what is left can be saved as positions.

    With a ``stand_in`` (balanced sources under ``on_error="skip"``), every
    record the source skips (a :class:`_Skipped`) is made up by one repeat of
    the sample this reader yielded last, or, before it has yielded any, of
    ``stand_in()``: the reader still yields exactly its planned number of
    samples. A made-up sample takes the position of the record it replaces,
    one at a time, so a state saved in the middle of a run of them resumes
    with exactly the rest (the source finds the same bad records again).
    """

    def __init__(
        self,
        source: _PlannedSource,
        pieces: Sequence[tuple[int | None, Range]],
        epoch: int,
        topology: Topology,
        fingerprint: dict[str, Any] | None,
        stand_in: Callable[[], Any] | None = None,
    ) -> None:
        self._source = source
        self._planned = pieces if isinstance(pieces, PlannedRanges) else None
        if isinstance(pieces, PlannedRanges):  # a plan's arrays, indexed lazily: no object per shard
            self.positions: Sequence[int | None] = pieces.positions
            self.ranges: Sequence[Range] = pieces.ranges
        else:
            self.positions = [position for position, _ in pieces]
            self.ranges = [piece for _, piece in pieces]
        self.range_index = 0
        self.done_in_range = 0
        self._records: Iterator[Any] | None = None
        self._epoch = epoch
        self._topology = topology
        self._fingerprint = fingerprint
        self._stand_in = stand_in
        self._last: Any = _NOTHING
        self._owed = 0  # records skipped in the current range and not made up yet
        self.skips: list[tuple[int, int]] = []  # (first position, records) of runs skipped without a sample
        self.base: dict[str, Any] | None = None  # the global state this epoch resumed from, on another world

    def state_dict(self) -> State:
        """The positions of this reader's part not read yet (records, not samples)."""
        if self._fingerprint is None:
            self._source._fingerprint(None)  # raises, naming the fix
        remaining = []
        if self._planned is not None:  # vectorised: a million ranges take milliseconds, not a second
            remaining = self._planned.remaining(self.range_index, self.done_in_range)
        for index in range(self.range_index, len(self.ranges) if self._planned is None else 0):
            _, start, stop = self.ranges[index]
            position = self.positions[index]
            done = self.done_in_range if index == self.range_index else 0
            remaining.append((position + done, position + stop - start))  # type: ignore[operator]
        topology = self._topology
        return node(
            "planned",
            epoch=self._epoch,
            world_size=topology.world_size,
            rank=topology.rank,
            fingerprint=self._fingerprint,
            remaining=[list(interval) for interval in union(remaining)],
            share=share_of(topology.worker_id, topology.num_workers),
            **({} if self.base is None else {"base": self.base}),
        )

    def __iter__(self) -> _RangeReader:
        return self

    def __next__(self) -> Any:
        if self._owed:
            return self._made_up()
        while self.range_index < len(self.ranges):
            if self._records is None:
                shard, start, stop = self.ranges[self.range_index]
                self._records = self._source._read(shard, start + self.done_in_range, stop)
                for ahead in self.ranges[self.range_index + 1 : self.range_index + 4]:
                    self._source._hint(*ahead)
            try:
                sample = next(self._records)
            except StopIteration:
                self._finish_range()
                continue
            if isinstance(sample, _Skipped):
                if self._stand_in is None:
                    position = self.positions[self.range_index]
                    if position is not None and sample.records:  # for _WindowReader: positions without a sample
                        self.skips.append((position + self.done_in_range, sample.records))
                    self.done_in_range += sample.records
                    continue
                self._owed = sample.records
                if self._owed:
                    return self._made_up()
                continue
            self.done_in_range += 1
            if self._stand_in is not None:
                self._last = sample
            return sample
        raise StopIteration

    def _made_up(self) -> Any:
        """One repeat in place of the next skipped record (see the class docstring)."""
        if self._last is _NOTHING:
            self._last = self._stand_in()  # type: ignore[misc]
        self._owed -= 1
        self.done_in_range += 1
        self._source._count_padded(self.ranges[self.range_index].shard)
        return self._last

    def _finish_range(self) -> None:
        self._records = None
        self.range_index += 1
        self.done_in_range = 0


class _WindowReader:
    """Sample-level shuffling over a :class:`_RangeReader`: read a window, yield it permuted.

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
        self, reader: _RangeReader, intervals: Sequence[Sequence[int]], size: int, *, seed: int, skip: int = 0
    ) -> None:
        self._reader = reader
        self._size = size
        self._seed = seed
        self._from = [(int(a), int(b)) for a, b in intervals if b > a]
        self._rest = self._from
        self._window: list[Any] = []  # samples of the current window, in reading order
        self._positions: list[int] = []  # their positions
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
        """Read the next window from the reader's current position and permute it.

        The window is the first ``size`` positions of ``self._from``; samples are
        read in batches (a C-level loop: this is every sample's path) and their
        positions found from the window's start and the reader's log of skipped
        records. A sample read past the window's end is carried to the next one.
        """
        head, self._rest = take(self._from, self._size)
        want = sum(b - a for a, b in head)
        end = head[-1][1] if head else 0  # positions are read in increasing order: the window is all below
        samples, positions = self._carry
        self._carry = ([], [])
        reader = self._reader
        if head:  # skips before the window no longer matter
            reader.skips = [(p, n) for p, n in reader.skips if p + n > head[0][0]]
        last = not self._rest  # read the reader to its end: its last range's end checks and counts run
        with _collection_paused():
            while want and (last or not positions or positions[-1] < end - 1):
                read = list(itertools.islice(reader, max(1, want - len(samples))))
                if not read:
                    break
                samples += read
                positions = self._positions_of(len(samples), reader.skips)
        inside = bisect.bisect_left(positions, end)
        self._carry = (samples[inside:], positions[inside:])
        first = head[0][0] if head else 0
        topology = self._reader._topology
        order = window_order(inside, seed=self._seed, epoch=self._reader._epoch, rank=topology.rank, first=first)
        self._window, self._order, self._positions = samples[:inside], order.tolist(), positions[:inside]
        self._yielded = 0

    def _positions_of(self, count: int, skips: list[tuple[int, int]]) -> list[int]:
        """Positions of the first ``count`` samples read from the window's start, given the records skipped."""
        skipped = sum(records for _, records in skips)
        span, _ = take(self._from, count + skipped)
        positions = np.concatenate([np.arange(a, b) for a, b in span]) if span else np.zeros(0, np.int64)
        if skipped:
            gone = np.concatenate([np.arange(p, p + n) for p, n in skips])
            positions = positions[~np.isin(positions, gone)]
        return positions[:count].tolist()

    def __iter__(self) -> _WindowReader:
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
        unyielded = [(self._positions[i], self._positions[i] + 1) for i in self._order[self._yielded :]]
        return [list(interval) for interval in union(unyielded + list(self._rest))]

    def state_dict(self) -> State:
        state = self._reader.state_dict()
        state["remaining"] = self.remaining()
        state["window"] = {"from": [list(i) for i in self._from], "yielded": self._yielded}
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


class ShardedDataset(_PlannedSource):
    """An IterableDataset over shard files, split over ranks and workers by :func:`plan`.

    Args:
        shards: a :class:`ShardList`, a glob / fsspec pattern (brace ranges
            allowed), or a sequence of urls.
        read_fn: ``read_fn(url, start, stop)`` yields the samples of records
            ``[start, stop)`` of one shard (``stop=None``: to its end). Define it
            at module level (or use :func:`functools.partial`) so it can be
            pickled to DataLoader workers started with spawn or forkserver.
        shuffle, seed: shuffle samples each epoch, from ``(seed, epoch)``
            (see :meth:`set_epoch`): the plan deals out blocks of at most
            ``shuffle_block`` (512) records from all over the dataset, and each
            reader yields every window of ``shuffle_window`` (4,096) records it
            reads in a seeded random order. Memory: one window of samples per
            reader (DataLoader worker). Measured: about 0.05% of neighbours
            adjacent in storage, jump entropy about 0.97 of a uniform
            permutation's (``benchmarks/shuffle.py``). Set the attribute
            ``shuffle_window = 0`` for the shard-and-block shuffle alone.
            Needs record counts (counted once with ``count_fn`` when unknown;
            without counts or ``count_fn``, whole shards are shuffled only).
        balance: ``"pad"`` (default), ``"drop"`` or ``"none"``; see :func:`plan`.
        rank, world_size: override the detected DDP rank (both or neither).
        on_error: ``"raise"`` (default) or ``"skip"``: skip what cannot be read,
            with a warning naming it, and count it in :meth:`stats`; see
            "Bad data" below.
        count_fn: ``count_fn(url) -> int``, used once when record counts are
            needed (several ranks with ``"pad"``/``"drop"``) and unknown.
        storage_options: fsspec options, for a glob ``shards``. Each process
            lists a glob itself; to list a large bucket once per job, pass
            ``shardkit.listing.list_shards(pattern)`` (a collective: call it on
            every rank) or a manifest.

    When the record counts are unknown, one rank deals whole shards to its
    workers (and warns if there are fewer shards than workers); several ranks
    with ``balance="none"`` do the same; several ranks with ``"pad"``/``"drop"``
    count the records once (see :mod:`shardkit.counting`).

    Bad data. ``read_fn`` must accept a ``stop`` past the shard's end and
    yield the records that exist (as slicing does): the reader of a shard's
    last planned record asks for one more, to find shards longer than their
    count. With known counts, a shard shorter or longer than its planned
    count raises :class:`~shardkit.CorruptRecordError` (url, the record where
    it ended, what was planned) under ``"raise"``. Under ``"skip"``:

    * a record whose data is bad while the framing around it is fine (a data
      CRC mismatch, a record that does not decode) costs that record only;
      an error that loses the framing (or any other exception) costs the
      rest of the range; records a short shard lacks are counted as
      ``missing``; a long shard's extra records are not read (counted in
      ``errors``). Every case warns and is counted in :meth:`stats`.
    * with ``balance="pad"``/``"drop"``, each record lost this way is made
      up by a repeat of the sample the same reader yielded just before (or,
      if it has yielded none yet, of the first readable record of its rank's
      part, else of the dataset), counted as ``padded``: every rank still
      yields exactly its planned number of samples, so DDP ranks stay in
      step. If no record at all is readable, :class:`BalanceError` is raised. With
      ``balance="none"`` nothing is made up: ranks may yield different counts.
    * resuming stays exact: a made-up sample takes the position of the
      record it replaces.
    """

    def __init__(
        self,
        shards: ShardList | str | Sequence[str],
        read_fn: ReadFn,
        *,
        shuffle: bool = False,
        seed: int = 0,
        balance: Balance = "pad",
        rank: int | None = None,
        world_size: int | None = None,
        on_error: OnError = "raise",
        count_fn: CountFn | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size)
        if not callable(read_fn):
            raise DatasetError(f"read_fn must be callable as read_fn(url, start, stop), got {read_fn!r}")
        if on_error not in ("raise", "skip"):
            raise DatasetError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if count_fn is not None and not callable(count_fn):
            raise DatasetError(f"count_fn must be callable as count_fn(url) -> int, got {count_fn!r}")
        self.shards = as_shard_list(shards, storage_options)
        self.storage_options = storage_options
        self.read_fn = read_fn
        self.on_error: OnError = on_error
        self.count_fn = count_fn
        self._stats = SharedStats(len(self.shards))

    def count_records(self) -> ShardedDataset:
        """Fill in unknown record counts now (in this process), and return self.

        Call it before building the DataLoader so that workers do not each
        count; the counts are also cached beside the data where writable.
        """
        self.shards = resolve_counts(self.shards, self.count_fn, why=repr(self), storage_options=self.storage_options)
        return self

    def stats(self) -> ReadStats:
        """Records read, skipped, missing and padded and errors met, per shard,
        summed over every worker of this process's DataLoader (and this
        process); see :class:`~shardkit.stats.ReadStats`."""
        return self._stats.snapshot()

    def _record_counts(self, topology: Topology, *, required: bool) -> Any:
        if self.shards.num_records is not None:
            return self.shards.num_records
        if required:
            self.count_records()
            return self.shards.num_records
        if len(self.shards) < topology.num_workers and topology.worker_id == 0:
            warnings.warn(
                f"{len(self.shards)} shards for {topology.num_workers} DataLoader workers and unknown "
                "record counts: whole shards are dealt out, so some workers get none. Give record "
                "counts (a manifest or index files) to split shards, or use fewer workers",
                stacklevel=3,
            )
        return self.shards.table.column("num_records")

    def _makes_up(self, balance: Balance) -> bool:
        return self.on_error == "skip" and balance != "none"

    def _count_padded(self, shard: int) -> None:
        self._stats.add(shard, padded=1)

    def _stand_in(self, counts: np.ndarray, topology: Topology, kwargs: dict[str, Any]) -> Any:
        """The first readable record of this rank's chunk (the record ``"pad"`` wraps round to),
        else of the dataset's shards in order."""
        if kwargs.get("chunk") is not None:
            size = sum(b - a for a, b in kwargs["chunk"])
        else:
            size = rank_span(int(counts.sum()), topology.world_size, topology.rank, kwargs["balance"])[1]
        ranges = [piece for _, piece in plan_intervals(counts, topology, [(0, size)], **kwargs)]
        ranges += [Range(shard, 0, None) for shard in range(len(counts))]
        for shard, start, stop in ranges:
            try:
                for sample in self.read_fn(self.shards[shard], start, stop):
                    if not isinstance(sample, _BadRecord):
                        return sample
            except Exception:  # noqa: S112 - this range is unreadable as well: try the next one
                continue
        raise BalanceError(
            f"{self!r}: records were skipped (on_error='skip') and no record of any shard can be read "
            f"to stand in for them, so rank {topology.rank} cannot yield its planned {size} samples; "
            "see stats() and the warnings for what failed"
        )

    def _planned_count(self, shard: int) -> int | None:
        """The record count the plan assumes for ``shard``, if known."""
        return self.shards.table.column(NUM_RECORDS)[shard].as_py()

    def _read(self, shard: int, start: int, stop: int | None) -> Iterator[Any]:
        """The samples of records ``[start, stop)``, with a :class:`_Skipped` for
        records skipped under ``on_error="skip"`` so that positions stay exact.

        A range that ends where its shard's planned count ends asks ``read_fn``
        for one record more: if the shard has it, the count is stale (records
        past it would never be read). A read that ends before ``stop`` means the
        shard is shorter than planned. Both are errors, or counted under skip.
        """
        url = self.shards[shard]
        tail = stop is not None and stop == self._planned_count(shard)
        cursor = _Cursor(start)
        try:
            while True:  # one pass per run of records between bad ones (a loop, not recursion)
                try:
                    yield from self._records(shard, url, cursor, stop, stop + 1 if tail else stop)
                    break
                except Exception as error:
                    intact = isinstance(error, CorruptRecordError) and error.framing_intact
                    lost = self._lost(shard, url, cursor.position, stop, error, intact=intact)
                    if lost:
                        cursor.position += lost
                        yield _Skipped(lost)
                    if not (intact and (stop is None or cursor.position < stop)):
                        return
            yield from self._check_end(shard, url, cursor, stop, tail)
        finally:
            self._stats.add(shard, read=cursor.read)

    def _records(self, shard: int, url: str, cursor: _Cursor, stop: int | None, ask: int | None) -> Iterator[Any]:
        """Records from ``cursor.position`` up to ``stop`` of ``read_fn(url, position, ask)``."""
        position = first = cursor.position
        bad = 0
        limit = sys.maxsize if stop is None else stop
        try:  # locals in the loop, the cursor updated once: this is every sample's path
            for sample in self.read_fn(url, position, ask):
                if position >= limit:
                    cursor.past_stop = True
                    return
                if sample.__class__ is _BadRecord:
                    if self.on_error == "raise":
                        raise sample.error
                    self._lost(shard, url, position, stop, sample.error, intact=True)
                    position += 1
                    bad += 1
                    yield _Skipped(1)
                    continue
                position += 1
                yield sample
        finally:
            cursor.read += position - first - bad
            cursor.position = position

    def _lost(self, shard: int, url: str, position: int, stop: int | None, error: Exception, *, intact: bool) -> int:
        """Count an error at record ``position``; raise it, or return how many records it costs (skip)."""
        if self.on_error == "raise":
            self._stats.add(shard, errors=1)
            raise error
        if intact:  # one record's data is bad, the framing around it is fine: skip just it
            lost = 1 if stop is None or position < stop else 0
            warnings.warn(f"skipping record {position} of {url}: {_plain_message(error)}", stacklevel=3)
        else:
            lost = 0 if stop is None else stop - position
            what = "the rest of the shard (count unknown)" if stop is None else f"{lost} records"
            warnings.warn(f"skipping {what} of {url} from record {position}: {_plain_message(error)}", stacklevel=3)
        self._stats.add(shard, skipped=lost, errors=1)
        return lost

    def _check_end(self, shard: int, url: str, cursor: _Cursor, stop: int | None, tail: bool) -> Iterator[Any]:
        """After a clean read: the shard must hold exactly the planned records."""
        if stop is None:
            return
        planned = self._planned_count(shard)
        if cursor.position < stop:
            missing = stop - cursor.position
            error = CorruptRecordError(
                url,
                cursor.position,
                -1,
                f"the shard ends after {cursor.position} records, but the plan reads it up to record {stop} "
                f"(its record count says {planned}): {missing} planned records are missing. The count (manifest, "
                "num_records=, counts cache or index file) does not describe this file: recount, or restore the file",
            )
            self._stats.add(shard, missing=missing, errors=1)
            if self.on_error == "raise":
                raise error
            warnings.warn(f"{_plain_message(error)}; counted as missing (on_error='skip')", stacklevel=3)
            cursor.position = stop
            yield _Skipped(missing)
        elif tail and cursor.past_stop:
            error = CorruptRecordError(
                url,
                stop,
                -1,
                f"the shard holds more records than its planned count {stop}: the records from {stop} on would "
                "never be read. The count (manifest, num_records=, counts cache or index file) does not describe "
                "this file: recount, or restore the file",
            )
            self._stats.add(shard, errors=1)
            if self.on_error == "raise":
                raise error
            warnings.warn(f"{_plain_message(error)}; the extra records are not read (on_error='skip')", stacklevel=3)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        try:
            pickle.dumps(self.read_fn)
        except Exception as error:
            raise DatasetError(
                f"read_fn {self.read_fn!r} cannot be pickled ({error}), and DataLoader workers started "
                "with spawn or forkserver receive the dataset pickled. Define read_fn at module level, "
                "or use functools.partial of one, or use multiprocessing_context='fork'"
            ) from error
        return state

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self.shards)} shards, shuffle={self.shuffle_shards}, balance={self.balance!r})"
        )


def _plain_message(error: Exception) -> str:
    """The error's message without the details line a DataLoader worker adds to a CorruptRecordError."""
    return str(error.args[0]) if isinstance(error, CorruptRecordError) and error.args else str(error)


def as_shard_list(shards: ShardList | str | Sequence[str], storage_options: dict[str, Any] | None = None) -> ShardList:
    """A :class:`ShardList` from a ShardList, a glob pattern or a list of urls."""
    if isinstance(shards, ShardList):
        return shards
    if isinstance(shards, str):
        # Listed by this process: a listing shared through the process group would make
        # building a dataset a collective, which hangs a rank-0-only build (e.g. for
        # evaluation). shardkit.listing.list_shards is that collective, opt-in.
        return ShardList.from_glob(shards, storage_options=storage_options)
    if isinstance(shards, Sequence):
        return ShardList(list(shards))
    raise DatasetError(f"shards must be a ShardList, a glob pattern or a list of urls, got {type(shards).__name__}")


class TFRecordDataset(ShardedDataset):
    """An IterableDataset over TFRecord shards, split over ranks and workers.

    Args:
        shards: a :class:`ShardList`, a glob / fsspec pattern, or a list of urls.
        decode: ``"example"`` (:func:`~shardkit.decode_example`, the default),
            ``"sequence_example"``, ``"raw"`` (the record bytes) or a callable
            on the record bytes.
        verify: check every record's CRCs (see :func:`~shardkit.read_tfrecord`).
        compression: ``None``, ``"gzip"``, ``"zlib"`` or ``"auto"``.
        index: use index files beside the shards (``shardkit index``), when
            present, to seek to a range's first record and to count records.
        readahead_bytes, retry, cache_dir, cache_limit_bytes: how remote shards
            are read; see :class:`TFRecordReader`.

    The other arguments are those of :class:`ShardedDataset`. Record counts,
    when needed and not in the ShardList, come from index files or from one
    fast framing scan.
    """

    def __init__(
        self,
        shards: ShardList | str | Sequence[str],
        *,
        decode: str | Callable[[bytes], Any] = "example",
        verify: bool = True,
        compression: str | None = "auto",
        shuffle: bool = False,
        seed: int = 0,
        balance: Balance = "pad",
        rank: int | None = None,
        world_size: int | None = None,
        on_error: OnError = "raise",
        index: bool = True,
        storage_options: dict[str, Any] | None = None,
        readahead_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        cache_dir: str | None = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        if not callable(decode) and decode not in DECODERS:
            raise DatasetError(f"decode must be one of {DECODERS} or a callable on the record bytes, got {decode!r}")
        if compression not in (None, "gzip", "zlib", "auto"):
            raise DatasetError(f"compression must be None, 'gzip', 'zlib' or 'auto', got {compression!r}")
        reader = TFRecordReader(
            decode,
            verify=verify,
            compression=compression,
            index=index,
            storage_options=storage_options,
            readahead_bytes=readahead_bytes,
            retry=retry,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )
        super().__init__(
            shards,
            reader,
            shuffle=shuffle,
            seed=seed,
            balance=balance,
            rank=rank,
            world_size=world_size,
            on_error=on_error,
            count_fn=reader.count,
            storage_options=storage_options,
        )


class TFRecordReader:
    """The ``read_fn`` (and ``count_fn``) of :class:`TFRecordDataset`; picklable.

    Remote shards (see :mod:`shardkit.remote`): ``readahead_bytes`` are fetched
    ahead of the reader, across shard boundaries in the plan's order (default
    :data:`~shardkit.remote.DEFAULT_READAHEAD_BYTES`, 0 turns it off);
    transient failures are retried under ``retry`` (a
    :class:`~shardkit.remote.RetryPolicy`); ``cache_dir`` keeps fetched shards
    on local disk, shared by the processes of a machine, under
    ``cache_limit_bytes`` (see :mod:`shardkit.cache`). Local files ignore all four.
    """

    def __init__(
        self,
        decode: str | Callable[[bytes], Any] = "raw",
        *,
        verify: bool = True,
        compression: str | None = "auto",
        index: bool = True,
        storage_options: dict[str, Any] | None = None,
        readahead_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        cache_dir: str | None = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        self.decode = decode
        self.verify = verify
        self.compression = compression
        self.index = index
        self.storage_options = storage_options
        self.remote = remote_options(readahead_bytes, retry, cache_dir, cache_limit_bytes)

    def __call__(self, url: str, start: int, stop: int | None) -> Iterator[Any]:
        """Records ``[start, stop)`` of ``url``, decoded.

        A record that is bad while the framing around it is fine (a data CRC
        mismatch, or bytes that do not decode) comes as a :class:`_BadRecord`
        holding its :class:`~shardkit.CorruptRecordError`, and reading goes
        on with the next record: :class:`ShardedDataset` raises that error or
        skips just that record. Other errors are raised.
        """
        seekable = start > 0 and self.compression in (None, "auto")
        return self._records(url, start, stop, self._offsets(url) if seekable else None)

    def _records(self, url: str, start: int, stop: int | None, offsets: np.ndarray | None) -> Iterator[Any]:
        from shardkit.formats.tfrecord import read_tfrecord

        decode = self._decoder()
        position, index = start, offsets
        while True:  # one pass per run of good records; a bad data CRC ends read_tfrecord's iterator
            records = read_tfrecord(
                url,
                compression=self.compression,
                verify=self.verify,
                start=position,
                stop=stop,
                index=index,
                storage_options=self.storage_options,
                remote=self.remote,
            )
            try:
                yield from records if decode is None else self._decoded(decode, url, position, records)
                return
            except CorruptRecordError as error:
                if not error.framing_intact or error.record_index < position:
                    raise
                yield _BadRecord(error)
                position = error.record_index + 1
                index = self._index_past(url, error, offsets)
                if index is _SHARD_ENDS:  # the bad record was the file's last
                    return

    def _decoded(self, decode: Callable[[bytes], Any], url: str, start: int, records: Iterator[bytes]) -> Iterator[Any]:
        for position, record in enumerate(records, start):
            try:
                sample = decode(record)
            except Exception as error:  # the CRCs were fine: only this record is bad
                sample = _BadRecord(self._decode_error(url, position, error))
            yield sample

    def _decode_error(self, url: str, position: int, error: Exception) -> CorruptRecordError:
        """The error for record ``position``, whose CRCs are fine but whose bytes do not decode."""
        offsets = self._offsets(url) if self.compression in (None, "auto") else None
        offset = int(offsets[position]) if offsets is not None and position < len(offsets) else -1
        name = getattr(self.decode, "__name__", repr(self.decode)) if callable(self.decode) else repr(self.decode)
        reason = f"the record's CRCs are fine but it does not decode with {name}: {type(error).__name__}: {error}"
        return CorruptRecordError(url, position, offset, reason, framing_intact=True)

    def _index_past(self, url: str, error: CorruptRecordError, offsets: np.ndarray | None) -> Any:
        """Offsets that let ``read_tfrecord`` seek to the record after the bad one at ``error.offset``.

        With an index file (``offsets``), that index. Else, in an uncompressed file, the bad
        record's header (its length CRC was checked) gives the next offset: an
        array holding just that offset at its index saves rescanning the file
        from its start after each bad record; ``_SHARD_ENDS`` when that offset
        is the end of the file (the bad record was the last, and no record is
        claimed past it). A compressed stream cannot seek: None, and the next
        pass decompresses from the start again.
        """
        if offsets is not None:
            return _SHARD_ENDS if error.record_index + 1 >= len(offsets) else offsets
        if self.compression not in (None, "auto"):
            return None
        import fsspec

        from shardkit.formats.crc import masked_crc32c

        with fsspec.open(url, "rb", **(self.storage_options or {})) as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(error.offset)
            header = file.read(12)
        if len(header) < 12 or masked_crc32c(header[:8]) != int.from_bytes(header[8:], "little"):
            return None  # not a plain file at that offset (compressed, "auto" resolved so)
        after = np.zeros(error.record_index + 2, dtype=np.int64)
        after[-1] = error.offset + int.from_bytes(header[:8], "little") + 16
        return _SHARD_ENDS if after[-1] >= size else after

    def count(self, url: str) -> int:
        """Records in ``url``: from its index file if there is a valid one, else a framing scan.

        An index that does not fit the file (see :func:`~shardkit.formats.index.load_index`)
        is not used: a warning names it and the fix, and the file is scanned.
        """
        from shardkit.formats.index import IndexFileError
        from shardkit.formats.tfrecord import count_records

        try:
            offsets = self._offsets(url)
        except IndexFileError as error:
            warnings.warn(f"{error}; counting its records by a framing scan instead", stacklevel=2)
            offsets = None
        if offsets is not None:
            return len(offsets)
        return count_records(
            url, compression=self.compression, storage_options=self.storage_options, remote=self.remote
        )

    def prefetch(self, url: str, start: int, stop: int | None) -> None:
        """Start opening remote ``url`` for a later ``self(url, start, stop)``: its first blocks when
        reading from its start, else just the open (the offset needs the index)."""
        prefetch(url, self.storage_options, self.remote, offset=0 if start == 0 else None)

    def _offsets(self, url: str) -> np.ndarray | None:
        """The record offsets from ``url``'s index file, checked against the file; None when there
        is none, the file is compressed, or ``index=False``.

        Raises:
            IndexFileError: the index does not fit the file; seeking never uses such an index.
        """
        if not self.index or self.compression in ("gzip", "zlib"):
            return None
        from shardkit.formats.index import load_index

        return load_index(url, storage_options=self.storage_options)

    def _decoder(self) -> Callable[[bytes], Any] | None:
        if callable(self.decode):
            return self.decode
        if self.decode == "raw":
            return None
        from shardkit.formats import example

        return example.decode_example if self.decode == "example" else example.decode_sequence_example


def wrap(
    dataset: Dataset | IterableDataset | Iterable[Any],
    *,
    shuffle: bool = False,
    seed: int = 0,
    balance: Balance = "pad",
    rank: int | None = None,
    world_size: int | None = None,
) -> Pipeline:
    """Make an existing dataset a shardkit source, split over ranks and workers.

    * A map-style dataset (``__len__`` and ``__getitem__``) becomes a source
      over its indices, split by :func:`plan` exactly like shards of one record
      each: ``shuffle=True`` permutes every index from ``(seed, epoch)``.
    * Any other iterable (an ``IterableDataset``, a generator factory's
      result, a list) becomes a source in which reader ``k`` of ``n`` keeps
      items ``k, k + n, ...``. Every reader still iterates past the others'
      items, so the cost of producing an item is paid ``n`` times: prefer a
      map-style dataset or shards when producing items is expensive. Under
      ``"pad"``/``"drop"`` every reader keeps ``ceil``/``floor`` of
      ``items / n``; ``shuffle`` is not available (chain ``.shuffle(buffer)``).
    """
    if isinstance(dataset, Pipeline):
        raise DatasetError(f"{dataset!r} is already a shardkit pipeline; use it directly")
    is_map_style = (
        not isinstance(dataset, IterableDataset) and hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    )
    if is_map_style:
        return MapSource(dataset, shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size)
    if not isinstance(dataset, Iterable):
        raise DatasetError(
            f"wrap() takes a map-style dataset (__len__ and __getitem__) or an iterable, got {type(dataset).__name__}"
        )
    if shuffle:
        raise DatasetError(
            "wrap(shuffle=True) needs a map-style dataset (__len__ and __getitem__) to permute; "
            "for an iterable, chain .shuffle(buffer_size) after wrap()"
        )
    return StreamSource(dataset, seed=seed, balance=balance, rank=rank, world_size=world_size)


class MapSource(_PlannedSource):
    """A map-style dataset as a source over its indices; see :func:`wrap`."""

    shuffle_window = 0  # shuffled, every index is a block of its own: already a uniform permutation

    def __init__(
        self, dataset: Any, *, shuffle: bool, seed: int, balance: Balance, rank: int | None, world_size: int | None
    ) -> None:
        super().__init__(shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size)
        self.dataset = dataset

    def _record_counts(self, topology: Topology, *, required: bool) -> Any:
        # Shuffled: every index is a shard of one record, so the plan permutes
        # them all; otherwise one shard of len(dataset) records.
        size = len(self.dataset)
        return np.ones(size, dtype=np.int64) if self.shuffle_shards else np.array([size], dtype=np.int64)

    def _read(self, shard: int, start: int, stop: int | None) -> Iterator[Any]:
        if self.shuffle_shards:
            start, stop = shard, shard + 1
        return map(self.dataset.__getitem__, range(start, stop))

    def __repr__(self) -> str:
        return f"wrap({type(self.dataset).__name__} of {len(self.dataset)}, shuffle={self.shuffle_shards}, balance={self.balance!r})"


class StreamSource(_Source):
    """An iterable as a source: reader ``k`` of ``n`` keeps items ``k, k + n, ...``; see :func:`wrap`."""

    def __init__(
        self, iterable: Iterable[Any], *, seed: int, balance: Balance, rank: int | None, world_size: int | None
    ) -> None:
        super().__init__(shuffle=False, seed=seed, balance=balance, rank=rank, world_size=world_size)
        self.iterable = iterable

    _state_kind = "stream"

    def _open(self, state: State | None) -> Iterator[Any]:
        topology, epoch = self._start()
        reader = _StrideReader(iter(self.iterable), topology.reader_index, topology.num_readers, self.balance, epoch)
        if state is not None and applies(state, epoch, self):
            expect_equal(self, "reader slot [rank * num_workers + worker, readers]", state["reader"], reader.slot)
            reader.skip(state["items"], state["done"])
        return reader

    def __repr__(self) -> str:
        return f"wrap({type(self.iterable).__name__}, balance={self.balance!r})"


class _StrideReader:
    """Keeps item ``reader`` of every group of ``readers`` consecutive items.

    The last, incomplete group: ``"none"`` keeps the item if there is one;
    ``"drop"`` keeps nothing of it; ``"pad"`` keeps an item of it in every
    reader (wrapping round the group), so all readers yield the same number.
    """

    def __init__(self, items: Iterator[Any], reader: int, readers: int, balance: Balance, epoch: int) -> None:
        self._items = items
        self._reader = reader
        self._readers = readers
        self._balance = balance
        self._done = False
        self._epoch = epoch
        self.items_seen = 0

    @property
    def slot(self) -> list[int]:
        return [self._reader, self._readers]

    def skip(self, items: int, done: bool) -> None:
        """Step past the ``items`` items a saved reader had stepped past (they are read again)."""
        for _ in itertools.islice(self._items, items):
            self.items_seen += 1
        if self.items_seen < items:
            raise StateError(
                f"the state says {items} items were read, but the iterable has only {self.items_seen}; "
                "it must yield the same items every time it is iterated"
            )
        self._done = done

    def state_dict(self) -> State:
        """How many items this reader has stepped past; resuming replays them."""
        return node("stream", epoch=self._epoch, reader=self.slot, items=self.items_seen, done=self._done)

    def __iter__(self) -> _StrideReader:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        group = []
        for item in self._items:
            self.items_seen += 1
            group.append(item)
            if len(group) == self._readers:
                return group[self._reader]
        self._done = True
        if group and self._balance == "pad":
            return group[self._reader % len(group)]
        if group and self._balance == "none" and self._reader < len(group):
            return group[self._reader]
        raise StopIteration


# --------------------------------------------------------------------------- sources over the named formats


class _FormatDataset(ShardedDataset):
    """A :class:`ShardedDataset` whose ``read_fn``/``count_fn`` are a :class:`~shardkit.formats.base.ShardFormat`'s."""

    def __init__(self, shards: ShardList | str | Sequence[str], fmt: Any, **options: Any) -> None:
        self.format = fmt
        super().__init__(shards, fmt.read, count_fn=fmt.count, **options)


class TarDataset(_FormatDataset):
    """An IterableDataset over WebDataset tar shards, split over ranks and workers.

    A sample is ``{"__key__": str, "__url__": str, <ext>: bytes, ...}``, grouped
    as WebDataset groups members (see :mod:`shardkit.formats.tar`).

    Args:
        shards: a :class:`ShardList`, a glob / fsspec pattern, or a list of urls.
        compression: ``"auto"`` (gzip when the file starts with its magic), ``None`` or ``"gzip"``.
        index: use tar index files beside the shards (``shardkit index``), when
            present and valid, to count samples and to seek to a range's first sample.

    The other arguments are those of :class:`ShardedDataset`. Record counts,
    when needed and not in the ShardList, come from index files or one header scan.
    """

    def __init__(
        self,
        shards: ShardList | str | Sequence[str],
        *,
        compression: str | None = "auto",
        index: bool = True,
        shuffle: bool = False,
        seed: int = 0,
        balance: Balance = "pad",
        rank: int | None = None,
        world_size: int | None = None,
        on_error: OnError = "raise",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        from shardkit.formats.tar import TarFormat

        fmt = TarFormat(compression=compression, index=index, storage_options=storage_options)
        super().__init__(
            shards, fmt, shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size,
            on_error=on_error, storage_options=storage_options,
        )  # fmt: skip


class ParquetDataset(_FormatDataset):
    """An IterableDataset over Parquet shards, split over ranks and workers.

    A record is a row, yielded as a dict of column to value; record counts come
    from the files' footers, and a range reads only the row groups it overlaps.

    Args:
        shards: a :class:`ShardList`, a glob / fsspec pattern, or a list of urls.
        columns: the columns to read (all by default).
        batch_size: yield batches of up to this many rows of one file, as a dict
            of column to numpy array, instead of rows: a record is then a
            batch, and plans, exactly-once and resuming count batches.

    The other arguments are those of :class:`ShardedDataset`.
    """

    def __init__(
        self,
        shards: ShardList | str | Sequence[str],
        *,
        columns: Sequence[str] | None = None,
        batch_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        balance: Balance = "pad",
        rank: int | None = None,
        world_size: int | None = None,
        on_error: OnError = "raise",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        from shardkit.formats.parquet import ParquetFormat

        fmt = ParquetFormat(columns=columns, batch_size=batch_size, storage_options=storage_options)
        super().__init__(
            shards, fmt, shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size,
            on_error=on_error, storage_options=storage_options,
        )  # fmt: skip
        # Counts everywhere else (manifests, the counts cache, num_records=) are rows; with
        # batch_size the plan counts batches, ceil(rows / batch_size) per file, worked out here.
        self.count_fn = fmt.count_rows

    def _record_counts(self, topology: Topology, *, required: bool) -> Any:
        counts = super()._record_counts(topology, required=required)
        size = self.format.batch_size
        if size is None:
            return counts
        if isinstance(counts, np.ndarray):
            return -(-counts // size)
        import pyarrow.compute as pc

        return pc.divide(pc.add(counts, size - 1), size)

    def _planned_count(self, shard: int) -> int | None:
        rows = super()._planned_count(shard)
        size = self.format.batch_size
        return rows if rows is None or size is None else -(-rows // size)


class JsonlDataset(_FormatDataset):
    """An IterableDataset over JSON lines shards, split over ranks and workers.

    A record is a non-blank line, parsed with ``json.loads``; a line that is
    not JSON is a :class:`~shardkit.CorruptRecordError` that costs that line
    alone under ``on_error="skip"``.

    Args:
        shards: a :class:`ShardList`, a glob / fsspec pattern, or a list of urls.
        compression: ``"auto"`` (from the first bytes), ``None``, ``"gzip"`` or
            ``"zstd"`` (needs the ``zstandard`` package).
        index: use newline index files beside the shards (``shardkit index``),
            when present and valid, to count lines and to seek.

    The other arguments are those of :class:`ShardedDataset`.
    """

    def __init__(
        self,
        shards: ShardList | str | Sequence[str],
        *,
        compression: str | None = "auto",
        index: bool = True,
        shuffle: bool = False,
        seed: int = 0,
        balance: Balance = "pad",
        rank: int | None = None,
        world_size: int | None = None,
        on_error: OnError = "raise",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        from shardkit.formats.jsonl import JsonlFormat

        fmt = JsonlFormat(compression=compression, index=index, storage_options=storage_options)
        super().__init__(
            shards, fmt, shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size,
            on_error=on_error, storage_options=storage_options,
        )  # fmt: skip
