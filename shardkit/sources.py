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
import pickle
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, NamedTuple

import numpy as np
from torch.utils.data import Dataset, IterableDataset

from shardkit.counting import (
    CountFn,
    OnError,
    ReadFn,
    Salvage,
    StoredCountFn,
    plan_counts,
    resolve_counts,
    shared_stored_counts,
)
from shardkit.epoch import SharedEpoch, check_epoch
from shardkit.errors import CorruptRecordError, ShardkitError, redact, redact_url
from shardkit.formats.base import MAX_EXPANSION, BadRecord, RecordBound, capabilities
from shardkit.formats.example import ColumnBatches, FeatureCheck, FeatureSpec
from shardkit.io.remote import RetryPolicy, remote_options
from shardkit.pipeline import Pipeline
from shardkit.planning import (
    BALANCES,
    SHUFFLE_BLOCK,
    SHUFFLE_WINDOW,
    Balance,
    PlannedRanges,
    Range,
    WholeShards,
    plan_intervals,
    plan_whole_shards,
    rank_span,
    share,
    split_remaining,
    take,
    through,
    union,
    window_order,
)
from shardkit.seeding import check_seed, seed_iteration
from shardkit.shardlist import NUM_RECORDS, ShardList
from shardkit.stateful import (
    EPOCH,
    SEQUENCE,
    SHARE,
    Resume,
    StageIterator,
    State,
    StateError,
    check,
    check_all_shares,
    check_intervals,
    check_positions,
    check_share,
    expect_equal,
    field,
    node,
    same_value,
    share_field,
    whole_number,
)
from shardkit.stats import ReadStats, SharedStats
from shardkit.topology import Topology
from shardkit.trainers import check_dataloader_len, worker_lengths

logger = logging.getLogger("shardkit")

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


class _Skipped(NamedTuple):
    """Yielded by ``_read`` in place of ``records`` records it could not read (on_error='skip')."""

    records: int


class _Cursor:
    """Where ``ShardedDataset._read`` is in a range: the next record, records yielded, a record found past the stop."""

    __slots__ = ("position", "read", "past_stop")

    def __init__(self, position: int) -> None:
        self.position = position
        self.read = 0
        self.past_stop = False


class _PlannedSource(_Source):
    """A source whose records are ranges of numbered shards, split by :func:`plan`."""

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
            raise _unknown_counts(self)
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
        expect_equal(self, "dataset", state[_RangeIterator.FINGERPRINT], self._fingerprint(counts))
        super().load_state_dict(state)

    def __len__(self) -> int:
        """Samples this rank yields per epoch (all of its workers together)."""
        check_dataloader_len(self)  # refuses a DataLoader len that would cut the epoch short
        topology = self.topology()
        counts = self._record_counts(topology, required=False)
        if not isinstance(counts, np.ndarray):
            raise self._unknown_length("the record counts of its shards are unknown (call count_records() first)")
        return rank_span(int(counts.sum()), topology.world_size, topology.rank, self.balance)[1]

    def reader_lengths(self, num_workers: int) -> list[int] | None:
        """Samples each of ``num_workers`` DataLoader workers yields per pass: this rank's, split as planned."""
        return worker_lengths(len(self), num_workers)

    #: Records a reader permutes at once under ``shuffle=True`` (memory: this many
    #: samples per reader); 0 keeps shuffling at the level of shards and blocks.
    shuffle_window: int = SHUFFLE_WINDOW

    #: Largest block of the shuffled stream under sample-level shuffling.
    shuffle_block: int = SHUFFLE_BLOCK

    def _windowed(self) -> bool:
        """Whether ``shuffle=True`` shuffles samples here (needs known record counts)."""
        return self.shuffle_shards and self.shuffle_window > 0

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        topology, epoch = self._start()
        counts, balance = self._counts(topology)
        kwargs = {"seed": self.seed, "epoch": epoch, "shuffle": self.shuffle_shards, "balance": balance}
        if not isinstance(counts, np.ndarray):  # no positions without counts: whole shards
            if resume is not None:
                self._fingerprint(counts)  # raises, naming the fix
            pieces = plan_whole_shards(counts, topology, seed=self.seed, epoch=epoch, shuffle=self.shuffle_shards)
            return self._hinting(_RangeIterator(self._calls(), pieces, epoch, topology, None), counts, topology, kwargs)
        if self._windowed():
            kwargs["block_size"] = self.shuffle_block
        fingerprint = self._fingerprint(counts)
        base = None if resume is None else _RangeIterator.base_of(resume, fingerprint)
        size = self._chunk_size(counts, topology, base, kwargs)
        start = _RangeIterator.start_of(resume, size, self._windowed(), topology)
        iterator = self._new_iterator(counts, topology, epoch, fingerprint, start, kwargs, base)
        if start.exact and resume is not None:  # the window read again must leave what the state says is left
            saved = resume.state[_RangeIterator.REMAINING]
            expect_equal(self, "remaining positions (for its window)", saved, iterator.remaining())
        return iterator

    def _calls(self) -> _SourceCalls:
        """What a :class:`_RangeIterator` calls back: this source's reads, hints and padding counts."""
        return _SourceCalls(self, self._read, self._hint, self._count_padded)

    def _chunk_size(self, counts: np.ndarray, topology: Topology, base: State | None, kwargs: dict[str, Any]) -> int:
        """Positions in this rank's chunk. After a global state (``base``) the chunk
        is this rank's part of what that state left, which ``kwargs`` then carry."""
        total, balance = int(counts.sum()), kwargs["balance"]
        if base is None:
            return rank_span(total, topology.world_size, topology.rank, balance)[1]
        chunk = split_remaining(base["remaining"], total, topology.world_size, topology.rank, balance)
        kwargs.update(chunk=chunk, stream_world_size=base["world_size"])
        return sum(b - a for a, b in chunk)

    def _new_iterator(
        self,
        counts: np.ndarray,
        topology: Topology,
        epoch: int,
        fingerprint: dict[str, Any],
        start: _Start,
        kwargs: dict[str, Any],
        base: State | None,
    ) -> _RangeIterator | _WindowIterator:
        """The iterator over ``start``'s positions: their ranges, windowed under sample-level shuffling."""
        pieces = plan_intervals(counts, topology, start.intervals, **kwargs)
        stand_in = None
        if self._makes_up(kwargs["balance"]):
            stand_in = functools.partial(self._stand_in, counts, topology, kwargs)
        ranges = _RangeIterator(self._calls(), pieces, epoch, topology, fingerprint, stand_in)
        ranges.base = base
        self._hinting(ranges, counts, topology, kwargs)
        if not self._windowed():
            return ranges
        return _WindowIterator(ranges, start.intervals, self.shuffle_window, seed=self.seed, skip=start.yielded)

    def _hinting(
        self, ranges: _RangeIterator, counts: Any, topology: Topology, kwargs: dict[str, Any]
    ) -> _RangeIterator:
        """``ranges``, set to hint the next epoch's first ranges as it ends when the shards are remote."""
        if self._reads_remote():
            ranges.next_head = functools.partial(self._next_epoch_head, counts, topology, kwargs)
        return ranges

    def _reads_remote(self) -> bool:
        """Whether hints can start anything: the shards are remote (the first one says for all)."""
        shards = getattr(self, "shards", None)
        if shards is None or not len(shards):
            return False
        first = str(shards[0])
        return "://" in first and not first.startswith("file://")

    def _next_epoch_head(self, counts: Any, topology: Topology, kwargs: dict[str, Any]) -> list[Range]:
        """The first ranges this reader reads in the next epoch when that epoch is ``epoch + 1`` from its
        start (the usual next pass). A guess, only used to open shards ahead: a wrong one costs the
        requests of a few blocks, never a record."""
        fresh = {k: v for k, v in kwargs.items() if k not in ("chunk", "stream_world_size")}
        fresh["epoch"] += 1
        if not isinstance(counts, np.ndarray):
            whole = plan_whole_shards(counts, topology, seed=self.seed, epoch=fresh["epoch"], shuffle=fresh["shuffle"])
            return [whole[i][1] for i in range(min(_HINTED, len(whole)))]
        size = rank_span(int(counts.sum()), topology.world_size, topology.rank, fresh["balance"])[1]
        start = _RangeIterator.start_of(None, size, self._windowed(), topology)
        pieces = plan_intervals(counts, topology, start.intervals, **fresh)
        return [pieces[i][1] for i in range(min(_HINTED, len(pieces)))]

    def _makes_up(self, balance: Balance) -> bool:
        """Whether records this source skips are replaced by repeats, to keep ranks balanced."""
        return False

    def _stand_in(self, counts: np.ndarray, topology: Topology, kwargs: dict[str, Any]) -> Any:
        """A sample to repeat in place of skipped records when the reader has yielded none yet."""
        raise NotImplementedError

    def _count_padded(self, shard: int) -> None:
        """Count one sample yielded in place of a skipped or missing record of ``shard``."""


