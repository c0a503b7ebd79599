"""This process's remote-read counters: requests, bytes, retries, waits, cache hits and misses, prefetches.

Every part of a remote read counts here (the ranged reader, its retries, the
cache, prefetching), under one lock, so :func:`remote_stats` is one snapshot.
A forked DataLoader worker starts at zero: it counts its own reads, and a
dataset's ``stats()`` sums them over the workers (:mod:`shardkit.stats`), which
would count the parent's twice otherwise.
"""

from __future__ import annotations

import os
import threading
from typing import Final

__all__ = ["count", "remote_stats"]

_COUNTERS: Final = ("requests", "bytes", "retries", "retry_wait_seconds", "cache_hits", "cache_misses", "prefetched")
_counts: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
_counts_lock = threading.Lock()


def count(**deltas: float) -> None:
    """Add ``deltas`` to the counters they name."""
    with _counts_lock:
        for name, delta in deltas.items():
            _counts[name] += delta


def remote_stats(reset: bool = False) -> dict[str, float]:
    """This process's remote-read counters: requests, bytes, retries, retry_wait_seconds, cache_hits,
    cache_misses, prefetched (shards opened ahead by :func:`~shardkit.io.remote.prefetch`); ``reset``
    zeroes them after reading."""
    with _counts_lock:
        snapshot = dict(_counts)
        if reset:
            _counts.update(dict.fromkeys(_COUNTERS, 0))
    return snapshot


def _after_fork_in_child() -> None:
    """A fresh lock (one held by a fetch thread of the parent at fork time would never be released:
    threads do not survive fork) and zero counts (a worker counts its own reads)."""
    global _counts_lock
    _counts_lock = threading.Lock()
    _counts.update(dict.fromkeys(_COUNTERS, 0))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
