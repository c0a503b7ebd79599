"""Lance datasets, read in place with ``pylance``: a shard is one fragment of one pinned version.

A Lance dataset is a directory (local or in an object store) of data files
grouped into fragments, and a manifest per version naming the fragments and
their row counts (physical rows less deleted ones): the counts every plan
needs, with no pass over the data. A shard's url names the dataset, the
fragment and the version, ``<uri>#fragment=<id>&version=<v>``, so every rank
and DataLoader worker reads the same rows of the same version: an append, a
delete or a compaction committed while an epoch runs makes a new version and
changes nothing that epoch reads (nor a resumed one: the version is in the
state's shard urls).

A record is a row, a dict of column to value as ``pyarrow``'s ``to_pylist``
gives it (what ``lance.dataset(uri).to_table().to_pylist()`` holds, in that
order), or with ``batch_size=b`` up to ``b`` rows of one fragment as a dict of
column to numpy array, like :class:`~shardkit.formats.parquet.ParquetFormat`
(a fixed-size list column without nulls, such as an embedding, as one 2-D array).
``columns=`` projects: other columns are never read.

A fragment that yields fewer rows than its manifest says (a data file cut
short or gone), or whose data does not decode, is a
:class:`~shardkit.CorruptRecordError` at the first row not read, with the
fragment's url (``framing_intact`` false: under ``on_error="skip"`` the rest of
the range is skipped and counted). Byte offsets are Lance's own business and
are reported as unknown (-1).

``pylance`` is imported only when a Lance dataset is read: ``pip install shardkit[lance]``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any, Final, NamedTuple

import numpy as np

from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.base import FormatBase, ProcessCache, column_options
from shardkit.io.remote import RemoteOptions

__all__ = ["LanceFormat", "FragmentUrl", "fragment_url", "import_lance", "parse_fragment_url"]

OPEN_DATASETS: Final = 16
"""Opened dataset versions kept per process."""

SCAN_ROWS: Final = 1024
"""Rows per batch scanned when a record is a row."""


class FragmentUrl(NamedTuple):
    """The parts of a Lance shard url."""

    uri: str
    fragment: int
    version: int


def fragment_url(uri: str, fragment: int, version: int) -> str:
    """The shard url of fragment ``fragment`` of version ``version`` of the Lance dataset at ``uri``."""
    return f"{uri.rstrip('/')}#fragment={fragment}&version={version}"


def parse_fragment_url(url: str) -> FragmentUrl:
    """The dataset uri, fragment id and version a Lance shard url names.

    Raises:
        ShardkitError: ``url`` is not such a url (a Lance dataset is read by ``LanceDataset(uri)``).
    """
    uri, _, fragment = url.rpartition("#")
    try:
        fields = dict(part.split("=", 1) for part in fragment.split("&"))
        return FragmentUrl(uri, int(fields["fragment"]), int(fields["version"]))
    except (ValueError, KeyError):
        raise ShardkitError(
            f"{url} names no Lance fragment (<uri>#fragment=<id>&version=<v>): read a Lance dataset "
            "with shardkit.LanceDataset(uri)"
        ) from None


_USED_BY: int | None = None
"""The process in which shardkit first used Lance (its runtime's threads do not survive a fork); None: none."""


def import_lance() -> Any:
    """The ``lance`` module (``pylance``), or an error naming the extra that installs it.

    Refused in a child forked from a process that used it: Lance's runtime threads are not copied by a fork,
    so a read there can wait forever (seen: a forked DataLoader worker stuck in ``to_batches``, its loader
    with it). Spawned processes start clean.
    """
    global _USED_BY
    if _USED_BY is not None and _USED_BY != os.getpid():
        raise ShardkitError(
            "this process was forked from one that used Lance, whose runtime does not survive a fork (a read "
            "here can hang for ever): start the DataLoader's workers with multiprocessing_context='spawn' or "
            "'forkserver'"
        )
    try:
        import lance
    except ImportError:
        raise ShardkitError("reading Lance datasets needs pylance: pip install 'shardkit[lance]'") from None
    _USED_BY = os.getpid()
    return lance


class LanceFormat(FormatBase):
    """Fragments of Lance datasets, each at a pinned version (see the module docstring).

    Args:
        columns: the columns to read (all by default).
        batch_size: None (a record is a row, as a dict) or ``b`` (a record is up to ``b``
            rows of one fragment, as a dict of column to numpy array).
        storage_options: Lance's object store options (``aws_access_key_id``, ``aws_endpoint``,
            ``allow_http``...), handed to ``lance.dataset``.
    """

    name = "lance"
    suffixes = ()  # a fragment is named by its dataset, not a file: LanceDataset lists them

    def __init__(
        self,
        *,
        columns: Sequence[str] | None = None,
        batch_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        remote: RemoteOptions | None = None,
    ) -> None:
        self.columns, self.batch_size = column_options(columns, batch_size)
        self.storage_options = storage_options
        self.remote = remote
        self._open: ProcessCache[Any] = ProcessCache(OPEN_DATASETS)

    def __repr__(self) -> str:
        return f"LanceFormat(columns={self.columns!r}, batch_size={self.batch_size!r})"

    def sniff(self, head: bytes) -> bool:
        return False

    def dataset(self, uri: str, version: int | None = None) -> Any:
        """The Lance dataset at ``uri``, at ``version`` (None: its latest), opened once per process."""
        lance = import_lance()
        if version is None:
            return lance.dataset(uri, storage_options=self.storage_options)
        key = (uri, version, os.getpid())  # one per process (a forked one is refused by import_lance)
        return self._open.get(key, lambda: lance.dataset(uri, version=version, storage_options=self.storage_options))

    def fragment(self, url: str) -> Any:
        where = parse_fragment_url(url)
        fragment = self.dataset(where.uri, where.version).get_fragment(where.fragment)
        if fragment is None:
            raise ShardkitError(f"{url}: version {where.version} of {where.uri} has no fragment {where.fragment}")
        return fragment

    def count_rows(self, url: str) -> int:
        """Rows of the fragment ``url`` names, from its version's manifest (its deletions taken off)."""
        return int(self.fragment(url).metadata.num_rows)

    def stored_count(self, url: str) -> int:
        return self.count_rows(url)

    def count(self, url: str) -> int:
        """Records of the fragment: rows, or batches of ``batch_size`` rows."""
        rows = self.count_rows(url)
        return rows if self.batch_size is None else -(-rows // self.batch_size)

    def build_index(self, url: str) -> str | None:
        """The manifest is the index: check the fragment is in it, return None."""
        self.count_rows(url)
        return None

    def prefetch(self, url: str, start: int, stop: int | None) -> None:
        """Nothing: Lance reads its object store itself."""

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """Records ``[start, stop)`` of the fragment ``url`` names."""
        if start < 0 or (stop is not None and stop < start):
            raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
        if self.batch_size is None:
            return (row for batch in self._scan(url, start, stop, SCAN_ROWS) for row in batch.to_pylist())
        b = self.batch_size
        return (_numpy(batch) for batch in self._scan(url, start * b, None if stop is None else stop * b, b))

    def _scan(self, url: str, lo: int, hi: int | None, size: int) -> Iterator[Any]:
        """Rows ``[lo, hi)`` as record batches of ``size`` rows (the last may be shorter), each row
        checked for: fewer rows than the manifest says is a located error at the first one missing."""
        fragment = self.fragment(url)
        rows = int(fragment.metadata.num_rows)
        hi = rows if hi is None else min(hi, rows)
        if lo >= hi:
            return
        at = lo
        try:
            for batch in _recut(
                fragment.to_batches(columns=self.columns, batch_size=size, offset=lo, limit=hi - lo), size
            ):
                at += batch.num_rows
                yield batch
        except (OSError, ValueError, RuntimeError) as error:
            raise CorruptRecordError(url, self._record_of(at), -1, f"the fragment does not read ({error})") from None
        if at < hi:
            reason = (
                f"the fragment ended after {at} rows; version {parse_fragment_url(url).version}'s manifest says {rows}"
            )
            raise CorruptRecordError(url, self._record_of(at), -1, reason)

    def _record_of(self, row: int) -> int:
        return row if self.batch_size is None else row // self.batch_size


def _recut(batches: Iterator[Any], size: int) -> Iterator[Any]:
    """``batches`` re-cut into ``size`` rows each, the last one shorter (Lance may cut at its pages)."""
    import pyarrow as pa

    pending: list[Any] = []
    have = 0
    for batch in batches:
        if not pending and batch.num_rows == size:
            yield batch  # how Lance cuts them when nothing is pending: no copy
            continue
        pending.append(batch)
        have += batch.num_rows
        while have >= size:
            table = pa.Table.from_batches(pending)
            yield table.slice(0, size).combine_chunks().to_batches()[0]
            rest = table.slice(size)
            pending, have = rest.to_batches(), have - size
    if have:
        yield pa.Table.from_batches(pending).combine_chunks().to_batches()[0]


def _numpy(batch: Any) -> dict[str, np.ndarray]:
    return {name: _column(column) for name, column in zip(batch.schema.names, batch.columns)}


def _column(column: Any) -> np.ndarray:
    """A column as numpy: a fixed-size list without nulls (an embedding) as one 2-D array, not an object
    array of rows; any other as pyarrow converts it."""
    import pyarrow as pa

    if pa.types.is_fixed_size_list(column.type) and column.null_count == 0:
        size = column.type.list_size
        values = column.flatten()
        if values.null_count == 0:
            return values.to_numpy(zero_copy_only=False).reshape(len(column), size)
    return column.to_numpy(zero_copy_only=False)