def _unknown_counts(owner: object) -> StateError:
    return StateError(
        f"{owner!r}: resuming needs the record count of every shard, and some are unknown; "
        "call count_records() (or give counts: a manifest, index files) before iterating"
    )


def _calling(callback: Callable[[], None]) -> Iterator[Any]:
    """An empty iterator that calls ``callback`` when it is reached (in an ``itertools.chain``)."""
    callback()
    yield from ()


_HINTED: Final = 3
"""Ranges hinted ahead of the one being opened (the remote module keeps four shards open ahead)."""


class _SourceCalls(NamedTuple):
    """The source a :class:`_RangeIterator` reads for (named in errors) and what it calls back."""

    owner: object
    read: Callable[[int, int, int | None], Iterator[Any]]
    hint: Callable[[int, int, int | None], None]
    count_padded: Callable[[int], None]


class _Start(NamedTuple):
    """Where a reader starts: the positions it reads (in order), the samples of its
    first window already yielded, and whether that window is exactly a saved one."""

    intervals: list[tuple[int, int]]
    yielded: int
    exact: bool


class _RangeIterator(StageIterator):
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

    Its node (``"planned"``, see :mod:`shardkit.state`) is positions: the
    keys below, ``epoch`` and ``share``. A :class:`_WindowIterator` over it
    adds ``window``. A planned source's ``_open`` plans the positions a
    loaded node leaves (:meth:`start_of`, :meth:`base_of`) instead of loading
    them into an iterator.
    """

    KIND = "planned"
    WORLD_SIZE = "world_size"  #: state key: the world size (of a global node: that its stream was planned for)
    RANK = "rank"  #: state key: the rank; None in a global node (all ranks')
    FINGERPRINT = "fingerprint"  #: state key: what the dataset must agree on (``_PlannedSource._fingerprint``)
    REMAINING = "remaining"  #: state key: ``[start, stop)`` intervals of positions still to read
    BASE = "base"  #: state key: the global node (``world_size``, ``remaining``) this epoch resumed from
    WINDOW = "window"  #: state key: ``{"from": positions from the window's start, "yielded": its samples yielded}``
    WINDOW_FROM = "from"
    WINDOW_YIELDED = "yielded"

    def __init__(
        self,
        source: _SourceCalls,
        pieces: Sequence[tuple[int | None, Range]],
        epoch: int,
        topology: Topology,
        fingerprint: dict[str, Any] | None,
        stand_in: Callable[[], Any] | None = None,
    ) -> None:
        self._source = source
        self._planned = pieces if isinstance(pieces, PlannedRanges) else None
        if isinstance(pieces, (PlannedRanges, WholeShards)):  # a plan's arrays, indexed lazily: no object per shard
            self.positions: Sequence[int | None] = pieces.positions
            self.ranges: Sequence[Range] = pieces.ranges
        else:
            self.positions = [position for position, _ in pieces]
            self.ranges = [piece for _, piece in pieces]
        self.range_index = 0
        self.done_in_range = 0
        self._records: Iterator[Any] | None = None
        self.epoch = epoch
        self.topology = topology
        self._fingerprint = fingerprint
        self._stand_in = stand_in
        self._last: Any = _NOTHING
        self._owed = 0  # records skipped in the current range and not made up yet
        self.skips: list[tuple[int, int]] = []  # (first position, records) of runs skipped without a sample
        self.base: State | None = None  # the global node this epoch resumed from, on another world
        # This reader's first ranges of the next epoch, hinted as this one ends (a pass begun in the next epoch
        # then starts on shards already open). None: nothing to hint, the source reads no remote shards.
        self.next_head: Callable[[], list[Range]] | None = None
        self._head: list[Range] | None = None
        self._hinted: list[Range] = []

    def __next__(self) -> Any:
        if self._owed:
            return self._made_up()
        while self.range_index < len(self.ranges):
            records = self._records if self._records is not None else self._open_range()
            try:
                sample = next(records)
            except StopIteration:
                self._finish_range()
                continue
            if isinstance(sample, _Skipped):
                if self._skip(sample.records):
                    return self._made_up()
                continue
            self.done_in_range += 1
            if self._stand_in is not None:
                self._last = sample
            return sample
        raise StopIteration

    def _open_range(self) -> Iterator[Any]:
        """Start reading the current range (from where it stopped) and hint the next three."""
        shard, start, stop = self.ranges[self.range_index]
        self._records = self._source.read(shard, start + self.done_in_range, stop)
        ahead = self.ranges[self.range_index + 1 : self.range_index + 1 + _HINTED]
        for piece in ahead:
            self._source.hint(*piece)
        if len(ahead) < _HINTED and self.next_head is not None:  # the epoch's end: the next one's start
            # Once this range's shard is open: hinting it before would find it still held open for this read.
            self._records = itertools.chain(
                itertools.islice(self._records, 1), _calling(self._hint_next_epoch), self._records
            )
        return self._records

    def _hint_next_epoch(self) -> None:
        """Hint the next epoch's first ranges, up to three ahead in all, but none of a shard this epoch still
        reads (it is hinted once its range here has opened it: the next epoch needs its own open)."""
        if self._head is None:
            self._head = self.next_head() if self.next_head is not None else []
        later = {piece[0] for piece in self.ranges[self.range_index + 1 :]}  # at most two: the epoch's last ranges
        room = _HINTED - (len(self.ranges) - self.range_index - 1)
        for piece in self._head[: max(0, room)]:
            if piece[0] not in later and piece not in self._hinted:
                self._hinted.append(piece)
                self._source.hint(*piece)

    def _skip(self, records: int) -> bool:
        """Account for ``records`` skipped records; True if they are to be made up now."""
        if self._stand_in is not None:
            self._owed = records
            return records > 0
        position = self.positions[self.range_index]
        if position is not None and records:  # for _WindowIterator: positions without a sample
            self.skips.append((position + self.done_in_range, records))
        self.done_in_range += records
        return False

    def _made_up(self) -> Any:
        """One repeat in place of the next skipped record (see the class docstring)."""
        if self._last is _NOTHING:
            self._last = self._stand_in()  # type: ignore[misc]
        self._owed -= 1
        self.done_in_range += 1
        self._source.count_padded(self.ranges[self.range_index].shard)
        return self._last

    def _finish_range(self) -> None:
        self._records = None
        self.range_index += 1
        self.done_in_range = 0

    def remaining(self) -> list[list[int]]:
        """The positions of this reader's part not read yet (records, not samples)."""
        if self._planned is not None:  # vectorised: a million ranges take milliseconds, not a second
            return [list(interval) for interval in self._planned.remaining(self.range_index, self.done_in_range)]
        remaining = []
        for index in range(self.range_index, len(self.ranges)):
            _, start, stop = self.ranges[index]
            position = self.positions[index]
            assert position is not None and stop is not None  # positions exist with known counts only
            done = self.done_in_range if index == self.range_index else 0
            remaining.append((position + done, position + stop - start))
        return [list(interval) for interval in union(remaining)]

    def state_dict(self) -> State:
        """The positions of this reader's part not read yet, and whose part it is."""
        if self._fingerprint is None:  # no positions without record counts
            raise _unknown_counts(self._source.owner)
        fields = {
            EPOCH: self.epoch,
            self.WORLD_SIZE: self.topology.world_size,
            self.RANK: self.topology.rank,
            self.FINGERPRINT: self._fingerprint,
            self.REMAINING: self.remaining(),
            SHARE: share_field(self.topology),
        }
        return node(self.KIND, **fields, **({} if self.base is None else {self.BASE: self.base}))

    @classmethod
    def base_of(cls, resume: Resume, fingerprint: dict[str, Any]) -> State | None:
        """The global node (``world_size``, ``remaining``) an epoch resumed from on
        another world, if any; the loaded node must be of this dataset (``fingerprint``)."""
        state, owner = resume.state, resume.owner
        expect_equal(owner, "dataset", state[cls.FINGERPRINT], fingerprint)
        if state[cls.RANK] is None:
            check_positions(owner, state[cls.REMAINING], state[cls.FINGERPRINT]["records"])
            return {cls.WORLD_SIZE: state[cls.WORLD_SIZE], cls.REMAINING: state[cls.REMAINING]}
        return state.get(cls.BASE)

    @classmethod
    def start_of(cls, resume: Resume | None, size: int, windowed: bool, topology: Topology) -> _Start:
        """Where this reader starts in a rank chunk of ``size`` positions: its even part of the
        chunk, unless ``resume`` is a rank's node (a global one only changes the chunk)."""
        if resume is None or resume.state[cls.RANK] is None:
            return _Start(share([(0, size)], topology.num_workers, topology.worker_id), 0, False)
        state, owner = resume.state, resume.owner
        expect_equal(owner, "world_size", state[cls.WORLD_SIZE], topology.world_size)
        expect_equal(owner, "rank", state[cls.RANK], topology.rank)
        remaining = state[cls.REMAINING]
        check_positions(owner, remaining, size)
        window = state.get(cls.WINDOW) if windowed else None
        if window is not None and (resume.own or topology.num_workers == 1):  # exactly where it stopped
            check_positions(owner, window[cls.WINDOW_FROM], size)
            return _Start([(a, b) for a, b in window[cls.WINDOW_FROM]], window[cls.WINDOW_YIELDED], True)
        if resume.own:
            return _Start(union(remaining), 0, False)
        return _Start(share(remaining, topology.num_workers, topology.worker_id), 0, False)

    @classmethod
    def check_state(cls, state: State, where: str) -> None:
        whole_number(state, EPOCH, where)
        world_size = whole_number(state, cls.WORLD_SIZE, where, 1)
        rank = field(state, cls.RANK, where, int, type(None))
        if rank is not None and rank < 0:
            raise StateError(f"{where}: state['rank'] must be >= 0 (or None for a global state), got {rank}")
        if rank is not None and rank >= world_size:
            raise StateError(f"{where}: state['rank'] {rank} is not below state['world_size'] {world_size}")
        field(state, cls.FINGERPRINT, where, dict)
        check_intervals(field(state, cls.REMAINING, where, *SEQUENCE), where)
        check_share(state, where)
        base = field(state, cls.BASE, where, dict, type(None)) if cls.BASE in state else None
        if rank is None and (state[SHARE] is not None or base is not None):
            raise StateError(f"{where}: a global state (rank None) has no share and no base")
        if base is not None:
            whole_number(base, cls.WORLD_SIZE, f"{where} (base)", 1)
            check_intervals(field(base, cls.REMAINING, f"{where} (base)", *SEQUENCE), f"{where} (base)")
        if cls.WINDOW in state[cls.FINGERPRINT]:  # a dataset that shuffles samples: the key is always there
            cls._check_window(state, rank, where)

    @classmethod
    def _check_window(cls, state: State, rank: int | None, where: str) -> None:
        window = field(state, cls.WINDOW, where, dict, type(None))
        if window is None:  # a merged state: positions only
            return
        if rank is None:
            raise StateError(f"{where}: a global state (rank None) has no window")
        check_intervals(field(window, cls.WINDOW_FROM, f"{where} (window)", *SEQUENCE), f"{where} (window)", "from")
        whole_number(window, cls.WINDOW_YIELDED, f"{where} (window)")

    @classmethod
    def merge(cls, states: Sequence[State]) -> State:
        """The workers' remaining positions united (each position is one worker's); windows start afresh."""
        check_all_shares(states)
        keys = (EPOCH, cls.WORLD_SIZE, cls.RANK, cls.FINGERPRINT)
        fields = {key: same_value(states, key) for key in keys}
        if states[0].get(cls.BASE) is not None:
            fields[cls.BASE] = same_value(states, cls.BASE)
        intervals = [interval for s in states for interval in s[cls.REMAINING]]
        remaining = union(intervals)
        if sum(b - a for a, b in remaining) != sum(b - a for a, b in intervals):
            raise StateError(
                "cannot merge worker states whose remaining positions overlap: each position is one worker's"
            )
        window = {cls.WINDOW: None} if cls.WINDOW in fields[cls.FINGERPRINT] else {}
        return node(cls.KIND, **fields, **{cls.REMAINING: [list(i) for i in remaining], SHARE: None}, **window)

    @classmethod
    def merge_ranks(cls, states: Sequence[State]) -> State:
        """The positions no rank has read yet, in the epoch's global stream (``rank`` None)."""
        fields = {key: same_value(states, key) for key in (EPOCH, cls.WORLD_SIZE, cls.FINGERPRINT)}
        fingerprint, world_size = fields[cls.FINGERPRINT], fields[cls.WORLD_SIZE]
        ranks = sorted(s[cls.RANK] for s in states)
        if ranks != list(range(world_size)):
            raise StateError(
                f"merge_ranks needs the state of every rank 0..{world_size - 1} exactly once, got ranks {ranks}"
            )
        bases = [s.get(cls.BASE) for s in states]
        if any(b != bases[0] for b in bases):
            raise StateError("cannot merge rank states resumed from different global states")
        pieces = [piece for state in states for piece in cls._global_positions(state, fingerprint, bases[0])]
        remaining = union(pieces)
        if sum(b - a for a, b in remaining) != sum(b - a for a, b in pieces):
            raise StateError("cannot merge rank states that both hold the same positions: each position is one rank's")
        window = {cls.WINDOW: None} if cls.WINDOW in fingerprint else {}
        return node(
            cls.KIND,
            **{EPOCH: fields[EPOCH], cls.WORLD_SIZE: world_size if bases[0] is None else bases[0][cls.WORLD_SIZE]},
            **{cls.RANK: None, cls.FINGERPRINT: fingerprint, cls.REMAINING: [list(i) for i in remaining]},
            **{SHARE: None},
            **window,
        )

    @classmethod
    def _global_positions(cls, state: State, fingerprint: dict[str, Any], base: State | None) -> list[tuple[int, int]]:
        """A rank's remaining positions in the global stream (repeats that ``"pad"`` planned are not owed)."""
        total, balance, world_size = fingerprint["records"], fingerprint["balance"], state[cls.WORLD_SIZE]
        if base is None:
            start, size = rank_span(total, world_size, state[cls.RANK], balance)
            chunk = [(start, start + size)]
        else:
            chunk = split_remaining(base[cls.REMAINING], total, world_size, state[cls.RANK], balance)
        pieces = []
        for a, b in state[cls.REMAINING]:
            pieces += [(x, min(y, total)) for x, y in through(chunk, a, b) if x < total]
        return pieces


