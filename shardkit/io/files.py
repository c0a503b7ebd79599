"""Open shard files anywhere fsspec reaches, streamed, with optional GZIP/ZLIB.

Readers get a :class:`Stream` (anything with ``read(n)`` and ``close()``) that
fetches the file in blocks of :data:`BLOCK_SIZE` bytes, so remote files are
never downloaded whole. A remote file (any filesystem but the local disk) is a
:class:`shardkit.io.remote.RemoteFile`: blocks fetched ahead of the reader,
transient failures retried without losing or repeating a byte, the object
pinned to the version opened, and optionally a local disk cache; how is set by
a :class:`~shardkit.io.remote.RemoteOptions` passed as ``remote=``. Every format
reader that opens its files here gets all of that. Compressed files are inflated on the fly; byte offsets
past this layer refer to the uncompressed stream. A compressed stream that is
damaged, truncated or not compressed at all raises
:class:`CompressedStreamError` with the compressed byte at fault, after the
bytes inflated before it; the record readers add the record it was in.
"""

from __future__ import annotations

import gzip
import os
import zlib
from typing import IO, Any, Final, Protocol, cast

import fsspec
from fsspec.implementations.local import LocalFileSystem

from shardkit.errors import ShardkitError
from shardkit.io.remote import RemoteOptions, open_remote

__all__ = [
    "BLOCK_SIZE",
    "COMPRESSIONS",
    "CompressedStreamError",
    "Sink",
    "Stream",
    "check_compression",
    "make_parent_dirs",
    "open_input",
    "open_output",
    "open_raw",
    "pread_exactly",
    "preadv_exactly",
    "sniff_compression",
]

BLOCK_SIZE: Final = 4 << 20
"""Bytes fetched per request from remote storage, and per read from streams."""

COMPRESSIONS: Final = (None, "gzip", "zlib")

_GZIP_MAGIC: Final = b"\x1f\x8b"
_WBITS: Final = {"gzip": 16 + zlib.MAX_WBITS, "zlib": zlib.MAX_WBITS}


class Stream(Protocol):
    """The minimal binary reader the record readers need."""

    def read(self, size: int = -1, /) -> bytes: ...

    def close(self) -> None: ...


class Sink(Protocol):
    """The minimal binary writer the record writers need."""

    def write(self, data: bytes | bytearray | memoryview, /) -> int: ...

    def close(self) -> None: ...


def check_compression(compression: str | None, *, allow_auto: bool) -> None:
    """Raise ``ValueError`` unless ``compression`` is a supported value."""
    allowed: tuple[str | None, ...] = COMPRESSIONS + (("auto",) if allow_auto else ())
    if compression not in allowed:
        raise ValueError(f"compression must be one of {allowed}, not {compression!r}")


def open_raw(
    url: str, mode: str, storage_options: dict[str, Any] | None = None, *, remote: RemoteOptions | None = None
) -> IO[bytes]:
    """Open ``url`` with fsspec in binary ``mode`` ("rb" or "wb").

    Local files are opened as they are; a remote file for reading is a
    :class:`~shardkit.io.remote.RemoteFile` (readahead, retries, version pinning;
    ``remote`` says how, default :class:`~shardkit.io.remote.RemoteOptions`), or
    its copy in the local cache when ``remote.cache_dir`` is set.
    """
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if mode == "wb":  # writers keep the filesystem's block size: S3 uploads need parts >= 5 MB
        make_parent_dirs(url, storage_options)
        return fs.open(path, mode)
    if isinstance(fs, LocalFileSystem) or mode != "rb":
        try:
            return cast("IO[bytes]", fs.open(path, mode))
        except IsADirectoryError as error:  # the plain "[Errno 21]" does not say what to give instead
            fix = f"is a directory; give files, or a glob such as '{url.rstrip('/')}/*.tfrecord'"
            raise IsADirectoryError(error.errno, f"{url} {fix}", url) from None
    return open_remote(fs, path, url, remote)  # type: ignore[no-any-return]


def pread_exactly(fd: int, size: int, pos: int) -> bytes:
    """``size`` bytes of the file ``fd`` at ``pos``; fewer only where the file ends.

    One ``os.pread`` may return fewer bytes than asked before the end of the
    file: Linux moves at most 0x7ffff000 (2 GiB - 4 KiB) per call, and a
    signal or a network filesystem can cut a read short too. A reader that
    took a short read for the end of the file reported a valid record over
    2 GiB as truncated; this reads on until ``size`` bytes or the end.
    """
    data = os.pread(fd, size, pos)
    if len(data) == size or not data:
        return data
    parts, have = [data], len(data)
    while have < size and (data := os.pread(fd, size - have, pos + have)):
        parts.append(data)
        have += len(data)
    return b"".join(parts)


