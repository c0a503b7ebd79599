"""ShardWriter: write records into a numbered series of shards plus a manifest.

Shards are TFRecord unless the pattern's suffix (``.tar``, ``.parquet``,
``.jsonl``...) or ``format=`` names another format with a writer (see
:mod:`shardkit.formats.base`).

A run is published so that a reader never sees a manifest describing files it
does not match, whatever happens to the writing process:

1. Before the first record is written, the manifest of an earlier run at the
   same path is removed: from then on no manifest describes the directory
   while shards are being replaced.
2. Each shard is written to a temporary name beside its final name
   (``<name>.<random>.partial``) and renamed to the final name only when it is
   complete, so no file with a final name is ever partial.
3. The manifest is written last, to a temporary name, and renamed into place.

On a local filesystem the renames are ``os.replace`` (atomic), data is
fsync'ed before each rename and the directory after, so the order above also
holds after a power loss. On other fsspec filesystems the rename is the
filesystem's ``mv``: on object stores (S3, GCS, Azure) that is a server-side
copy then a delete, which still never shows a partial object under a final
name, but a process killed between the two leaves the ``.partial`` object
behind.

A format whose shard is two files (Megatron's ``.bin`` and ``.idx``) lists the
second as a ``companion`` of the first: it is written under a temporary name
too and renamed into place just before the first, so a glob for the first
never finds it without the second (:class:`TokenWriter` writes one such pair).

If the ``with`` block raises, the shard being written is deleted and no
manifest is written; the shards completed before the error are kept under
their final names (each is whole and valid, and they may already have replaced
an earlier run's shards, so deleting them would restore nothing). A process
killed outright leaves at most one ``.partial`` file per shard directory and
no manifest; delete the ``.partial`` files and run again.

Shards of an earlier run numbered beyond this run's last one are left where
they are (they are whole files; deleting what this run did not write is not
the writer's call): the manifest does not list them, but a glob over the
directory would find them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import fsspec
from fsspec.implementations.local import LocalFileSystem

from shardkit.errors import ShardkitError
from shardkit.formats.tfrecord import TFRecordWriter
from shardkit.io.files import check_compression, make_parent_dirs
from shardkit.io.retry import retried_call

if TYPE_CHECKING:
    from shardkit.shardlist import ShardList

__all__ = ["PARTIAL_SUFFIX", "ShardWriter", "TokenWriter", "default_manifest_path", "write_lance"]

PARTIAL_SUFFIX = ".partial"
"""Suffix of the temporary names files are written under before their rename."""


def default_manifest_path(pattern: str) -> str:
    """The manifest beside a shard pattern: the text before its ``%`` field + ``.manifest.arrow``.

    ``out/train-%05d.tfrecord`` -> ``out/train.manifest.arrow``;
    ``out/%05d.tfrecord`` -> ``out/manifest.arrow``.
    """
    base = pattern[: pattern.index("%")].rstrip("-_.")
    return f"{base}manifest.arrow" if not base or base.endswith("/") else f"{base}.manifest.arrow"


class ShardWriter:
    """Write records into shards ``pattern % 0``, ``pattern % 1``, ... and a manifest.

    ``format`` is a format name (``"tfrecord"``, ``"tar"``, ``"parquet"``,
    ``"jsonl"``, ``"megatron"``) or a format object; by default the pattern's suffix
    decides (``.bin``: Megatron pairs, int32 tokens unless the format object says
    otherwise), and a pattern no format claims is TFRecord. A record is what the
    format's reader yields: ``bytes`` for TFRecord, a sample dict (``"__key__"`` and
    extensions) for tar, a row dict for Parquet, a JSON value for JSON lines, a
    document ``{"input_ids": tokens}`` for Megatron.

    A new shard starts when the current one holds ``max_records`` records, or
    when the next record would take it past ``max_bytes`` framed (uncompressed)
    bytes (TFRecord; other formats start a new shard once ``max_bytes`` is
    reached, and Parquet counts bytes per row group written); a record larger
    than ``max_bytes`` gets a shard of its own. On
    :meth:`close` the manifest (see :meth:`shardkit.ShardList.to_manifest`) is
    written with every shard's url, record count and byte size, at ``manifest`` or
    :func:`default_manifest_path` ``(pattern)``; a local shard is listed relative to
    the manifest's folder (absolute when outside it), so a relative ``pattern``
    reads back from any working directory::

        with ShardWriter("s3://bucket/train-%05d.tfrecord", max_records=10_000) as writer:
            for example in examples:
                writer.write(shardkit.encode_example(example))
        shards = writer.shards  # a ShardList with record counts

    Writes are atomic (see the module docstring): an earlier run's manifest is
    removed before the first shard is written, each shard appears under its
    final name only when complete, and the manifest is renamed into place last.
    If the ``with`` block raises, the shard in progress is deleted, no manifest
    is written and ``shards`` stays ``None``.
    """

    def __init__(
        self,
        pattern: str,
        *,
        max_records: int | None = None,
        max_bytes: int | None = None,
        compression: str | None = None,
        manifest: str | None = None,
        storage_options: dict[str, Any] | None = None,
        format: Any = None,  # noqa: A002 - the name the issue and the CLI use
    ) -> None:
        try:
            distinct = pattern % 0 != pattern % 1
        except (TypeError, ValueError):
            distinct = False
        if not distinct:
            raise ValueError(f"pattern must contain one integer field such as %05d, got {pattern!r}")
        for name, limit in (("max_records", max_records), ("max_bytes", max_bytes)):
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be a positive integer or None, got {limit!r}")
        check_compression(compression, allow_auto=False)
        self.format = _writable_format(format, pattern, compression, storage_options)
        self.pattern = pattern
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.compression = compression
        self.manifest = manifest if manifest is not None else default_manifest_path(pattern)
        self.storage_options = storage_options
        self.shards: ShardList | None = None  # set by close()
        self._urls: list[str] = []  # published shards
        self._counts: list[int] = []
        self._sizes: list[int] = []  # bytes on storage, so that readers can tell a replaced file
        self._current: Any = None  # a TFRecordWriter, or the format's writer
        self._current_url = ""  # final name of the shard being written to self._current.url
        self._started = False
        self._closed = False

    def write(self, record: Any) -> None:
        """Append one record, starting a new shard first if a limit says so."""
        if self._closed:
            raise ValueError("write() on a closed ShardWriter")
        current = self._current
        if current is None or self._full(current, record):
            current = self._next_shard()
        current.write(record)

    def _full(self, current: Any, record: Any) -> bool:
        if self.max_records is not None and current.num_records >= self.max_records:
            return True
        if self.max_bytes is None or current.num_records == 0:
            return False
        if isinstance(current, TFRecordWriter):  # the record's size is known before it is written
            return current.num_bytes + len(record) + 16 > self.max_bytes  # 16 bytes of framing per record
        return current.num_bytes >= self.max_bytes

    def _start(self) -> None:
        """Begin the run: remove an earlier run's manifest before any shard it lists is replaced."""
        if not self._started:
            remove_if_present(self.manifest, self.storage_options)
            _sync_parent(self.manifest, self.storage_options)
            self._started = True

    def _next_shard(self) -> TFRecordWriter:
        self._start()
        self._finish_shard()
        url = self.pattern % len(self._urls)
        options = self.storage_options
        if self.format is None:
            self._current = TFRecordWriter(partial_name(url), compression=self.compression, storage_options=options)
        else:
            self._current = self.format.writer(partial_name(url), name=url)
        self._current_url = url
        return self._current

    def _finish_shard(self) -> None:
        """Close the shard in progress and rename it to its final name."""
        if self._current is not None:
            current = self._current
            current.close()
            for partial, final in getattr(current, "companions", ()):  # a Megatron .idx: in place before its .bin
                publish(partial, final, self.storage_options)
            publish(current.url, self._current_url, self.storage_options)
            self._current = None
            fs, path = fsspec.core.url_to_fs(self._current_url, **(self.storage_options or {}))
            self._sizes.append(retried_call(fs, "size", path))  # bounded: a stalled store fails, naming the url
            self._urls.append(self._current_url)
            self._counts.append(current.num_records)

    def _abort(self) -> None:
        """Close and delete the shard in progress; publish nothing more."""
        self._closed = True
        current, self._current = self._current, None
        if current is not None:
            try:
                current.close()
            finally:
                for partial, _ in getattr(current, "companions", ()):
                    remove_if_present(partial, self.storage_options)
                remove_if_present(current.url, self.storage_options)

    def close(self) -> ShardList:
        """Publish the last shard, then the manifest; return the shards as a ShardList.

        If publishing fails, the shard in progress is deleted and the error raised.
        """
        if self.shards is None:
            from shardkit.shardlist import ShardList

            self._closed = True
            try:
                self._start()
                self._finish_shard()
            except BaseException:
                self._abort()
                raise
            shards = ShardList(self._urls, num_records=self._counts, sizes=self._sizes)
            for url in {os.path.dirname(u): u for u in self._urls}.values():
                _sync_parent(url, self.storage_options)  # the shard renames are durable before the manifest
            write_manifest(shards, self.manifest, self.storage_options)
            self.shards = shards
        return self.shards

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:  # do not publish the shard in progress, nor a manifest of a partial run
            self._abort()


