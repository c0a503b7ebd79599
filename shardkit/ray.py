"""Write shards from a Ray Data ``Dataset``: :func:`write_shards` and the :class:`ShardSink` under it.

Each Ray write task writes its rows with a :class:`~shardkit.writer.ShardWriter`
of its own (the same records, roll-over and atomic publishing as one process
writes), plus each shard's index file where the format has one, and returns
every shard's url, record count, size and identity. The driver commits once,
in ``on_write_complete``: it checks that every returned shard is on storage as
returned, deletes every other file the run's names could have produced, and
writes the one Arrow manifest (:meth:`~shardkit.ShardList.to_manifest`, with
counts) last. Readers plan from it with no counting pass.

Exactly once through failures rests on three rules:

- **Deterministic names.** Task ``t``'s ``k``-th shard is ``prefix + (field % t)
  + "-%05d" % k + suffix`` for a pattern ``prefix%05dsuffix`` (a folder gets
  ``part-%05d`` and the format's suffix). Ray gives a retried task the same task
  index and the same rows, so a retry (after an exception, a SIGKILLed worker or
  a lost node) rewrites the same names with the same bytes, each by rename.
- **One run per name prefix.** The run is refused before anything is written if
  the manifest or any file starting with the prefix exists, so every such file
  found at commit is this run's; whatever the manifest does not list (a killed
  attempt's ``.partial``, a shard a failed attempt numbered beyond the retry's
  last) is deleted then. A failed run deletes them all and writes no manifest.
- **The manifest is written last**, by rename, listing exactly the shards the
  successful task attempts returned.

A task attempt still running when its node was declared lost (a zombie) can
only rename a file with a final name over the same bytes; it cannot add a name
the manifest lacks after commit unless its rows differ from the retry's, which
a deterministic dataset excludes.

Ray is imported here, at the top: this module is what needs it, and nothing in
``import shardkit`` imports this module.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec

from shardkit.errors import ShardkitError
from shardkit.writer import (
    ShardWriter,
    _writable_format,
    default_manifest_path,
    write_manifest,
)

try:
    from ray.data.block import BlockAccessor
    from ray.data.datasource.datasink import Datasink, WriteResult
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(f"shardkit.ray needs Ray Data ({error}); install it with: pip install 'shardkit[ray]'") from error

__all__ = [
    "DatasetExistsError", "ShardSink", "WrittenShard", "check_empty", "record_of", "shard_pattern", "task_pattern",
    "write_shards",
]  # fmt: skip

_FIELD = re.compile(r"%0?\d*d")
_COMPRESSED = (".gz", ".tgz", ".zst", ".zstd", ".bz2", ".xz", ".br", ".snappy")
"""Suffixes of a file compressed whole: it cannot seek, so it gets no index."""


class DatasetExistsError(ShardkitError, FileExistsError):
    """The output already holds a manifest or files with the run's names: two runs would mix."""


@dataclass(frozen=True)
class WrittenShard:
    """One shard a write task published: its task and number in the task, url, records, bytes, identity."""

    task: int
    number: int
    url: str
    num_records: int
    size: int
    identity: str | None


def shard_pattern(path: str, format: Any = None) -> str:  # noqa: A002
    """``path`` as a shard pattern: itself when it has an integer field (``out/train-%05d.tar``),
    else the folder's ``part-%05d`` with the format's first suffix (``.tfrecord`` by default)."""
    if _FIELD.search(path):
        return path
    fmt = _writable_format(format, "x-%05d.tfrecord", None, None)
    suffixes = fmt.suffixes if fmt is not None else (".tfrecord",)
    suffix = next((s for s in suffixes if not s.endswith(_COMPRESSED)), suffixes[0])
    return f"{path.rstrip('/')}/part-%05d{suffix}"


def task_pattern(pattern: str, task: int) -> str:
    """The pattern task ``task`` numbers its shards with: the task's number in the field, ``-%05d`` after it."""
    match = _FIELD.search(pattern)
    if match is None:
        raise ValueError(f"pattern must contain one integer field such as %05d, got {pattern!r}")
    prefix, suffix = pattern[: match.start()], pattern[match.end() :]
    return prefix.replace("%", "%%") + match.group() % task + "-%05d" + suffix.replace("%", "%%")


def name_prefix(pattern: str) -> str:
    """The text every file of a run starts with: the pattern before its field."""
    match = _FIELD.search(pattern)
    assert match is not None
    return pattern[: match.start()]