_PlannedSource._iterator_type = _RangeIterator  # named here: the source class comes first in this module


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
        unyielded = [(self._positions[i], self._positions[i] + 1) for i in self._order[self._yielded :]]
        return [list(interval) for interval in union(unyielded + list(self._rest))]

    def state_dict(self) -> State:
        """The ranges' node, with the unyielded positions as ``remaining`` and the window's start."""
        state = self._ranges.state_dict()
        state[_RangeIterator.REMAINING] = self.remaining()
        state[_RangeIterator.WINDOW] = {
            _RangeIterator.WINDOW_FROM: [list(i) for i in self._from],
            _RangeIterator.WINDOW_YIELDED: self._yielded,
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
        storage_options: fsspec options, for a glob ``shards``. A glob is
            listed once per job: under a torch.distributed process group the
            first rank to build the dataset lists it and the others read that
            listing from the group's store; DataLoader workers never list (see
            :mod:`shardkit.listing`). A manifest skips listing altogether.

    Record counts come from the shard list, else from the files' own index
    files or footers (under every ``balance``), the same way in every rank and
    worker whatever was called first (see :func:`~shardkit.counting.plan_counts`).
    When they are still unknown, one rank deals whole shards to its
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
      CRC mismatch, a record that does not decode) costs that record only
      (``read_fn`` raises a :class:`~shardkit.CorruptRecordError` with
      ``framing_intact`` and is called again from the next record, or yields
      a :class:`~shardkit.formats.base.BadRecord` in its place and reads on);
      an intact error with ``records=n`` (a Parquet row group) costs those
      ``n`` records, with one warning and one error counted;
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
    * a shard that ends cleanly more than :data:`MADE_UP_MISSING` records (and
      more than it read) short of its range raises :class:`BalanceError` under
      ``"pad"``/``"drop"``: a count that far off is wrong, and making it up would
      repeat stand-ins practically without end. So does a range that loses that
      many to a break in the framing when its shard's count is more than the
      file's size can hold (a format's ``record_bound``, see
      :func:`~shardkit.formats.base.max_records`).
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
        self._stored_shared = False  # the job's stored counts came through the process group: look no more
        self._share_stored_counts()

    def count_records(self) -> ShardedDataset:
        """Fill in unknown record counts now (in this process), and return self.

        Call it on every rank (under a process group it is a collective), before
        building the DataLoader so that workers do not each count; the counts are
        also kept in the counts cache (see :mod:`shardkit.counting`).
        """
        self.shards = resolve_counts(
            self.shards, self.count_fn, why=repr(self), storage_options=self.storage_options, **self._count_policy()
        )
        return self

    def stats(self) -> ReadStats:
        """Records read, skipped, missing and padded and errors met, per shard,
        summed over every worker of this process's DataLoader (and this
        process); see :class:`~shardkit.stats.ReadStats`."""
        return self._stats.snapshot()

    def _record_counts(self, topology: Topology, *, required: bool) -> Any:
        counts = self._resolve_counts(required)
        if counts is not None:
            return counts
        if len(self.shards) < topology.num_workers and topology.worker_id == 0:
            warnings.warn(
                f"{len(self.shards)} shards for {topology.num_workers} DataLoader workers and unknown "
                "record counts: whole shards are dealt out, so some workers get none. Give record "
                "counts (a manifest or index files) to split shards, or use fewer workers",
                stacklevel=3,
            )
        return self.shards.table.column("num_records")

    def _resolve_counts(self, required: bool) -> np.ndarray | None:
        """The record counts every plan, ``len()`` and state of this source use (None: unknown, whole
        shards are dealt), by :func:`~shardkit.counting.plan_counts`: the same precedence in every
        rank and worker, whichever method runs first. Counts once known are kept in ``shards``.

        Raises:
            IndexFileError: an index does not fit its shard: it is refused, not trusted.
        """
        if self.shards.num_records is None:
            stored_count = None if self._stored_shared else self._stored_count()
            self.shards = plan_counts(
                self.shards, stored_count=stored_count, count_fn=self.count_fn, required=required,
                why=repr(self), storage_options=self.storage_options, **self._count_policy(),
            )  # fmt: skip
        return self.shards.num_records

    def _count_policy(self) -> dict[str, Any]:
        """What counting does with a shard it cannot count: raise, or under ``on_error="skip"`` count what
        ``read_fn`` yields from it, so that the plan reads exactly that (see :func:`~shardkit.counting.resolve_counts`)."""
        return {"on_error": self.on_error, "salvage": Salvage(self.read_fn, self._counted_damaged)}

    def _counted_damaged(self, url: str, count: int) -> None:
        """Count the error of a damaged shard counted as empty: no plan opens it, so reading never will. (One
        counted as holding records has its break met, and counted, by the range that reads to its end.)"""
        if count == 0:
            for shard in np.flatnonzero(self.shards.table.column("url").to_numpy(zero_copy_only=False) == url):
                self._stats.add(int(shard), errors=1)

    def _share_stored_counts(self) -> None:
        """Under a process group, take the stored counts once per job, as the first rank to build a dataset
        over these shards found them (:func:`~shardkit.counting.shared_stored_counts`), so that every rank
        and worker plans with the same counts and DataLoader workers look nothing up."""
        stored_count = self._stored_count() if self.shards.num_records is None else None
        if stored_count is not None:
            shared = shared_stored_counts(
                self.shards, stored_count, storage_options=self.storage_options, **self._count_policy()
            )
            if shared is not None:
                self.shards, self._stored_shared = shared, True

    def _stored_count(self) -> StoredCountFn | None:
        """``stored_count(url)``, the count a shard's own metadata or index file holds (None where it
        has none); None when the reader keeps no such count."""
        return None

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
                    if not isinstance(sample, BadRecord):
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
                    ask = stop + 1 if tail and stop is not None else stop
                    yield from self._records(shard, url, cursor, stop, ask)
                    break
                except Exception as error:
                    intact = isinstance(error, CorruptRecordError) and error.framing_intact
                    exceeded = None if intact or stop is None else self._exceeded_bound(shard, stop, cursor)
                    if exceeded is not None:  # the rest of the range is a lie too large to make up
                        self._stats.add(shard, errors=1)
                        raise _count_beyond_size(url, exceeded) from error
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
                if sample.__class__ is BadRecord:
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
        if intact:  # the records' data is bad, the framing around them is fine: skip just them
            spoilt = error.records if isinstance(error, CorruptRecordError) else 1
            lost = spoilt if stop is None else max(0, min(spoilt, stop - position))
            what = (
                f"record {position}" if lost <= 1 else f"records {position} to {position + lost - 1} ({lost} records)"
            )
            warnings.warn(f"skipping {what} of {redact_url(url)}: {_plain_message(error)}", stacklevel=3)
        else:
            lost = 0 if stop is None else stop - position
            what = "the rest of the shard (count unknown)" if stop is None else f"{lost} records"
            warnings.warn(
                f"skipping {what} of {redact_url(url)} from record {position}: {_plain_message(error)}", stacklevel=3
            )
        self._stats.add(shard, skipped=lost, errors=1)
        return lost

    def _record_bound(self, shard: int) -> RecordBound | None:
        """The most records ``shard``'s file can hold by its size; None: no bound known (a plain
        ``read_fn`` says nothing of its format)."""
        return None

    def _past_allowance(self, lost: int, cursor: _Cursor) -> bool:
        """Whether ``lost`` records are more than ``"pad"``/``"drop"`` may make up for a range that read
        ``cursor.read`` (:data:`MADE_UP_MISSING`); never under ``"none"``, which makes nothing up."""
        return self._makes_up(self.balance) and lost > max(MADE_UP_MISSING, cursor.read)

    def _exceeded_bound(self, shard: int, stop: int, cursor: _Cursor) -> _Exceeded | None:
        """Why ``"pad"``/``"drop"`` must not make up records ``[cursor.position, stop)`` of ``shard``:
        they are more than the allowance (``max(MADE_UP_MISSING, records read)``) and the planned count
        is more than the file's size can hold (a lie, however the read ended). None otherwise: an
        honest count on a shard whose framing breaks early is padded to its end."""
        lost, planned = stop - cursor.position, self._planned_count(shard)
        if planned is None or not self._past_allowance(lost, cursor):
            return None
        bound = self._record_bound(shard)
        return _Exceeded(planned, bound, lost) if bound is not None and planned > bound.most else None

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
            if self._past_allowance(missing, cursor):
                exceeded = self._exceeded_bound(shard, stop, cursor)
                raise _count_taken_as_wrong(error, missing, cursor.read, exceeded)
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


