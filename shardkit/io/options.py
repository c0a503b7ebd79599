"""How remote shards are read: :class:`RemoteOptions`, picklable, so it travels to DataLoader workers.

One frozen value holds every knob of a remote read (readahead, block size, the
retry policy, the opt-in local cache), so that a reader's options compare equal
in every worker and key what :func:`~shardkit.io.remote.prefetch` opened ahead.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Final

from shardkit.io.retry import RetryPolicy

__all__ = ["DEFAULT_READAHEAD_BYTES", "RemoteOptions", "remote_options"]

DEFAULT_READAHEAD_BYTES: Final = 32 << 20
"""Bytes fetched ahead of a remote reader, per open stream: 8 blocks of 4 MiB.

At 100 ms per request and ~1 GB/s per node, 32 MiB in flight keeps a worker
that decodes a few hundred MB/s fed; more only costs memory."""


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