class TokenWriter:
    """Write one Megatron-LM indexed dataset, ``prefix.bin`` + ``prefix.idx``, that megatron-core reads back.

    ``prefix`` is as Megatron's ``--data-path`` takes it (``data/corpus``; a ``.bin`` or ``.idx``
    path names the same pair). A document is ``{"input_ids": tokens}`` (optionally with
    ``"sequence_lengths"`` adding up to its length) or the tokens alone; ``dtype`` is what the
    ``.bin`` holds (``np.uint16`` fits vocabularies under 65,536 tokens), and a token it cannot hold
    exactly is an error naming the document. Both files are written under temporary names and
    renamed into place on :meth:`close`, the ``.idx`` first; if the ``with`` block raises, neither
    appears. For many pairs with a manifest, use ``ShardWriter("out/part-%05d.bin")``.
    """

    def __init__(self, prefix: str, *, dtype: Any = None, storage_options: dict[str, Any] | None = None) -> None:
        import numpy as np

        from shardkit.formats.megatron import PairWriter, bin_url

        self.url = bin_url(prefix)
        self.storage_options = storage_options
        self._writer = PairWriter(
            partial_name(self.url), name=self.url, dtype=np.int32 if dtype is None else dtype,
            storage_options=storage_options,
        )  # fmt: skip
        self._done = False

    @property
    def num_records(self) -> int:
        """Documents written so far."""
        return self._writer.num_records

    def write(self, document: Any) -> None:
        """Append one document."""
        if self._done:
            raise ValueError(f"{self.url}: write() on a closed TokenWriter")
        self._writer.write(document)

    def close(self) -> None:
        """Write the ``.idx`` and rename both files into place, the ``.idx`` first."""
        if self._done:
            return
        self._done = True
        try:
            self._writer.close()
            for partial, final in self._writer.companions:
                publish(partial, final, self.storage_options)
            publish(self._writer.url, self.url, self.storage_options)
            _sync_parent(self.url, self.storage_options)
        finally:
            self._remove_partials()

    def _remove_partials(self) -> None:
        for partial, _ in self._writer.companions:
            remove_if_present(partial, self.storage_options)
        remove_if_present(self._writer.url, self.storage_options)

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
            return
        self._done = True
        try:
            self._writer.close()
        finally:
            self._remove_partials()


