"""The list of shard files, kept in a memory-mapped Arrow IPC file.

A :class:`ShardList` is a table with one row per shard file: its ``url``
(``string``, or ``large_string`` once the urls pass 2 GiB), its
``num_records`` (``int64``, null when unknown) and its byte ``size`` (``int64``,
null when unknown).

The table always lives in an uncompressed Arrow IPC file that is memory-mapped,
and a ShardList pickles as the path of that file. DataLoader workers therefore
share the same page-cache pages whatever the start method (fork, forkserver or
spawn), instead of each holding a copy: reading every entry of a Python list in
a forked worker touches every object's refcount and copies the page. A list
built from Python objects is written to a temporary file under
``tempfile.gettempdir()`` (prefix ``shardkit-``) that the building process
deletes when the ShardList is garbage-collected or at interpreter exit;
unpickled copies never delete it.

Urls are read in batches (``slice(...).to_pylist()``); no per-file Python object
is kept, and columns are never combined into one chunk (that copies).

Trust nothing: a manifest is never mapped in place. It is first copied into a
private temporary file (one ``copyfile``: measured 0.05 s for 1M urls), so a
manifest replaced after loading cannot hand spawn workers a different list,
and one truncated after loading cannot kill the process with SIGBUS. A url
listed twice would be read twice per epoch: :class:`DuplicateShardWarning`
names it and its positions. :meth:`ShardList.url_digest` is a stable hash of
the urls (from the Arrow buffers, 0.03 s for 1M urls) that the counts cache
and resume states are bound to.

The container is here; below it, each its own job: the columns and their
checks (:mod:`~shardkit.shardlist.columns`), the mapped Arrow files
(:mod:`~shardkit.shardlist.arrowfile`), and manifests
(:mod:`~shardkit.shardlist.manifest`). Globbing is I/O, so
:meth:`ShardList.from_glob` calls :mod:`shardkit.io.glob` for it.
"""

from __future__ import annotations

import contextlib
import operator
import os
import posixpath
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as _compute
from fsspec.implementations.local import LocalFileSystem

from shardkit.arrays import valid_mask
from shardkit.errors import ShardkitError, redact_url, reraise_redacted
from shardkit.io.glob import glob_files
from shardkit.io.retry import RetryPolicy
from shardkit.shardlist.arrowfile import map_ipc, map_ipc_checked, persist, private_copy, release_heap, write_ipc
from shardkit.shardlist.columns import (
    NUM_RECORDS,
    SIZE,
    URL,
    IntColumn,
    ShardListError,
    build_table,
    int64_array,
    int_column,
    same_values,
    string_digest,
)
from shardkit.shardlist.manifest import (
    IPC_MAGIC,
    manifest_joiner,
    manifest_table,
    normalize_manifest,
    open_manifest,
    read_manifest,
)
from shardkit.tempfiles import delete_with

__all__ = ["NUM_RECORDS", "SIZE", "URL", "DuplicateShardWarning", "IntColumn", "ShardList", "ShardListError"]

#: pyarrow.compute's functions are generated at import time: a type checker sees none of them.
pc: Any = _compute

_BATCH = 4096


class DuplicateShardWarning(UserWarning):
    """A url is listed more than once: its records are read once per listing each epoch."""


