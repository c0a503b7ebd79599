"""The counts cache: record counts of earlier counting passes, one Arrow IPC file per shard list, per machine.

Each row holds a url, its count, the identity its file had *before* it was
counted (:func:`shardkit.io.identity.identity`, so a file rewritten during the
count is counted again next time) and whether the count was taken from an
index or footer (``stored``). A row is used only while its file keeps that
identity. The file is written to a temporary name and renamed; one that cannot
be read (truncated, corrupt, of another list) is ignored and rewritten. Where
it lives: :func:`cache_dir` (never beside the data).
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import uuid
from collections import defaultdict
from typing import Any, NamedTuple

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc  # its functions are generated at import: pyright sees some, not all

from shardkit.errors import redact
from shardkit.io.identity import any_listed, identity, listed_identities
from shardkit.io.retry import retried_call
from shardkit.shardlist import ShardList

__all__ = ["CACHE_ENV", "Cached", "cache_dir", "cache_path"]

logger = logging.getLogger("shardkit")

CACHE_ENV = "SHARDKIT_CACHE_DIR"
_SCHEMA_V1 = pa.schema([("url", pa.large_string()), ("num_records", pa.int64()), ("identity", pa.large_string())])
#: ``stored``: the count came from the file's metadata or index file, not from a scan; only those
#: stand in for that metadata when the plan would not count (see :func:`plan_counts`).
_SCHEMA = _SCHEMA_V1.append(pa.field("stored", pa.bool_()))


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


class Cached:
    """The counts a shard list has or the counts cache holds for its files as they are now
    (``counts``; ``missing`` the shards with neither; ``stored`` the cached ones taken from the
    files' metadata, not from a scan), and where more go once known."""

    def __init__(self, path: str | None, identities: list[str | None], found: Found) -> None:
        self.path, self.identities, self.counts, self.stored = path, identities, found.counts, found.stored
        self.missing = np.flatnonzero(~found.known)

    @classmethod
    def read(cls, shards: ShardList, storage_options: dict[str, Any] | None, cache_dir: str | None) -> Cached:
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


class Found(NamedTuple):
    """Counts known from a shard list or its counts cache: ``known`` which, ``stored`` which of those the cache
    took from the files' metadata."""

    counts: np.ndarray
    known: np.ndarray
    stored: np.ndarray


def _known_counts(shards: ShardList, path: str | None, identities: list[str | None]) -> Found:
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
    return Found(counts, known, stored)


def _identities(shards: ShardList, storage_options: dict[str, Any] | None) -> list[str | None]:
    """The :func:`~shardkit.io.identity.identity` of every shard's file (None where it cannot be read):
    one ``os.stat`` per local path, the glob listing's where it found the url
    (:func:`~shardkit.io.identity.remember`), one listing per directory elsewhere (not one request per
    object)."""
    urls = list(shards)
    found: list[str | None] = [None] * len(urls)
    by_dir: dict[str, list[int]] = defaultdict(list)
    listed, identities = listed_identities(urls) if any_listed() else (np.zeros(len(urls), dtype=bool), found)
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
            listing = {info["name"].rstrip("/"): info for info in retried_call(fs, "ls", fs_dir, detail=True)}
        except Exception as error:  # noqa: BLE001 - unreachable: these shards are counted, not cached
            logger.debug("shardkit: cannot list %s for the counts cache (%s)", redact(directory), redact(str(error)))
            continue
        for i in positions:
            info = listing.get(fs._strip_protocol(urls[i]).rstrip("/"))
            if info is not None and info.get("type") != "directory":
                found[i] = identity(info)
    return found


def _local_identity(path: str) -> str | None:
    """:func:`~shardkit.io.identity.identity` of a local file from one ``stat`` (fsspec's ``info`` costs 10x more), to the nanosecond."""
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
