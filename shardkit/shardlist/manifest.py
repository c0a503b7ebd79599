"""Manifests: shard lists saved as files (Arrow IPC, Parquet or JSON lines), and how their urls resolve.

A manifest's relative urls resolve against its own directory, the only meaning
one may give them: its schema metadata says so (:data:`PATHS_KEY` =
:data:`PATHS_RELATIVE`), and a manifest naming another convention is refused
rather than guessed at. Writing one stores local urls under its folder
relative to it, so a dataset directory can move with its manifest.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.compute as _compute
from fsspec.implementations.local import LocalFileSystem

from shardkit.io.remote import open_remote
from shardkit.shardlist.columns import NUM_RECORDS, SIZE, URL, ShardListError, check_urls, int_column

__all__ = [
    "IPC_MAGIC",
    "PATHS_KEY",
    "PATHS_RELATIVE",
    "manifest_joiner",
    "manifest_table",
    "normalize_manifest",
    "open_manifest",
    "read_manifest",
]

#: pyarrow.compute's functions are generated at import time: a type checker sees none of them.
pc: Any = _compute

IPC_MAGIC = b"ARROW1"
_PARQUET_MAGIC = b"PAR1"

#: Schema metadata of a manifest saying how its relative urls resolve (the only value: against its folder).
PATHS_KEY = b"paths"
PATHS_RELATIVE = b"relative-to-manifest"


def open_manifest(fs: fsspec.AbstractFileSystem, fs_path: str) -> Any:
    """The manifest at ``fs_path`` opened for reading: a remote one as shards are read
    (:func:`~shardkit.io.remote.open_remote`), each request bounded and retried (fsspec's own file
    would wait on a silent server as long as its client does: aiohttp's 5 minutes)."""
    if isinstance(fs, LocalFileSystem):
        return fs.open(fs_path, "rb")
    return open_remote(fs, fs_path, fs.unstrip_protocol(fs_path))


def read_manifest(fs: fsspec.AbstractFileSystem, fs_path: str, magic: bytes, path: str) -> pa.Table:
    """Read a manifest into memory (remote IPC, Parquet, or JSON lines)."""
    try:
        with open_manifest(fs, fs_path) as f:
            if magic == IPC_MAGIC:
                return pa.ipc.open_file(f).read_all()
            if magic.startswith(_PARQUET_MAGIC):
                import pyarrow.parquet as pq

                return pq.read_table(f)
            import pyarrow.json as pj

            schema = pa.schema([(URL, pa.string()), (NUM_RECORDS, pa.int64()), (SIZE, pa.int64())])
            options = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
            return pj.read_json(f, parse_options=options)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ShardListError(f"cannot read manifest {path!r} as Arrow IPC, Parquet or JSON lines: {err}") from err


def normalize_manifest(table: pa.Table, path: str, join: Callable[[str], str]) -> pa.Table:
    """The manifest as (url, num_records, size) with absolute urls; the same
    object when nothing had to change. ``join`` resolves a relative url."""
    names = table.column_names
    if URL not in names:
        raise ShardListError(f"manifest {path!r} has no {URL!r} column (it has {names})")
    urls = table.column(URL)
    if not (pa.types.is_string(urls.type) or pa.types.is_large_string(urls.type)):
        raise ShardListError(f"manifest {path!r}: column {URL!r} must be strings, got {urls.type}")
    check_urls(urls, f"manifest {path!r}: {URL}")
    paths = (table.schema.metadata or {}).get(PATHS_KEY, PATHS_RELATIVE)
    if paths != PATHS_RELATIVE:  # a convention this version does not know: guessing would read the wrong files
        raise ShardListError(
            f"manifest {path!r}: schema metadata paths={paths.decode(errors='replace')!r} is not "
            f"{PATHS_RELATIVE.decode()!r}; it was written by a newer shardkit or another tool"
        )
    resolved = _resolve_relative(urls, join)
    counts, sizes = (
        int_column(table.column(name) if name in names else None, len(urls), f"manifest {path!r}: {name}")
        for name in (NUM_RECORDS, SIZE)
    )
    unchanged = (
        names == [URL, NUM_RECORDS, SIZE]
        and resolved is urls
        and table.schema.field(NUM_RECORDS).type == pa.int64()
        and table.schema.field(SIZE).type == pa.int64()
    )
    if unchanged:
        return table
    return pa.table({URL: resolved, NUM_RECORDS: counts, SIZE: sizes})


def manifest_table(table: pa.Table, folder: str | None) -> pa.Table:
    """``table`` as a manifest in ``folder`` (None: not local) stores it: local paths relative
    to ``folder`` when under it, else absolute; the convention named in the schema metadata."""
    urls = table.column(URL)
    local = pc.invert(pc.match_substring(urls, "://"))
    if folder is not None and pc.any(local).as_py():
        cwd, prefix = os.getcwd(), folder.rstrip("/") + "/"
        batches = []
        for begin in range(0, len(urls), 65536):
            batch = urls.slice(begin, 65536).to_pylist()
            flags = local.slice(begin, 65536).to_pylist()
            batches.append(pa.array([_stored(u, cwd, prefix) if f else u for u, f in zip(batch, flags)], urls.type))
        table = table.set_column(0, URL, pa.chunked_array(batches, type=urls.type))
    return table.replace_schema_metadata({**(table.schema.metadata or {}), PATHS_KEY: PATHS_RELATIVE})


def _stored(url: str, cwd: str, prefix: str) -> str:
    """A local ``url`` as a manifest in the folder ``prefix`` stores it."""
    absolute = posixpath.normpath(posixpath.join(cwd, url))
    return absolute[len(prefix) :] if absolute.startswith(prefix) else absolute


def manifest_joiner(fs: fsspec.AbstractFileSystem, manifest_path: str) -> Callable[[str], str]:
    """A function resolving a relative url against the manifest's directory."""
    base = posixpath.dirname(manifest_path)
    if isinstance(fs, LocalFileSystem):
        return lambda url: posixpath.normpath(posixpath.join(base, url))
    return lambda url: fs.unstrip_protocol(posixpath.normpath(posixpath.join(base, url)))


def _resolve_relative(urls: pa.ChunkedArray, join: Callable[[str], str]) -> pa.ChunkedArray:
    """``urls`` with relative entries (no ``/`` start, no ``://``) joined;
    the same object when all are absolute."""
    absolute = pc.or_(pc.starts_with(urls, "/"), pc.match_substring(urls, "://"))
    if pc.all(absolute).as_py() is not False:
        return urls
    dotted = pc.match_substring_regex(urls, r"(^|/)\.\.?(/|$)|//")
    if not pc.any(pc.and_(dotted, pc.invert(absolute))).as_py():  # what to_manifest writes: joined in Arrow
        prefix = join(".").rstrip("/") + "/"
        return pc.if_else(absolute, urls, pc.binary_join_element_wise(prefix, urls, ""))
    batches = []
    for begin in range(0, len(urls), 65536):
        batch = urls.slice(begin, 65536).to_pylist()
        flags = absolute.slice(begin, 65536).to_pylist()
        batches.append(pa.array([u if a else join(u) for u, a in zip(batch, flags)], type=urls.type))
    return pa.chunked_array(batches, type=urls.type)
