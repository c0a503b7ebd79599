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
what is left. A ``wrap`` of a plain iterable saves how many items its reader
stepped past and resumes into the same reader slot only.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
from torch.utils.data import Dataset, IterableDataset

from shardkit.counting import CountFn, resolve_counts
from shardkit.epoch import SharedEpoch, check_epoch
from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.pipeline import Pipeline
from shardkit.planning import BALANCES, Balance, Range, plan, plan_intervals, rank_span, share, union
from shardkit.remote import RetryPolicy, prefetch, remote_options
from shardkit.seeding import check_seed, seed_iteration
from shardkit.shardlist import ShardList
from shardkit.state import State, StateError, applies, check, check_positions, expect_equal, node, own_share, share_of
from shardkit.stats import ReadStats, SharedStats
from shardkit.topology import Topology

logger = logging.getLogger("shardkit")

OnError = Literal["raise", "skip"]
ReadFn = Callable[[str, int, "int | None"], Iterable[Any]]
DECODERS = ("example", "sequence_example", "raw")


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
        self._epoch = SharedEpoch(0)

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


class _Skipped(NamedTuple):
    """Yielded by ``_read`` in place of ``records`` records it could not read (on_error='skip')."""

    records: int


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
        """One of the next two ranges after the one being opened is ``[start, stop)`` of ``shard``: a ``read_fn``
        with a ``prefetch(url, start, stop)`` method may start fetching it (remote readahead across shards)."""
        prefetch = getattr(getattr(self, "read_fn", None), "prefetch", None)
        if prefetch is not None:
            prefetch(self.shards[shard], start, stop)  # type: ignore[attr-defined]

    def _counts(self, topology: Topology) -> tuple[Any, Balance]:
        """Record counts for the plan and the balance to plan with."""
        required = topology.world_size > 1 and self.balance != "none"
        counts = self._record_counts(topology, required=required)
        # Unknown counts on one rank: whole shards to the workers, nothing to equalise.
        balance = self.balance if isinstance(counts, np.ndarray) else "none"
        return counts, balance

    def _fingerprint(self, counts: Any) -> dict[str, Any]:
        """What a state must agree on with the dataset it is loaded into (no file names)."""
        if not isinstance(counts, np.ndarray):
            raise StateError(
                f"{self!r}: resuming needs the record count of every shard, and some are unknown; "
                "call count_records() (or give counts: a manifest, index files) before iterating"
            )
        return {
            "shards": len(counts),
            "records": int(counts.sum()),
            "seed": self.seed,
            "shuffle": self.shuffle_shards,
            "balance": self.balance,
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

    def __len__(self) -> int:
        """Samples this rank yields per epoch (all of its workers together)."""
        topology = self.topology()
        counts = self._record_counts(topology, required=False)
        if not isinstance(counts, np.ndarray):
            raise self._unknown_length("the record counts of its shards are unknown (call count_records() first)")
        return rank_span(int(counts.sum()), topology.world_size, topology.rank, self.balance)[1]

    def _open(self, state: State | None) -> Iterator[Any]:
        topology, epoch = self._start()
        counts, balance = self._counts(topology)
        kwargs = {"seed": self.seed, "epoch": epoch, "shuffle": self.shuffle_shards, "balance": balance}
        if not isinstance(counts, np.ndarray):  # no positions without counts: whole shards
            if state is not None:
                self._fingerprint(counts)  # raises, naming the fix
            return _RangeReader(self, [(None, r) for r in plan(counts, topology, **kwargs)], epoch, topology, None)
        fingerprint = self._fingerprint(counts)
        size = rank_span(int(counts.sum()), topology.world_size, topology.rank, balance)[1]
        intervals = share([(0, size)], topology.num_workers, topology.worker_id)
        if state is not None and applies(state, epoch, self):
            expect_equal(self, "dataset", state["fingerprint"], fingerprint)
            expect_equal(self, "world_size", state["world_size"], topology.world_size)
            expect_equal(self, "rank", state["rank"], topology.rank)
            remaining = state["remaining"]
            check_positions(self, remaining, size)
            own = own_share(state, topology.worker_id, topology.num_workers, self)
            intervals = union(remaining) if own else share(remaining, topology.num_workers, topology.worker_id)
        pieces = plan_intervals(counts, topology, intervals, **kwargs)
        return _RangeReader(self, pieces, epoch, topology, fingerprint)


class _RangeReader:
    """Reads one reader's ranges in order; the cursor is (range, records done).

    Each range comes with the rank-chunk position of its first record (None
    when record counts are unknown), so what is left can be saved as positions.
    """

    def __init__(
        self,
        source: _PlannedSource,
        pieces: list[tuple[int | None, Range]],
        epoch: int,
        topology: Topology,
        fingerprint: dict[str, Any] | None,
    ) -> None:
        self._source = source
        self.positions = [position for position, _ in pieces]
        self.ranges = [piece for _, piece in pieces]
        self.range_index = 0
        self.done_in_range = 0
        self._records: Iterator[Any] | None = None
        self._epoch = epoch
        self._topology = topology
        self._fingerprint = fingerprint

    def state_dict(self) -> State:
        """The positions of this reader's part not read yet (records, not samples)."""
        if self._fingerprint is None:
            self._source._fingerprint(None)  # raises, naming the fix
        remaining = []
        for index in range(self.range_index, len(self.ranges)):
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
        )

    def __iter__(self) -> _RangeReader:
        return self

    def __next__(self) -> Any:
        while self.range_index < len(self.ranges):
            if self._records is None:
                shard, start, stop = self.ranges[self.range_index]
                self._records = self._source._read(shard, start + self.done_in_range, stop)
                for ahead in self.ranges[self.range_index + 1 : self.range_index + 3]:
                    self._source._hint(*ahead)
            try:
                sample = next(self._records)
            except StopIteration:
                self._finish_range()
                continue
            if isinstance(sample, _Skipped):
                self.done_in_range += sample.records
                continue
            self.done_in_range += 1
            return sample
        raise StopIteration

    def _finish_range(self) -> None:
        self._records = None
        self.range_index += 1
        self.done_in_range = 0


