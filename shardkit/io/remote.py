"""Remote objects read at local speed: opening, the local cache, and shards opened ahead.

:func:`open_remote` returns a seekable binary stream over one object in any
fsspec filesystem that is not the local disk: a
:class:`~shardkit.io.reader.RemoteFile` (readahead, retries that lose nothing,
one version per read: see :mod:`shardkit.io.reader`), or with a ``cache_dir``
a local file in the cache (:mod:`shardkit.io.cache`). Any format reader can use
it (:func:`shardkit.io.files.open_raw` hands it out for every non-local url),
so the design lives here, not in a format. The layers below, each its own job:
:mod:`~shardkit.io.options` (what a read is told), :mod:`~shardkit.io.retry`
(what is retried, the errors a read ends with), :mod:`~shardkit.io.counters`
(what is counted), :mod:`~shardkit.io.identity` (which version is read).

- **Across shards.** :func:`prefetch` lets a reader that knows its next shard
  (its plan does) open that shard and start its first blocks before it gets
  there, so a worker crosses shard boundaries without waiting a round trip.
- **Across epochs.** A reader hints its next epoch's first ranges (its own
  seeded plan for ``epoch + 1``) as its epoch ends, so a pass starts on
  shards already open; a wrong guess (an explicit ``set_epoch`` elsewhere)
  costs the first blocks of three shards, never a record.
- **Counted.** Requests, bytes, retries, the time spent waiting to retry and
  cache hits and misses are counted per process (:func:`remote_stats`); a
  dataset's ``stats()`` sums the retries over its DataLoader workers
  (:mod:`shardkit.stats`).

The names a reader is configured with and catches are importable from here.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Final

from shardkit.errors import reraise_redacted
from shardkit.io.cache import Cache
from shardkit.io.counters import count, remote_stats
from shardkit.io.http import Unsupported
from shardkit.io.options import DEFAULT_READAHEAD_BYTES, RemoteOptions, remote_options
from shardkit.io.reader import RemoteFile, executor, getter_for, object_info, open_by_get
from shardkit.io.retry import ObjectChangedError, RemoteReadError, RetryPolicy, with_retries

__all__ = [
    "DEFAULT_READAHEAD_BYTES",
    "ObjectChangedError",
    "RemoteFile",
    "RemoteOptions",
    "RemoteReadError",
    "RetryPolicy",
    "open_remote",
    "prefetch",
    "remote_options",
    "remote_stats",
]


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
            return _started(open_by_get(getter, fs, path, url, options, offset), offset)
        except Unsupported:
            pass  # an answer the getter does not read: a HEAD and fsspec, as below
    info = with_retries(lambda: object_info(fs, path, options.retry.timeout), options.retry, url)
    if options.cache_dir is not None:
        local = Cache(options.cache_dir, options.cache_limit_bytes).open(fs, path, url, info, options)
        if local is not None:
            return local
    return _started(RemoteFile(fs, path, url, info, options), offset)


def _started(remote: RemoteFile, offset: int | None) -> RemoteFile:
    """``remote`` fetching from ``offset`` (None: not yet), a warm shard's share of the readahead ahead."""
    return remote if offset is None else remote.start(offset, remote.options.readahead_bytes // _WARM_LIMIT)


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
    pool = executor()
    with _warm_lock:
        if (url, options) in _warm:
            return
        _warm[(url, options)] = pool.submit(_open_now, fs, path, url, options, offset)
        while len(_warm) > _WARM_LIMIT:
            _, old = _warm.popitem(last=False)
            old.add_done_callback(_close_result)
    count(prefetched=1)


def _take_warm(url: str, options: RemoteOptions) -> Future[Any] | None:
    with _warm_lock:
        return _warm.pop((url, options), None)


def _close_result(future: Future[Any]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


def _after_fork_in_child() -> None:
    """A forked DataLoader worker starts with a fresh lock and no warm shards: a lock held by a fetch
    thread of the parent at fork time would otherwise never be released (threads do not survive fork),
    and the parent's warm shards are fetched by the parent's threads."""
    global _warm_lock
    _warm_lock = threading.Lock()
    _warm.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
