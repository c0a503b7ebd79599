"""The ranged reader: one remote object as a seekable stream, read at local speed without losing a byte.

:class:`RemoteFile` is a seekable binary stream over one object in any fsspec
filesystem that is not the local disk; any format reader can use it. How:

- **Blocks and readahead.** The object is fetched in aligned blocks of
  ``block_size`` bytes, each one ranged request. While the reader consumes
  block *k*, the blocks after it, up to ``readahead_bytes`` ahead, are already
  being fetched by a small per-process thread pool; blocks behind the reader
  are dropped, so memory stays at about ``readahead_bytes`` plus a block.
- **Retries that lose nothing.** A block is requested as a byte range and
  handed to the reader only once it is whole; a short body is completed by a
  ranged request from its first missing byte; transient failures are retried
  (:mod:`shardkit.io.retry`). So a retry never loses or repeats a byte, and
  the records cut from those bytes are exactly those of a local read.
- **One version per read.** The object's identity
  (:func:`shardkit.io.identity.version`) is taken when it is opened: from the
  answer to the first block's ranged GET where the store has a getter
  (:func:`open_by_get`: ``Content-Range`` gives the size, ``ETag`` and a
  version id the version), which saves a HEAD per shard; else from a HEAD
  (``fs.info``). Range requests carry ``If-Match: <ETag>`` (S3: also the
  version id), and the ETag and size each answer gives are compared with
  those (for a store that ignores ``If-Match``); after any failed request the
  identity is checked again. An object that changed under the reader raises
  :class:`~shardkit.io.retry.ObjectChangedError`, never a silent mix of two
  versions.
- **HTTP(S) without fsspec.** A ranged GET over ``http(s)://`` is sent by
  :mod:`shardkit.io.http` on a kept-alive connection per thread, its body
  read in one blocking call that holds no GIL, instead of through aiohttp's
  event loop. S3 blocks go through s3fs's client (:mod:`shardkit.io.s3`),
  which returns the answer's version with them. Other stores (``gs://``
  among them) go through fsspec with a HEAD per shard.
- **Bounded.** Every request waits at most ``retry.timeout`` seconds for its
  answer (:class:`~shardkit.io.retry.RetryPolicy`): a plain-HTTP GET that
  long without a byte, a GET, HEAD or ``GetObject`` through a store's client
  that long in all; then it fails as transient and is tried again within the
  policy's budget.

Opening (and the cache, and prefetching) is :mod:`shardkit.io.remote`.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final, Protocol

from shardkit.errors import reraise_redacted
from shardkit.io import s3
from shardkit.io.counters import count
from shardkit.io.http import HTTPGetter, PreconditionFailed, Response, Unsupported, client_for
from shardkit.io.identity import describe, version
from shardkit.io.options import RemoteOptions
from shardkit.io.retry import ObjectChangedError, RemoteReadError, call_bounded, code_of, status_of, with_retries

__all__ = ["Getter", "RemoteFile", "executor", "getter_for", "object_info", "open_by_get"]

_POOL_THREADS: Final = 8
_SMALL_READ: Final = 64 << 10


def _etag(info: dict[str, Any]) -> str | None:
    value = info.get("ETag", info.get("etag"))
    return value if isinstance(value, str) and value else None


# --------------------------------------------------------------------------- the pool


_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pool_lock = threading.Lock()


def executor() -> ThreadPoolExecutor:
    """This process's fetch pool (a forked worker makes its own: threads do not survive fork)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="shardkit-fetch")
            _pool_pid = os.getpid()
        return _pool