def as_shard_list(shards: ShardList | str | Sequence[str], storage_options: dict[str, Any] | None = None) -> ShardList:
    """A :class:`ShardList` from a ShardList, a glob pattern or a list of urls."""
    if isinstance(shards, ShardList):
        return shards
    if isinstance(shards, str):
        from shardkit.listing import shared_listing

        # Once per job: the first rank to get here lists, the others read its listing from the
        # process group's store (not a collective: a rank-0-only build does not wait).
        return shared_listing(shards, storage_options)
    if isinstance(shards, Sequence):
        return ShardList(list(shards))
    raise DatasetError(f"shards must be a ShardList, a glob pattern or a list of urls, got {type(shards).__name__}")


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
        return map(self.dataset.__getitem__, range(start, len(self.dataset) if stop is None else stop))

    def __repr__(self) -> str:
        return f"wrap({type(self.dataset).__name__} of {len(self.dataset)}, shuffle={self.shuffle_shards}, balance={self.balance!r})"


class StreamSource(_Source):
    """An iterable as a source: reader ``k`` of ``n`` keeps items ``k, k + n, ...``; see :func:`wrap`."""

    def __init__(
        self, iterable: Iterable[Any], *, seed: int, balance: Balance, rank: int | None, world_size: int | None
    ) -> None:
        super().__init__(shuffle=False, seed=seed, balance=balance, rank=rank, world_size=world_size)
        self.iterable = iterable

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        topology, epoch = self._start()
        iterator = _StrideIterator(
            iter(self.iterable), topology.reader_index, topology.num_readers, self.balance, epoch
        )
        if resume is not None:
            iterator.restore(resume)
        return iterator

    def __repr__(self) -> str:
        return f"wrap({type(self.iterable).__name__}, balance={self.balance!r})"


