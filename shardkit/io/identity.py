"""A file's identity: the one string by which what shardkit knows of a file is bound to it.

Record counts in the counts cache, a listing shared between ranks, an entry of
the remote cache and a remote reader pinned to one version of an object all
ask the same question: is this still the file as it was? They answer it with
:func:`identity`, made from what the filesystem's ``info`` reports: the size,
then every key of :data:`IDENTITY_KEYS` present (modification time, inode,
ETag, object version, generation...). One spelling, so an identity taken from
a listing compares equal to one taken from a ``stat`` or a HEAD, and counts
caches written by earlier versions keep matching (the string is stored there).

A size alone cannot tell a rewritten file from the one counted, so
:func:`identity` is None then: nothing is bound to such a file. A reader that
holds an object open still compares what it has (:func:`version`: the size,
when that is all the store reports). An error names a version to a person in
its own, shorter spelling (:func:`describe`), which decides nothing; the
remote cache hashes that spelling into its entries' names only because the
entries already on disk are named so.

Listings see many files' identities at once; :func:`remember` keeps the last
few, so the counts cache checks its rows against them instead of listing every
shard's directory again in each DataLoader worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc  # its functions are generated at import: pyright sees some, not all

__all__ = ["IDENTITY_KEYS", "any_listed", "describe", "identity", "listed_identities", "remember", "version"]

IDENTITY_KEYS: Final = (
    "mtime", "ino", "created", "ETag", "etag", "VersionId", "version_id",
    "generation", "md5Hash", "LastModified", "last_modified", "updated", "Last-Modified",
)  # fmt: skip
"""Keys of an fsspec ``info`` dict that change when a file's content may have: local (mtime, inode,
ctime), S3 (ETag, VersionId, LastModified), GCS (generation, md5Hash, updated), Azure (etag,
last_modified), memory (created), HTTP (ETag, Last-Modified). Their order is part of the stored
identities: new keys go at the end."""


def identity(info: Mapping[str, Any]) -> str | None:
    """What identifies a file's content in fsspec's ``info`` dict, as a string.

    The size plus every key of :data:`IDENTITY_KEYS` present. None when the
    filesystem reports nothing beyond the size: a size alone cannot tell a
    rewritten file, so nothing is bound to it.
    """
    parts = [f"{key}={info[key]}" for key in IDENTITY_KEYS if info.get(key) is not None]
    if not parts:
        return None
    return f"size={info.get('size')};" + ";".join(parts)


def version(info: Mapping[str, Any]) -> str:
    """The :func:`identity` of an object held open, or its size alone where the store reports no more:
    a reader pinned to one object still notices it change size."""
    return identity(info) or f"size={info.get('size')}"


def describe(info: Mapping[str, Any]) -> str:
    """How a version of an object is named to a person (in :class:`~shardkit.io.retry.ObjectChangedError`):
    its ETag, version, size and modification time as the store gives them, comma-separated.

    What binds metadata to a file is :func:`identity`. The remote cache names its entries by a hash of
    this spelling (:meth:`shardkit.io.cache.Cache.entry_path`), as it did before :func:`identity` was
    shared, so that objects already cached keep their entries.
    """
    keys = ("ETag", "etag", "VersionId", "version_id", "generation", "md5Hash", "size")
    keys += ("LastModified", "Last-Modified", "mtime", "updated")
    return ",".join(f"{key}={info[key]}" for key in keys if info.get(key) is not None)


_listed: list[pa.Table] = []
"""(url, identity) of the remote files the last few glob listings of this process saw or received (Arrow
columns: a million urls cost their bytes, not a million dict entries); see :func:`remember`."""
_LISTINGS_KEPT: Final = 4


def remember(urls: Sequence[str], identities: Sequence[str | None]) -> None:
    """Keep the identities a listing gave for ``urls``: the counts cache then checks its entries against
    them instead of listing the shards' directories again in every reader (a LIST per DataLoader worker
    otherwise). Forked workers inherit them; a listing shared between ranks carries them."""
    _listed.append(pa.table({"url": pa.array(urls, pa.string()), "identity": pa.array(identities, pa.string())}))
    del _listed[:-_LISTINGS_KEPT]


def any_listed() -> bool:
    """Whether this process remembers any listing (else :func:`listed_identities` knows nothing)."""
    return bool(_listed)


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
