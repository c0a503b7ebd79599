"""Record counts for shard lists that lack them.

Sources resolve the counts they plan with in one function, :func:`plan_counts`,
the same way in every rank and DataLoader worker whichever of ``len()``,
``state_dict()``, ``count_records()`` or iteration runs first, so that the plan
is a function of the shards, their counts as the job sees them, the topology,
the seed and the epoch. In order of preference the counts come from:

1. the :class:`~shardkit.ShardList` itself (a manifest, ``num_records=``, or
   an earlier ``count_records()``, which every rank calls: it is collective
   under a process group);
2. the counts stored with every shard (:func:`counts_from_indexes`): a
   checked index file beside it (``shardkit index``), a Parquet footer. They
   are looked up under every balance mode, ``"none"`` included, since they are
   a function of the files: every reader finds the same ones. An index that
   does not fit its shard raises :class:`~shardkit.formats.offsets.IndexFileError`
   rather than being trusted;
3. only when the plan cannot go without counts (``"pad"``/``"drop"`` over
   several ranks, sample-level shuffling; :func:`resolve_counts`): the counts
   cache of an earlier counting pass, for every shard whose file still has the
   identity it had when it was counted (:func:`identity`: size plus
   modification time, inode, ETag, version or generation — whatever the
   filesystem reports), then ``count_fn(url)`` for the others only — for
   TFRecord, the index file when there is a valid one, else a fast framing
   scan. When ``torch.distributed`` is initialised the shards are shared out
   over the ranks and the counts all-gathered. Under ``on_error="skip"`` a
   shard that breaks while counted counts as what reading it yields
   (:func:`readable_count`), and that count is not cached;
4. else the counts stay unknown, and plans deal whole shards.

The cache never turns unknown counts into known ones: it is per machine and
fills as ranks count, so a rank on a machine that counted in an earlier run
would split records while ranks elsewhere dealt whole shards. Its rows say
whether a count was taken from an index or footer (``stored``); such a row,
for a file that kept its identity, stands in for reading that index again.

Once per job: under an initialised process group, the first rank to build a
dataset over a shard list looks the stored counts up (step 2) as it builds it
and puts its answer (the counts, or that there are none) in the group's store;
the other ranks take that answer (:func:`shared_stored_counts`, no collective,
as :mod:`shardkit.listing` shares a listing), and DataLoader workers receive it
with the dataset: they look nothing up. So an index file written (or removed)
while a job starts cannot give ranks different plans: the first rank's answer
holds for the whole job. Without a process group (ranks given as ``rank=``,
``world_size=``) each reader looks the files up when it first plans, and a
reader that saw every index would split records while one that found a shard
without its index dealt whole shards: write indexes (or a manifest) before the
job starts.

Where the cache lives (never beside the data: shardkit writes nothing where
the user did not ask): one Arrow IPC file per shard list, named by the hash of
its urls (:meth:`ShardList.url_digest`), in :func:`cache_dir` — the
``cache_dir`` argument, else ``$SHARDKIT_CACHE_DIR``, else
``$XDG_CACHE_HOME/shardkit``, else ``~/.cache/shardkit``. An empty
``SHARDKIT_CACHE_DIR`` turns the cache off. Each row holds a url, its count
and the identity its file had *before* it was counted, so a file rewritten
during the count is counted again next time. The file is written to a
temporary name and renamed; one that cannot be read (truncated, corrupt, of
another list) is ignored and rewritten. To share counts between machines,
write a manifest (:meth:`ShardList.to_manifest`) instead.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import posixpath
import uuid
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc  # its functions are generated at import: pyright sees some, not all

from shardkit.errors import CorruptRecordError, ShardkitError, redact, redact_url
from shardkit.jobstore import group_store, job_key, once_per_job
from shardkit.shardlist import ShardList

logger = logging.getLogger("shardkit")

CACHE_ENV = "SHARDKIT_CACHE_DIR"

CountFn = Callable[[str], int]
StoredCountFn = Callable[[str], "int | None"]
#: ``read_fn(url, start, stop)``, a source's reader.
ReadFn = Callable[[str, int, "int | None"], Iterable[Any]]
OnError = Literal["raise", "skip"]


class Salvage(NamedTuple):
    """How a source counts a shard it finds damaged under ``on_error="skip"``: as the records its reader
    (``read``, the source's ``read_fn``) yields before the break (:func:`readable_count`). ``damaged(url,
    count)`` is told of each such shard in the process that counted it: a source counts the error there of
    one that reads as empty, since no plan then opens it."""

    read: ReadFn
    damaged: Callable[[str, int], None] | None = None


#: Keys of an fsspec ``info`` dict that change when a file's content may have:
#: local (mtime, inode, ctime), S3 (ETag, VersionId, LastModified), GCS
#: (generation, md5Hash, updated), Azure (etag, last_modified), memory (created).
_IDENTITY_KEYS = (
    "mtime", "ino", "created", "ETag", "etag", "VersionId", "version_id",
    "generation", "md5Hash", "LastModified", "last_modified", "updated",
)  # fmt: skip
_SCHEMA_V1 = pa.schema([("url", pa.large_string()), ("num_records", pa.int64()), ("identity", pa.large_string())])
#: ``stored``: the count came from the file's metadata or index file, not from a scan; only those
#: stand in for that metadata when the plan would not count (see :func:`plan_counts`).
_SCHEMA = _SCHEMA_V1.append(pa.field("stored", pa.bool_()))


class CountsUnavailableError(ShardkitError, ValueError):
    """Record counts are needed and there is no way to get them."""


def identity(info: Mapping[str, Any]) -> str | None:
    """What identifies a file's content in fsspec's ``info`` dict, as a string.

    The size plus every key of :data:`_IDENTITY_KEYS` present (modification
    time, inode, ETag, object version...). None when the filesystem reports
    nothing beyond the size: a size alone cannot tell a rewritten file, so
    such counts are not cached.
    """
    parts = [f"{key}={info[key]}" for key in _IDENTITY_KEYS if info.get(key) is not None]
    if not parts:
        return None
    return f"size={info.get('size')};" + ";".join(parts)


_listed: list[pa.Table] = []
"""(url, identity) of the remote files the last few glob listings of this process saw or received (Arrow
columns: a million urls cost their bytes, not a million dict entries); see :func:`remember`."""
_LISTINGS_KEPT = 4


def remember(urls: Sequence[str], identities: Sequence[str | None]) -> None:
    """Keep the identities a listing gave for ``urls``: the counts cache then checks its entries against
    them instead of listing the shards' directories again in every reader (a LIST per DataLoader worker
    otherwise). Forked workers inherit them; a listing shared between ranks carries them."""
    _listed.append(pa.table({"url": pa.array(urls, pa.string()), "identity": pa.array(identities, pa.string())}))
    del _listed[:-_LISTINGS_KEPT]


def listed_identities(urls: Sequence[str]) -> tuple[np.ndarray, list[str | None]]:
    """Which of ``urls`` a remembered listing saw, and their identities there (None where unseen
    or where the listing reported none); the newest listing wins."""
    known = np.zeros(len(urls), dtype=bool)
    found: list[str | None] = [None] * len(urls)
    column = pa.array(urls, pa.string())
    for table in reversed(_listed):
        where = pc.index_in(column, value_set=table.column("url")).to_numpy(zero_copy_only=False)  # pyright: ignore[reportAttributeAccessIssue]
        fresh = np.flatnonzero(~known & ~np.isnan(where.astype(np.float64)))
        if fresh.size:
            identities = table.column("identity").take(pa.array(where[fresh].astype(np.int64))).to_pylist()
            for i, ident in zip(fresh.tolist(), identities):
                found[i] = ident
            known[fresh] = True
    return known, found


def cache_dir(override: str | None = None) -> str | None:
    """The directory of the counts cache, or None when caching is off (``SHARDKIT_CACHE_DIR=""``)."""
    if override is not None:
        return override or None
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return configured or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shardkit")


def cache_path(shards: ShardList, directory: str | None = None) -> str | None:
    """The counts cache file of ``shards`` (None when caching is off or the list is empty)."""
    root = cache_dir(directory)
    if root is None or len(shards) == 0:
        return None
    return os.path.join(root, f"counts-{shards.url_digest()[:32]}.arrow")


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
    cached = _Cached.read(shards, storage_options, cache_dir)
    counts, missing = cached.counts, cached.missing
    if count_fn is not None:
        missing = _union_over_ranks(missing)  # caches are per node: ranks may miss different shards
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
        counted = _count(shards, missing, functools.partial(_counted, count_fn, on_error=on_error, salvage=salvage))
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
    count_one = functools.partial(_counted, stored_count, on_error=on_error, salvage=salvage)
    probed = _probe_first(shards, count_one, cache_dir)
    if probed is None:
        return None
    cached = _Cached.read(shards, storage_options, cache_dir)
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
    shards: ShardList, stored_count: Callable[[str], _Counted], cache_dir: str | None
) -> dict[int, _Counted] | None:
    """The stored count of the first shard lacking one when no counts cache exists (None: it has
    none, so neither have the counts): settles the usual case of shards without indexes with one
    probe, before the cache's file identities cost a stat per shard or a listing per directory."""
    path = cache_path(shards, cache_dir)
    if path is not None and os.path.exists(path):
        return {}
    first = int(np.flatnonzero(~shards.known_counts)[0])
    found = stored_count(shards[first])
    return None if found.records is None else {first: found}