class _StrideIterator(StageIterator):
    """Keeps item ``slot`` of every group of ``readers`` consecutive items.

    The last, incomplete group: ``"none"`` keeps the item if there is one;
    ``"drop"`` keeps nothing of it; ``"pad"`` keeps an item of it in every
    reader (wrapping round the group), so all readers yield the same number.

    Its node (``"stream"``): ``epoch``, the ``items`` stepped past, whether it
    is ``done``, and its ``reader`` slot; resuming iterates the iterable again
    and skips them, so it resumes only into the same reader slot.
    """

    KIND = "stream"
    READER = "reader"  #: state key: ``[slot, readers]``, the reader slot (rank-major) and how many there are
    ITEMS = "items"  #: state key: items stepped past
    DONE = "done"  #: state key: the last group was handled

    def __init__(self, items: Iterator[Any], slot: int, readers: int, balance: Balance, epoch: int) -> None:
        self._items = items
        self._slot = slot
        self._readers = readers
        self._balance = balance
        self._done = False
        self._epoch = epoch
        self.items_seen = 0

    @property
    def reader(self) -> list[int]:
        """``[slot, readers]``: which reader this is."""
        return [self._slot, self._readers]

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        group = []
        for item in self._items:
            self.items_seen += 1
            group.append(item)
            if len(group) == self._readers:
                return group[self._slot]
        self._done = True
        if group and self._balance == "pad":
            return group[self._slot % len(group)]
        if group and self._balance == "none" and self._slot < len(group):
            return group[self._slot]
        raise StopIteration

    def state_dict(self) -> State:
        """How many items this reader has stepped past; resuming replays them."""
        fields = {EPOCH: self._epoch, self.READER: self.reader, self.ITEMS: self.items_seen, self.DONE: self._done}
        return node(self.KIND, **fields)

    def restore(self, resume: Resume) -> None:
        """Step past the items the saved reader had stepped past (they are read again); same slot only."""
        state = resume.state
        expect_equal(
            resume.owner, "reader slot [rank * num_workers + worker, readers]", state[self.READER], self.reader
        )
        items = state[self.ITEMS]
        for _ in itertools.islice(self._items, items):
            self.items_seen += 1
        if self.items_seen < items:
            raise StateError(
                f"the state says {items} items were read, but the iterable has only {self.items_seen}; "
                "it must yield the same items every time it is iterated"
            )
        self._done = state[self.DONE]

    @classmethod
    def check_state(cls, state: State, where: str) -> None:
        whole_number(state, EPOCH, where)
        reader = field(state, cls.READER, where, *SEQUENCE)
        if len(reader) != 2 or any(type(v) is not int for v in reader) or not 0 <= reader[0] < reader[1]:
            raise StateError(f"{where}: state['reader'] must be [slot, readers] with 0 <= slot < readers, got {reader}")
        whole_number(state, cls.ITEMS, where)
        field(state, cls.DONE, where, bool)

    @classmethod
    def merge(cls, states: Sequence[State]) -> State:
        """Only one reader's node merges (into itself): readers keep every n-th item."""
        if len(states) == 1:
            return states[0]
        raise StateError(
            "a wrap() of a plain iterable resumes only into the same reader slot (same num_workers): "
            "its readers keep every n-th item, so their positions cannot be split anew. "
            "Wrap a map-style dataset or use shard files to resume with another number of workers"
        )


