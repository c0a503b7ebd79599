"""Sources over a :class:`~shardkit.formats.base.ShardFormat`: :class:`FormatDataset` and the named ones.

:class:`FormatDataset` reads any format through its capabilities
(:class:`~shardkit.formats.base.FormatBase`; a format that does not subclass it
gets the defaults through :func:`~shardkit.formats.base.capabilities`): record
level splits, counts the files hold, seeking, bad records skipped one at a time,
counts bounded by file size, and remote shards opened ahead (hints, through the
format's ``prefetch``). ``TFRecordDataset``, ``TarDataset``, ``ParquetDataset``
and ``JsonlDataset`` are thin over it: each spells out its keywords, builds its
format and hands it, with the :class:`~shardkit.sources.options.SourceOptions`,
to the one constructor they share (:meth:`FormatDataset._build`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from shardkit.counting import OnError, StoredCountFn
from shardkit.formats.base import FormatBase, RecordBound, ShardFormat, capabilities
from shardkit.formats.example import ColumnBatches, FeatureCheck, FeatureSpec
from shardkit.io.remote import RetryPolicy
from shardkit.planning import Balance
from shardkit.shardlist import ShardList
from shardkit.sources.errors import DatasetError
from shardkit.sources.options import SourceOptions
from shardkit.sources.sharded import ShardedDataset
from shardkit.topology import Topology

if TYPE_CHECKING:
    from shardkit.formats.parquet import ParquetFormat


class FormatDataset(ShardedDataset):
    """An IterableDataset over shards of one :class:`~shardkit.formats.base.ShardFormat`, split over ranks and workers.

    Any format works, registered or not: it is read through its capabilities
    (:class:`~shardkit.formats.base.FormatBase`; a format with only the
    ``ShardFormat`` methods gets the defaults, see
    :func:`~shardkit.formats.base.capabilities`). The dataset reads with
    ``read_marked`` (a bad record the format can step over costs that record
    alone under ``on_error="skip"``), seeks to a range's first record as the
    format's ``read`` does, takes record counts the files hold
    (``stored_count``: index files, footers) before counting with ``count``,
    bounds counts by file size (``record_bound``) and, for remote shards, has
    the format open the next ranges ahead (``prefetch``).

    Args:
        shards: a :class:`~shardkit.ShardList`, a glob / fsspec pattern, or a list of urls.
        fmt: the format of the shard files.
        storage_options, readahead_bytes, retry, cache_dir, cache_limit_bytes:
            how the files are listed and read, as for :class:`TFRecordDataset`.
            Given, they replace the format's own (on a copy: ``fmt`` itself is
            not changed); left at None, the format's own apply. A format that
            does not subclass ``FormatBase`` reads with its own options.

    The other arguments are those of :class:`~shardkit.sources.sharded.ShardedDataset`.
    """

    format: FormatBase

    def __init__(
        self,
        shards: ShardList | str | Sequence[str],
        fmt: ShardFormat,
        *,
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
        options = SourceOptions.of(
            shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size, on_error=on_error,
            storage_options=storage_options, readahead_bytes=readahead_bytes, retry=retry, cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )  # fmt: skip
        self._build(shards, _with_options(capabilities(fmt), options), options)

    def _build(self, shards: ShardList | str | Sequence[str], fmt: FormatBase, options: SourceOptions) -> None:
        """The constructor every format dataset shares: read ``shards`` with ``fmt`` under ``options``."""
        self.format = fmt
        # Every ShardFormat has count; FormatBase, the optional capabilities only, leaves it to the format.
        count = fmt.count  # pyright: ignore[reportAttributeAccessIssue]
        super().__init__(shards, fmt.read_marked, count_fn=count, **options.source())

    @property
    def storage_options(self) -> dict[str, Any] | None:
        """fsspec options for listing, counting and reading the shards: the format's."""
        return self.format.storage_options

    def _listing_retry(self) -> RetryPolicy | None:
        """The format's ``retry``: a glob is listed under the policy its shards are read with."""
        retry = getattr(getattr(self.format, "remote", None), "retry", None)
        return retry if isinstance(retry, RetryPolicy) else None

    def _stored_count(self) -> StoredCountFn | None:
        return self.format.stored_count

    def _record_bound(self, shard: int) -> RecordBound | None:
        try:
            return self.format.record_bound(self.shards[shard])
        except Exception:  # the file cannot even be stat'ed (gone, no access): no bound, the usual rules apply
            return None

    def _reads_remote(self) -> bool:
        """Whether hints can start anything: the shards are remote (the first one says for all)."""
        if not len(self.shards):
            return False
        first = str(self.shards[0])
        return "://" in first and not first.startswith("file://")

    def _hint(self, shard: int, start: int, stop: int | None) -> None:
        self.format.prefetch(self.shards[shard], start, stop)


