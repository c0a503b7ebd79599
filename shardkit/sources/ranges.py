"""The iterator a planned source reads with: one reader's ranges, in order.

:class:`_RangeIterator` is the ``"planned"`` stage node (see :mod:`shardkit.state`): it reads
the ranges the plan gave its reader, accounts for records the source skipped, makes them up
under ``"pad"``/``"drop"``, and saves what is left as positions of its rank's chunk. While it
opens a range it hints the next ones to the source (:data:`_HINTED`), so that remote shards
are open before they are read.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, NamedTuple

import numpy as np

from shardkit.planning import (
    PlannedRanges,
    Range,
    WholeShards,
    positions_union,
    rank_span,
    share,
    split_remaining,
    take,
    through,
    union,
    window_order,
)
from shardkit.sources import whole
from shardkit.sources.errors import _unknown_counts
from shardkit.stateful import (
    EPOCH,
    MAX_RECORD,
    SEQUENCE,
    SHARE,
    Resume,
    StageIterator,
    State,
    StateError,
    check_all_shares,
    check_intervals,
    check_positions,
    check_share,
    expect_equal,
    field,
    node,
    pack,
    same_data,
    same_value,
    share_field,
    whole_number,
)
from shardkit.topology import Topology

_NOTHING = object()


class _Skipped(NamedTuple):
    """Yielded by ``_read`` in place of ``records`` records it could not read (on_error='skip')."""

    records: int


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
    identity: Callable[[int], str | None] = lambda shard: None  # a shard's file identity now (whole.STARTED)


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
    UNBOUNDED_FIELDS = frozenset({FINGERPRINT})  # only compared with the dataset's: its seed may be any int >= 0
    REMAINING = "remaining"  #: state key: ``[start, stop)`` intervals of positions still to read
    BASE = "base"  #: state key: the global node (``world_size``, ``remaining``) this epoch resumed from
    #: state key: the current window, ``{"yielded": its samples yielded, "skipped": [[position, records], ...]
    #: skipped in it}``, ``remaining`` then holding the positions from the window's start (see :meth:`left_of`).
    #: A state saved before shardkit 0.x (the same version number) holds ``{"from": the positions from the
    #: window's start, "yielded": ...}`` and, in ``remaining``, exactly the positions not yielded: it still loads.
    WINDOW = "window"
    WINDOW_FROM = "from"
    WINDOW_YIELDED = "yielded"
    WINDOW_SKIPPED = "skipped"

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
        self._range_count = len(self.ranges)  # asked before every record: a plan's lazy column counts slowly
        self.range_index = 0
        self.done_in_range = 0
        self._records: Iterator[Any] | None = None
        self.epoch = epoch
        self.topology = topology
        self._fingerprint = fingerprint
        self._stand_in = stand_in
        self._last: Any = _NOTHING
        self._owed = 0  # records skipped in the current range and not made up yet
        self._owed_made = False  # the sample returned last was made up
        self.skips: list[tuple[int, int]] = []  # (first position, records) of runs skipped without a sample
        self.base: State | None = None  # the global node this epoch resumed from, on another world
        # This reader's first ranges of the next epoch, hinted as this one ends (a pass begun in the next epoch
        # then starts on shards already open). None: nothing to hint, the source reads no remote shards.
        self.next_epoch_hints: Callable[[], list[Range]] | None = None
        self._next_hints: list[Range] | None = None
        self._hinted: list[Range] = []
        # The packed position (stateful.positions) of the current range's first record; None: past what one holds.
        self._range_base: int | None = None
        self._repeated: int | None = None  # the position of the sample a made-up one repeats
        self._last_position: int | None = None  # with a stand_in: the position of the last sample read
        # Without record counts (whole shards, see sources.whole): the reader's items and the node's fingerprint.
        self.shard_items: whole.Items | None = None
        self._identities: dict[int, str | None] = {}  # begun shards' identities, looked up once

    def __next__(self) -> Any:
        if self._owed:
            return self._made_up()
        while self.range_index < self._range_count:
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
                self._last, self._owed_made = sample, False
                self._last_position = self.position
            return sample
        raise StopIteration

    @property
    def position(self) -> int | None:
        """The packed position (:func:`~shardkit.stateful.pack`) of the record of the sample returned
        last; of a made-up sample, that of the sample it repeats (None when it repeats a stand-in)."""
        if self._owed_made:
            return self._repeated
        base = self._range_base
        return None if base is None else base + self.done_in_range - 1

    def _open_range(self) -> Iterator[Any]:
        """Start reading the current range (from where it stopped) and hint the next three."""
        shard, start, stop = self.ranges[self.range_index]
        fits = (start if stop is None else stop) <= MAX_RECORD  # a shard read to an unknown end may pass it
        self._range_base = pack(shard, start) if fits else None
        self._records = self._source.read(shard, start + self.done_in_range, stop)
        ahead = self.ranges[self.range_index + 1 : self.range_index + 1 + _HINTED]
        for piece in ahead:
            self._source.hint(*piece)
        if len(ahead) < _HINTED and self.next_epoch_hints is not None:  # the epoch's end: the next one's start
            # Once this range's shard is open: hinting it before would find it still held open for this read.
            self._records = itertools.chain(
                itertools.islice(self._records, 1), _calling(self._hint_next_epoch), self._records
            )
        return self._records

    def _hint_next_epoch(self) -> None:
        """Hint the next epoch's first ranges, up to three ahead in all, but none of a shard this epoch still
        reads (it is hinted once its range here has opened it: the next epoch needs its own open)."""
        if self._next_hints is None:
            self._next_hints = self.next_epoch_hints() if self.next_epoch_hints is not None else []
        later = {piece[0] for piece in self.ranges[self.range_index + 1 :]}  # at most two: the epoch's last ranges
        room = _HINTED - (len(self.ranges) - self.range_index - 1)
        for piece in self._next_hints[: max(0, room)]:
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
        self._owed_made = True
        self._repeated = self._last_position
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
        if self.shard_items is not None:
            return self._shards_node()
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

    def _shards_node(self) -> State:
        """The count-free node (:mod:`~shardkit.sources.whole`): the items left and how far the begun ones are read."""
        items, at = self.shard_items, self.range_index
        assert items is not None  # noqa: S101 - the caller checked
        left = items.indices[at:]
        started = []
        if at < len(self.ranges):
            current = int(left[0])
            shard, start, _ = self.ranges[at]
            read = start + self.done_in_range
            if read:
                saved = items.started.get(current)
                identity = saved[1] if saved is not None else self._identity(shard)
                started.append([current, read, identity])
            started += [[i, read, identity] for i, (read, identity) in sorted(items.started.items()) if i > current]
        fields = {
            EPOCH: self.epoch,
            self.WORLD_SIZE: self.topology.world_size,
            self.RANK: self.topology.rank,
            self.FINGERPRINT: self._fingerprint,
            whole.SHARDS: whole.runs_of(left),
            whole.STARTED: started,
            SHARE: share_field(self.topology),
        }
        return node(self.KIND, **fields, **({} if self.base is None else {self.BASE: self.base}))

    def _identity(self, shard: int) -> str | None:
        """The identity of ``shard``'s file, looked up once per shard (at the first save that finds it begun)."""
        if shard not in self._identities:
            self._identities[shard] = self._source.identity(shard)
        return self._identities[shard]

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
    def left_of(cls, state: State) -> list[list[int]]:
        """The positions a node has not yielded. Its ``remaining`` holds them, except in a node with a window
        saved by its start: then they are worked out from it (:func:`window_rest`), as the reader re-reads it."""
        window = state.get(cls.WINDOW)
        if window is None or cls.WINDOW_FROM in window:
            return state[cls.REMAINING]
        fingerprint = state[cls.FINGERPRINT]
        return window_rest(
            state[cls.REMAINING], fingerprint["window"][1], window[cls.WINDOW_YIELDED], window[cls.WINDOW_SKIPPED],
            seed=fingerprint["seed"], epoch=state[EPOCH], rank=state[cls.RANK],
        )  # fmt: skip

    @classmethod
    def start_of(cls, resume: Resume | None, size: int, windowed: bool, topology: Topology) -> _Start:
        """Where this reader starts in a rank chunk of ``size`` positions: its even part of the
        chunk, unless ``resume`` is a rank's node (a global one only changes the chunk)."""
        if resume is None or resume.state[cls.RANK] is None:
            return _Start(share([(0, size)], topology.num_workers, topology.worker_id), 0, False)
        state, owner = resume.state, resume.owner
        expect_equal(owner, "world_size", state[cls.WORLD_SIZE], topology.world_size)
        _expect_own_rank(owner, state[cls.RANK], topology.rank)
        check_positions(owner, state[cls.REMAINING], size)
        window = state.get(cls.WINDOW) if windowed else None
        if window is not None and (resume.own or topology.num_workers == 1):  # exactly where it stopped
            start = window.get(cls.WINDOW_FROM, state[cls.REMAINING])
            check_positions(owner, start, size)
            return _Start([(a, b) for a, b in start], window[cls.WINDOW_YIELDED], True)
        remaining = cls.left_of(state)
        if resume.own:
            return _Start(union(remaining), 0, False)
        return _Start(share(remaining, topology.num_workers, topology.worker_id), 0, False)

    @classmethod
    def check_state(cls, state: State, where: str) -> None:
        if whole.count_free(state.get(cls.FINGERPRINT)):
            whole.check_state(state, where)
            return
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
        whole_number(window, cls.WINDOW_YIELDED, f"{where} (window)")
        if cls.WINDOW_FROM in window:  # saved with the positions not yielded in remaining
            check_intervals(field(window, cls.WINDOW_FROM, f"{where} (window)", *SEQUENCE), f"{where} (window)", "from")
            return
        for run in field(window, cls.WINDOW_SKIPPED, f"{where} (window)", *SEQUENCE):
            if type(run) not in SEQUENCE or len(run) != 2 or any(type(v) is not int or v < 0 for v in run):
                raise StateError(f"{where} (window): state['skipped'] must hold [position, records] pairs, got {run!r}")
        window_size = state[cls.FINGERPRINT]["window"]
        if not (type(window_size) in SEQUENCE and len(window_size) == 2 and type(window_size[1]) is int):
            raise StateError(f"{where}: the fingerprint's window must be [block, window], got {window_size!r}")

    @classmethod
    def merge(cls, states: Sequence[State]) -> State:
        """The workers' remaining positions united (each position is one worker's); windows start afresh."""
        if whole.count_free(states[0].get(cls.FINGERPRINT)):
            return whole.merge(states)
        check_all_shares(states)
        keys = (EPOCH, cls.WORLD_SIZE, cls.RANK, cls.FINGERPRINT)
        fields = {key: same_value(states, key) for key in keys}
        if states[0].get(cls.BASE) is not None:
            fields[cls.BASE] = same_value(states, cls.BASE)
        intervals = [interval for s in states for interval in cls.left_of(s)]
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
        if whole.count_free(states[0].get(cls.FINGERPRINT)):
            return whole.merge_ranks(states)
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
        for a, b in cls.left_of(state):
            pieces += [(x, min(y, total)) for x, y in through(chunk, a, b) if x < total]
        return pieces