def _writable_format(format: Any, pattern: str, compression: str | None, storage_options: dict[str, Any] | None) -> Any:  # noqa: A002
    """The format object whose writer writes the shards; None for TFRecord (written here directly)."""
    from shardkit.formats.base import FormatError, ShardFormat
    from shardkit.formats.registry import format_for, formats

    if format is None:
        try:
            fmt = format_for(pattern % 0, head=b"")
        except FormatError:
            return None
    elif isinstance(format, str):
        fmt = formats().get(format)
        if fmt is None:
            raise ValueError(f"format must be one of {sorted(formats())} or a format object, got {format!r}")
    elif isinstance(format, ShardFormat):
        fmt = format
    else:
        raise ValueError(f"format must be a format name or a ShardFormat object, got {format!r}")
    if fmt.name == "tfrecord":
        return None
    if compression is not None:
        raise ValueError(
            f"compression={compression!r} is for TFRecord shards; {fmt.name} shards compress by their suffix"
        )
    if not callable(getattr(fmt, "writer", None)):
        raise ValueError(f"the {fmt.name} format cannot be written (it has no writer)")
    if storage_options is not None and getattr(fmt, "storage_options", None) != storage_options:
        import copy

        copied: Any = copy.copy(fmt)  # the same format, writing with these options
        copied.storage_options = storage_options
        return copied
    return fmt