class _TaskWriter(ShardWriter):
    """A ShardWriter for one write task: no manifest of its own (the driver writes the one manifest), and
    never removes one (a task retried after the commit must not touch it); each shard gets its index."""

    def __init__(self, pattern: str, task: int, *, index: bool, **options: Any) -> None:
        super().__init__(task_pattern(pattern, task), **options)
        self.task = task
        self.index = index
        self.written: list[WrittenShard] = []

    def _start(self) -> None:
        self._started = True

    def _finish_shard(self) -> None:
        before = len(self._urls)
        super()._finish_shard()
        if len(self._urls) == before:
            return
        url = self._urls[-1]
        if self.index and self.compression is None and not url.endswith(_COMPRESSED):
            _index_format(self.format).build_index(url)  # written by rename beside the shard
        fs, path = fsspec.core.url_to_fs(url, **(self.storage_options or {}))
        from shardkit.io.identity import identity

        info = fs.info(path)
        self.written.append(WrittenShard(self.task, before, url, self._counts[-1], int(info["size"]), identity(info)))

    def finish(self) -> list[WrittenShard]:
        """Publish the last shard; return every shard this task wrote."""
        self._closed = True
        try:
            self._finish_shard()
        except BaseException:
            self._abort()
            raise
        return self.written


def _index_format(fmt: Any) -> Any:
    """The format whose ``build_index`` indexes a shard: TFRecord's where the writer writes TFRecord itself."""
    if fmt is not None:
        return fmt
    from shardkit.formats.registry import formats

    return formats()["tfrecord"]