class ShardedDataset(_PlannedSource):
    """An IterableDataset over shard files, split over ranks and workers by :func:`plan`.

    Args:
        shards: a :class:`ShardList`, a glob / fsspec pattern (brace ranges
            allowed), or a sequence of urls.
        read_fn: ``read_fn(url, start, stop)`` yields the samples of records
            ``[start, stop)`` of one shard (``stop=None``: to its end). Define it
            at module level (or use :func:`functools.partial`) so it can be
            pickled to DataLoader workers started with spawn or forkserver.
        shuffle, seed: permute shards (and the blocks of large shards) each
            epoch, from ``(seed, epoch)``; see :meth:`set_epoch`.
        balance: ``"pad"`` (default), ``"drop"`` or ``"none"``; see :func:`plan`.
        rank, world_size: override the detected DDP rank (both or neither).
        on_error: ``"raise"`` (default) or ``"skip"``: skip what cannot be read,
            with a warning naming it, and count it in :meth:`stats`.
        count_fn: ``count_fn(url) -> int``, used once when record counts are
            needed (several ranks with ``"pad"``/``"drop"``) and unknown.
        storage_options: fsspec options, for a glob ``shards``. Under an
            initialised ``torch.distributed`` process group a glob is listed by
            rank 0 only and broadcast (:func:`shardkit.listing.list_shards`), so
            every rank must build the dataset.

    When the record counts are unknown, one rank deals whole shards to its
    workers (and warns if there are fewer shards than workers); several ranks
    with ``balance="none"`` do the same; several ranks with ``"pad"``/``"drop"``
    count the records once (see :mod:`shardkit.counting`).
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
        """Records read, skipped and errors met, per shard, summed over every
        worker of this process's DataLoader (and this process)."""
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

    def _read(self, shard: int, start: int, stop: int | None) -> Iterator[Any]:
        """The samples of records ``[start, stop)``, with a :class:`_Skipped` for
        records skipped under ``on_error="skip"`` so that positions stay exact."""
        url = self.shards[shard]
        position = start
        try:
            for sample in self.read_fn(url, start, stop):
                position += 1
                yield sample
        except Exception as error:
            self._stats.add(shard, read=position - start, errors=1)
            if self.on_error == "raise":
                raise
            yield from self._skip(shard, url, position, stop, error)
            return
        self._stats.add(shard, read=position - start)

    def _skip(self, shard: int, url: str, position: int, stop: int | None, error: Exception) -> Iterator[Any]:
        """Under on_error='skip': count what is lost, warn, and go on where the data allows."""
        if isinstance(error, CorruptRecordError) and error.framing_intact and (stop is None or position < stop):
            # One record's data is bad, the framing around it is fine: skip just it.
            self._stats.add(shard, skipped=1)
            warnings.warn(f"skipping record {position} of {url}: {error}", stacklevel=2)
            yield _Skipped(1)
            yield from self._read(shard, position + 1, stop)
            return
        lost = "the rest of the shard (count unknown)" if stop is None else f"{stop - position} records"
        warnings.warn(f"skipping {lost} of {url} from record {position}: {error}", stacklevel=2)
        if stop is not None:
            self._stats.add(shard, skipped=stop - position)
            yield _Skipped(stop - position)

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
        return f"{type(self).__name__}({len(self.shards)} shards, shuffle={self.shuffle_shards}, balance={self.balance!r})"