class _Cached:
    """The counts a shard list has or the counts cache holds for its files as they are now
    (``counts``; ``missing`` the shards with neither; ``stored`` the cached ones taken from the
    files' metadata, not from a scan), and where more go once known."""

    def __init__(self, path: str | None, identities: list[str | None], found: _Found) -> None:
        self.path, self.identities, self.counts, self.stored = path, identities, found.counts, found.stored
        self.missing = np.flatnonzero(~found.known)

    @classmethod
    def read(cls, shards: ShardList, storage_options: dict[str, Any] | None, cache_dir: str | None) -> _Cached:
        path = cache_path(shards, cache_dir)
        identities: list[str | None] = (
            _identities(shards, storage_options) if path is not None else [None] * len(shards)
        )
        return cls(path, identities, _known_counts(shards, path, identities))

    def forget(self, damaged: np.ndarray) -> None:
        """Cache no count for the ``damaged`` shards (counted as what reading them yields): without an
        identity their rows never match, so the files are counted again, repaired or not."""
        for i in damaged.tolist():
            self.identities[i] = None

    def write(self, shards: ShardList) -> None:
        """Keep ``counts`` in the cache, bound to each file's identity (where one is known)."""
        if self.path is not None and any(found is not None for found in self.identities):
            _write_cache(self.path, shards, self.counts, self.identities, self.stored)


