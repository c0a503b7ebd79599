"""Record counts for shard lists that lack them.

Balanced plans (``"pad"``/``"drop"`` over several ranks) need every shard's
record count. In order of preference the counts come from:

1. the :class:`~shardkit.ShardList` itself (a manifest, or ``num_records=``);
2. a counts manifest cached beside the data by an earlier counting pass
   (``shardkit-counts.arrow`` in the first shard's directory);
3. ``count_fn(url)`` — for TFRecord, the index file when there is one, else a
   fast framing scan. When ``torch.distributed`` is initialised the shards are
   shared out over the ranks and the counts all-gathered; the result is then
   written to the cache, where the storage allows, so it happens once.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable
from typing import Any

import numpy as np

from shardkit.errors import ShardkitError
from shardkit.shardlist import ShardList

logger = logging.getLogger("shardkit")

CACHE_NAME = "shardkit-counts.arrow"

CountFn = Callable[[str], int]


class CountsUnavailableError(ShardkitError, ValueError):
    """Record counts are needed and there is no way to get them."""


def cache_path(shards: ShardList) -> str | None:
    """Where the counts of ``shards`` are cached: beside the first shard."""
    if len(shards) == 0:
        return None
    return posixpath.join(posixpath.dirname(shards[0]), CACHE_NAME)


def resolve_counts(
    shards: ShardList, count_fn: CountFn | None, *, why: str, storage_options: dict[str, Any] | None = None
) -> ShardList:
    """``shards`` with every record count filled in.

    Args:
        shards: the list; returned as is when its counts are all known.
        count_fn: counts the records of one url; None when the format has no
            way to count.
        why: what needs the counts, for the log line and the error message.
        storage_options: fsspec options for the cache beside the data.

    Raises:
        CountsUnavailableError: counts are missing and ``count_fn`` is None.
    """
    if shards.num_records is not None:
        return shards
    cached = _read_cache(shards, storage_options)
    if cached is not None:
        return cached
    if count_fn is None:
        raise CountsUnavailableError(
            f"{why} needs the record count of every shard, and {len(shards)} shards have none. "
            "Give counts with ShardList(urls, num_records=...) or a manifest "
            "(ShardList.from_manifest, written by ShardWriter or ShardList.to_manifest), "
            "pass count_fn=, or use balance='none' to deal out whole shards"
        )
    missing = np.flatnonzero(~shards.known_counts)
    logger.warning(
        "shardkit: counting the records of %d shards once (index files where present, else a framing scan), for %s",
        len(missing),
        why,
    )
    counts = shards.table.column("num_records").fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    counts[missing] = _count(shards, missing, count_fn)
    counted = shards.with_num_records(counts)
    _write_cache(counted, storage_options)
    return counted


def _count(shards: ShardList, missing: np.ndarray, count_fn: CountFn) -> np.ndarray:
    """Count the ``missing`` shards, shared out over the ranks when distributed."""
    import torch.distributed as dist
    from torch.utils.data import get_worker_info

    distributed = dist.is_available() and dist.is_initialized() and get_worker_info() is None
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    mine = missing[rank::world]
    local = {int(i): int(count_fn(shards[int(i)])) for i in mine}
    if distributed:
        gathered: list[dict[int, int] | None] = [None] * world
        dist.all_gather_object(gathered, local)
        for part in gathered:
            local.update(part or {})
    return np.array([local[int(i)] for i in missing], dtype=np.int64)


def _read_cache(shards: ShardList, storage_options: dict[str, Any] | None) -> ShardList | None:
    path = cache_path(shards)
    if path is None:
        return None
    try:
        cached = ShardList.from_manifest(path, storage_options=storage_options)
    except Exception:  # noqa: BLE001 - no cache, or an unreadable one: count instead
        return None
    if cached.num_records is None:
        return None
    cached_sizes = cached.sizes if cached.sizes is not None else [None] * len(cached)
    by_url = dict(zip(cached.urls(), zip(cached.num_records.tolist(), list(cached_sizes))))
    sizes = shards.sizes if shards.sizes is not None else [None] * len(shards)
    counts = []
    for url, size in zip(shards.urls(), sizes):
        count, cached_size = by_url.get(url, (None, None))
        if count is None or (size is not None and cached_size is not None and size != cached_size):
            return None  # not counted before, or the file changed since
        counts.append(count)
    logger.info("shardkit: record counts from %s", path)
    return shards.with_num_records(counts)


def _write_cache(shards: ShardList, storage_options: dict[str, Any] | None) -> None:
    path = cache_path(shards)
    if path is None:
        return
    try:
        shards.to_manifest(path, storage_options=storage_options)
    except Exception as error:  # noqa: BLE001 - read-only storage: count again next time
        logger.info("shardkit: could not cache record counts at %s (%s)", path, error)