def _with_options(fmt: FormatBase, options: SourceOptions) -> FormatBase:
    """``fmt`` reading with the ``storage_options`` and ``remote`` of ``options`` where they are given:
    a copy, so that the caller's format object keeps its own; ``fmt`` itself where neither is given."""
    if options.storage_options is None and options.remote is None:
        return fmt
    configured = copy.copy(fmt)
    if options.storage_options is not None:
        configured.storage_options = options.storage_options
    if options.remote is not None:
        configured.remote = options.remote
    return configured


class TFRecordDataset(FormatDataset):
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
            failures are retried under ``retry`` (a :class:`~shardkit.io.remote.RetryPolicy`), which
            also bounds a glob's listing and every size or identity looked up; ``cache_dir``
            keeps fetched shards on local disk, shared by the processes of a machine, under ``cache_limit_bytes`` (see :mod:`shardkit.io.cache`). Local files ignore all four.

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
        options = SourceOptions.of(
            shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size, on_error=on_error,
            storage_options=storage_options, readahead_bytes=readahead_bytes, retry=retry, cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )  # fmt: skip
        fmt = TFRecordFormat(
            decode=decode, verify=verify, compression=compression, index=index,
            storage_options=options.storage_options, remote=options.remote,
        )  # fmt: skip
        self._build(shards, fmt, options)

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


class TarDataset(FormatDataset):
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

        options = SourceOptions.of(
            shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size, on_error=on_error,
            storage_options=storage_options, readahead_bytes=readahead_bytes, retry=retry, cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )  # fmt: skip
        fmt = TarFormat(
            compression=compression, index=index, storage_options=options.storage_options, remote=options.remote
        )
        self._build(shards, fmt, options)


