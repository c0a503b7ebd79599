"""Planned sources: records are ranges of numbered shards, split by :func:`~shardkit.plan`.

A planned source knows (or counts) the records of its shards, plans its reader's part of
its rank's chunk when iteration starts, and reads it with a :class:`_RangeIterator`
(windowed by :class:`_WindowIterator` under sample-level shuffling).

Resuming (``state_dict`` / ``load_state_dict``, see :mod:`shardkit.state`): a planned
source saves the positions of its rank's chunk it has not read yet. The chunk does not
depend on the number of workers, so a state merged from all workers resumes with any
number of them, each reading an even part of what is left. The states of all ranks
combine (:func:`shardkit.state.gather`, :func:`shardkit.state.merge_ranks`) into one
global state of stream positions that loads on any world size: each new rank takes its
part of what is left (:func:`~shardkit.planning.split_remaining`). A state must agree
with the dataset it is loaded into on a fingerprint of its shards, counts and options.
Without record counts the plan deals whole shards, and a state is the shards each reader
has left and the records it read of its current one (:mod:`~shardkit.sources.whole`).

Hints: while a range is opened, the next ones (and, at an epoch's end, the next epoch's
first ones) are hinted to the source, which may start opening remote shards for them.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

from shardkit.arrays import int64_values
from shardkit.planning import (
    SHUFFLE_BLOCK,
    SHUFFLE_WINDOW,
    Balance,
    Range,
    WholeShards,
    plan_intervals,
    plan_whole_shards,
    rank_span,
    split_remaining,
)
from shardkit.sources import whole
from shardkit.sources.base import _Source
from shardkit.sources.ranges import _HINTED, _expect_own_rank, _RangeIterator, _Skipped, _SourceCalls, _Start
from shardkit.sources.window import _WindowIterator
from shardkit.stateful import Records, Resume, State, StateError, check, expect_equal, unpack
from shardkit.topology import Topology
from shardkit.trainers import check_dataloader_len, worker_lengths


class _PlannedSource(_Source):
    """A source whose records are ranges of numbered shards, split by :func:`plan`."""

    _iterator_type = _RangeIterator

    def _record_counts(self, topology: Topology, *, required: bool) -> Any:
        """Per-shard record counts for the plan: an int64 array, or, where some
        are unknown and ``required`` is false, a pyarrow array with nulls."""
        raise NotImplementedError

    def _read(self, shard: int, start: int, stop: int | None) -> Iterator[Any]:
        raise NotImplementedError

    def _hint(self, shard: int, start: int, stop: int | None) -> None:
        """One of the next three ranges after the one being opened is ``[start, stop)`` of ``shard``: a source
        over remote shards may start opening it (readahead across shards). By default nothing is opened."""

    def _reads_remote(self) -> bool:
        """Whether hints can start anything (the shards are remote); by default no hint is made."""
        return False

    def _can_count(self) -> bool:
        """Whether this source can count records it does not know (a ``count_fn``); by default not."""
        return False

    def _url_digest(self) -> str | None:
        """A digest of the shard urls in order, for the fingerprint; None for a source without files."""
        return None

    def _counts(self, topology: Topology) -> tuple[Any, Balance]:
        """Record counts for the plan and the balance to plan with."""
        required = topology.world_size > 1 and self.balance != "none"
        # Sample-level shuffling plans by position: count (once, cached) where the format can.
        required = required or (self._windowed() and self._can_count())
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
            return self._shards_fingerprint(counts)
        return {
            "shards": len(counts),
            "records": int(counts.sum()),
            "urls": self._url_digest(),
            "counts": hashlib.sha256(np.ascontiguousarray(counts, dtype="<i8").tobytes()).hexdigest()[:16],
            "seed": self.seed,
            "shuffle": self.shuffled,
            "balance": self.balance,
            **({"window": [self.shuffle_block, self.shuffle_window]} if self._windowed() else {}),
        }

    def _shards_fingerprint(self, counts: Any) -> dict[str, Any]:
        """The fingerprint of a source whose counts are not all known: its positions are whole shards
        (:mod:`~shardkit.sources.whole`), so it binds the shards, the counts it does know and the options."""
        known = int64_values(counts, fill=-1)  # from buffers: a Python scalar would import pandas (shardkit.arrays)
        return {
            "shards": len(known),
            "records": None,
            "urls": self._url_digest(),
            "counts": hashlib.sha256(np.ascontiguousarray(known).tobytes()).hexdigest()[:16],
            "seed": self.seed,
            "shuffle": self.shuffled,
            "balance": self.balance,
            whole.SPLIT: "shards",
        }

    def load_state_dict(self, state: State) -> None:
        """Resume from ``state`` at the next ``__iter__``; see :meth:`Pipeline.load_state_dict`.

        A state saved with record counts, loaded where they are not known, has them counted now (the
        counts cache, bound to each file's identity, then the source's ``count_fn``; see
        :mod:`shardkit.counting`), and they must be the counts it was saved with.

        Raises:
            StateError: the state is of another dataset (shard count, record
                count, seed, shuffle, balance) or another format version, or it
                needs counts that cannot be had here.
        """
        check(state, self._state_kind, self)
        saved = state[_RangeIterator.FINGERPRINT]
        topology = self.topology()
        counts, _ = self._counts(topology)
        if not isinstance(counts, np.ndarray) and not whole.count_free(saved):
            counts = self._count_for(topology)
        self._expect_dataset(saved, self._fingerprint(counts))
        super().load_state_dict(state)

    def _count_for(self, topology: Topology) -> Any:
        """The record counts a state saved with them needs, counted now (see :meth:`load_state_dict`)."""
        try:
            return self._record_counts(topology, required=True)
        except Exception as error:
            raise StateError(
                f"{self!r}: the state was saved with the record count of every shard (positions of records), "
                f"but here they are unknown and cannot be counted ({error}). Fix: give the counts it was saved "
                "with (the same manifest or num_records=), or call count_records() before loading"
            ) from error

    def _expect_dataset(self, saved: Any, fingerprint: dict[str, Any]) -> None:
        """Raise unless ``saved`` is ``fingerprint``, saying so when one has record counts and the other not."""
        if whole.count_free(saved) and not whole.count_free(fingerprint):
            raise StateError(
                f"{self!r}: the state was saved while some record counts were unknown, so its positions are whole "
                "shards, but here every count is known (a manifest, index files, count_records() or balance="
                f"{self.balance!r} over several ranks, which counts): the plans differ. Fix: resume with the "
                "dataset as it was saved (the same shard list, no counts, the same balance), on any world size "
                "with balance='none'"
            )
        expect_equal(self, "dataset", saved, fingerprint)

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
        return self.shuffled and self.shuffle_window > 0

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        topology, epoch = self._start()
        counts, balance = self._counts(topology)
        kwargs = {"seed": self.seed, "epoch": epoch, "shuffle": self.shuffled, "balance": balance}
        if not isinstance(counts, np.ndarray):  # positions without counts: whole shards (sources.whole)
            return self._set_next_epoch_hints(
                self._open_whole(counts, topology, epoch, resume), counts, topology, kwargs
            )
        if self._windowed():
            kwargs["block_size"] = self.shuffle_block
        fingerprint = self._fingerprint(counts)
        base = None if resume is None else _RangeIterator.base_of(resume, fingerprint)
        size = self._chunk_size(counts, topology, base, kwargs)
        start = _RangeIterator.start_of(resume, size, self._windowed(), topology)
        iterator = self._new_iterator(counts, topology, epoch, fingerprint, start, kwargs, base)
        if start.exact and resume is not None:  # the window read again must leave what the state says is left
            saved = _RangeIterator.left_of(resume.state)
            expect_equal(self, "remaining positions (for its window)", saved, iterator.remaining())
        return iterator

    def _calls(self) -> _SourceCalls:
        """What a :class:`_RangeIterator` calls back: this source's reads, hints, padding counts, identities."""
        return _SourceCalls(self, self._read, self._hint, self._count_padded, self._identity_now)

    def _identity_now(self, shard: int) -> str | None:
        return self._shard_identity(shard)[1]

    def _open_whole(self, counts: Any, topology: Topology, epoch: int, resume: Resume | None) -> _RangeIterator:
        """The iterator over this reader's whole shards, from where ``resume`` (a count-free node) left them."""
        fingerprint = self._shards_fingerprint(counts)
        state, own = None, False
        if resume is not None:
            state = resume.state
            self._expect_dataset(state[_RangeIterator.FINGERPRINT], fingerprint)
            if state[whole.RANK] is not None:
                expect_equal(self, "world_size", state[whole.WORLD_SIZE], topology.world_size)
                _expect_own_rank(self, state[whole.RANK], topology.rank)
                own = resume.own
        order = plan_whole_shards(
            counts, Topology(rank=0, world_size=1), seed=self.seed, epoch=epoch, shuffle=self.shuffled
        )
        items = whole.reader_items(
            state, own, topology.world_size, topology.rank, topology.worker_id, topology.num_workers, len(order)
        )
        shards, stops = order.shard[items.order], order.counts[items.order]
        starts = np.zeros(len(shards), np.int64)
        if items.started:
            where = {int(i): k for k, i in enumerate(items.indices.tolist())}
            for index, (read, identity) in items.started.items():
                self._expect_same_file(int(shards[where[index]]), read, identity)
                starts[where[index]] = read
        pieces = [(None, Range(int(s), int(a), None if b < 0 else int(b))) for s, a, b in zip(shards, starts, stops)]
        ranges = _RangeIterator(
            self._calls(), pieces if items.started else WholeShards(shards, stops), epoch, topology, fingerprint
        )
        ranges.shard_items, ranges.base = items, whole.base_of(state)
        return ranges

    def _expect_same_file(self, shard: int, read: int, saved: str | None) -> None:
        """Raise unless ``shard``, of which a state says ``read`` records were read, is still the file they were
        read from (its identity; not checked where none was known when it was saved)."""
        if saved is None:
            return
        name, now = self._shard_identity(shard)
        if now != saved:
            raise StateError(
                f"{self!r}: {name} changed since the state was saved (its identity was {saved}, now {now}): the "
                f"state resumes it after its first {read} records, which would read another file's records, or "
                "none. Fix: restore the file as it was, or resume from a state saved after it was read, or start "
                "the epoch afresh"
            )

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
        self._set_next_epoch_hints(ranges, counts, topology, kwargs)
        if not self._windowed():
            return ranges
        return _WindowIterator(ranges, start.intervals, self.shuffle_window, seed=self.seed, skip=start.yielded)

    def _set_next_epoch_hints(
        self, ranges: _RangeIterator, counts: Any, topology: Topology, kwargs: dict[str, Any]
    ) -> _RangeIterator:
        """``ranges``, set to hint the next epoch's first ranges as it ends when the shards are remote."""
        if self._reads_remote():
            ranges.next_epoch_hints = functools.partial(self._next_epoch_hints, counts, topology, kwargs)
        return ranges

    def _next_epoch_hints(self, counts: Any, topology: Topology, kwargs: dict[str, Any]) -> list[Range]:
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

    # -- reading held records again by position (shardkit.stateful.positions) ------------------

    def records(self) -> Records | None:
        """Reads records again by (shard, record) position: each run of nearby records of a shard in one range read."""
        return _ShardRecords(self)

    def _read_again(self, shard: int, start: int, stop: int) -> Iterator[Any]:
        """The samples of records ``[start, stop)`` of ``shard``, read again for a restore (not counted as reads);
        a record that cannot be read is a :class:`StateError`."""
        for sample in self._read(shard, start, stop):
            if isinstance(sample, _Skipped):
                raise StateError(
                    f"{self!r}: a record of shard {shard} in [{start}, {stop}) that a saved state holds cannot be "
                    "read again; the shard changed since the state was saved"
                )
            yield sample

    def _shard_identity(self, shard: int) -> tuple[str, str | None]:
        """The name of shard ``shard`` and its file's identity now (None: no file, or none known)."""
        return f"shard {shard}", None

    def _shard_count(self) -> int:
        """How many shards this source reads (a position naming another is refused)."""
        raise NotImplementedError