class _Found(NamedTuple):
    """Counts known from a shard list or its counts cache: ``known`` which, ``stored`` which of those the cache
    took from the files' metadata."""

    counts: np.ndarray
    known: np.ndarray
    stored: np.ndarray


def _known_counts(shards: ShardList, path: str | None, identities: list[str | None]) -> _Found:
    """Counts known from the list or from a cache entry whose identity still matches, and which those are."""
    counts = shards.table.column("num_records").fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    known = shards.known_counts.copy()
    stored = np.zeros(len(shards), dtype=bool)
    cached = _read_cache(path, shards) if path is not None else None
    if cached is not None:
        current = pa.array(identities, pa.large_string())
        same = pc.equal(cached.column("identity"), current)  # pyright: ignore[reportAttributeAccessIssue]
        fresh = pc.fill_null(same, False).to_numpy(zero_copy_only=False)
        use = fresh & ~known
        counts[use] = cached.column("num_records").to_numpy(zero_copy_only=False)[use]
        stored = use & cached.column("stored").to_numpy(zero_copy_only=False)
        known |= fresh
        if use.any():
            logger.info("shardkit: record counts of %d shards from %s", int(use.sum()), redact(str(path)))
    return _Found(counts, known, stored)


def _distributed() -> bool:
    """Whether this is a rank's main process in an initialised process group (where collectives run)."""
    import torch.distributed as dist
    from torch.utils.data import get_worker_info

    return dist.is_available() and dist.is_initialized() and get_worker_info() is None