class ParquetDataset(FormatDataset):
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

        options = SourceOptions.of(
            shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size, on_error=on_error,
            storage_options=storage_options, readahead_bytes=readahead_bytes, retry=retry, cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )  # fmt: skip
        fmt = ParquetFormat(
            columns=columns, batch_size=batch_size, storage_options=options.storage_options, remote=options.remote
        )
        self._build(shards, fmt, options)
        # Counts everywhere else (manifests, the counts cache, num_records=) are rows; with
        # batch_size the plan counts batches, ceil(rows / batch_size) per file, worked out here.
        self.count_fn = fmt.count_rows

    @property
    def _batch_size(self) -> int | None:
        """Rows per record (None: a record is a row); the format is the ParquetFormat built above."""
        return cast("ParquetFormat", self.format).batch_size

    @property
    def column_batches(self) -> bool:
        """Whether this dataset yields column batches (``batch_size`` given); :class:`~shardkit.MixedLoader`
        then cuts its batches from them."""
        return self._batch_size is not None

    def _record_counts(self, topology: Topology, *, required: bool) -> Any:
        counts = super()._record_counts(topology, required=required)
        size = self._batch_size
        if size is None:
            return counts
        if isinstance(counts, np.ndarray):
            return -(-counts // size)
        import pyarrow.compute as pc

        return pc.divide(pc.add(counts, size - 1), size)  # pyright: ignore[reportAttributeAccessIssue]  (generated)

    def _planned_count(self, shard: int) -> int | None:
        rows = super()._planned_count(shard)
        size = self._batch_size
        return rows if rows is None or size is None else -(-rows // size)


class JsonlDataset(FormatDataset):
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

        options = SourceOptions.of(
            shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size, on_error=on_error,
            storage_options=storage_options, readahead_bytes=readahead_bytes, retry=retry, cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )  # fmt: skip
        fmt = JsonlFormat(
            compression=compression, index=index, storage_options=options.storage_options, remote=options.remote
        )
        self._build(shards, fmt, options)


class TokenDataset(FormatDataset):
    """An IterableDataset over Megatron-LM indexed datasets (``X.bin`` + ``X.idx``), read in place.

    A record is a whole document, ``{"input_ids": np.ndarray}`` in the file's
    dtype (a read-only view: no copy per document); a document of several
    sequences is one record. Counts come from the ``.idx`` headers, so
    documents are split over ranks and workers, shuffled, padded or dropped
    and resumed exactly as any other dataset's records, with no scan. See
    :mod:`shardkit.formats.megatron` for what is checked and how faults are
    reported (a located :class:`~shardkit.CorruptRecordError`, or under
    ``on_error="skip"`` a counted skip).

    Args:
        paths: Megatron prefixes as ``--data-path`` takes them (``"data/X_text_document"``),
            ``.bin`` (or ``.idx``) paths, a glob of them (``"data/*.bin"``; a glob without
            the suffix gets it: ``"data/*"`` is ``"data/*.bin"``), a list of any of these,
            or a :class:`~shardkit.ShardList` of ``.bin`` urls (``ShardWriter`` manifests).
        readahead_bytes, retry, cache_dir, cache_limit_bytes: how remote ``.bin`` files
            are read, as for :class:`TFRecordDataset`; each ``.idx`` is fetched whole, once per process.

    The other arguments are those of :class:`ShardedDataset`.
    """

    def __init__(
        self,
        paths: ShardList | str | Sequence[str],
        *,
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
        from shardkit.formats.megatron import MegatronFormat, bin_url

        options = SourceOptions.of(
            shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size, on_error=on_error,
            storage_options=storage_options, readahead_bytes=readahead_bytes, retry=retry, cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )  # fmt: skip
        fmt = MegatronFormat(storage_options=options.storage_options, remote=options.remote)
        if isinstance(paths, str):
            paths = bin_url(paths)
        elif not isinstance(paths, ShardList):
            paths = [bin_url(str(p)) for p in paths]
        self._build(paths, fmt, options)


class ArrayRecordDataset(FormatDataset):
    """An IterableDataset over ArrayRecord shards (Grain's format), read in place, split over ranks and workers.

    Counts come from each file's footer (no scan), a range reads only the chunks it overlaps, and
    records are what the ``array-record`` package's reader returns; see :mod:`shardkit.formats.array_record`.

    Args:
        paths: a :class:`ShardList`, a glob / fsspec pattern, or a list of urls
            (Grain's ``name.array_record-00000-of-00004`` names too).
        decode: ``"example"`` (:func:`~shardkit.decode_example`, the default: records
            are usually serialized tf.Examples, decoded as :class:`TFRecordDataset`
            decodes them), ``"raw"`` (the record bytes) or a callable on the bytes.
        readahead_bytes, retry, cache_dir, cache_limit_bytes: how remote shards are read,
            as for :class:`TFRecordDataset`; a remote shard needs ``cache_dir`` (the package
            reads local files: the shard is fetched whole into the cache and read there).

    The other arguments are those of :class:`ShardedDataset`.
    """

    def __init__(
        self,
        paths: ShardList | str | Sequence[str],
        *,
        decode: str | Callable[[bytes], Any] = "example",
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
        from shardkit.formats.array_record import DECODERS, ArrayRecordFormat

        if not callable(decode) and decode not in DECODERS:
            raise DatasetError(f"decode must be one of {DECODERS} or a callable on the record bytes, got {decode!r}")
        options = SourceOptions.of(
            shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size, on_error=on_error,
            storage_options=storage_options, readahead_bytes=readahead_bytes, retry=retry, cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )  # fmt: skip
        fmt = ArrayRecordFormat(decode=decode, storage_options=options.storage_options, remote=options.remote)
        self._build(paths, fmt, options)


class MDSDataset(FormatDataset):
    """An IterableDataset over a Mosaic Streaming (MDS) dataset, read in place, split over ranks and workers.

    A sample is the dict Mosaic's ``StreamingDataset`` returns (images as their encoded bytes); counts come
    from ``index.json``, held to each shard when it is read; a ``pkl`` column is refused (nothing shardkit
    loads runs code). See :mod:`shardkit.formats.mds`.

    Args:
        path: the dataset's directory (local or remote, holding ``index.json``), or a list of them
            (read one after another, as Mosaic's ``Stream`` list), or a :class:`ShardList` of shard urls.
        readahead_bytes, retry, cache_dir, cache_limit_bytes: how remote shards are read,
            as for :class:`TFRecordDataset`.

    The other arguments are those of :class:`ShardedDataset`.
    """

    def __init__(
        self,
        path: ShardList | str | Sequence[str],
        *,
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
        from shardkit.formats.mds import MDSFormat, dataset_shards

        options = SourceOptions.of(
            shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size, on_error=on_error,
            storage_options=storage_options, readahead_bytes=readahead_bytes, retry=retry, cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )  # fmt: skip
        fmt = MDSFormat(storage_options=options.storage_options, remote=options.remote)
        if not isinstance(path, ShardList):
            urls: list[str] = []
            counts: list[int] = []
            for root in [path] if isinstance(path, str) else list(path):
                found = dataset_shards(str(root), options.storage_options, options.remote)
                urls += found[0]
                counts += found[1]
            path = ShardList(urls, num_records=counts)
        self._build(path, fmt, options)
