"""Megatron-LM indexed datasets as a shard format: a record is a whole document, ``{"input_ids": array}``.

A shard is a ``.bin``/``.idx`` pair (see :mod:`shardkit.formats.megatron.index`),
named by its ``.bin`` (``data/X.bin``); the prefix (``data/X``, as Megatron's
``--data-path`` takes it) and the ``.idx`` name the same pair. Counts come from
the ``.idx`` header (its 34 bytes and its size: no scan), so plans, splits over
ranks and workers, shuffling, pad/drop and resuming work per document with no
pass over the data.

Reading: the ``.idx`` is read once per process (kept in a small cache bound to
the file's size, modification time and inode locally, fetched once remotely)
and checked whole; the ``.bin`` is read with ``os.pread`` locally and ranged
reads remotely (:mod:`shardkit.io.reader`), a run of neighbouring documents
(up to :data:`SPAN_BYTES`) per read, and each document is a read-only numpy
view of that run in the file's dtype: no copy per document, no per-token work.
Not a memory map: a ``.bin`` truncated while it is read would kill the worker
with ``SIGBUS`` on the first page past the new end; ``pread`` returns short
instead, which is reported like any truncation. A short ``pread`` is read on
from (:func:`~shardkit.io.files.preadv_exactly`): Linux moves at most 2 GiB - 4 KiB
per call, so a valid document over 2 GiB read in one call looked truncated.

Faults, each a :class:`~shardkit.CorruptRecordError`:

- the ``.idx`` header does not fit its file (magic, version, dtype code, counts
  that do not match its size, truncated): at the ``.idx`` byte, nothing read;
- a document index out of order: documents before it are read, the rest of a
  range from it raises (``framing_intact`` false: skipped and counted);
- a pointer or length that disagrees: that document and its neighbour are bad
  alone (``framing_intact``: under ``on_error="skip"`` each costs itself);
- a document past the end of the ``.bin`` (a truncated ``.bin``, at open or
  while reading): raised at that document, the rest of the range lost;
- a ``.bin`` longer than the index says, or sequences in no document: the pair
  does not belong together (a stale ``.idx``), raised at a range's first record.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Final

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileOpener

from shardkit.errors import CorruptRecordError
from shardkit.formats.base import BadRecord, FormatBase, ProcessCache
from shardkit.formats.megatron.index import (
    HEADER_BYTES,
    KEY,
    MAGIC,
    TokenIndex,
    bin_url,
    dtype_code,
    idx_url,
    parse_header,
    parse_index,
)
from shardkit.formats.megatron.writer import PairWriter
from shardkit.io.files import open_raw, preadv_exactly
from shardkit.io.remote import RemoteOptions
from shardkit.io.retry import retried_call

__all__ = ["INDEX_CACHE_BYTES", "SPAN_BYTES", "MegatronFormat", "describe"]

SPAN_BYTES: Final = 1 << 20
"""Bytes of neighbouring documents read at once; a larger document is read alone."""

INDEX_CACHE_BYTES: Final = 256 << 20
"""Checked indexes kept per process (16 bytes per document), least recently used dropped first."""


def _index_bytes(index: TokenIndex) -> int:
    return index.nbytes


class MegatronFormat(FormatBase):
    """Megatron-LM / megatron-core indexed datasets (``X.bin`` + ``X.idx``).

    Args:
        dtype: what :meth:`writer` writes tokens as (reading takes the file's own).
        storage_options: fsspec options.
        remote: how remote ``.bin`` files are read (:class:`~shardkit.io.remote.RemoteOptions`).
    """

    name = "megatron"
    suffixes = (".bin",)

    def __init__(
        self,
        *,
        dtype: Any = np.int32,
        storage_options: dict[str, Any] | None = None,
        remote: RemoteOptions | None = None,
    ) -> None:
        dtype_code(dtype)  # a dtype a .bin can hold, checked now
        self.dtype = np.dtype(dtype)
        self.storage_options = storage_options
        self.remote = remote
        self._indexes: ProcessCache[TokenIndex] = ProcessCache(INDEX_CACHE_BYTES, _index_bytes)

    def __repr__(self) -> str:
        return f"MegatronFormat(dtype={self.dtype})"

    def sniff(self, head: bytes) -> bool:
        """An ``.idx`` starts with the magic; a ``.bin`` has none (its suffix names it)."""
        return head[:9] == MAGIC

    # -- counts

    def stored_count(self, url: str) -> int:
        """Documents in the pair ``url`` names, from the ``.idx`` header (checked against its size)."""
        index = idx_url(url)
        fs, path = fsspec.core.url_to_fs(index, **(self.storage_options or {}))
        try:
            size = int(retried_call(fs, "info", path, retry=self.remote.retry if self.remote else None)["size"])
        except FileNotFoundError:
            raise _no_index(url) from None
        with open_raw(index, "rb", self.storage_options, remote=self.remote) as f:
            head = f.read(HEADER_BYTES)
        return parse_header(head, size, index).documents

    def count(self, url: str) -> int:
        return self.stored_count(url)

    def build_index(self, url: str) -> str | None:
        """The ``.idx`` is the index: check it whole, return None."""
        self.index(url)
        return None

    def index(self, url: str) -> TokenIndex:
        """The checked :class:`~shardkit.formats.megatron.index.TokenIndex` of the pair ``url`` names."""
        index = idx_url(url)
        fs, path = fsspec.core.url_to_fs(index, **(self.storage_options or {}))
        key = (index, *_local_identity(path)) if _is_local(fs) else (index,)
        return self._indexes.get(key, lambda: self._read_index(url, index))

    def _read_index(self, url: str, index: str) -> TokenIndex:
        try:
            with open_raw(index, "rb", self.storage_options, remote=self.remote) as f:
                data = f.read()
        except FileNotFoundError:
            raise _no_index(url) from None
        return parse_index(data, index)

    # -- reading

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """Documents ``[start, stop)`` of the pair ``url`` names, as ``{"input_ids": array}``."""
        _check_range(start, stop)
        return self._documents(url, start, stop, marked=False)

    def read_marked(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """:meth:`read`, with a :class:`~shardkit.formats.base.BadRecord` in place of each bad document."""
        _check_range(start, stop)
        return self._documents(url, start, stop, marked=True)

    def _documents(self, url: str, start: int, stop: int | None, *, marked: bool) -> Iterator[Any]:
        index = self.index(url)
        stop = index.documents if stop is None else min(stop, index.documents)
        if start >= stop:
            return
        data = bin_url(url)
        with open_raw(data, "rb", self.storage_options, remote=self.remote) as f:
            fd = f.fileno() if isinstance(f, LocalFileOpener) else None
            size = os.fstat(fd).st_size if fd is not None else int(getattr(f, "size", None) or f.seek(0, 2))
            _check_pair(data, index, size, start)
            limit, fault = _limit(data, index, size, stop)
            yield from _spans(data, index, f, fd, start, limit, marked)
            if fault is not None:
                raise fault

    # -- writing

    def writer(self, url: str, *, name: str | None = None) -> Any:
        """A writer of documents to the ``.bin`` ``url``; its ``.idx`` goes beside ``name`` (default
        ``url``), published by :class:`~shardkit.ShardWriter` before the ``.bin`` (see ``companions``)."""
        return PairWriter(url, name=name, dtype=self.dtype, storage_options=self.storage_options)


def _check_range(start: int, stop: int | None) -> None:
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")


def _is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _local_identity(path: str) -> tuple[int, ...]:
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return st.st_size, st.st_mtime_ns, st.st_ino


def _no_index(url: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{bin_url(url)} has no {idx_url(url)} beside it: a Megatron indexed dataset is a .bin with its .idx "
        "(written together by shardkit.TokenWriter or Megatron's preprocess_data.py)"
    )


def _check_pair(data: str, index: TokenIndex, size: int, start: int) -> None:
    """Raise at the range's first record when the ``.bin`` and ``.idx`` do not belong together."""
    if index.broken is None and index.orphans:
        reason = (
            f"{index.orphans} of the {index.sequences} sequences in {index.url} belong to no document "
            "(its last document index is short): the .idx does not describe this .bin"
        )
        raise CorruptRecordError(data, start, -1, reason)
    if size > index.described and index.broken is None and not len(index.bad):
        reason = (
            f"the .bin has {size} bytes, {size - index.described} more than its lengths in {index.url} add up to: "
            "the .idx is of another .bin (stale?); rewrite the pair"
        )
        raise CorruptRecordError(data, start, index.described, reason)


def _limit(data: str, index: TokenIndex, size: int, stop: int) -> tuple[int, CorruptRecordError | None]:
    """Where reading ``[.., stop)`` must end, and the error to raise there (None: none)."""
    limit, fault = stop, None
    if index.broken is not None and index.broken[0] < limit:
        document, offset, reason = index.broken
        limit, fault = document, CorruptRecordError(index.url, document, offset, reason)
    past = index.past_end(size)
    if past < limit:
        start, end = int(index.starts[past]), int(index.ends[past])
        reason = (
            f"document {past} is bytes [{start}, {end}) by {index.url}, but the .bin ends at byte {size}: "
            "it is truncated (or the .idx is of another .bin)"
        )
        limit, fault = past, CorruptRecordError(data, past, min(start, size), reason)
    return limit, fault


def _spans(data: str, index: TokenIndex, f: Any, fd: int | None, start: int, limit: int, marked: bool) -> Iterator[Any]:
    """Documents ``[start, limit)``, a run of good neighbours per read, bad ones raised or marked."""
    bad, starts, ends = index.bad, index.starts, index.ends
    d = start
    while d < limit:
        if _is_bad(bad, d):
            error = index.bad_error(data, d)
            if not marked:
                raise error
            yield BadRecord(error)
            d += 1
            continue
        stop = _run_end(index, d, limit)
        lo, hi = int(starts[d]), int(ends[stop - 1])
        chunk = _pread(fd, lo, hi - lo) if fd is not None else _ranged(f, lo, hi - lo)
        item = index.dtype.itemsize
        tokens = np.frombuffer(chunk, dtype=index.dtype, count=len(chunk) // item)
        # Each document's token bounds within the run, worked out for the whole run at once (no numpy
        # scalar per document), as Python ints for the slicing.
        firsts = ((starts[d:stop] - lo) // item).tolist()
        lasts = ((ends[d:stop] - lo) // item).tolist()
        count = len(tokens)
        for doc, a, b in zip(range(d, stop), firsts, lasts):
            if b > count:
                raise _shrunk(data, index, doc, lo + len(chunk))
            yield {KEY: tokens[a:b]}
        d = stop


def _is_bad(bad: np.ndarray, d: int) -> bool:
    at = int(np.searchsorted(bad, d))
    return at < len(bad) and int(bad[at]) == d


def _run_end(index: TokenIndex, d: int, limit: int) -> int:
    """The end of the run of good documents from ``d`` that lie back to back within :data:`SPAN_BYTES`."""
    after = int(np.searchsorted(index.bad, d))
    stop = min(limit, int(index.bad[after]) if after < len(index.bad) else limit)
    far = int(np.searchsorted(index.ends[d:stop], int(index.starts[d]) + SPAN_BYTES, side="right"))
    stop = d + max(1, min(far, stop - d))
    apart = np.flatnonzero(index.starts[d + 1 : stop] != index.ends[d : stop - 1])
    return d + 1 + int(apart[0]) if apart.size else stop


def _pread(fd: int, offset: int, size: int) -> np.ndarray:
    """``size`` bytes of the local ``.bin`` at ``offset`` (fewer where it ends), read into an array:
    a document over 2 GiB takes several ``pread`` calls, and is then held once, not joined from parts."""
    buf = np.empty(size, dtype=np.uint8)
    read = preadv_exactly(fd, buf, offset)
    buf.flags.writeable = False  # documents are read-only views, as of the bytes a pread returns
    return buf[:read]


def _ranged(f: Any, offset: int, size: int) -> bytes:
    f.seek(offset)
    return bytes(f.read(size))


def _shrunk(data: str, index: TokenIndex, doc: int, end: int) -> CorruptRecordError:
    start, stop = int(index.starts[doc]), int(index.ends[doc])
    reason = (
        f"the .bin ended at byte {end} while it was read (truncated under the reader?); "
        f"document {doc} is bytes [{start}, {stop}) by {index.url}"
    )
    return CorruptRecordError(data, doc, start, reason)


def describe(fmt: MegatronFormat, url: str) -> str:
    """``documents, tokens, dtype`` of the pair ``url`` names, for ``shardkit inspect``."""
    index = fmt.index(url)
    return f"{index.documents} documents, {index.tokens()} tokens, dtype {index.dtype.newbyteorder('=')}"