# --------------------------------------------------------------------------- Lance datasets

LANCE_CHUNK_ROWS = 8192
"""Rows turned into one Arrow record batch at a time while writing a Lance dataset."""


class LanceWritten(NamedTuple):
    """What :func:`write_lance` wrote: rows and fragments (data files), from the new dataset's manifest."""

    records: int
    fragments: int


class LanceWriteError(ShardkitError):
    """Rows do not fit one Lance schema, or the destination of a Lance dataset cannot be written."""


def write_lance(
    rows: Iterable[dict[str, Any]],
    path: str,
    *,
    schema: Any = None,
    max_records: int | None = None,
    max_bytes: int | None = None,
) -> LanceWritten:
    """Write ``rows`` (dicts of column to value, as ``to_pylist`` gives them) as a new Lance dataset at
    ``path``; return how many rows and fragments it holds, as its manifest says (checked against the rows
    given before the dataset is published).

    The dataset is written by ``lance.write_dataset`` into a temporary directory beside ``path``
    (``<path>.<random>.partial``) and renamed to ``path`` when whole, so ``path`` never holds a part
    of it; if anything fails (a source record, a row that does not fit the schema, the disk) the
    temporary directory is deleted and nothing is left. ``schema`` (a ``pyarrow.Schema``) types the
    columns; without it the first rows decide, as pyarrow infers them. ``max_records`` and
    ``max_bytes`` bound each data file (Lance's ``max_rows_per_file`` and ``max_bytes_per_file``).

    Raises:
        LanceWriteError: ``path`` is not a local path or exists already, or rows do not fit the schema.
    """
    from shardkit.formats.lance import import_lance

    lance = import_lance()
    target = new_lance_directory(path)
    partial = partial_name(target)
    batches, failure, counted = _record_batches(rows, schema)
    try:
        first = next(batches, None)
        if first is None:
            raise LanceWriteError(f"{path}: no records to write (a Lance dataset needs at least one row)")
        import pyarrow as pa

        reader = pa.RecordBatchReader.from_batches(first.schema, itertools.chain([first], batches))
        limits = {"max_rows_per_file": max_records, "max_bytes_per_file": max_bytes}
        try:
            lance.write_dataset(reader, partial, mode="create", **{k: v for k, v in limits.items() if v is not None})
        except BaseException as error:
            if failure:
                raise failure[0] from None  # the source's own error (a corrupt record), not Lance's wrapping of it
            if isinstance(error, (OSError, RuntimeError)):  # the disk, or Lance itself
                raise LanceWriteError(
                    f"{path}: Lance could not write the dataset ({error}); nothing was kept"
                ) from None
            raise
        if failure:
            raise failure[0]
        dataset = lance.dataset(partial)
        written = LanceWritten(int(dataset.count_rows()), len(dataset.get_fragments()))
        if written.records != counted[0]:
            raise LanceWriteError(f"{path}: Lance wrote {written.records} rows of the {counted[0]} given")
        os.rename(partial, target)  # a directory: fails if one appeared at target meanwhile
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _sync_parent(target, None)
    return written


def new_lance_directory(path: str, *, create: bool = True) -> str:
    """``path`` as a local absolute path that does not exist yet, its parent created (with ``create``).

    Raises:
        LanceWriteError: ``path`` is not local, or exists.
    """
    if "://" in path and not path.startswith("file://"):
        raise LanceWriteError(
            f"{path}: a Lance dataset is written to a local directory (written whole, then renamed into place); "
            "write it locally and copy it"
        )
    target = os.path.abspath(path.removeprefix("file://")).rstrip("/")
    if os.path.lexists(target):
        raise LanceWriteError(
            f"{path} exists: a Lance dataset is written only where nothing is; remove it or name another"
        )
    if create:
        os.makedirs(os.path.dirname(target), exist_ok=True)
    return target


