"""Remote objects read at local speed: readahead, retries that lose nothing, object identity.

:func:`open_remote` returns a :class:`RemoteFile`, a seekable binary stream
over one object in any fsspec filesystem that is not the local disk. Any
format reader can use it (:func:`shardkit.io.files.open_raw` hands it out
for every non-local url), so the design lives here, not in a format:

- **Blocks and readahead.** The object is fetched in aligned blocks of
  ``block_size`` bytes, each one ranged request. While the reader consumes
  block *k*, the blocks after it, up to ``readahead_bytes`` ahead, are already
  being fetched by a small per-process thread pool; blocks behind the reader
  are dropped, so memory stays at about ``readahead_bytes`` plus a block.
  :func:`prefetch` lets a reader that knows its next shard (its plan does)
  open that shard and start its first blocks before it gets there, so a worker
  crosses shard boundaries without waiting a round trip.
- **Retries that lose nothing.** A transient failure (connection reset or
  refused, timeout, an incomplete body, HTTP 408/429/500/502/503/504, S3
  SlowDown / throttling / internal errors) is retried with exponential backoff
  and full jitter, bounded by :attr:`RetryPolicy.attempts` and
  :attr:`RetryPolicy.max_seconds`. A block is requested as a byte range and
  handed to the reader only once it is whole; a short body is completed by a
  ranged request from its first missing byte. So a retry never loses or
  repeats a byte, and the records cut from those bytes are exactly those of a
  local read.
- **One version per read.** The object's identity (ETag, version id,
  generation, size, modification time: whichever the store gives) is taken
  when it is opened: over ``http(s)://`` and S3 from the answer to the
  first block's ranged GET (``Content-Range`` gives the size, ``ETag`` and a
  version id the version), which saves a HEAD per shard; elsewhere from a
  HEAD (``fs.info``). Range requests carry ``If-Match: <ETag>`` (S3: also the
  version id), and the ETag and size each answer gives are compared with
  those (for a store that ignores ``If-Match``); after any failed request the
  identity is checked again. An object that changed under the
  reader raises :class:`ObjectChangedError` naming it and both identities,
  never a silent mix of two versions.
- **HTTP(S) without fsspec.** A ranged GET over ``http://`` or ``https://``
  is sent by :mod:`shardkit.io.http` on a kept-alive connection per
  thread and (plain HTTP) its body read in one blocking call that holds no
  GIL, instead of through aiohttp's event loop (a GIL hand-off per loop turn,
  each one a wait beside a decoding worker). Filesystems built with options
  and other stores go through fsspec; S3 blocks go through s3fs's client
  (:mod:`shardkit.io.s3`), which returns the answer's version with them.
  ``gs://`` goes through fsspec (gcsfs) with a HEAD per shard: no ranged-GET
  getter for it yet.
- **Across epochs.** A reader hints its next epoch's first ranges (its own
  seeded plan for ``epoch + 1``) as its epoch ends, so a pass starts on
  shards already open; a wrong guess (an explicit ``set_epoch`` elsewhere)
  costs the first blocks of three shards, never a record.
- **Counted.** Requests, bytes, retries, the time spent waiting to retry and
  cache hits and misses are counted per process (:func:`remote_stats`); a
  dataset's ``stats()`` sums the retries over its DataLoader workers
  (:mod:`shardkit.stats`).

The opt-in local cache (``cache_dir=``) is :mod:`shardkit.io.cache`.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

from shardkit.errors import ShardkitError, reraise_redacted
from shardkit.io import s3
from shardkit.io.http import HTTPGetter, PreconditionFailed, Response, Unsupported, client_for

__all__ = [
    "DEFAULT_READAHEAD_BYTES",
    "ObjectChangedError",
    "RemoteFile",
    "RemoteOptions",
    "RemoteReadError",
    "RetryPolicy",
    "identity_of",
    "open_remote",
    "prefetch",
    "remote_stats",
]

DEFAULT_READAHEAD_BYTES: Final = 32 << 20
"""Bytes fetched ahead of a remote reader, per open stream: 8 blocks of 4 MiB.