class ShardList:
    """An immutable list of shard urls with optional record counts and sizes.

    Args:
        urls: one non-empty url or path per shard, as a sequence of ``str`` or a
            pyarrow string array.
        num_records: records in each shard, ``None`` for an unknown count; the
            whole argument ``None`` when no count is known.
        sizes: byte size of each shard, ``None`` when unknown.

    Raises:
        ShardListError: lengths differ, a url is missing or empty, or a count or
            size is negative; the message names the first offending index.

    Warns:
        DuplicateShardWarning: a url is listed more than once (the message names
            it and its positions); its records would be read more than once.

    The list is written to a temporary Arrow IPC file and memory-mapped; see the
    module docstring for why. Keep this object alive while DataLoader workers
    started with spawn or forkserver run: its process owns that file.
    """

    __hash__ = None  # type: ignore[assignment]  # equality is by content

    def __init__(
        self,
        urls: Sequence[str] | pa.Array | pa.ChunkedArray,
        num_records: IntColumn | None = None,
        sizes: IntColumn | None = None,
    ) -> None:
        self._own(persist(lambda: build_table(urls, num_records, sizes)))
        _warn_duplicates(self.table.column(URL), "urls")

    # -- other constructors -------------------------------------------------

    @classmethod
    def from_glob(
        cls, pattern: str, storage_options: Mapping[str, Any] | None = None, retry: RetryPolicy | None = None
    ) -> ShardList:
        """List the files matching ``pattern`` on any fsspec filesystem, sorted.

        Brace groups are expanded first: ranges ``{00000..00127}`` (zero padding
        kept) and lists ``{train,val}``; then each part is globbed (``*``, ``?``,
        ``[...]``). A part without glob characters names one file, which must
        exist. Urls keep their protocol (``s3://...``) except on the local
        filesystem, where they are absolute paths. Byte sizes are recorded when
        the listing reports them. Listing requests are bounded and retried under
        ``retry`` (default :class:`~shardkit.io.retry.RetryPolicy`: 30 s per try,
        60 s in all), as remote reads are.

        Raises:
            ShardListError: nothing matches, or files named without wildcards
                do not exist.
            RemoteReadError: the store did not answer the listing within ``retry``.
        """
        try:
            return cls._from_glob(pattern, storage_options, retry)
        except ShardkitError:
            raise
        except Exception as error:  # a store's own error may name the url, credentials and all
            reraise_redacted(error)

    @classmethod
    def _from_glob(
        cls, pattern: str, storage_options: Mapping[str, Any] | None, retry: RetryPolicy | None
    ) -> ShardList:
        """:meth:`from_glob`, its errors from the filesystem not yet redacted."""
        found = glob_files(pattern, storage_options, retry)
        if found.directory is not None:
            raise ShardListError(
                f"{found.directory!r} is a directory; give files, or a glob such as "
                f"'{found.directory.rstrip('/')}/*.tfrecord'"
            )
        if found.missing:
            shown = ", ".join(repr(m) for m in found.missing[:3])
            raise ShardListError(
                f"{len(found.missing)} file(s) named by {pattern!r} do not exist, e.g. {shown}; "
                "use a wildcard if some may be absent"
            )
        if not found.files:
            raise ShardListError(f"no files match {pattern!r}; check the path and the storage_options")
        return cls([url for url, _ in found.files], sizes=[size for _, size in found.files])

    @classmethod
    def from_manifest(cls, path: str, storage_options: Mapping[str, Any] | None = None) -> ShardList:
        """Read a manifest: an Arrow IPC file, a Parquet file or JSON lines.

        The format is recognised from the file's first bytes. A JSON-lines
        manifest holds one ``{"url": ..., "num_records": ..., "size": ...}``
        object per line (only ``url`` is required). Relative urls resolve
        against the manifest's directory (the only meaning a manifest may give
        them: schema metadata ``paths`` other than ``relative-to-manifest`` is
        refused). A local, uncompressed IPC file with
        absolute urls and the :meth:`to_manifest` schema is copied byte for
        byte to a private temporary file and memory-mapped from there (no
        parsing); any other manifest is converted into one. Either way the list
        never changes after loading, whatever happens to the manifest file.

        Raises:
            ShardListError: the manifest has no ``url`` column, cannot be
                parsed, or holds invalid entries (the message names the row).

        Warns:
            DuplicateShardWarning: a url is listed more than once.
        """
        fs, fs_path = fsspec.core.url_to_fs(path, **dict(storage_options or {}))
        local = isinstance(fs, LocalFileSystem)
        with open_manifest(fs, fs_path) as f:
            magic = f.read(len(IPC_MAGIC))
        join = manifest_joiner(fs, fs_path)
        if magic == IPC_MAGIC and local:
            shards = cls._from_local_ipc(fs_path, path, join)
        else:
            shards = cls._build(lambda: normalize_manifest(read_manifest(fs, fs_path, magic, path), path, join))
        _warn_duplicates(shards.table.column(URL), f"manifest {path!r}")
        return shards

    @classmethod
    def _from_local_ipc(cls, fs_path: str, path: str, join: Callable[[str], str]) -> ShardList:
        """A local IPC manifest: map a private copy, kept as is when it already
        has the ShardList layout, else converted."""
        snapshot = cls.__new__(cls)
        snapshot._own(private_copy(fs_path))  # deleted with this object, whatever happens below
        table, zero_copy = map_ipc_checked(snapshot.backing_file, path)
        if zero_copy and normalize_manifest(table, path, join) is table:
            release_heap()  # what validating the urls allocated
            snapshot._table = table
            return snapshot
        del table
        return cls._build(lambda: normalize_manifest(map_ipc_checked(snapshot.backing_file, path)[0], path, join))

    def to_manifest(self, path: str, storage_options: Mapping[str, Any] | None = None) -> None:
        """Write this list as an uncompressed Arrow IPC file at ``path``.

        Local paths are written to a temporary file next to ``path`` and renamed
        over it, so readers never see half a manifest. Any fsspec url works.

        A local manifest stores each local shard path relative to its own
        folder when the shard lies under it, else absolute (a path relative
        to the working directory means nothing once the manifest is read from
        elsewhere); the schema metadata says so (``paths:
        relative-to-manifest``), and :meth:`from_manifest` resolves by it.
        Urls with a scheme (``s3://``...) are stored as they are.
        """
        fs, fs_path = fsspec.core.url_to_fs(path, **dict(storage_options or {}))
        local = isinstance(fs, LocalFileSystem)
        table = manifest_table(self.table, posixpath.dirname(fs_path) if local else None)
        if not local:
            with fs.open(fs_path, "wb") as f:
                write_ipc(table, f)
            return
        partial = f"{fs_path}.{uuid.uuid4().hex}.partial"
        try:
            with pa.OSFile(partial, "wb") as f:
                write_ipc(table, f)
            os.replace(partial, fs_path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)

    def with_num_records(self, num_records: IntColumn) -> ShardList:
        """A new ShardList with the same urls and sizes and these counts.

        ``num_records`` takes the same forms as in the constructor; use it to
        store the result of a counting pass.
        """
        return ShardList._build(
            lambda: self.table.set_column(1, NUM_RECORDS, int_column(num_records, len(self), NUM_RECORDS))
        )

    def select(self, indices: Sequence[int] | np.ndarray) -> ShardList:
        """A new ShardList holding the rows at ``indices`` (negative ones count
        from the end; a boolean mask of length ``len(self)`` also works)."""
        n = len(self)
        positions = np.asarray(indices)
        if positions.dtype == np.bool_:
            if positions.shape != (n,):
                raise ShardListError(f"a boolean mask must have {n} entries, got shape {positions.shape}")
            positions = np.flatnonzero(positions)
        elif positions.size and positions.dtype.kind not in "iu":
            raise ShardListError(f"indices must be integers, got dtype {positions.dtype}")
        positions = positions.astype(np.int64).ravel()
        positions = np.where(positions < 0, positions + n, positions)
        bad = np.flatnonzero((positions < 0) | (positions >= n))
        if bad.size:
            raise IndexError(f"indices[{bad[0]}] is out of range for a ShardList of {n} urls")
        return ShardList._build(lambda: self.table.take(pa.array(positions, pa.int64())))

    # -- reading -------------------------------------------------------------

    @property
    def table(self) -> pa.Table:
        """The memory-mapped table (columns ``url``, ``num_records``, ``size``).

        Do not pickle it or a slice of it: pyarrow ships every byte. Pickle the
        ShardList instead.
        """
        if self._table is None:
            self._table, _ = map_ipc(self._path)
        return self._table

    @property
    def backing_file(self) -> str:
        """Path of the Arrow IPC file this list is memory-mapped from."""
        return self._path

    def __len__(self) -> int:
        return self.table.num_rows

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> ShardList: ...

    def __getitem__(self, index: int | slice) -> str | ShardList:
        """``sl[i]`` is the i-th url; ``sl[a:b:c]`` is a new ShardList."""
        n = len(self)
        if isinstance(index, slice):
            return self.select(np.arange(*index.indices(n)))
        i = operator.index(index)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of range for a ShardList of {n} urls")
        return self.table.column(URL)[i % n].as_py()

    def urls(self, start: int = 0, stop: int | None = None) -> list[str]:
        """The urls from ``start`` to ``stop`` as a list, read in one batch.

        Bounds follow slice rules (negative counts from the end, clipped).
        """
        begin, end, _ = slice(start, stop).indices(len(self))
        return self.table.column(URL).slice(begin, max(end - begin, 0)).to_pylist()

    def __iter__(self) -> Iterator[str]:
        column = self.table.column(URL)
        for begin in range(0, len(column), _BATCH):
            yield from column.slice(begin, _BATCH).to_pylist()

    @property
    def num_records(self) -> np.ndarray | None:
        """Records per shard as a read-only ``int64`` array, or ``None`` if ANY
        count is unknown (see :attr:`known_counts` for which ones are)."""
        return int64_array(self.table.column(NUM_RECORDS))

    @property
    def known_counts(self) -> np.ndarray:
        """Boolean array: True where the shard's record count is known."""
        return valid_mask(self.table.column(NUM_RECORDS))

    @property
    def total_records(self) -> int | None:
        """Sum of :attr:`num_records`, or ``None`` if any count is unknown."""
        column = self.table.column(NUM_RECORDS)
        if column.null_count:
            return None
        return int(pc.sum(column).as_py() or 0)

    @property
    def sizes(self) -> np.ndarray | None:
        """Byte size per shard as a read-only ``int64`` array, or ``None`` if
        any size is unknown."""
        return int64_array(self.table.column(SIZE))

    def url_digest(self) -> str:
        """A SHA-256 hex digest of the urls in order, the same in every process.

        It hashes the url bytes and lengths straight from the Arrow buffers
        (0.03 s for 1M urls), whatever the chunking or string type; computed
        once per object. Counts caches and resume states are bound to it.
        """
        digest = getattr(self, "_url_digest", None)
        if digest is None:
            digest = self._url_digest = string_digest(self.table.column(URL))
        return digest

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardList):
            return NotImplemented
        if other is self or other._path == self._path:
            return True
        mine, theirs = self.table, other.table
        if mine.num_rows != theirs.num_rows:
            return False
        return all(same_values(mine.column(name), theirs.column(name)) for name in (URL, NUM_RECORDS, SIZE))

    def __repr__(self) -> str:
        n = len(self)
        if n == 0:
            return "ShardList([])"
        total = self.total_records
        records = "unknown" if total is None else str(total)
        return f"ShardList({n} urls, first={self[0]!r}, last={self[-1]!r}, total_records={records})"

    # -- pickling: by path ----------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self._path, "owns_file": self._finalizer is not None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # An unpickled copy never owns the file; it maps it on first access.
        self._path = state["path"]
        self._table = None
        self._finalizer = None

    def __copy__(self) -> ShardList:
        return self  # immutable

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardList:
        return self  # immutable

    # -- internals --------------------------------------------------------------

    @classmethod
    def _build(cls, make_table: Callable[[], pa.Table]) -> ShardList:
        shards = cls.__new__(cls)
        shards._own(persist(make_table))
        return shards

    def _own(self, path: str) -> None:
        self._path = path
        self._table = None
        self._finalizer: weakref.finalize | None = delete_with(self, path)


def _warn_duplicates(column: pa.ChunkedArray, label: str) -> None:
    """Warn, naming the first url listed twice and all its positions, if there is one."""
    n = len(column)
    if n < 2 or pc.all(pc.greater(column.slice(1), column.slice(0, n - 1))).as_py():
        return  # strictly increasing (a glob, most manifests): no duplicates, checked in O(n)
    if len(pc.unique(column)) == n:
        return
    counts = pc.value_counts(column)
    first = counts.filter(pc.greater(counts.field("counts"), 1))[0]["values"].as_py()
    positions = np.flatnonzero(pc.equal(column, first).to_numpy(zero_copy_only=False)).tolist()
    repeated = pc.sum(pc.greater(counts.field("counts"), 1)).as_py()
    warnings.warn(
        f"{label}: {redact_url(first)!r} is listed {len(positions)} times (at positions {positions[:10]}), and "
        f"{repeated} url(s) in all are listed more than once; their records are read once per listing "
        "every epoch. Remove the repeats, or repeat a shard on purpose only if you mean to oversample it",
        DuplicateShardWarning,
        stacklevel=3,
    )
