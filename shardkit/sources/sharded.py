"""``ShardedDataset``: a planned source over shard files read by any ``read_fn(url, start, stop)``.

The plan is exact only if every range reads exactly its planned records, so a
range is read through one accounting path (:meth:`ShardedDataset._read`): it
yields a :class:`_Skipped` in place of records lost under ``on_error="skip"``,
so that positions (and states) stay exact; it asks for one record past a
shard's planned end, to find shards longer than their count; and it counts
every record read, skipped, missing or made up in the shared
:class:`~shardkit.stats.ReadStats`. The refusals for counts too far off to make
up are in :mod:`shardkit.sources.errors`.
"""

from __future__ import annotations

import os
import pickle
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import numpy as np

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
from shardkit.errors import CorruptRecordError, StateError, redact_url
from shardkit.formats.base import BadRecord, RecordBound
from shardkit.io.identity import identity
from shardkit.io.retry import RetryPolicy, retried_call
from shardkit.planning import Balance, Range, plan_intervals, rank_span
from shardkit.shardlist import NUM_RECORDS, ShardList
from shardkit.sources.base import as_shard_list
from shardkit.sources.errors import (
    MADE_UP_MISSING,
    BalanceError,
    DatasetError,
    _count_beyond_size,
    _count_taken_as_wrong,
    _Exceeded,
    _plain_message,
)
from shardkit.sources.planned import _PlannedSource
from shardkit.sources.ranges import _Skipped
from shardkit.stats import ReadStats, SharedStats
from shardkit.topology import Topology


class _Cursor:
    """Where ``ShardedDataset._read`` is in a range: the next record, records yielded, a record found past the stop."""

    __slots__ = ("position", "read", "past_stop")

    def __init__(self, position: int) -> None:
        self.position = position
        self.read = 0
        self.past_stop = False


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
            :mod:`shardkit.listing`). A manifest skips listing altogether. The
            listing's requests are bounded and retried under a format dataset's
            ``retry=`` (here, the default :class:`~shardkit.io.remote.RetryPolicy`).

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
        self._storage_options = storage_options
        self._take_shards(shards, read_fn, on_error, count_fn)

    def _take_shards(
        self, shards: ShardList | str | Sequence[str], read_fn: ReadFn, on_error: OnError, count_fn: CountFn | None
    ) -> None:
        """Check how the shards are read and list them: the constructor's part after the source's options."""
        if not callable(read_fn):
            raise DatasetError(f"read_fn must be callable as read_fn(url, start, stop), got {read_fn!r}")
        if on_error not in ("raise", "skip"):
            raise DatasetError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if count_fn is not None and not callable(count_fn):
            raise DatasetError(f"count_fn must be callable as count_fn(url) -> int, got {count_fn!r}")
        self.shards = as_shard_list(shards, self.storage_options, self._listing_retry())
        self.read_fn = read_fn
        self.on_error: OnError = on_error
        self.count_fn = count_fn
        self._stats = SharedStats(len(self.shards))
        self._stored_shared = False  # the job's stored counts came through the process group: look no more
        self._share_stored_counts()

    @property
    def storage_options(self) -> dict[str, Any] | None:
        """fsspec options for listing and counting the shards."""
        return self._storage_options

    def _listing_retry(self) -> RetryPolicy | None:
        """How a glob's listing requests are bounded and retried: a format dataset's ``retry=``; None, the default."""
        return None

    def _can_count(self) -> bool:
        return self.count_fn is not None

    def _url_digest(self) -> str | None:
        return self.shards.url_digest()[:16]

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
        else of the dataset's shards in order.

        Raises:
            BalanceError: no record of any shard can be read; it names the first failure met
                (the file and its cause), which is why the epoch cannot end with equal counts.
        """
        if kwargs.get("chunk") is not None:
            size = sum(b - a for a, b in kwargs["chunk"])
        else:
            size = rank_span(int(counts.sum()), topology.world_size, topology.rank, kwargs["balance"])[1]
        ranges = [piece for _, piece in plan_intervals(counts, topology, [(0, size)], **kwargs)]
        ranges += [Range(shard, 0, None) for shard in range(len(counts))]
        first_failure: str | None = None
        for shard, start, stop in ranges:
            url = self.shards[shard]
            try:
                for sample in self.read_fn(url, start, stop):
                    if not isinstance(sample, BadRecord):
                        return sample
                    first_failure = first_failure or _failure(url, sample.error)
            except Exception as error:  # this range is unreadable as well: try the next one
                first_failure = first_failure or _failure(url, error)
                continue
            first_failure = first_failure or f"{redact_url(url)} yielded no record from record {start}"
        raise BalanceError(
            f"{self!r}: records were skipped (on_error='skip') and no record of any shard can be read "
            f"to stand in for them, so rank {topology.rank} cannot yield its planned {size} samples. "
            f"The first failure: {first_failure}. Fix: repair or remove that file (stats() and the "
            "warnings list every shard skipped)"
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

    def _read_again(self, shard: int, start: int, stop: int) -> Iterator[Any]:
        """Records ``[start, stop)`` of ``shard`` read again for a restore, through ``read_fn`` (not counted in
        ``stats()``: they were counted when first read); a record that is now bad is a :class:`StateError`."""
        url = self.shards[shard]
        for index, sample in enumerate(self.read_fn(url, start, stop), start):
            if index >= stop:
                return
            if sample.__class__ is BadRecord:
                raise StateError(
                    f"{self!r}: record {index} of {redact_url(url)} cannot be read again ({sample.error}), but a saved "
                    "state holds it (read, not yet delivered); the shard changed since the state was saved"
                )
            yield sample

    def _shard_count(self) -> int:
        return len(self.shards)

    def _shard_identity(self, shard: int) -> tuple[str, str | None]:
        url = str(self.shards[shard])
        return redact_url(url), file_identity(url, self.storage_options)

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
        return f"{type(self).__name__}({len(self.shards)} shards, shuffle={self.shuffled}, balance={self.balance!r})"


def file_identity(url: str, storage_options: dict[str, Any] | None = None) -> str | None:
    """:func:`~shardkit.io.identity.identity` of the file at ``url`` now: one ``os.stat`` for a local path, else
    the store's ``info`` (retried as a read is); None where it cannot be looked up or reports only a size."""
    if "://" not in url or url.startswith("file://"):
        try:
            st = os.stat(url.removeprefix("file://"))
        except OSError:
            return None
        return identity({"size": st.st_size, "mtime": st.st_mtime_ns, "ino": st.st_ino, "created": st.st_ctime_ns})
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        return identity(retried_call(fs, "info", path))
    except Exception:  # noqa: BLE001 - unreachable now: the re-read that follows names the failure
        return None


def _failure(url: str, error: Exception) -> str:
    """One failure for a message: its class, the file (unless the error's message names it) and the cause."""
    message, where = _plain_message(error), redact_url(url)
    return f"{type(error).__name__}: {message}" if where in message else f"{type(error).__name__}: {where}: {message}"