def preadv_exactly(fd: int, buffer: Any, pos: int) -> int:
    """Fill ``buffer`` (writable, bytes-like) from the file ``fd`` at ``pos``: the bytes read,
    fewer than its length only where the file ends (see :func:`pread_exactly`)."""
    view = memoryview(buffer).cast("B")
    size = len(view)
    have = os.preadv(fd, [view], pos)
    while 0 < have < size and (got := os.preadv(fd, [view[have:]], pos + have)):
        have += got
    return have


def make_parent_dirs(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Create the directory ``url`` will be written into, on local filesystems.

    Object stores have no directories to create, so nothing happens there.
    """
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if isinstance(fs, LocalFileSystem):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)


def sniff_compression(head: bytes) -> str | None:
    """Guess "gzip" or "zlib" from a stream's first bytes, else ``None``.

    A zlib header is two bytes: method 8 in the low nibble of the first, and the
    pair as a big-endian number divisible by 31.
    """
    if head[:2] == _GZIP_MAGIC:
        return "gzip"
    if len(head) >= 2 and head[0] & 0x0F == 8 and head[0] >> 4 <= 7 and (head[0] << 8 | head[1]) % 31 == 0:
        return "zlib"
    return None


def open_input(
    url: str,
    compression: str | None,
    storage_options: dict[str, Any] | None = None,
    *,
    raw: IO[bytes] | None = None,
    head: bytes = b"",
    remote: RemoteOptions | None = None,
) -> Stream:
    """A readable stream over ``url``'s (decompressed) bytes.

    ``raw``/``head`` let a caller that already opened the file and read its
    first bytes (to sniff the compression) hand them over instead of reopening.
    """
    check_compression(compression, allow_auto=False)
    stream: Stream = raw if raw is not None else open_raw(url, "rb", storage_options, remote=remote)
    if head:
        stream = _Prefixed(head, stream)
    if compression is None:
        return stream
    return _Inflater(stream, url, compression)


def open_output(url: str, compression: str | None, storage_options: dict[str, Any] | None = None) -> Sink:
    """A writable binary file at ``url``; GZIP or ZLIB compresses the whole stream."""
    check_compression(compression, allow_auto=False)
    raw = open_raw(url, "wb", storage_options)
    if compression is None:
        return raw
    if compression == "gzip":
        return _ClosingGzip(raw)
    return _Deflater(raw)


class _Prefixed:
    """Replays bytes already read from a stream before reading the rest of it."""

    def __init__(self, head: bytes, stream: Stream) -> None:
        self._head = head
        self._stream = stream

    def read(self, size: int = -1, /) -> bytes:
        if not self._head:
            return self._stream.read(size)
        if size < 0:
            out, self._head = self._head + self._stream.read(), b""
            return out
        out, self._head = self._head[:size], self._head[size:]
        if len(out) < size:
            out += self._stream.read(size - len(out))
        return out

    def close(self) -> None:
        self._stream.close()


class CompressedStreamError(ShardkitError):
    """A GZIP/ZLIB stream cannot be inflated: damaged, truncated, or not compressed at all.

    Raised by the streams :func:`open_input` returns, after every byte inflated
    before the fault has been read. The stream does not know which record it was
    inflating, so the record readers catch this and raise a
    :class:`~shardkit.CorruptRecordError` that names it. ``compressed_offset``
    is the position in the compressed file of the byte inflating failed at (or
    the file size, if it ended early); ``not_compressed`` is true when the file
    does not even start with this compression's header, so it is not in this
    compression at all.
    """

    def __init__(self, url: str, reason: str, compressed_offset: int, not_compressed: bool = False) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason
        self.compressed_offset = compressed_offset
        self.not_compressed = not_compressed

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.url, self.reason, self.compressed_offset, self.not_compressed))


_FEED: Final = 64 << 10
"""Compressed bytes inflated per call; the decompressor is copied before each, to replay a failing one."""


class _Inflater:
    """Streaming GZIP/ZLIB decompression with located errors.

    Concatenated GZIP members are read one after another, as ``gzip`` does.
    When zlib refuses a piece of input, the piece is replayed a byte at a time
    from a copy of the decompressor taken before it: that finds the exact
    compressed byte at fault and keeps everything inflated before it, which is
    returned first; the :class:`CompressedStreamError` comes on the read after.
    """

    def __init__(self, stream: Stream, url: str, compression: str) -> None:
        self._stream = stream
        self._url = url
        self._compression = compression
        self._wbits = _WBITS[compression]
        self._inflate = zlib.decompressobj(self._wbits)
        self._pending = b""  # compressed input read from the file, consumed from _pos on
        self._pos = 0
        self._base = 0  # compressed offset of _pending[0]
        self._started = False
        self._salvaged = b""  # inflated before a fault, still to be returned
        self._error: CompressedStreamError | None = None  # raised once nothing else is left to return
        self._done = False

    def read(self, size: int = -1, /) -> bytes:
        if size < 0:
            parts = []
            while chunk := self.read(BLOCK_SIZE):
                parts.append(chunk)
            return b"".join(parts)
        out: list[bytes] = []
        want = size
        while want > 0:
            if self._salvaged:
                chunk, self._salvaged = self._salvaged[:want], self._salvaged[want:]
            elif self._error is not None:
                if want < size:  # return what came before the fault first
                    break
                raise self._error
            elif self._done:
                break
            else:
                chunk = self._inflate_some(want)
            out.append(chunk)
            want -= len(chunk)
        return b"".join(out)

    def _inflate_some(self, want: int) -> bytes:
        """Inflate the next piece of input into at most ``want`` bytes (``b""`` at the end or a fault)."""
        if self._pos >= len(self._pending):
            self._base += len(self._pending)
            self._pending, self._pos = self._stream.read(BLOCK_SIZE), 0
            if not self._pending:
                if not self._inflate.eof and self._started:
                    self._error = CompressedStreamError(
                        self._url,
                        f"{self._compression} stream is truncated: the compressed file ends at byte {self._base} "
                        "before the end-of-stream marker",
                        self._base,
                    )
                self._done = True
                return b""
        if self._inflate.eof:  # previous member finished and more input follows
            self._inflate = zlib.decompressobj(self._wbits)
        before = self._inflate.copy()
        piece = memoryview(self._pending)[self._pos : self._pos + _FEED]
        try:
            chunk = self._inflate.decompress(piece, want)
        except zlib.error as exc:
            self._replay(before, piece, exc)
            return b""
        self._started = True
        self._pos += len(piece) - len(self._inflate.unconsumed_tail) - len(self._inflate.unused_data)
        return chunk

    def _replay(self, inflate: Any, piece: memoryview, exc: zlib.error) -> None:
        """Feed a piece zlib refused a byte at a time: keep what it inflates, find the byte at fault."""
        out = []
        start = self._base + self._pos
        for i in range(len(piece)):
            try:
                out.append(inflate.decompress(piece[i : i + 1]))
            except zlib.error as byte_exc:
                exc, start = byte_exc, start + i
                break
        # (If the replay inflated the whole piece, which zlib should never do, report the piece's start.)
        self._salvaged = b"".join(out)
        self._error = self._damaged(exc, start)

    def _damaged(self, exc: zlib.error, at: int) -> CompressedStreamError:
        first_piece = self._base == 0 and self._pos == 0
        if first_piece and sniff_compression(self._pending[:2]) != self._compression:
            reason = (
                f"cannot decompress as compression={self._compression!r} ({exc}): the file is not "
                f"{self._compression} data from its first byte; pass the right compression or compression='auto'"
            )
            return CompressedStreamError(self._url, reason, at, not_compressed=True)
        reason = f"{self._compression} stream is damaged at compressed byte {at} ({exc})"
        return CompressedStreamError(self._url, reason, at)

    def close(self) -> None:
        self._stream.close()


class _ClosingGzip(gzip.GzipFile):
    """A GzipFile that also closes the file it writes into."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__(fileobj=raw, mode="wb", filename="", mtime=0)
        self._raw = raw

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()


class _Deflater:
    """Write-only ZLIB stream over a binary file."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._deflate = zlib.compressobj()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._raw.write(self._deflate.compress(data))
        return len(data)

    def close(self) -> None:
        try:
            self._raw.write(self._deflate.flush())
        finally:
            self._raw.close()