def _record_batches(
    rows: Iterable[dict[str, Any]], schema: Any
) -> tuple[Iterator[Any], list[BaseException], list[int]]:
    """``rows`` as Arrow record batches of :data:`LANCE_CHUNK_ROWS` rows of one schema (``schema``, or the
    first batch's); a list that holds the error that stopped them (Lance reads the batches from Rust, where
    a Python error comes back wrapped in its own); and one that holds the rows made into batches so far."""
    import pyarrow as pa

    failure: list[BaseException] = []
    counted = [0]

    def batches() -> Iterator[Any]:
        fixed = schema
        done = 0
        it = iter(rows)
        try:
            while chunk := list(itertools.islice(it, LANCE_CHUNK_ROWS)):
                try:
                    batch = pa.RecordBatch.from_pylist(chunk, schema=fixed)
                except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as error:
                    raise LanceWriteError(
                        f"rows {done}..{done + len(chunk) - 1} do not fit one Lance schema ({error}); the first "
                        f"rows gave {fixed}"
                    ) from None
                extra = {key for row in chunk for key in row} - set(batch.schema.names)
                if extra:  # pyarrow would drop them: a silent change
                    raise LanceWriteError(
                        f"rows {done}..{done + len(chunk) - 1} hold columns {sorted(extra)} that the first rows' "
                        f"schema has not ({batch.schema.names})"
                    )
                fixed = batch.schema
                done += len(chunk)
                counted[0] = done
                yield batch
        except BaseException as error:
            failure.append(error)
            raise

    return batches(), failure, counted


# --------------------------------------------------------------------------- atomic publishing
# Also used by `shardkit index` and `shardkit demo`, which write files the same way.


def partial_name(url: str) -> str:
    """A fresh temporary name in ``url``'s directory (so renaming it is atomic)."""
    return f"{url}.{uuid.uuid4().hex[:16]}{PARTIAL_SUFFIX}"


def _local(url: str, storage_options: dict[str, Any] | None) -> tuple[fsspec.AbstractFileSystem, str, bool]:
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs, path, isinstance(fs, LocalFileSystem)


def publish(partial: str, final: str, storage_options: dict[str, Any] | None) -> None:
    """Rename the complete file ``partial`` to ``final``, replacing what is there."""
    fs, partial_path, local = _local(partial, storage_options)
    final_path = fsspec.core.url_to_fs(final, **(storage_options or {}))[1]
    if local:
        fd = os.open(partial_path, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data is on disk before the name points at it
        finally:
            os.close(fd)
        os.replace(partial_path, final_path)
    else:
        fs.mv(partial_path, final_path)


def remove_if_present(url: str, storage_options: dict[str, Any] | None) -> None:
    """Delete ``url`` if it exists."""
    fs, path, local = _local(url, storage_options)
    with contextlib.suppress(FileNotFoundError):
        if local:
            os.unlink(path)
        else:
            fs.rm(path)


def _sync_parent(url: str, storage_options: dict[str, Any] | None) -> None:
    """fsync the local directory holding ``url``, so renames and deletions in it are durable."""
    _, path, local = _local(url, storage_options)
    directory = os.path.dirname(path) or "."
    if not local or not os.path.isdir(directory):
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory; the rename is still atomic
        pass
    finally:
        os.close(fd)


def write_manifest(shards: ShardList, manifest: str, storage_options: dict[str, Any] | None) -> None:
    """Write ``shards`` to a temporary name beside ``manifest`` and rename it into place."""
    make_parent_dirs(manifest, storage_options)
    partial = partial_name(manifest)
    try:
        shards.to_manifest(partial, storage_options=storage_options)
        publish(partial, manifest, storage_options)
        _sync_parent(manifest, storage_options)
    finally:
        remove_if_present(partial, storage_options)
