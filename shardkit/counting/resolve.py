"""Which record counts a plan uses, resolved the same way in every rank and DataLoader worker.

:func:`plan_counts` is the one place sources resolve counts (the order of
preference is in :mod:`shardkit.counting`): the list's own counts, then the
counts stored with every shard, then, only when the plan needs them, the counts
cache (:mod:`shardkit.counting.cache`) and a scan (:mod:`shardkit.counting.scan`).
Under a process group the stored counts are looked up once per job and shared
(:func:`shared_stored_counts`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from shardkit.counting.cache import Cached, cache_path
from shardkit.counting.scan import (
    Counted,
    CountFn,
    OnError,
    Salvage,
    StoredCountFn,
    count_or_salvage,
    count_shards,
    union_over_ranks,
)
from shardkit.errors import ShardkitError, redact
from shardkit.jobstore import group_store, job_key, once_per_job
from shardkit.shardlist import ShardList

__all__ = ["CountsUnavailableError", "counts_from_indexes", "plan_counts", "resolve_counts", "shared_stored_counts"]

logger = logging.getLogger("shardkit")


class CountsUnavailableError(ShardkitError, ValueError):
    """Record counts are needed and there is no way to get them."""


def resolve_counts(
    shards: ShardList,
    count_fn: CountFn | None,
    *,
    why: str,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    on_error: OnError = "raise",
    salvage: Salvage | None = None,
) -> ShardList:
    """``shards`` with every record count filled in.

    Args:
        shards: the list; returned as is when its counts are all known.
        count_fn: counts the records of one url; None when the format has no
            way to count.
        why: what needs the counts, for the log line and the error message.
        storage_options: fsspec options, to read the shards' identities.
        cache_dir: where to cache counts (default: see :func:`cache_dir`;
            ``""`` turns the cache off).
        on_error: the source's policy. Under ``"skip"`` a shard whose count
            breaks (a :class:`~shardkit.CorruptRecordError`) counts as the
            records its reader yields (``salvage``, :func:`readable_count`); that
            count is not cached, so the file is counted again next time.
        salvage: how, for ``on_error="skip"`` (without it, damage raises).

    Raises:
        CountsUnavailableError: counts are missing, not cached for the files
            as they are now, and ``count_fn`` is None.
        CorruptRecordError: a shard cannot be counted (under ``"raise"``).
    """
    if shards.num_records is not None:
        return shards
    cached = Cached.read(shards, storage_options, cache_dir)
    counts, missing = cached.counts, cached.missing
    if count_fn is not None:
        missing = union_over_ranks(missing)  # caches are per node: ranks may miss different shards
    if missing.size and count_fn is None:
        raise CountsUnavailableError(
            f"{why} needs the record count of every shard, and {missing.size} of {len(shards)} shards have none. "
            "Give counts with ShardList(urls, num_records=...) or a manifest "
            "(ShardList.from_manifest, written by ShardWriter or ShardList.to_manifest), "
            "pass count_fn=, or use balance='none' to deal out whole shards"
        )
    if missing.size and count_fn is not None:  # None with shards missing raised above
        logger.warning(
            "shardkit: counting the records of %d shards once (index files where present, else a framing scan), for %s",
            missing.size,
            redact(why),
        )
        counted = count_shards(
            shards, missing, functools.partial(count_or_salvage, count_fn, on_error=on_error, salvage=salvage)
        )
        counts[missing] = counted.counts
        cached.forget(missing[counted.damaged])
        cached.write(shards)
    return shards.with_num_records(counts)


def plan_counts(
    shards: ShardList,
    *,
    stored_count: StoredCountFn | None,
    count_fn: CountFn | None,
    required: bool,
    why: str,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    on_error: OnError = "raise",
    salvage: Salvage | None = None,
) -> ShardList:
    """The record counts a plan uses: the one place sources resolve them, the same way in every
    rank and DataLoader worker, whichever of ``len()``, ``state_dict()`` or iteration came first.

    Precedence, per shard list:

    1. the counts the list has (a manifest, ``num_records=``, ``count_records()``);
    2. the counts stored beside or in every file (``stored_count``: a checked index file, a
       Parquet footer), looked up under every balance mode: they are a function of the files,
       so every reader finds the same ones;
    3. only when the plan cannot go without counts (``required``: ``"pad"``/``"drop"`` over
       several ranks, sample-level shuffling): the counts cache, then ``count_fn``
       (:func:`resolve_counts`), which give every reader the same counts too;
    4. else unknown: the plan deals whole shards.

    The counts cache does not turn unknown counts into known ones (step 3 only): it is per
    machine and fills as ranks count, so a rank on a machine that counted before would split
    records while the others deal whole shards. Only its entries that were themselves taken from
    stored counts, for files that kept their identity since, stand in for reading those again.

    Raises:
        IndexFileError: an index does not fit its shard; see :func:`counts_from_indexes`.
        CountsUnavailableError: see :func:`resolve_counts`.

    ``on_error`` and ``salvage``: a shard that cannot be counted, see :func:`resolve_counts`.
    """
    if shards.num_records is not None:
        return shards
    policy: dict[str, Any] = {"on_error": on_error, "salvage": salvage}
    if stored_count is not None:
        stored = counts_from_indexes(
            shards, stored_count, storage_options=storage_options, cache_dir=cache_dir, **policy
        )
        if stored is not None:
            return stored
    if not required:
        return shards
    return resolve_counts(shards, count_fn, why=why, storage_options=storage_options, cache_dir=cache_dir, **policy)


_STORED, _NONE = b"stored:", b"none:"  # the answers shared_stored_counts shares


def shared_stored_counts(
    shards: ShardList,
    stored_count: StoredCountFn,
    *,
    storage_options: dict[str, Any] | None = None,
    on_error: OnError = "raise",
    salvage: Salvage | None = None,
) -> ShardList | None:
    """:func:`counts_from_indexes` once per job under a process group (:func:`~shardkit.jobstore.once_per_job`):
    the first rank to build a dataset over ``shards`` looks the stored counts up and shares its answer,
    the others take it. ``shards``, with the counts or without (no stored counts: every rank deals whole
    shards), or None when there is no group to share through (each reader then looks the counts up when
    it first plans).

    The first rank's answer holds for the job: an index written after it looked is not used by any
    rank, so ranks never plan with different counts.

    Raises:
        IndexFileError: this rank looked and an index does not fit its shard.
        CountsUnavailableError: the rank that looked failed; its error is in the message.
    """
    store = group_store()
    key = job_key("counts", [shards.url_digest(), dict(storage_options or {})]) if store is not None else None
    if store is None or key is None:
        return None

    def work() -> tuple[ShardList, bytes]:
        found = counts_from_indexes(
            shards, stored_count, storage_options=storage_options, on_error=on_error, salvage=salvage
        )
        counts = None if found is None else found.num_records
        if found is None or counts is None:
            return shards, _NONE
        return found, _STORED + counts.astype("<i8").tobytes()

    def taken(answer: bytes) -> ShardList:
        if answer == _NONE:
            return shards
        return shards.with_num_records(np.frombuffer(answer[len(_STORED) :], dtype="<i8").astype(np.int64))

    def failed(error: str) -> CountsUnavailableError:
        return CountsUnavailableError(
            f"another rank looked up the record counts of {len(shards)} shards ({shards[0]}, ...) for this one "
            f"and failed: {error}"
        )

    return once_per_job(store, key, work, taken, failed)


def counts_from_indexes(
    shards: ShardList,
    stored_count: StoredCountFn,
    *,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | None = None,
    on_error: OnError = "raise",
    salvage: Salvage | None = None,
) -> ShardList | None:
    """``shards`` with every count filled in from the counts stored with the shards; None as soon
    as a shard has none. Nothing is counted by a scan, nothing collective.

    ``stored_count(url)`` is the count a shard's metadata holds (an index
    file's length, checked against the file as it is now; a Parquet footer),
    or None where there is none. A counts cache entry that was taken from such
    a count, for a file with the identity it had then, stands in for reading it
    again; an entry from a scan does not (the shard may have no index). Counts
    taken from the shards go to the cache, marked as stored.

    A file whose stored count cannot be read (a Parquet footer destroyed) raises
    its :class:`~shardkit.CorruptRecordError`, or under ``on_error="skip"``
    counts as what its reader yields (``salvage``), uncached (see :func:`resolve_counts`).

    Raises:
        IndexFileError: an index does not fit its shard (stale, damaged); its
            message names the fix (rebuild it, delete it, or ``index=False``).
    """
    if shards.num_records is not None:
        return shards
    count_one = functools.partial(count_or_salvage, stored_count, on_error=on_error, salvage=salvage)
    probed = _probe_first(shards, count_one, cache_dir)
    if probed is None:
        return None
    cached = Cached.read(shards, storage_options, cache_dir)
    known = shards.known_counts | cached.stored
    counts = np.where(known, cached.counts, 0)
    missing = np.flatnonzero(~known)
    damaged = []
    for i in missing:
        found = probed.get(int(i))
        found = count_one(shards[int(i)]) if found is None else found
        if found.records is None:
            return None
        counts[i] = found.records
        damaged += [int(i)] if found.damaged else []
    if missing.size:
        logger.info("shardkit: record counts of %d shards from their index files or footers", missing.size)
        cached.counts, cached.stored[missing] = counts, True
        cached.forget(np.array(damaged, dtype=np.int64))
        cached.write(shards)
    return shards.with_num_records(counts)


def _probe_first(
    shards: ShardList, stored_count: Callable[[str], Counted], cache_dir: str | None
) -> dict[int, Counted] | None:
    """The stored count of the first shard lacking one when no counts cache exists (None: it has
    none, so neither have the counts): settles the usual case of shards without indexes with one
    probe, before the cache's file identities cost a stat per shard or a listing per directory."""
    path = cache_path(shards, cache_dir)
    if path is not None and os.path.exists(path):
        return {}
    first = int(np.flatnonzero(~shards.known_counts)[0])
    found = stored_count(shards[first])
    return None if found.records is None else {first: found}