StreamSource._iterator_type = _StrideIterator  # named here: the source class comes first in this module


# --------------------------------------------------------------------------- sources over the named formats


class _FormatDataset(ShardedDataset):
    """A :class:`ShardedDataset` over one :class:`~shardkit.formats.base.ShardFormat`, through its
    capabilities (:class:`~shardkit.formats.base.FormatBase`, defaults for a format without them):
    it reads with ``read_marked`` (bad records skipped one at a time where the format can step
    over them), counts with ``count``, takes record counts the files hold (``stored_count``: index
    files, footers) when the shard list has none, bounds counts by file size (``record_bound``),
    and opens the next ranges of remote shards ahead (``prefetch``)."""

    def __init__(self, shards: ShardList | str | Sequence[str], fmt: Any, **options: Any) -> None:
        self.format = capabilities(fmt)
        super().__init__(shards, self.format.read_marked, count_fn=self.format.count, **options)

    def _stored_count(self) -> StoredCountFn | None:
        return self.format.stored_count

    def _record_bound(self, shard: int) -> RecordBound | None:
        try:
            return self.format.record_bound(self.shards[shard])
        except Exception:  # the file cannot even be stat'ed (gone, no access): no bound, the usual rules apply
            return None

    def _hint(self, shard: int, start: int, stop: int | None) -> None:
        self.format.prefetch(self.shards[shard], start, stop)