At 100 ms per request and ~1 GB/s per node, 32 MiB in flight keeps a worker
that decodes a few hundred MB/s fed; more only costs memory."""

_POOL_THREADS: Final = 8
_SMALL_READ: Final = 64 << 10
_TRANSIENT_STATUS: Final = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_CODES: Final = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "RequestLimitExceeded",
        "TooManyRequests",
    }
)
_TRANSIENT_ERRNOS: Final = frozenset(
    {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT}
)
_TRANSIENT_NAMES: Final = frozenset(
    {
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ClientConnectionError",
        "ClientOSError",
        "ServerTimeoutError",
        "ConnectionTimeoutError",
        "SocketTimeoutError",
        "ContentLengthError",
        "IncompleteRead",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "EndpointConnectionError",
        "ResponseStreamingError",
        "_ShortRead",
        "SSLEOFError",  # a TLS stream cut without its close_notify
    }
)
T = TypeVar("T")


class RemoteReadError(ShardkitError):
    """A remote read failed for good: not transient, or still failing after the retry budget."""


class ObjectChangedError(ShardkitError):
    """An object changed while it was being read (its ETag, version or size differs from when it was opened).

    Reading on would mix two versions of the shard; restart the epoch (or pin
    versions) instead.
    """

    def __init__(self, url: str, opened: str, now: str) -> None:
        super().__init__(
            f"{url}: the object changed while it was being read (opened as {opened}, now {now}); "
            "its records would mix two versions, so the read stops here: restart the epoch, or do not "
            "overwrite shards while a job reads them"
        )
        self.url = url
        self.opened = opened
        self.now = now

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.url, self.opened, self.now))


@dataclass(frozen=True)
class RetryPolicy:
    """How transient failures are retried: at most ``attempts`` tries and ``max_seconds`` of waiting per request.

    The wait before try *n* (n >= 2) is uniform in ``[0, min(max_backoff, backoff * 2**(n-2))]``
    ("full jitter"), so many workers throttled at once do not retry in step.
    """

    attempts: int = 8
    max_seconds: float = 60.0
    backoff: float = 0.1
    max_backoff: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.max_seconds < 0 or self.backoff < 0 or self.max_backoff < 0:
            raise ValueError(f"RetryPolicy needs attempts >= 1 and non-negative times, got {self}")

    def wait(self, attempt: int) -> float:
        """Seconds to wait before try ``attempt + 1`` (``attempt`` >= 1 tries made)."""
        return random.uniform(0, min(self.max_backoff, self.backoff * 2 ** (attempt - 1)))


@dataclass(frozen=True)
class RemoteOptions:
    """How remote shards are read; picklable, so it travels to DataLoader workers.

    ``readahead_bytes``: how far ahead of the reader blocks are fetched (0: no
    readahead, one request at a time). ``cache_dir``/``cache_limit_bytes``: the
    opt-in local cache (:mod:`shardkit.io.cache`); ``cache_limit_bytes=None`` means
    no limit. ``block_size``: bytes per ranged request.
    """

    readahead_bytes: int = DEFAULT_READAHEAD_BYTES
    retry: RetryPolicy = RetryPolicy()
    cache_dir: str | None = None
    cache_limit_bytes: int | None = None
    block_size: int = 4 << 20

    def __post_init__(self) -> None:
        if self.readahead_bytes < 0 or self.block_size < 1:
            raise ValueError(f"need readahead_bytes >= 0 and block_size >= 1, got {self}")
        if self.cache_limit_bytes is not None and self.cache_limit_bytes < 0:
            raise ValueError(f"cache_limit_bytes must be >= 0 or None, got {self.cache_limit_bytes}")
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", os.path.abspath(os.fspath(self.cache_dir)))


# --------------------------------------------------------------------------- counters


_COUNTERS: Final = ("requests", "bytes", "retries", "retry_wait_seconds", "cache_hits", "cache_misses", "prefetched")
_counts: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
_counts_lock = threading.Lock()


def _count(**deltas: float) -> None:
    with _counts_lock:
        for name, delta in deltas.items():
            _counts[name] += delta


def remote_stats(reset: bool = False) -> dict[str, float]:
    """This process's remote-read counters: requests, bytes, retries, retry_wait_seconds, cache_hits,
    cache_misses, prefetched (shards opened ahead by :func:`prefetch`); ``reset`` zeroes them after reading."""
    with _counts_lock:
        snapshot = dict(_counts)
        if reset:
            _counts.update(dict.fromkeys(_COUNTERS, 0))
    return snapshot


# --------------------------------------------------------------------------- retries


def _status_of(error: BaseException) -> int | None:
    status = getattr(error, "status", None)
    if isinstance(status, int):
        return status
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code if isinstance(code, int) else None
    return None


def _code_of(error: BaseException) -> str | None:
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return code if isinstance(code, str) else None
    return None


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` is worth retrying: a dropped connection, a timeout, throttling or a server error."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:  # look through the causes s3fs and aiohttp wrap
        seen.add(id(error))
        if _status_of(error) in _TRANSIENT_STATUS or _code_of(error) in _TRANSIENT_CODES:
            return True
        if isinstance(error, (TimeoutError, ConnectionError)) or type(error).__name__ in _TRANSIENT_NAMES:
            return True
        if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
            return True
        if any(code in str(error) for code in ("SlowDown", "Please reduce your request rate")):
            return True
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return False


def with_retries(
    call: Callable[[], T], policy: RetryPolicy, what: str, on_retry: Callable[[], None] | None = None
) -> T:
    """``call()``, retried on transient errors under ``policy``; waits and retries are counted.

    ``on_retry`` runs before each retry (to check the object did not change).
    Raises :class:`RemoteReadError` naming ``what``, the tries and the last error.
    """
    deadline = time.monotonic() + policy.max_seconds
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except (ObjectChangedError, FileNotFoundError):
            raise
        except Exception as error:
            if not is_transient(error):
                raise
            wait = policy.wait(attempt)
            if attempt >= policy.attempts or time.monotonic() + wait > deadline:
                raise RemoteReadError(
                    f"{what}: still failing after {attempt} tries over {policy.max_seconds:g} s at most "
                    f"({type(error).__name__}: {error}); raise RetryPolicy(attempts=, max_seconds=) if the "
                    "store is just slow"
                ) from error
            _count(retries=1, retry_wait_seconds=wait)
            time.sleep(wait)
            if on_retry is not None:
                on_retry()


# --------------------------------------------------------------------------- identity


def identity_of(info: dict[str, Any]) -> str:
    """A string naming one version of an object, from what ``fs.info`` gives (ETag, version, size, mtime)."""
    parts = []
    for key in (
        "ETag",
        "etag",
        "VersionId",
        "version_id",
        "generation",
        "md5Hash",
        "size",
        "LastModified",
        "Last-Modified",
        "mtime",
        "updated",
    ):
        value = info.get(key)
        if value is not None:
            parts.append(f"{key}={value}")
    return ",".join(parts)


def _etag(info: dict[str, Any]) -> str | None:
    value = info.get("ETag", info.get("etag"))
    return value if isinstance(value, str) and value else None


# --------------------------------------------------------------------------- the pool


_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """This process's fetch pool (a forked worker makes its own: threads do not survive fork)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="shardkit-fetch")
            _pool_pid = os.getpid()
            _warm.clear()
        return _pool


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
        self.identity = identity_of(info)
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
                    self._blocks[k] = _executor().submit(self._fetch, k)

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
            )
            parts.append(data)
            have += len(data)
        return b"".join(parts)

    def _request(self, start: int, stop: int) -> bytes:
        _count(requests=1)
        if self._getter is not None:
            try:
                return self._ranged_get(self._getter, start, stop)
            except Unsupported:
                self._getter = None  # an answer the getter does not read: fsspec from now on
        try:
            data = self.fs.cat_file(self.path, start=start, end=stop, **self._fetch_kwargs)
        except Exception as error:
            if _status_of(error) == 412 or _code_of(error) == "PreconditionFailed":
                raise ObjectChangedError(self.url, self.identity, "its ETag no longer matches") from error
            raise
        return self._checked_body(data, start, stop, ignored_range=False)

    def _ranged_get(self, getter: Getter, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` by a getter, pinned to and checked against the version opened."""
        try:
            response = getter.get(start, stop, self.info)
        except PreconditionFailed as error:
            raise ObjectChangedError(self.url, self.identity, "its ETag no longer matches") from error
        etag, total = response.headers.get("etag"), response.total_size()
        if (self._etag and etag and etag != self._etag) or (total is not None and total != self.size):
            now = identity_of({"ETag": etag, "size": total})
            raise ObjectChangedError(self.url, self.identity, f"answered as {now}")
        return self._checked_body(response.body, start, stop, ignored_range=response.status == 200 and start > 0)

    def _checked_body(self, data: bytes, start: int, stop: int, *, ignored_range: bool) -> bytes:
        """``data``, the answer for bytes ``[start, stop)``, counted; an error if the server ignored the
        range (a longer body, or a whole-object 200 to a request not from 0: never trust such a body)
        or sent nothing."""
        _count(bytes=len(data))
        if ignored_range or len(data) > stop - start:
            raise RemoteReadError(
                f"{self.url}: asked for bytes {start}-{stop - 1}, got {len(data)} bytes: the server ignores "
                "HTTP Range requests, which reading in blocks needs"
            )
        if not data:
            raise _ShortRead(f"{self.url}: empty body for bytes {start}-{stop - 1}")
        return data

    def _seed(self, block: int, data: bytes) -> None:
        """Keep block ``block``'s bytes, fetched already (by the GET that opened the object)."""
        future: Future[bytes] = Future()
        future.set_result(data)
        self._blocks[block] = future

    def check_identity(self) -> None:
        """Raise :class:`ObjectChangedError` unless the object is still the version opened."""
        now = identity_of(with_retries(lambda: _info(self.fs, self.path), self.options.retry, self.url))
        if now != self.identity:
            raise ObjectChangedError(self.url, self.identity, now)

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


def _info(fs: Any, path: str) -> dict[str, Any]:
    _count(requests=1)
    info = fs.info(path)
    if "size" not in info or info["size"] is None:
        raise RemoteReadError(f"{path}: the store does not say how big the object is; cannot read it in ranges")
    return info


def open_remote(fs: Any, path: str, url: str, options: RemoteOptions | None = None) -> Any:
    """Open ``url`` (``path`` in filesystem ``fs``) for reading: a :class:`RemoteFile`, or with a
    ``cache_dir`` a local file in the cache. A shard :func:`prefetch` opened already is handed over."""
    options = options or RemoteOptions()
    try:
        warm = _take_warm(url, options)
        if warm is not None:
            return warm.result()
        return _open_now(fs, path, url, options)
    except Exception as error:
        reraise_redacted(error)  # fsspec's and aiohttp's errors quote the url whole


def _open_now(fs: Any, path: str, url: str, options: RemoteOptions, offset: int | None = 0) -> Any:
    getter = getter_for(fs, path) if options.cache_dir is None else None
    if getter is not None:
        try:
            return _open_by_get(getter, fs, path, url, options, offset)
        except Unsupported:
            pass  # an answer the getter does not read: a HEAD and fsspec, as below
    info = with_retries(lambda: _info(fs, path), options.retry, url)
    if options.cache_dir is not None:
        from shardkit.io.cache import Cache

        local = Cache(options.cache_dir, options.cache_limit_bytes).open(fs, path, url, info, options)
        if local is not None:
            return local
    remote = RemoteFile(fs, path, url, info, options)
    return remote if offset is None else remote.start(offset, options.readahead_bytes // _WARM_LIMIT)


def _open_by_get(
    getter: Getter, fs: Any, path: str, url: str, options: RemoteOptions, offset: int | None
) -> RemoteFile:
    """Open with no HEAD: the first block's ranged GET also says the object's size and version
    (``Content-Range``, ``ETag``, a version id), which every later request is then pinned to."""
    bs = options.block_size
    first = (offset or 0) // bs
    # Where the reader will start is unknown (offset None): one byte says the size and version, as a HEAD would.
    start, stop = (first * bs, (first + 1) * bs) if offset is not None else (0, 1)
    what = f"{url} bytes {start}-{stop - 1}"
    response = with_retries(lambda: _first_get(getter, start, stop), options.retry, what)
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
        remote._seed(first, response.body)
        _count(bytes=len(response.body))
    return remote if offset is None else remote.start(offset, options.readahead_bytes // _WARM_LIMIT)


def _first_get(getter: Getter, start: int, stop: int) -> Response:
    _count(requests=1)
    return getter.get(start, stop)


class Getter(Protocol):
    """Ranged GETs of one object that return the answer's headers and identity (see ``httpranges``)."""

    def get(self, start: int, stop: int, info: dict[str, Any] | None = None) -> Response: ...


def getter_for(fs: Any, path: str) -> Getter | None:
    """A getter for ``path`` when its store has one (plain HTTP without options, S3 through s3fs), else None."""
    client = client_for(fs, path)
    if client is not None:
        return HTTPGetter(client, path)
    if s3.usable(fs):
        return s3.S3Getter(fs, path)
    return None


def _after_fork_in_child() -> None:
    """A forked DataLoader worker starts with fresh locks, no warm shards and zero counters: a lock held by
    a fetch thread of the parent at fork time would otherwise never be released (threads do not survive
    fork), and the parent's counts would be summed twice into a dataset's stats()."""
    global _counts_lock, _pool_lock, _warm_lock, _pool
    _counts_lock, _pool_lock, _warm_lock = threading.Lock(), threading.Lock(), threading.Lock()
    _pool = None
    _warm.clear()
    _counts.update(dict.fromkeys(_COUNTERS, 0))  # a worker counts its own reads (stats.py sums them)


# --------------------------------------------------------------------------- prefetch across shards


_WARM_LIMIT: Final = 4
"""Shards held opened ahead per process: the next three of a plan (at 100 ms per request, opening one takes two
round trips, HEAD and GET, while a 5 MB shard of 1 KB records decodes in about 100 ms), plus the one being
opened, which was hinted before it and is taken over just after."""
_warm: OrderedDict[tuple[str, RemoteOptions], Future[Any]] = OrderedDict()
_warm_lock = threading.Lock()


def prefetch(
    url: str,
    storage_options: dict[str, Any] | None = None,
    options: RemoteOptions | None = None,
    offset: int | None = 0,
) -> None:
    """Start opening remote ``url`` in the background and fetching from byte ``offset`` (``None``: just
    open it); the next :func:`open_remote` of it takes that over. Local files and ``readahead_bytes=0``
    do nothing; nor does a url fsspec cannot resolve (reading it reports why).

    At most four shards are held warm per process (the oldest is dropped), each
    fetched a quarter of ``readahead_bytes`` ahead, so a reader's fetched-ahead
    bytes stay under twice ``readahead_bytes``, hints or not.
    """
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    options = options or RemoteOptions()
    if not options.readahead_bytes:
        return
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except Exception:
        return
    if isinstance(fs, LocalFileSystem):
        return
    pool = _executor()
    with _warm_lock:
        if (url, options) in _warm:
            return
        _warm[(url, options)] = pool.submit(_open_now, fs, path, url, options, offset)
        while len(_warm) > _WARM_LIMIT:
            _, old = _warm.popitem(last=False)
            old.add_done_callback(_close_result)
    _count(prefetched=1)


def _take_warm(url: str, options: RemoteOptions) -> Future[Any] | None:
    with _warm_lock:
        return _warm.pop((url, options), None)


def _close_result(future: Future[Any]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


def remote_options(
    readahead_bytes: int | None = None,
    retry: RetryPolicy | None = None,
    cache_dir: str | None = None,
    cache_limit_bytes: int | None = None,
) -> RemoteOptions:
    """:class:`RemoteOptions` from the keyword arguments readers take (``None``: the default)."""
    changes: dict[str, Any] = {"cache_dir": cache_dir, "cache_limit_bytes": cache_limit_bytes}
    if readahead_bytes is not None:
        changes["readahead_bytes"] = readahead_bytes
    if retry is not None:
        changes["retry"] = retry
    return dataclasses.replace(RemoteOptions(), **changes)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