class ShardSink(Datasink):
    """A Ray Data ``Datasink`` writing shardkit shards and one manifest: ``ds.write_datasink(ShardSink(...))``.

    ``path`` is a folder (shards ``part-TTTTT-KKKKK<suffix>``, manifest ``manifest.arrow``) or a pattern with
    one integer field (``out/train-%05d.tfrecord``: shards ``out/train-TTTTT-KKKKK.tfrecord``, manifest
    :func:`~shardkit.writer.default_manifest_path`), ``TTTTT`` the write task, ``KKKKK`` its shard. ``format``,
    ``max_records``, ``max_bytes`` and ``compression`` are :class:`~shardkit.ShardWriter`'s. A row becomes one
    record (:func:`record_of`): the value of ``column`` when given, else the row as the format takes it
    (a tf.Example for TFRecord and ArrayRecord); ``to_records(row)`` instead turns a row into any number of
    records. ``index`` writes each shard's index file where the format has one. See the module docstring
    for what happens on failures; after :meth:`on_write_complete`, ``shards`` is the committed ShardList.
    """

    def __init__(
        self,
        path: str,
        *,
        format: Any = None,  # noqa: A002 - ShardWriter's name
        max_records: int | None = None,
        max_bytes: int | None = None,
        compression: str | None = None,
        column: str | None = None,
        to_records: Callable[[dict[str, Any]], Iterable[Any]] | None = None,
        index: bool = True,
        manifest: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.pattern = shard_pattern(path if "://" in path else os.path.abspath(path), format)
        self.options = {
            "format": format, "max_records": max_records, "max_bytes": max_bytes, "compression": compression,
            "storage_options": storage_options,
        }  # fmt: skip
        fmt = ShardWriter(self.pattern, **self.options).format  # checks the options before any task runs
        self.format_name = "tfrecord" if fmt is None else fmt.name
        self.column = column
        self.to_records = to_records
        self.index = index
        if manifest is None:
            folder = path if not _FIELD.search(path) else None
            manifest = f"{folder.rstrip('/')}/manifest.arrow" if folder else default_manifest_path(self.pattern)
        self.manifest = manifest if "://" in manifest else os.path.abspath(manifest)
        self.storage_options = storage_options
        self.shards: Any = None
        self._started = False

    # -- driver: before and after --------------------------------------------------------------

    def on_write_start(self, schema: Any = None) -> None:
        """Refuse an output that holds a manifest or files with this run's names (two runs never mix)."""
        check_empty(self.pattern, self.manifest, self.storage_options)
        self._started = True  # from here on, every file with the run's names is this run's

    def on_write_complete(self, write_result: WriteResult) -> None:
        """Commit: check the returned shards, delete every other file with the run's names, write the manifest."""
        from shardkit.shardlist import ShardList

        written = sorted((s for task in write_result.write_returns for s in task), key=lambda s: (s.task, s.number))
        on_disk = _run_files(self.pattern, self.storage_options)
        for shard in written:
            if on_disk.get(_path(shard.url, self.storage_options)) != shard.size:
                raise ShardkitError(
                    f"{shard.url}: a write task returned it with {shard.size} bytes, but storage has "
                    f"{on_disk.get(_path(shard.url, self.storage_options), 'no such file')}; nothing was committed"
                )
        _remove_unlisted(self.pattern, on_disk, [s.url for s in written], self.storage_options)
        shards = ShardList([s.url for s in written], num_records=[s.num_records for s in written],
                           sizes=[s.size for s in written])  # fmt: skip
        write_manifest(shards, self.manifest, self.storage_options)
        self.shards = shards

    def on_write_failed(self, error: Exception) -> None:
        """Delete every file with this run's names and write no manifest (best effort, as Ray calls it).
        Nothing when the run was refused at its start: those files are an earlier run's."""
        if not self._started:
            return
        on_disk = _run_files(self.pattern, self.storage_options)
        _remove_unlisted(self.pattern, on_disk, [], self.storage_options)

    # -- a write task ---------------------------------------------------------------------------

    @property
    def min_rows_per_write(self) -> int | None:
        """Whole shards per task where rows are records: a task gets at least ``max_records`` rows."""
        return self.options["max_records"] if self.to_records is None else None

    def write(self, blocks: Iterable[Any], ctx: Any) -> list[WrittenShard]:
        """Write this task's rows as shards named by its task index; return what it published."""
        writer = _TaskWriter(self.pattern, ctx.task_idx, index=self.index, **self.options)
        try:
            for record in self._records(blocks):
                writer.write(record)
        except BaseException:
            writer._abort()
            raise
        return writer.finish()

    def _records(self, blocks: Iterable[Any]) -> Iterator[Any]:
        for block in blocks:
            table = BlockAccessor.for_block(block).to_arrow()
            if self.to_records is not None:
                for row in table.to_pylist():
                    yield from self.to_records(row)
            elif self.column is not None:
                yield from table.column(self.column).to_pylist()
            else:
                for row in table.to_pylist():
                    yield record_of(row, self.format_name)


def record_of(row: dict[str, Any], format_name: str) -> Any:
    """The record a Ray row stands for in ``format_name``: a tf.Example for TFRecord and ArrayRecord
    (:func:`~shardkit.formats.example_rows.example_from_row`), the row itself for the others (a tar
    sample, a Parquet row, a JSON object, a Megatron document ``{"input_ids": tokens}``)."""
    if format_name in ("tfrecord", "array_record"):
        from shardkit.formats.example_rows import example_from_row

        return example_from_row(row)
    return row


def write_shards(
    dataset: Any,
    path: str,
    *,
    format: Any = None,  # noqa: A002 - ShardWriter's name
    max_records: int | None = None,
    max_bytes: int | None = None,
    compression: str | None = None,
    column: str | None = None,
    to_records: Callable[[dict[str, Any]], Iterable[Any]] | None = None,
    index: bool = True,
    manifest: str | None = None,
    storage_options: dict[str, Any] | None = None,
    ray_remote_args: dict[str, Any] | None = None,
    concurrency: int | None = None,
) -> Any:
    """Write the ``ray.data.Dataset`` ``dataset`` as shards under ``path`` with one manifest; return the
    committed :class:`~shardkit.ShardList` (urls, record counts, sizes).

    The keywords are :class:`ShardSink`'s, and ``ray_remote_args`` / ``concurrency`` go to
    ``Dataset.write_datasink`` (``{"retry_exceptions": [OSError]}`` retries failed write tasks on I/O errors;
    Ray always retries a task whose worker or node died). An output holding a manifest or files with the
    run's names is refused before anything is written (:class:`DatasetExistsError`).
    """
    sink = ShardSink(
        path, format=format, max_records=max_records, max_bytes=max_bytes, compression=compression,
        column=column, to_records=to_records, index=index, manifest=manifest, storage_options=storage_options,
    )  # fmt: skip
    check_empty(sink.pattern, sink.manifest, storage_options)  # before Ray computes anything
    dataset.write_datasink(sink, ray_remote_args=ray_remote_args, concurrency=concurrency)
    return sink.shards


# --------------------------------------------------------------------------- the run's files


def check_empty(pattern: str, manifest: str, storage_options: dict[str, Any] | None) -> None:
    """Raise :class:`DatasetExistsError` if ``manifest`` or any file with the run's name prefix exists."""
    fs, manifest_path = fsspec.core.url_to_fs(manifest, **(storage_options or {}))
    found = sorted(_run_files(pattern, storage_options))
    if fs.exists(manifest_path):
        found.insert(0, manifest_path)
    if found:
        raise DatasetExistsError(
            f"{name_prefix(pattern)}*: the output already holds {len(found)} file(s) of a dataset "
            f"(first {found[0]}); write into an empty place, or delete them first, so that two runs never mix"
        )


def _run_files(pattern: str, storage_options: dict[str, Any] | None) -> dict[str, int]:
    """Every file whose name starts with the run's prefix, path (as the filesystem lists it) -> size."""
    fs, path = fsspec.core.url_to_fs(name_prefix(pattern), **(storage_options or {}))
    folder = path.rsplit("/", 1)[0] if "/" in path else "."
    if not fs.isdir(folder):
        return {}
    fs.invalidate_cache(folder)  # an object store's listing cache would hide the tasks' files
    return {
        info["name"]: int(info.get("size") or 0)
        for info in fs.ls(folder, detail=True)
        if info["name"].startswith(path) and info.get("type") == "file"
    }


def _path(url: str, storage_options: dict[str, Any] | None) -> str:
    return fsspec.core.url_to_fs(url, **(storage_options or {}))[1]


def _remove_unlisted(
    pattern: str, on_disk: dict[str, int], urls: list[str], storage_options: dict[str, Any] | None
) -> None:
    """Delete every file of ``on_disk`` that is not a listed shard, its index or its Megatron companion."""
    fs = fsspec.core.url_to_fs(pattern, **(storage_options or {}))[0]
    keep = set()
    for url in urls:
        path = _path(url, storage_options)
        keep.update((path, path + ".idx", re.sub(r"\.bin$", ".idx", path)))
    for path in sorted(set(on_disk) - keep):
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)