def _after_fork_in_child() -> None:
    """A forked DataLoader worker starts with a fresh lock and no pool: a lock held by a fetch thread of
    the parent at fork time would otherwise never be released (threads do not survive fork)."""
    global _pool_lock, _pool
    _pool_lock, _pool = threading.Lock(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --------------------------------------------------------------------------- the stream


class _ShortRead(Exception):
    """A response body ended before the range asked for (completed by a ranged request from there)."""


class RemoteFile:
    """A seekable read-only stream over one remote object, with readahead and retries (see the module doc)."""

    def __init__(self, fs: Any, path: str, url: str, info: dict[str, Any], options: RemoteOptions) -> None:
        self.fs = fs
        self.path = path
        self.url = url
        self.info = info
        self.identity = version(info)
        self.described = describe(info)  # how errors name the version opened
        self.size = int(info["size"])
        self.options = options
        self._pos = 0
        self._blocks: OrderedDict[int, Future[bytes]] = OrderedDict()
        self._closed = False
        self._fetch_kwargs = _fetch_kwargs(fs, info)
        self._getter = getter_for(fs, path)  # ranged GETs that report the version answering (None: fsspec)
        self._etag = _etag(info)

    # -- reading

    def read(self, size: int = -1, /) -> bytes:
        if self._closed:
            raise ValueError(f"{self.url}: read from a closed RemoteFile")
        end = self.size if size < 0 else min(self.size, self._pos + size)
        # A small read (a header sniffed, an index checked) fetches what it needs, not the readahead.
        readahead = 0 if 0 <= size < _SMALL_READ else None
        parts = []
        while self._pos < end:
            block = self._pos // self.options.block_size
            try:
                data = self._block(block, readahead)
            except Exception as error:
                reraise_redacted(error)
            lo = self._pos - block * self.options.block_size
            piece = data[lo : lo + end - self._pos]
            parts.append(piece)
            self._pos += len(piece)
        self._drop_behind()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _block(self, block: int, readahead: int | None) -> bytes:
        """Block ``block``'s bytes, after making sure the blocks ahead of it are being fetched."""
        self._schedule(block, readahead)
        return self._blocks[block].result()

    def _schedule(self, block: int, readahead: int | None = None) -> None:
        """Have blocks ``block`` .. (``readahead`` bytes on, default the options') requested."""
        bs = self.options.block_size
        last = (self.size - 1) // bs if self.size else -1
        readahead = self.options.readahead_bytes if readahead is None else readahead
        ahead = max(1, -(-readahead // bs)) if readahead else 0
        for k in range(block, min(last, block + ahead) + 1):
            if k not in self._blocks:
                if k == block and not ahead:  # no readahead: fetch in this thread
                    future: Future[bytes] = Future()
                    future.set_result(self._fetch(k))
                    self._blocks[k] = future
                else:
                    self._blocks[k] = executor().submit(self._fetch, k)

    def _drop_behind(self) -> None:
        current = self._pos // self.options.block_size
        for k in [k for k in self._blocks if k < current]:
            self._blocks.pop(k).cancel()

    def _fetch(self, block: int) -> bytes:
        """Block ``block`` whole, by ranged requests retried until it is all there."""
        bs = self.options.block_size
        start, stop = block * bs, min(self.size, (block + 1) * bs)
        parts: list[bytes] = []
        have = start
        while have < stop:  # a short body is completed from its first missing byte
            data = with_retries(
                lambda: self._request(have, stop),
                self.options.retry,
                f"{self.url} bytes {have}-{stop - 1}",
                self.check_identity,
                lambda: self._closed or block < self._pos // bs,  # closed, or dropped behind the reads
            )
            parts.append(data)
            have += len(data)
        return b"".join(parts)

    def _request(self, start: int, stop: int) -> bytes:
        count(requests=1)
        if self._getter is not None:
            try:
                return self._ranged_get(self._getter, start, stop)
            except Unsupported:
                self._getter = None  # an answer the getter does not read: fsspec from now on
        try:
            bound = self.options.retry.timeout
            data = call_bounded(
                self.fs, "cat_file", self.path, start=start, end=stop, timeout=bound, **self._fetch_kwargs
            )
        except Exception as error:
            if status_of(error) == 412 or code_of(error) == "PreconditionFailed":
                raise ObjectChangedError(self.url, self.described, "its ETag no longer matches") from error
            raise
        return self._checked_body(data, start, stop, ignored_range=False)

    def _ranged_get(self, getter: Getter, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` by a getter, pinned to and checked against the version opened."""
        try:
            response = getter.get(start, stop, self.info, timeout=self.options.retry.timeout)
        except PreconditionFailed as error:
            raise ObjectChangedError(self.url, self.described, "its ETag no longer matches") from error
        etag, total = response.headers.get("etag"), response.total_size()
        if (self._etag and etag and etag != self._etag) or (total is not None and total != self.size):
            now = describe({"ETag": etag, "size": total})
            raise ObjectChangedError(self.url, self.described, f"answered as {now}")
        return self._checked_body(response.body, start, stop, ignored_range=response.status == 200 and start > 0)

    def _checked_body(self, data: bytes, start: int, stop: int, *, ignored_range: bool) -> bytes:
        """``data``, the answer for bytes ``[start, stop)``, counted; an error if the server ignored the
        range (a longer body, or a whole-object 200 to a request not from 0: never trust such a body)
        or sent nothing."""
        count(bytes=len(data))
        if ignored_range or len(data) > stop - start:
            raise RemoteReadError(
                f"{self.url}: asked for bytes {start}-{stop - 1}, got {len(data)} bytes: the server ignores "
                "HTTP Range requests, which reading in blocks needs"
            )
        if not data:
            raise _ShortRead(f"{self.url}: empty body for bytes {start}-{stop - 1}")
        return data

    def seed(self, block: int, data: bytes) -> None:
        """Keep block ``block``'s bytes, fetched already (by the GET that opened the object)."""
        future: Future[bytes] = Future()
        future.set_result(data)
        self._blocks[block] = future

    def check_identity(self) -> None:
        """Raise :class:`ObjectChangedError` unless the object is still the version opened."""
        retry = self.options.retry
        now = with_retries(lambda: object_info(self.fs, self.path, retry.timeout), retry, self.url)
        if version(now) != self.identity:
            raise ObjectChangedError(self.url, self.described, describe(now))

    # -- file protocol

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.size}[whence]
        self._pos = max(0, base + offset)
        self._drop_behind()
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        """Read by pyarrow (Parquet footers) and ``io`` wrappers before every call."""
        return self._closed

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer)))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._closed = True
        for future in self._blocks.values():
            future.cancel()
        self._blocks.clear()

    def __enter__(self) -> RemoteFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self, offset: int = 0, readahead: int | None = None) -> RemoteFile:
        """Begin fetching from ``offset`` now, ``readahead`` bytes on (used by :func:`prefetch`)."""
        self.seek(offset)
        if self.size:
            self._schedule(offset // self.options.block_size, readahead)
        return self


def _fetch_kwargs(fs: Any, info: dict[str, Any]) -> dict[str, Any]:
    """Per-request arguments that pin the version opened: If-Match over HTTP, the version id on S3."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    etag = _etag(info)
    if protocol in ("http", "https") and etag:
        return {"headers": {"If-Match": etag}}
    version = info.get("VersionId")
    if protocol in ("s3", "s3a") and isinstance(version, str) and version not in ("", "null"):
        return {"version_id": version}
    return {}


def object_info(fs: Any, path: str, timeout: float) -> dict[str, Any]:
    """``fs.info(path)`` (a HEAD) within ``timeout`` seconds, counted; it must give the size, which reading
    in ranges needs."""
    count(requests=1)
    info = call_bounded(fs, "info", path, timeout=timeout)
    if "size" not in info or info["size"] is None:
        raise RemoteReadError(f"{path}: the store does not say how big the object is; cannot read it in ranges")
    return info


def open_by_get(getter: Getter, fs: Any, path: str, url: str, options: RemoteOptions, offset: int | None) -> RemoteFile:
    """A :class:`RemoteFile` opened with no HEAD, not yet started: the first block's ranged GET also says the object's size and version
    (``Content-Range``, ``ETag``, a version id), which every later request is then pinned to."""
    bs = options.block_size
    first = (offset or 0) // bs
    # Where the reader will start is unknown (offset None): one byte says the size and version, as a HEAD would.
    start, stop = (first * bs, (first + 1) * bs) if offset is not None else (0, 1)
    what = f"{url} bytes {start}-{stop - 1}"
    response = with_retries(lambda: _first_get(getter, start, stop, options.retry.timeout), options.retry, what)
    size = response.total_size()
    if size is None and response.status == 200:  # the whole object: fine if it is smaller than a block
        if len(response.body) > bs:
            raise RemoteReadError(
                f"{url}: asked for bytes {start}-{stop - 1}, got {len(response.body)} bytes: the server ignores "
                "HTTP Range requests, which reading in blocks needs"
            )
        size = len(response.body)
    if size is None:
        raise Unsupported(f"{url}: a ranged answer without Content-Range")
    info: dict[str, Any] = {"size": size, **response.info}  # named as fs.info() names them: identities compare
    remote = RemoteFile(fs, path, url, info, options)
    expected = max(0, min(size, (first + 1) * bs) - first * bs)
    if response.status in (200, 206) and len(response.body) == expected and (response.status == 206 or first == 0):
        remote.seed(first, response.body)
        count(bytes=len(response.body))
    return remote


def _first_get(getter: Getter, start: int, stop: int, timeout: float) -> Response:
    count(requests=1)
    return getter.get(start, stop, timeout=timeout)


class Getter(Protocol):
    """Ranged GETs of one object that return the answer's headers and identity (see :mod:`shardkit.io.http`)."""

    def get(self, start: int, stop: int, info: dict[str, Any] | None = None, *, timeout: float) -> Response: ...


def getter_for(fs: Any, path: str) -> Getter | None:
    """A getter for ``path`` when its store has one (plain HTTP without options, S3 through s3fs), else None."""
    client = client_for(fs, path)
    if client is not None:
        return HTTPGetter(client, path)
    if s3.usable(fs):
        return s3.S3Getter(fs, path)
    return None