#: Most positions a saved window's rest is worked out over: a state naming a larger window was edited.
_MOST_WINDOW = 1 << 24


def window_rest(
    start: Sequence[Sequence[int]],
    size: int,
    yielded: int,
    skipped: Sequence[Sequence[int]],
    *,
    seed: int,
    epoch: int,
    rank: int | None,
) -> list[list[int]]:
    """The positions not yielded of a reader whose window of ``size`` starts at the positions ``start``
    (in reading order) and has yielded ``yielded`` samples, records ``skipped`` (``[position, records]``
    runs) leaving no sample in it: the window's positions in the order
    :func:`~shardkit.planning.window_order` gives (what :class:`~shardkit.sources.window._WindowIterator`
    yields), past the first ``yielded``, and every position after the window.

    Raises:
        StateError: the window is larger than :data:`_MOST_WINDOW` or has fewer than ``yielded`` samples.
    """
    head, rest = take(start, size)
    total = sum(b - a for a, b in head)
    if total > _MOST_WINDOW:
        raise StateError(f"a saved window of {total} positions is more than {_MOST_WINDOW}: the state was edited")
    positions = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in head]) if head else np.zeros(0, np.int64)
    if len(skipped):
        gone = np.concatenate([np.arange(p, p + min(n, total), dtype=np.int64) for p, n in skipped])
        positions = positions[~np.isin(positions, gone)]
    if yielded > len(positions):
        raise StateError(
            f"the state says {yielded} samples of the current window were yielded, but the window holds "
            f"{len(positions)}; the state is not of this dataset, or it was edited"
        )
    first = head[0][0] if head else 0
    order = window_order(len(positions), seed=seed, epoch=epoch, rank=rank or 0, first=first)
    return positions_union(positions[order[yielded:]], rest)


def _expect_own_rank(owner: object, saved: object, actual: int) -> None:
    """Raise :class:`StateError` if a rank's state was saved by another rank, saying why that happens
    (a trainer keeps rank 0's loader state alone) and which loaders save every rank's."""
    if same_data(saved, actual):
        return
    raise StateError(
        f"{owner!r}: the state was saved with rank {saved!r}, but here it is {actual!r}: it holds rank {saved!r}'s "
        "position, not this rank's. Trainers save rank 0's checkpoint only (Lightning's save_checkpoint, "
        "Accelerate's save_state), and a loader that saves the calling rank's state alone (torchdata's "
        "StatefulDataLoader, a plain DataLoader) puts rank 0's loader state in it, which every rank then loads "
        "(loaded anyway, each rank would train rank 0's records again). Fix: build the loader with "
        "shardkit.StatefulDataLoader (import it instead of torchdata's; it takes the same arguments) or "
        "shardkit.MixedLoader: their state_dict() holds every rank's state, and each rank loads its own"
    )