def as_shard_list(shards: ShardList | str | Sequence[str], storage_options: dict[str, Any] | None = None) -> ShardList:
    """A :class:`ShardList` from a ShardList, a glob pattern or a list of urls."""
    if isinstance(shards, ShardList):
        return shards
    if isinstance(shards, str):  # under a process group, rank 0 lists and the others receive it
        from shardkit.listing import list_shards

        return list_shards(shards, storage_options)
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
            decode, verify=verify, compression=compression, index=index, storage_options=storage_options,
            readahead_bytes=readahead_bytes, retry=retry, cache_dir=cache_dir, cache_limit_bytes=cache_limit_bytes,
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
        from shardkit.formats.tfrecord import read_tfrecord

        seekable = start > 0 and self.compression in (None, "auto")
        records = read_tfrecord(
            url,
            compression=self.compression,
            verify=self.verify,
            start=start,
            stop=stop,
            index=self._offsets(url) if seekable else None,
            storage_options=self.storage_options,
            remote=self.remote,
        )
        decode = self._decoder()
        return records if decode is None else map(decode, records)

    def count(self, url: str) -> int:
        """Records in ``url``: from its index file if there is one, else a framing scan."""
        from shardkit.formats.tfrecord import count_records

        offsets = self._offsets(url)
        if offsets is not None:
            return len(offsets)
        return count_records(url, compression=self.compression, storage_options=self.storage_options, remote=self.remote)

    def prefetch(self, url: str, start: int, stop: int | None) -> None:
        """Start opening remote ``url`` for a later ``self(url, start, stop)``: its first blocks when
        reading from its start, else just the open (the offset needs the index)."""
        prefetch(url, self.storage_options, self.remote, offset=0 if start == 0 else None)

    def _offsets(self, url: str) -> np.ndarray | None:
        """The record offsets from ``url``'s index file, or None when there is none (or ``index=False``)."""
        if not self.index:
            return None
        import fsspec

        from shardkit.formats.index import index_path_for, read_index

        path = index_path_for(url)
        fs, fs_path = fsspec.core.url_to_fs(path, **(self.storage_options or {}))
        return read_index(path, storage_options=self.storage_options) if fs.exists(fs_path) else None

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
    is_map_style = not isinstance(dataset, IterableDataset) and hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
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

    def __init__(self, dataset: Any, *, shuffle: bool, seed: int, balance: Balance, rank: int | None, world_size: int | None) -> None:
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

    def __init__(self, iterable: Iterable[Any], *, seed: int, balance: Balance, rank: int | None, world_size: int | None) -> None:
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
