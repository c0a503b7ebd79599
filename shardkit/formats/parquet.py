"""Parquet shards: a record is a row (a dict of column to value), or a batch of rows.

Counts come from the footer (``num_rows``, no scan) and a record range maps
to the row groups it overlaps: only those are read (``read_row_group``), and
the first is sliced from the range's offset. ``columns=`` projects, so other
columns are never read. The footer is the index: there is no index file.

With ``batch_size=b`` a record is instead a batch of ``b`` consecutive rows of
one file (the last batch of a file may be shorter), yielded as a dict of
column to numpy array: no Python object per row. Plans, exactly-once and
resuming then count batches: a file of ``n`` rows holds ``ceil(n / b)``
records. Measured in ``benchmarks/formats.py``.

Trust nothing: page CRCs are checked where the file has them (:class:`ParquetWriter`
writes them; many writers do not, and then a flipped value byte goes
unseen: Parquet has no other checksum). A footer that cannot be read raises
:class:`~shardkit.CorruptRecordError` at record 0 with ``framing_intact``
false: nothing in the file can be located, so under ``on_error="skip"`` the
rest of the range is skipped and counted. So does a footer whose total row
count is not the sum of its row groups' (a negative or absurd ``num_rows``):
it lies about one or the other. Its file is counted by its row groups (a
count never comes from a total the file contradicts, so ``len()`` and the
planned, padded counts stay what the row groups hold) and its reads raise
at their first record, with the footer's byte offset.

A row group that does not decode (a bad page CRC, a bad length, a truncated
page, fewer rows than its footer entry) costs exactly its own rows: the
footer still locates every other row group. The error names the url, the
first record of the row group in the range, the byte offset of the column
chunk that failed (found by decoding the group's columns one at a time, only
after a failure) and its column, with ``framing_intact`` true and
``records`` the records of the group from there on. Under
``on_error="skip"`` the source skips those records at once: one warning,
one error and ``records`` skipped in ``stats()``, positions exact for
pad/drop, and the read goes on from the next row group (the bad group is
not decoded again). With ``batch_size`` a record is a batch: the batches
holding any row of the bad group are lost (rows of a neighbouring good
group in such a batch with them).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, Final

import numpy as np

from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.base import FormatBase, column_options
from shardkit.io.files import open_raw
from shardkit.io.remote import RemoteOptions

__all__ = ["ParquetFormat", "ParquetWriter"]

_MAGIC: Final = b"PAR1"


class ParquetFormat(FormatBase):
    """Parquet shards (``.parquet``, ``.pq``).

    Args:
        columns: the columns to read (all by default).
        batch_size: None (a record is a row, as a dict) or ``b`` (a record is
            up to ``b`` rows, as a dict of column to numpy array).
        storage_options: fsspec options.
        remote: how remote shards are read (:class:`~shardkit.io.remote.RemoteOptions`: readahead,
            retries, the local cache); local files ignore it.
    """

    name = "parquet"
    suffixes = (".parquet", ".pq")

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

    def __repr__(self) -> str:
        return f"ParquetFormat(columns={self.columns!r}, batch_size={self.batch_size!r})"

    def sniff(self, head: bytes) -> bool:
        return head[:4] == _MAGIC

    def _open(self, url: str) -> tuple[Any, Any]:
        """(raw file, pyarrow ParquetFile), the footer read and checked."""
        import pyarrow.parquet as pq

        raw = open_raw(url, "rb", self.storage_options, remote=self.remote)
        try:
            # Page CRCs, where the writer stored them (ParquetWriter here does), are checked.
            return raw, pq.ParquetFile(raw, page_checksum_verification=True)
        except Exception as error:
            raw.close()
            raise CorruptRecordError(
                url, 0, -1, f"the Parquet footer cannot be read ({type(error).__name__}: {error})"
            ) from None

    def count(self, url: str) -> int:
        """Records in ``url`` from its footer: rows, or batches of ``batch_size`` rows."""
        rows = self.count_rows(url)
        return rows if self.batch_size is None else -(-rows // self.batch_size)

    def stored_count(self, url: str) -> int:
        """Rows in ``url`` from its footer: what sources take as its record count when the list has none."""
        return self.count_rows(url)

    def count_rows(self, url: str) -> int:
        """Rows in ``url``, from its footer: the sum of its row groups' counts, which locate every row.

        A footer whose total disagrees with them is counted by its row groups,
        as the reader numbers its rows, and reported when the file is read.
        """
        raw, pf = self._open(url)
        try:
            return sum(_group_rows(url, raw, pf.metadata))
        finally:
            raw.close()

    def build_index(self, url: str) -> str | None:
        """Parquet needs no index file (the footer is its index): check the footer, return None."""
        raw, pf = self._open(url)
        try:
            _check_footer(url, raw, pf.metadata, 0)
        finally:
            raw.close()
        return None

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """Records ``[start, stop)`` of the Parquet file at ``url``."""
        if start < 0 or (stop is not None and stop < start):
            raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
        if self.batch_size is None:
            return itertools.chain.from_iterable(t.to_pylist() for t in self._tables(url, start, stop))
        b = self.batch_size
        return self._batches(self._tables(url, start * b, None if stop is None else stop * b))

    def _tables(self, url: str, lo: int, hi: int | None) -> Iterator[Any]:
        """Rows ``[lo, hi)`` as Arrow tables, one per row group read."""
        if hi is not None and hi <= lo:
            return
        raw, pf = self._open(url)
        try:
            meta = pf.metadata
            sizes = _check_footer(url, raw, meta, self._record_of(lo))
            starts = list(itertools.accumulate(sizes, initial=0))
            hi = starts[-1] if hi is None else min(hi, starts[-1])
            if self.columns is not None:
                missing = sorted(set(self.columns) - set(pf.schema_arrow.names))
                if missing:
                    raise ShardkitError(f"{url} has no columns {missing}; it has {pf.schema_arrow.names}")
            group = bisect.bisect_right(starts, lo) - 1
            while group < len(sizes) and starts[group] < hi:
                first, end = max(lo, starts[group]), starts[group + 1]
                table = self._row_group(url, pf, group, first, end)
                yield table.slice(first - starts[group], min(hi, end) - first)
                group += 1
        finally:
            raw.close()

    def _row_group(self, url: str, pf: Any, group: int, first: int, end: int) -> Any:
        """Row group ``group`` (rows ``[.., end)``, read from row ``first``) as a table, or its located error."""
        try:
            table = pf.read_row_group(group, columns=self.columns)
        except Exception as error:
            offset, column = _failing_chunk(pf, group, self.columns)
            where = f" in column {column!r}" if column is not None else ""
            reason = f"row group {group} does not decode{where} ({type(error).__name__}: {error})"
            raise self._bad_group(url, pf, group, first, end, offset, reason) from None
        expected = pf.metadata.row_group(group).num_rows
        if table.num_rows != expected:
            reason = f"row group {group} holds {table.num_rows} rows, its footer says {expected}"
            raise self._bad_group(url, pf, group, first, end, _shape(pf, group)[2], reason)
        return table

    def _bad_group(
        self, url: str, pf: Any, group: int, first: int, end: int, offset: int, reason: str
    ) -> CorruptRecordError:
        """The error for the bad row group at row ``first``: it costs the group's records from there on."""
        record = self._record_of(first)
        last = end if self.batch_size is None else -(-end // self.batch_size)  # every batch holding one of its rows
        return CorruptRecordError(url, record, offset, reason, framing_intact=True, records=last - record)

    def _record_of(self, row: int) -> int:
        return row if self.batch_size is None else row // self.batch_size

    def _batches(self, tables: Iterator[Any]) -> Iterator[dict[str, np.ndarray]]:
        """Re-cut the tables into ``batch_size`` rows (the last may be shorter), as dicts of numpy arrays."""
        import pyarrow as pa

        b = self.batch_size
        assert b is not None
        pending: list[Any] = []
        have = 0
        for table in tables:
            pending.append(table)
            have += table.num_rows
            if have < b:
                continue
            joined = pa.concat_tables(pending) if len(pending) > 1 else pending[0]
            cut = have - have % b
            for at in range(0, cut, b):
                yield _numpy(joined.slice(at, b))
            pending, have = ([joined.slice(cut)], have - cut) if have > cut else ([], 0)
        if have:
            yield _numpy(pa.concat_tables(pending) if len(pending) > 1 else pending[0])

    def writer(self, url: str, *, name: str | None = None) -> ParquetWriter:
        """A writer of rows to ``url`` (``name``: the name it will be renamed to, which its errors give)."""
        return ParquetWriter(url, storage_options=self.storage_options, name=name)


def _group_rows(url: str, raw: Any, meta: Any) -> list[int]:
    """The row count of each row group in the footer ``meta``; a negative one is a located error."""
    sizes = [int(meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
    bad = next((g for g, n in enumerate(sizes) if n < 0), None)
    if bad is not None:
        reason = f"the Parquet footer says row group {bad} holds {sizes[bad]} rows: its rows cannot be located"
        raise CorruptRecordError(url, 0, _footer_offset(raw, meta), reason)
    return sizes


def _check_footer(url: str, raw: Any, meta: Any, record: int) -> list[int]:
    """The row groups' row counts, checked against the footer's total (``num_rows``).

    A total that disagrees (negative, absurd, or one row off) means the footer
    lies about one or the other, so no row of the file can be trusted: a
    located error at ``record`` (the range's first), ``framing_intact`` false,
    which under ``on_error="skip"`` skips and counts the rest of the range.
    """
    sizes = _group_rows(url, raw, meta)
    if int(meta.num_rows) != sum(sizes):
        reason = (
            f"the Parquet footer says it holds {meta.num_rows} rows, its {len(sizes)} row groups {sum(sizes)}: "
            "the footer is damaged or its writer broken (rewrite the file)"
        )
        raise CorruptRecordError(url, record, _footer_offset(raw, meta), reason)
    return sizes


def _footer_offset(raw: Any, meta: Any) -> int:
    """The byte offset of the footer's metadata: the file ends ``<metadata><its length: 4 bytes>PAR1``."""
    return int(raw.seek(0, 2)) - 8 - int(meta.serialized_size)


def _shape(pf: Any, group: int) -> tuple[int, int, int]:
    """(rows, bytes, byte offset of its first column chunk) of row group ``group``, from the footer."""
    meta = pf.metadata.row_group(group)
    starts = [_chunk_start(meta.column(c)) for c in range(meta.num_columns)]
    return int(meta.num_rows), int(meta.total_byte_size), min(starts) if starts else -1


def _chunk_start(chunk: Any) -> int:
    """Where a column chunk's first page (its dictionary page, if it has one) starts."""
    dictionary = chunk.dictionary_page_offset if chunk.has_dictionary_page else None
    return int(dictionary if dictionary is not None else chunk.data_page_offset)


def _failing_chunk(pf: Any, group: int, columns: list[str] | None) -> tuple[int, str | None]:
    """(byte offset, column) of the first projected column of ``group`` that does not decode on its own.

    Only called after the whole group failed. A column's chunks are its leaves
    (``tags.list.element`` for ``tags``); when every column decodes alone (the
    failure was in combining them), the group's first chunk and None.
    """
    meta = pf.metadata.row_group(group)
    starts: dict[str, int] = {}
    for c in range(meta.num_columns):
        chunk = meta.column(c)
        name = next((n for n in pf.schema_arrow.names if chunk.path_in_schema.split(".")[0] == n), None)
        if name is not None:
            starts[name] = min(starts.get(name, _chunk_start(chunk)), _chunk_start(chunk))
    for name, start in starts.items():
        if columns is not None and name not in columns:
            continue
        try:
            pf.read_row_group(group, columns=[name])
        except Exception:
            return start, name
    return _shape(pf, group)[2], None


def _numpy(table: Any) -> dict[str, np.ndarray]:
    return {name: column.to_numpy() for name, column in zip(table.column_names, table.columns)}


class ParquetWriter:
    """Write rows (dicts) to a Parquet file, a row group every ``row_group_size`` rows.

    The schema is inferred from the first row group's rows by pyarrow.
    """

    def __init__(
        self,
        url: str,
        *,
        row_group_size: int = 10_000,
        storage_options: dict[str, Any] | None = None,
        name: str | None = None,
    ) -> None:
        self.url = url
        self.name = name or url  # the final name, where url is a temporary file renamed to it when complete
        self.num_records = 0
        self.num_bytes = 0
        self._row_group_size = row_group_size
        self._rows: list[dict[str, Any]] = []
        self._raw: Any = open_raw(url, "wb", storage_options)
        self._writer: Any = None
        self._closed = False

    def write(self, row: dict[str, Any]) -> None:
        if self._closed:
            raise ShardkitError(f"{self.url}: write() on a closed ParquetWriter")
        if not isinstance(row, dict):
            raise ShardkitError(f"a Parquet record is a dict of column to value, got {type(row).__name__}")
        self._rows.append(row)
        self.num_records += 1
        if len(self._rows) >= self._row_group_size:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._rows:
            return
        try:
            table = pa.Table.from_pylist(self._rows, schema=None if self._writer is None else self._writer.schema)
        except (pa.ArrowException, TypeError, ValueError) as error:
            first = self.num_records - len(self._rows)
            raise ShardkitError(
                f"{self.name}: rows {first}..{self.num_records - 1} do not fit one Parquet schema "
                f"({type(error).__name__}: {str(error)[:200]}); a column holds scalars, text, bytes or lists "
                "of them, of one type (an array of more than one dimension: store it flat, with its shape)"
            ) from None
        if self._writer is None:
            self._writer = pq.ParquetWriter(self._raw, table.schema, write_page_checksum=True)
        self._writer.write_table(table)
        self.num_bytes += table.nbytes
        self._rows = []

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._flush()
            if self._writer is not None:
                self._writer.close()
        finally:
            self._raw.close()

    def __enter__(self) -> ParquetWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