class TFRecordDataset(_FormatDataset):
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
            are read (see :mod:`shardkit.io.remote`): ``readahead_bytes`` are fetched ahead of
            the reader, across shard boundaries in the plan's order (default
            :data:`~shardkit.io.remote.DEFAULT_READAHEAD_BYTES`, 0 turns it off); transient
            failures are retried under ``retry`` (a :class:`~shardkit.io.remote.RetryPolicy`);
            ``cache_dir`` keeps fetched shards on local disk, shared by the processes of a
            machine, under ``cache_limit_bytes`` (see :mod:`shardkit.io.cache`). Local files ignore all four.

        features, batch_size: yield column batches instead of samples: each
            batch is :func:`~shardkit.decode_columns` of the next ``batch_size``
            records (the last one may be shorter), ``features`` mapping names
            to fixed shapes, e.g. ``{"label": ("int64", ()), "image": ("bytes", ())}``.
            Use ``DataLoader(dataset, batch_size=None)``. Plans, shuffling,
            ``on_error`` and resuming stay per record; ``len()`` counts batches.
            A record that does not fit ``features`` raises
            :class:`~shardkit.ShardkitError` naming the feature and the record's
            place in its batch; under ``on_error="skip"`` every record is
            checked as it is read (:class:`~shardkit.formats.example.FeatureCheck`,
            a second decode), and one that does not fit is skipped alone,
            like a record with a bad CRC: warned with its url, record index
            and byte offset, and counted in ``stats()``.
            :class:`~shardkit.MixedLoader` cuts its batches from column batches
            without per-sample work (see ``column_batches``).

    The other arguments are those of :class:`ShardedDataset`. Record counts,
    when needed and not in the ShardList, come from index files or from one
    fast framing scan. Reading is :class:`~shardkit.formats.tfrecord.TFRecordFormat`'s.
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
        features: Mapping[str, FeatureSpec] | None = None,
        batch_size: int | None = None,
    ) -> None:
        from shardkit.formats.tfrecord import DECODERS, TFRecordFormat

        self.features, self.batch_size = _column_options(features, batch_size, decode)
        if features is not None:  # decode_columns decodes whole batches; under skip, each record is checked alone
            decode = FeatureCheck(features) if on_error == "skip" else "raw"
        if not callable(decode) and decode not in DECODERS:
            raise DatasetError(f"decode must be one of {DECODERS} or a callable on the record bytes, got {decode!r}")
        if compression not in (None, "gzip", "zlib", "auto"):
            raise DatasetError(f"compression must be None, 'gzip', 'zlib' or 'auto', got {compression!r}")
        fmt = TFRecordFormat(
            decode=decode, verify=verify, compression=compression, index=index, storage_options=storage_options,
            remote=remote_options(readahead_bytes, retry, cache_dir, cache_limit_bytes),
        )  # fmt: skip
        super().__init__(
            shards, fmt, shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size,
            on_error=on_error, storage_options=storage_options,
        )  # fmt: skip

    def __iter__(self) -> Iterator[Any]:
        records = super().__iter__()  # its state is the dataset's: a batch is drawn in one step
        if self.features is None or self.batch_size is None:
            return records
        return ColumnBatches(records, self.features, self.batch_size)

    @property
    def column_batches(self) -> bool:
        """Whether this dataset yields column batches (``features`` given); :class:`~shardkit.MixedLoader`
        then cuts its batches from them."""
        return self.features is not None

    def num_samples(self) -> int:
        """Records this rank reads per epoch, all of its workers together (``len()`` without ``features``)."""
        return super().__len__()

    def __len__(self) -> int:
        """Samples (with ``features``: batches) this rank yields per epoch, all of its workers together."""
        records = super().__len__()
        if self.batch_size is None:
            return records
        from shardkit.trainers import _loader_workers, worker_lengths

        return sum(-(-n // self.batch_size) for n in worker_lengths(records, _loader_workers()))


def _column_options(
    features: Mapping[str, FeatureSpec] | None, batch_size: int | None, decode: Any
) -> tuple[dict[str, FeatureSpec] | None, int | None]:
    """Check :class:`TFRecordDataset`'s ``features`` and ``batch_size``."""
    if features is None and batch_size is None:
        return None, None
    if features is None or type(batch_size) is not int or batch_size < 1:
        raise DatasetError(
            f"column batches need features (name -> (dtype, shape)) and batch_size (an int >= 1) together, "
            f"got features={features!r}, batch_size={batch_size!r}"
        )
    if decode != "example":
        raise DatasetError(
            f"with features, decode_columns decodes the records: leave decode at 'example', not {decode!r}"
        )
    try:
        ColumnBatches(iter(()), features, batch_size)
    except ValueError as error:
        raise DatasetError(str(error)) from None
    return dict(features), batch_size


class TarDataset(_FormatDataset):
    """An IterableDataset over WebDataset tar shards, split over ranks and workers.

    A sample is ``{"__key__": str, "__url__": str, <ext>: bytes, ...}``, grouped
    as WebDataset groups members (see :mod:`shardkit.formats.tar`).

    Args:
        shards: a :class:`ShardList`, a glob / fsspec pattern, or a list of urls.
        compression: ``"auto"`` (gzip when the file starts with its magic), ``None`` or ``"gzip"``.
        index: use tar index files beside the shards (``shardkit index``), when
            present and valid, to count samples and to seek to a range's first sample.
        readahead_bytes, retry, cache_dir, cache_limit_bytes: how remote shards
            are read, as for :class:`TFRecordDataset`.

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
        readahead_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        cache_dir: str | None = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        from shardkit.formats.tar import TarFormat

        fmt = TarFormat(
            compression=compression, index=index, storage_options=storage_options,
            remote=remote_options(readahead_bytes, retry, cache_dir, cache_limit_bytes),
        )  # fmt: skip
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
        readahead_bytes, retry, cache_dir, cache_limit_bytes: how remote shards
            are read, as for :class:`TFRecordDataset`.

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
        readahead_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        cache_dir: str | None = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        from shardkit.formats.parquet import ParquetFormat

        fmt = ParquetFormat(
            columns=columns, batch_size=batch_size, storage_options=storage_options,
            remote=remote_options(readahead_bytes, retry, cache_dir, cache_limit_bytes),
        )  # fmt: skip
        super().__init__(
            shards, fmt, shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size,
            on_error=on_error, storage_options=storage_options,
        )  # fmt: skip
        # Counts everywhere else (manifests, the counts cache, num_records=) are rows; with
        # batch_size the plan counts batches, ceil(rows / batch_size) per file, worked out here.
        self.count_fn = fmt.count_rows

    @property
    def column_batches(self) -> bool:
        """Whether this dataset yields column batches (``batch_size`` given); :class:`~shardkit.MixedLoader`
        then cuts its batches from them."""
        return self.format.batch_size is not None

    def _record_counts(self, topology: Topology, *, required: bool) -> Any:
        counts = super()._record_counts(topology, required=required)
        size = self.format.batch_size
        if size is None:
            return counts
        if isinstance(counts, np.ndarray):
            return -(-counts // size)
        import pyarrow.compute as pc

        return pc.divide(pc.add(counts, size - 1), size)  # pyright: ignore[reportAttributeAccessIssue]  (generated)

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
        readahead_bytes, retry, cache_dir, cache_limit_bytes: how remote shards
            are read, as for :class:`TFRecordDataset`.

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
        readahead_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        cache_dir: str | None = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        from shardkit.formats.jsonl import JsonlFormat

        fmt = JsonlFormat(
            compression=compression, index=index, storage_options=storage_options,
            remote=remote_options(readahead_bytes, retry, cache_dir, cache_limit_bytes),
        )  # fmt: skip
        super().__init__(
            shards, fmt, shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size,
            on_error=on_error, storage_options=storage_options,
        )  # fmt: skip