def _union_over_ranks(missing: np.ndarray) -> np.ndarray:
    """The shards any rank lacks a count for: every rank then counts its share of the same set,
    so the all-gather in :func:`_count` is entered by all ranks or by none."""
    if not _distributed():
        return missing
    import torch.distributed as dist

    gathered: list[np.ndarray | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, missing)
    return np.unique(np.concatenate([part for part in gathered if part is not None]))


class _Counted(NamedTuple):
    """One shard's count (None: it has none stored), and whether it was taken from a damaged file."""

    records: int | None
    damaged: bool


class _Counts(NamedTuple):
    """The counts of the shards counted, in order, and a mask of those taken from damaged files."""

    counts: np.ndarray
    damaged: np.ndarray


def _counted(
    count_fn: Callable[[str], int | None], url: str, *, on_error: OnError, salvage: Salvage | None
) -> _Counted:
    """``count_fn(url)``; under ``on_error="skip"`` a file it finds damaged counts as what reading it yields."""
    try:
        count = count_fn(url)
    except CorruptRecordError as error:  # damage to the file: other errors (an index that does not fit) still raise
        if on_error == "raise" or salvage is None:
            raise
        readable = readable_count(url, salvage.read, error)
        if salvage.damaged is not None:
            salvage.damaged(url, readable)
        return _Counted(readable, True)
    return _Counted(None if count is None else int(count), False)


def readable_count(url: str, read_fn: ReadFn, broke: CorruptRecordError) -> int:
    """The records ``read_fn`` yields from ``url`` before it breaks, for a shard whose count ``broke``
    (``on_error="skip"``), with a warning naming the shard, where and why. A bad record read past (a
    :class:`~shardkit.formats.base.BadRecord`) counts: it keeps its place, as when the shard is read. So
    the plan reads exactly what the shard holds and its ranks stay equal; reading it counts the break."""
    count, reason = 0, broke
    try:
        for _ in read_fn(url, 0, None):
            count += 1
    except Exception as error:  # noqa: BLE001 - where reading breaks is the count
        reason = error
    where = "" if str(reason) == str(broke) else f" ({redact(str(reason))})"  # the same break: said once
    named = "" if url in str(broke) else f"{redact_url(url)}: "  # a CorruptRecordError's text starts with its url
    warnings.warn(
        f"shardkit: cannot count the records of a shard: {named}{redact(str(broke))}. It is counted as the "
        f"{count} records reading yields before it breaks{where} (on_error='skip'); reading it counts the break "
        "in stats(). Restore or rewrite the file to read it whole",
        stacklevel=2,
    )
    return count


def _count(shards: ShardList, missing: np.ndarray, count_fn: Callable[[str], _Counted]) -> _Counts:
    """Count the ``missing`` shards, shared out over the ranks when distributed."""
    import torch.distributed as dist

    distributed = _distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    mine = missing[rank::world]
    local: dict[int, _Counted] = {}
    with _counting_bar(len(mine)) as bar:
        for i in mine:
            local[int(i)] = count_fn(shards[int(i)])
            bar.update()
    if distributed:
        gathered: list[dict[int, _Counted] | None] = [None] * world
        dist.all_gather_object(gathered, local)
        for part in gathered:
            local.update(part or {})
    found = [local[int(i)] for i in missing]
    return _Counts(
        np.array([int(f.records or 0) for f in found], dtype=np.int64), np.array([f.damaged for f in found], dtype=bool)
    )


def _counting_bar(total: int) -> Any:
    """A bar over the shards this process counts, left on screen with its throughput (a pass over many
    shards takes minutes): only when stderr is a terminal (``disable=None``), never in a DataLoader
    worker (the workers' bars would overwrite each other and the loader's output)."""
    from torch.utils.data import get_worker_info
    from tqdm import tqdm

    in_worker = get_worker_info() is not None
    return tqdm(
        total=total, unit=" shards", desc="shardkit: counting records", leave=True, disable=True if in_worker else None
    )