#: Records between two wanted ones of a shard that a re-read reads through rather than starting another read.
_GAP = 64


class _ShardRecords(Records):
    """:class:`~shardkit.stateful.Records` of a planned source: by its ``_read_again``, identities cached."""

    def __init__(self, source: _PlannedSource) -> None:
        self._source = source
        self._identities: dict[int, tuple[str, str | None]] = {}

    def _check(self, shard: int) -> None:
        count = self._source._shard_count()
        if not 0 <= shard < count:
            raise StateError(
                f"{self._source!r}: the state holds a record of shard {shard}, but this dataset has {count} shards; "
                "the state is not of this dataset, or it was edited"
            )

    def fetch(self, positions: np.ndarray) -> list[Any]:
        shards, records = (column.tolist() for column in unpack(positions))
        for shard in set(shards):
            self._check(shard)
        order = sorted(range(len(shards)), key=lambda i: (shards[i], records[i]))
        out: list[Any] = [None] * len(order)
        begin = 0
        while begin < len(order):
            end = begin + 1
            while end < len(order) and _near(shards, records, order[end - 1], order[end]):
                end += 1
            run = order[begin:end]
            shard, first, last = shards[run[0]], records[run[0]], records[run[-1]]
            samples = list(itertools.islice(self._source._read_again(shard, first, last + 1), last + 1 - first))
            if len(samples) < last + 1 - first:
                url = self.shard_identity(shard)[0]
                raise StateError(
                    f"{self._source!r}: {url} ends after record {first + len(samples) - 1}, but a saved state holds "
                    f"record {last} of it; the shard changed since the state was saved"
                )
            for index in run:
                out[index] = samples[records[index] - first]
            begin = end
        return out

    def shard_identity(self, shard: int) -> tuple[str, str | None]:
        found = self._identities.get(shard)
        if found is None:
            self._check(shard)
            found = self._identities[shard] = self._source._shard_identity(shard)
        return found


def _near(shards: list[int], records: list[int], a: int, b: int) -> bool:
    """Whether the record at ``b`` (sorted after ``a``) is read in the same run as ``a``'s."""
    return shards[a] == shards[b] and records[b] - records[a] <= _GAP