def _identities(shards: ShardList, storage_options: dict[str, Any] | None) -> list[str | None]:
    """The :func:`identity` of every shard's file (None where it cannot be read):
    one ``os.stat`` per local path, the glob listing's where it found the url
    (:func:`remember`), one listing per directory elsewhere (not one request per
    object)."""
    urls = list(shards)
    found: list[str | None] = [None] * len(urls)
    by_dir: dict[str, list[int]] = defaultdict(list)
    listed, identities = listed_identities(urls) if _listed else (np.zeros(len(urls), dtype=bool), found)
    for i, url in enumerate(urls):
        if listed[i]:  # seen by the listing that found it: no directory listing per reader
            found[i] = identities[i]
        elif "://" in url:
            by_dir[posixpath.dirname(url)].append(i)
        else:
            found[i] = _local_identity(url)
    for directory, positions in by_dir.items():
        try:
            fs, fs_dir = fsspec.core.url_to_fs(directory, **(storage_options or {}))
            listing = {info["name"].rstrip("/"): info for info in fs.ls(fs_dir, detail=True)}
        except Exception as error:  # noqa: BLE001 - unreachable: these shards are counted, not cached
            logger.debug("shardkit: cannot list %s for the counts cache (%s)", redact(directory), redact(str(error)))
            continue
        for i in positions:
            info = listing.get(fs._strip_protocol(urls[i]).rstrip("/"))
            if info is not None and info.get("type") != "directory":
                found[i] = identity(info)
    return found


def _local_identity(path: str) -> str | None:
    """:func:`identity` of a local file from one ``stat`` (fsspec's ``info`` costs 10x more), to the nanosecond."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return identity({"size": st.st_size, "mtime": st.st_mtime_ns, "ino": st.st_ino, "created": st.st_ctime_ns})


def _read_cache(path: str, shards: ShardList) -> pa.Table | None:
    """The cache table of exactly these urls, or None when absent or unusable.

    Read into memory, not mapped: a cache truncated by another process while
    mapped would kill this one with SIGBUS.
    """
    try:
        with pa.OSFile(path, "rb") as f:
            table = pa.ipc.open_file(f).read_all()
    except FileNotFoundError:
        return None
    except (OSError, pa.ArrowException) as error:
        logger.warning(
            "shardkit: ignoring the unreadable counts cache %s (%s); it will be rewritten",
            redact(path),
            redact(str(error)),
        )
        return None
    if table.schema.equals(_SCHEMA_V1):  # written before counts were marked stored: all taken as scanned
        table = table.append_column("stored", pa.array(np.zeros(table.num_rows, dtype=bool)))
    urls = shards.table.column("url")
    usable = (
        table.schema.equals(_SCHEMA)
        and table.num_rows == len(shards)
        and table.column("url").equals(urls.cast(pa.large_string()))
        and table.column("num_records").null_count == 0
        and (pc.min(table.column("num_records")).as_py() or 0) >= 0  # pyright: ignore[reportAttributeAccessIssue]
    )
    if not usable:
        logger.warning(
            "shardkit: ignoring the counts cache %s: not one of this shard list; it will be rewritten", redact(path)
        )
        return None
    return table


def _write_cache(
    path: str, shards: ShardList, counts: np.ndarray, identities: list[str | None], stored: np.ndarray
) -> None:
    """Write the cache atomically (temporary name, then rename); a failure only costs a recount later."""
    table = pa.table(
        [
            shards.table.column("url").cast(pa.large_string()),
            pa.array(counts, pa.int64()),
            pa.array(identities, pa.large_string()),
            pa.array(stored, pa.bool_()),
        ],
        schema=_SCHEMA,
    )
    partial = f"{path}.{uuid.uuid4().hex}.partial"
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with pa.OSFile(partial, "wb") as f, pa.ipc.new_file(f, _SCHEMA) as writer:
            writer.write_table(table)
        os.replace(partial, path)
    except OSError as error:
        logger.info("shardkit: could not cache record counts at %s (%s)", redact(path), redact(str(error)))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
