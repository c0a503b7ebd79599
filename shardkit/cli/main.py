"""The ``shardkit`` command line: one sub-command per job.

Each sub-command is a ``_cmd_<name>(args) -> int`` function registered in
:func:`build_parser`; heavy imports happen inside the function so that
``shardkit --help`` stays fast.

Errors are for people and scripts alike: each is one line on stderr,
``shardkit <command>: error: <what, where>``, never a traceback (the global
``--traceback`` option shows one, for bug reports), and the exit code says
what happened (:data:`EXIT_CODES`). Commands that take several files check
every one even after a failure, report each bad one on its own line, and exit
with the worst outcome. Argument errors go through the same one-line format
(:class:`_Parser`), with argparse's exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from shardkit.errors import CorruptRecordError, ShardkitError, redact

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool its reader stopped reading (`... | head`)

EXIT_CODES = f"""\
exit codes:
  {EXIT_OK}    success
  {EXIT_CORRUPT}    corrupt data found: a bad CRC, a truncated record, damaged compression
       (each bad file is reported with its url, record index and byte offset)
  {EXIT_USAGE}    usage error or unreadable input: bad arguments, a missing file, a
       directory, a glob matching nothing, an unreadable or malformed manifest
       or index; 2 wins over 1 when both happen
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
  {EXIT_PIPE}  the output pipe closed early (`shardkit verify ... | head`): stops quietly
errors are single lines on stderr: "shardkit <command>: error: <message>"
"""

_GLOB_CHARS = re.compile(r"[*?\[{]")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, like every other error."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def _one_line(text: str) -> str:
    """``text`` with its line breaks folded, so that one error stays one line."""
    return re.sub(r"\s*[\r\n]+\s*", " | ", text.strip()) or "(no message)"


_OS_REASONS: dict[type, str] = {
    FileNotFoundError: "no such file or directory",
    FileExistsError: "exists and is not a directory",
    IsADirectoryError: "is a directory; give files, or a glob such as 'dir/*.tfrecord'",
    NotADirectoryError: "a part of the path is not a directory",
    PermissionError: "permission denied",
}


def describe_error(error: BaseException, where: str | None = None) -> str:
    """One line saying what went wrong and where: the url, and for corrupt data the
    record index and byte offset the error carries."""
    if isinstance(error, OSError) and not isinstance(error, ShardkitError):
        where = getattr(error, "filename", None) or where
        reason = _OS_REASONS.get(type(error)) or error.strerror or f"{type(error).__name__}: {error}"
    elif isinstance(error, ShardkitError):
        reason = str(error)
    else:
        reason = f"{type(error).__name__}: {error}"
    if where and str(where) not in reason:
        reason = f"{where}: {reason}"
    return _one_line(reason)


def exit_code_of(error: BaseException) -> int:
    """:data:`EXIT_CORRUPT` for corrupt data or data that contradicts its manifest or
    index, :data:`EXIT_USAGE` for anything else."""
    return EXIT_CORRUPT if isinstance(error, (CorruptRecordError, MismatchError)) else EXIT_USAGE


def _fail(args: argparse.Namespace, error: BaseException, where: str | None = None) -> int:
    """Report ``error`` as one line on stderr and return its exit code."""
    if getattr(args, "traceback", False):
        traceback.print_exception(type(error), error, error.__traceback__)
    print(f"shardkit {args.command}: error: {redact(describe_error(error, where))}", file=sys.stderr)
    return exit_code_of(error)


def _expand(pattern: str) -> list[str]:
    """The files ``pattern`` names: itself, or the sorted matches of a glob (``*?[`` or ``{a,b}``)."""
    if not _GLOB_CHARS.search(pattern):
        return [pattern]
    from shardkit.shardlist import ShardList

    return ShardList.from_glob(pattern).urls()


def _each_file(args: argparse.Namespace, job: Callable[[str], Any], listed: Sequence[str] = ()) -> int:
    """Run ``job(url)`` on every file in ``listed`` (taken literally) and every file
    ``args.urls`` names, even after failures; report each failure on its own line
    and return the worst exit code."""
    status = _run_each(args, job, listed)
    for pattern in args.urls:
        try:
            urls = _expand(pattern)
        except Exception as error:  # noqa: BLE001 - reported, then the next pattern
            status = max(status, _fail(args, error, pattern))
            continue
        status = max(status, _run_each(args, job, urls))
    return status


def _run_each(args: argparse.Namespace, job: Callable[[str], Any], urls: Sequence[str]) -> int:
    status = EXIT_OK
    for url in urls:
        try:
            if not _skipped(url):
                job(url)
        except Exception as error:  # noqa: BLE001 - one line per bad file, then the next
            if isinstance(error, BrokenPipeError) and _stdout_closed():
                raise  # nobody reads on: main ends quietly
            status = max(status, _fail(args, error, url))
    return status


def _skipped(url: str) -> bool:
    """Whether ``url`` is an index or manifest file, not shard data (say so): a glob such as
    ``data/*`` picks them up beside the shards, and they are not corrupt shards."""
    from shardkit.formats.sniff import SNIFF_BYTES, not_a_shard
    from shardkit.io.files import open_raw

    head = b""
    if "://" not in url or url.startswith("file://"):  # a remote file is not opened twice: its suffix decides
        try:
            with open_raw(url, "rb") as f:
                head = f.read(SNIFF_BYTES)
        except OSError:
            return False  # the command's own reading reports it
    what = not_a_shard(url, head)
    if what is not None:
        print(f"skipped {url}: {what}")
    return what is not None


# --------------------------------------------------------------------------- demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from shardkit.cli.demo import run_demo

    return run_demo(workdir=args.workdir)


# --------------------------------------------------------------------------- plan


def _cmd_plan(args: argparse.Namespace) -> int:
    try:
        shards, counts_from = _load_shards(args.source)
    except Exception as error:  # noqa: BLE001 - named after the source, then main's one line
        return _fail(args, error, args.source)
    options = {"seed": args.seed, "epoch": args.epoch, "shuffle": args.shuffle, "balance": args.balance}
    text = format_plan(shards, args.world_size, args.num_workers, show=args.show, **options)
    print(f"record counts: {counts_from}")
    print(text)
    return EXIT_OK


def _load_shards(source: str) -> tuple[Any, str]:
    """The ShardList ``source`` names (a glob, else a manifest) and where its counts came from."""
    from shardkit.shardlist import ShardList

    if not _GLOB_CHARS.search(source) and not _is_shard_file(source):
        return ShardList.from_manifest(source), "from the manifest"
    shards = ShardList.from_glob(source)
    counts = _index_counts(shards.urls())
    found = sum(count is not None for count in counts)
    if found == 0:
        return shards, "unknown (no index files; write them with `shardkit index`)"
    return shards.with_num_records(counts), f"from index files ({found} of {_plural(len(counts), 'shard')})"


def _is_shard_file(source: str) -> bool:
    """Whether ``source`` is a TFRecord or tar shard (planned as a list of one) rather than a manifest.

    Parquet and JSON lines files stay manifests: both formats hold manifests too.
    """
    from shardkit.formats.base import FormatError
    from shardkit.formats.registry import format_for
    from shardkit.formats.sniff import SNIFF_BYTES
    from shardkit.io.files import open_raw

    try:
        with open_raw(source, "rb") as f:
            fmt = format_for(source, f.read(SNIFF_BYTES))
    except (OSError, FormatError):
        return False  # reading it as a manifest reports what is wrong
    return fmt.name in ("tfrecord", "tar")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _index_counts(urls: list[str]) -> list[int | None]:
    """Each file's record count from the index file beside it, None where there is none.

    Each index is checked against its file (:func:`~shardkit.formats.index.load_index`):
    a stale or corrupt one is an error naming both files, never a wrong count.
    """
    import posixpath

    import fsspec

    from shardkit.formats.offsets import implicit_index_for

    located = {url: implicit_index_for(url) for url in urls}  # None: a url with a query string has no index
    indexes = {url: (index, *fsspec.core.url_to_fs(index)) for url, index in located.items() if index is not None}
    by_directory: dict[Any, set[str]] = {}
    for _, fs, path in indexes.values():
        by_directory.setdefault((fs, posixpath.dirname(path)), set()).add(path)
    present: set[str] = set()
    for (fs, directory), wanted in by_directory.items():
        try:  # one listing per directory rather than one request per file
            present.update(wanted.intersection(fs.ls(directory, detail=False)))
        except Exception:  # noqa: BLE001 - a store that cannot list (plain HTTP): ask per file
            present.update(path for path in wanted if fs.isfile(path))
    none = ("", None, "")
    return [_indexed_count(url, indexes.get(url, none)[0], indexes.get(url, none)[2] in present) for url in urls]


def _indexed_count(url: str, index: str, present: bool) -> int | None:
    """``url``'s record count without reading its records: its index file (checked against the file), or a
    Parquet footer."""
    from shardkit.formats.tfrecord.index import load_index

    fmt = _named_format(url)
    if fmt is not None and fmt.name == "parquet":
        return fmt.count(url)
    if not present:
        return None
    if fmt is not None and hasattr(fmt, "index_offsets"):
        offsets = fmt.index_offsets(url)
        return None if offsets is None else len(offsets)
    offsets = load_index(url, index)
    return None if offsets is None else len(offsets)


def _named_format(url: str) -> Any:
    """The format ``url``'s suffix names, other than TFRecord (which this module reads itself); None otherwise."""
    from shardkit.formats.base import FormatError
    from shardkit.formats.registry import format_for

    try:
        fmt = format_for(url, head=b"")
    except FormatError:
        return None
    return None if fmt.name == "tfrecord" else fmt


def _format_of(url: str) -> Any:
    """The format of the file at ``url`` (suffix, then first bytes), None for TFRecord or unknown."""
    from shardkit.formats.base import FormatError
    from shardkit.formats.registry import format_for

    try:
        fmt = format_for(url)
    except FormatError:
        return None  # TFRecord, perhaps compressed: its reader says what is wrong
    return None if fmt.name == "tfrecord" else fmt


def format_plan(shards: Any, world_size: int, num_workers: int, *, show: int = 3, **options: Any) -> str:
    """A table of who reads what: each reader's record count and first ranges."""
    from shardkit.planning import plan
    from shardkit.topology import Topology

    counts = shards.table.column("num_records")
    known = counts.null_count == 0
    lines = [
        f"{_plural(len(shards), 'shard')}, {shards.total_records if known else 'unknown'} records; "
        f"world_size={world_size}, num_workers={num_workers}, " + ", ".join(f"{k}={v}" for k, v in options.items()),
        f"{'rank':>4} {'worker':>6} {'records':>10} {'ranges':>7}  first ranges",
    ]
    rank_totals = []
    for rank in range(world_size):
        rank_total = 0
        for worker in range(num_workers):
            ranges = plan(counts, Topology(rank, world_size, worker, num_workers), **options)
            sizes = [r.stop - r.start for r in ranges if r.stop is not None]
            rank_total += sum(sizes)
            shown = ", ".join(
                f"{_shown_path(shards[r.shard])}[{r.start}:{'' if r.stop is None else r.stop}]" for r in ranges[:show]
            )
            more = f" ... (+{len(ranges) - show})" if len(ranges) > show else ""
            records = str(sum(sizes)) if len(sizes) == len(ranges) else "?"
            lines.append(f"{rank:>4} {worker:>6} {records:>10} {len(ranges):>7}  {shown}{more}")
        rank_totals.append(rank_total)
    if known:
        lines.append("records per rank: " + ", ".join(str(t) for t in rank_totals))
    return "\n".join(lines)


def _shown_path(url: str) -> str:
    """``url`` as the plan prints it: a local file relative to the working directory when under it, so
    that a wrong directory shows (``data/data/t-00000.tfrecord``); anything else in full."""
    if "://" in url or not os.path.isabs(url):
        return url
    relative = os.path.relpath(url)
    return url if relative.startswith("..") else relative


# --------------------------------------------------------------------------- progress


def _progress_bar(url: str, compression: str | None, storage_options: dict | None = None) -> Any:
    """A tqdm bar over a TFRecord file's bytes (total unknown if it is compressed)."""
    import fsspec
    from tqdm import tqdm

    if compression == "auto":
        compression = _detect_compression(url)
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    total = fs.size(path) if compression is None else None
    return tqdm(total=total, unit="B", unit_scale=True, desc=url, leave=True, disable=None)


def _detect_compression(url: str) -> str | None:
    from shardkit.formats.tfrecord import detect_compression
    from shardkit.io.files import open_raw

    with open_raw(url, "rb") as raw:
        return detect_compression(raw.read(12))


def _with_progress(url: str, compression: str | None, job: Callable[[Callable[[int], None]], Any]) -> Any:
    """Run ``job(progress)`` with a progress bar that ``progress(bytes_done)`` advances."""
    with _progress_bar(url, compression) as bar:
        return job(lambda done: bar.update(done - bar.n))


# --------------------------------------------------------------------------- inspect

Schema = dict[str, tuple[str, int, int]]  # feature name -> (kind, fewest values, most values)


def _kind(value: Any) -> str:
    import numpy as np

    if isinstance(value, np.ndarray):
        return "int64" if value.dtype == np.int64 else "float"
    return "bytes" if value else "empty"


def _add_to_schema(schema: Schema, name: str, kind: str, size: int) -> None:
    old_kind, low, high = schema.get(name, (kind, size, size))
    if kind not in old_kind.split("|"):
        kind = f"{old_kind}|{kind}"
    else:
        kind = old_kind
    schema[name] = (kind, min(low, size), max(high, size))


def _feature_schema(records: list[bytes]) -> Schema:
    """Feature name -> (kind, fewest values, most values) over tf.Example records."""
    from shardkit.formats.example import decode_example

    schema: Schema = {}
    for record in records:
        for name, value in decode_example(record).items():
            _add_to_schema(schema, name, _kind(value), len(value))
    return schema


def _sequence_schema(records: list[bytes]) -> tuple[Schema, Schema, Schema] | None:
    """(context schema, feature-list schema per step, steps per list) over
    tf.SequenceExample records; None unless at least one has a feature list.

    An Example decodes as a SequenceExample without feature lists (both keep
    their features in field 1), so the lists are what tells the two apart.
    """
    from shardkit.formats.example import decode_sequence_example

    context: Schema = {}
    lists: Schema = {}
    steps: Schema = {}
    for record in records:
        features, feature_lists = decode_sequence_example(record)
        for name, value in features.items():
            _add_to_schema(context, name, _kind(value), len(value))
        for name, values in feature_lists.items():
            _add_to_schema(steps, name, "steps", len(values))
            for value in values:
                _add_to_schema(lists, name, _kind(value), len(value))
    return (context, lists, steps) if steps else None


def _schema_lines(schema: Schema, indent: str, steps: Schema | None = None) -> list[str]:
    width = max([7, *map(len, schema)])
    lines = []
    for name, (kind, low, high) in sorted(schema.items()):
        count = str(low) if low == high else f"{low}..{high}"
        line = f"{indent}{name:<{width}}  {kind:<6} x {count}"
        if steps is not None:
            _, first, last = steps[name]
            line += f" per step, {first if first == last else f'{first}..{last}'} steps"
        lines.append(line)
    return lines


def _message_lines(records: list[bytes]) -> list[str]:
    """What the first records are: tf.SequenceExample, tf.Example, or neither."""
    label = f"the first {len(records)} records"
    try:
        sequence = _sequence_schema(records)
    except ShardkitError:
        sequence = None
    if sequence is not None:
        context, lists, steps = sequence
        return [
            f"{label} are tf.SequenceExample messages",
            "  context features:",
            *(_schema_lines(context, "    ") or ["    (none)"]),
            "  feature lists:",
            *(_schema_lines({n: lists.get(n, ("empty", 0, 0)) for n in steps}, "    ", steps)),
        ]
    try:
        schema = _feature_schema(records)
    except ShardkitError:
        return [f"{label} are neither tf.Example nor tf.SequenceExample messages"]
    return [f"{label} are tf.Example messages; features:", *_schema_lines(schema, "  ")]


def _inspect_format(url: str, fmt: Any, args: argparse.Namespace) -> None:
    """Inspect a tar, Parquet or JSON lines file: read (and so check) every record, describe the first."""
    count = 0
    first: Any = None
    for record in fmt.read(url):
        count += 1
        if first is None:
            first = record
    checks = {"tar": "every header checksum", "parquet": "every row group decoded", "jsonl": "every line parsed"}
    print(f"{url}: {count} records; format: {fmt.name}; {checks.get(fmt.name, 'every record read')}")
    if first is not None:
        print(f"first record: {_describe(first)}")


def _describe(record: Any) -> str:
    """The shape of a record: a dict's keys with their value types (and sizes of bytes), else its type."""
    if isinstance(record, dict):
        parts = []
        for key, value in record.items():
            size = f"[{len(value)}]" if isinstance(value, (bytes, str, list)) else ""
            parts.append(f"{key}: {type(value).__name__}{size}")
        return "{" + ", ".join(parts) + "}"
    return type(record).__name__


def _inspect_one(url: str, args: argparse.Namespace) -> None:
    from shardkit.formats.tfrecord import read_tfrecord

    fmt = _format_of(url)
    if fmt is not None:
        return _inspect_format(url, fmt, args)

    if args.compression == "auto":
        compression, how = _detect_compression(url), "detected"
    else:
        compression, how = args.compression, "given"
    verify = not args.no_verify
    count = total = 0
    smallest, largest = None, 0
    first: list[bytes] = []
    for record in read_tfrecord(url, compression=compression, verify=verify):
        count += 1
        total += len(record)
        smallest = len(record) if smallest is None else min(smallest, len(record))
        largest = max(largest, len(record))
        if len(first) < args.records:
            first.append(record)
    checked = "every length and data CRC checked" if verify else "CRCs NOT checked (--no-verify)"
    print(f"{url}: {count} records, {total} data bytes; compression: {compression or 'none'} ({how}); {checked}")
    if count:
        print(f"record size: min {smallest}, mean {total / count:.1f}, max {largest} bytes")
    if first:
        print("\n".join(_message_lines(first)))


def _cmd_inspect(args: argparse.Namespace) -> int:
    return _each_file(args, lambda url: _inspect_one(url, args))


# --------------------------------------------------------------------------- verify, index


class MismatchError(ShardkitError):
    """A file contradicts what its manifest or index file says about it."""


def _cmd_verify(args: argparse.Namespace) -> int:
    from shardkit.shardlist import ShardList

    expected: dict[str, tuple[int | None, int | None]] = {}
    if args.manifest:
        try:
            shards = ShardList.from_manifest(args.manifest)
        except Exception as error:  # noqa: BLE001 - one line, exit 2
            return _fail(args, error, args.manifest)
        counts, sizes = (shards.table.column(name).to_pylist() for name in ("num_records", "size"))
        expected = dict(zip(shards.urls(), zip(counts, sizes)))
    return _each_file(args, lambda url: _verify_one(url, args, *expected.get(url, (None, None))), listed=list(expected))


def _verify_one(url: str, args: argparse.Namespace, count: int | None, size: int | None) -> None:
    """Check every CRC of ``url``, then its record count against the manifest and its index file."""
    import fsspec

    from shardkit.formats.tfrecord import verify_tfrecord

    where = f"the manifest {args.manifest}"
    fs, path = fsspec.core.url_to_fs(url)
    if size is not None and (actual := fs.size(path)) != size:
        raise MismatchError(f"{url}: {actual} bytes, but {where} says {size}; the file changed since it was listed")
    fmt = _format_of(url)
    if fmt is not None:  # tar, Parquet, JSON lines: reading every record checks it
        found = sum(1 for _ in fmt.read(url))
    else:
        found = _with_progress(
            url,
            args.compression,
            lambda progress: verify_tfrecord(url, compression=args.compression, progress=progress),
        )
    if count is not None and found != count:
        raise MismatchError(f"{url}: {found} records, but {where} says {count}")
    indexed = _index_counts([url])[0]
    if indexed is not None and found != indexed:
        raise MismatchError(
            f"{url}: {found} records, but its index file says {indexed}; rebuild it with shardkit index"
        )
    checked = " (count matches the manifest)" if count is not None else ""
    print(f"ok {url}: {found} records{checked}")


def _cmd_index(args: argparse.Namespace) -> int:
    return _each_file(args, lambda url: _index_one(url, args))


def _index_one(url: str, args: argparse.Namespace) -> None:
    """Write ``url``'s index (each format writes its own by rename); Parquet needs none."""
    fmt = _format_of(url)
    if fmt is None:
        print(f"{url} -> {_write_index(url, args.compression)}")
        return
    target = fmt.build_index(url)
    if target is None:
        print(f"{url}: a {fmt.name} file needs no index (its footer holds the counts); footer checked")
    else:
        print(f"{url} -> {target}")


def _write_index(url: str, compression: str | None) -> str:
    """Build ``url``'s index under a temporary name and rename it into place: a reader
    never finds a partial index, and a corrupt file leaves the old index (if any) alone."""
    from shardkit.formats.offsets import index_path_for
    from shardkit.formats.tfrecord.index import build_index
    from shardkit.writer import partial_name, publish, remove_if_present

    target = index_path_for(url)
    partial = partial_name(target)
    try:
        _with_progress(
            url, compression, lambda progress: build_index(url, partial, compression=compression, progress=progress)
        )
        publish(partial, target, None)
    finally:
        remove_if_present(partial, None)
    return target


# --------------------------------------------------------------------------- convert


def _cmd_convert(args: argparse.Namespace) -> int:
    """Read every record of SRC's files in order and write them as DST shards, with a manifest."""
    from tqdm import tqdm

    from shardkit.formats.registry import format_for, formats
    from shardkit.writer import ShardWriter

    # A local pattern is made absolute so that the manifest's urls do not depend on where it is read from.
    pattern = args.pattern if "://" in args.pattern else os.path.abspath(args.pattern)
    try:
        urls = _expand(args.source)
        readers = [(url, format_for(url)) for url in urls]
        writer = ShardWriter(pattern, format=args.format, max_records=args.max_records, max_bytes=args.max_bytes)
    except Exception as error:  # noqa: BLE001 - one line, exit 2
        return _fail(args, error, args.source)
    target = formats()[args.format]
    try:
        convert = _record_converter(args.decode, readers, target.name)
    except Exception as error:  # noqa: BLE001 - one line, exit 2
        return _fail(args, error, args.source)
    count = 0
    with tqdm(unit=" records", desc=f"{args.source} -> {args.format}", leave=True, disable=None) as bar, writer:
        for url, fmt in readers:
            for record in fmt.read(url):
                writer.write(convert(record, count, url, fmt.name))
                count += 1
                bar.update()
    shards = writer.shards
    assert shards is not None
    print(f"{count} records from {len(urls)} files -> {len(shards)} {args.format} shards; manifest {writer.manifest}")
    return EXIT_OK


class ConvertError(ShardkitError):
    """A record has no faithful form in the target format."""


_PEEK = 100  # records of the first TFRecord file that decide --decode and the Parquet columns


def _record_converter(decode: str | None, readers: list[tuple[str, Any]], target: str) -> Callable[..., Any]:
    """``convert(record, n, url, source_format)``: with ``decode`` "example" (the default when the first
    TFRecord records decode as tf.Examples, or when writing TFRecord from another format), tf.Example
    features become fields and back (:mod:`shardkit.formats.example_rows`); otherwise records stay opaque."""
    import itertools

    from shardkit.formats import example_rows as rows

    first = next((url for url, fmt in readers if fmt.name == "tfrecord"), None)
    peek: list[Any] = []
    if target == "tfrecord":
        examples = decode != "raw"
    elif first is None or decode == "raw":
        examples = False
    else:
        from shardkit.formats.tfrecord import read_tfrecord

        peek = list(itertools.islice(read_tfrecord(first), _PEEK))
        examples = decode == "example" or rows.looks_like_examples(peek[:10])
        if examples and not rows.looks_like_examples(peek):
            raise ConvertError(f"{first}: the first records are not all tf.Examples; use --decode raw")
    scalars = rows.scalar_features(peek) if examples and target in ("parquet", "jsonl") else frozenset()

    def convert(record: Any, n: int, url: str, source: str) -> Any:
        if not examples or (source == "tfrecord") == (target == "tfrecord"):
            return _converted(record, n, url, target)
        try:
            if target == "tar":
                return rows.sample_from_example(record, f"{n:09d}")
            if target != "tfrecord":
                return rows.row_from_example(record, scalars, json_lines=target == "jsonl")
            if source == "tar":
                return rows.example_from_sample(record)
            return rows.example_from_row(record if isinstance(record, dict) else {"value": record})
        except ShardkitError as error:
            raise ConvertError(f"{url}: record {n}: {error}") from None

    return convert


def _converted(record: Any, n: int, url: str, target: str) -> Any:
    """``record`` (as its source format's reader yields it) as the ``target`` format's writer takes it.

    Tar samples keep their key (others get their running number); dict values
    that are neither bytes nor text go into a tar as JSON; a TFRecord record
    becomes ``{"record": bytes}`` in Parquet; JSON lines take text only.
    """
    if target == "tfrecord":
        if isinstance(record, (bytes, bytearray)):
            return record
        raise ConvertError(
            f"{url}: record {n} is a {type(record).__name__}; TFRecord shards are written from TFRecord (bytes) only"
        )
    if not isinstance(record, dict):
        record = {"record": record} if isinstance(record, (bytes, bytearray)) else {"value": record}
    if target == "tar":
        sample = {"__key__": record.get("__key__") or f"{n:09d}"}
        for key, value in record.items():
            if not key.startswith("__"):
                sample[key] = value if isinstance(value, (bytes, str)) else json.dumps(value).encode()
        return sample
    row = {key: value for key, value in record.items() if key != "__url__"}
    if target == "jsonl":
        for key, value in row.items():
            if isinstance(value, (bytes, bytearray)):
                try:
                    row[key] = bytes(value).decode("utf-8")
                except UnicodeDecodeError:
                    raise ConvertError(
                        f"{url}: record {n} holds bytes in {key!r} that are not UTF-8 text; JSON lines hold text: "
                        "convert to tar or parquet instead"
                    ) from None
    return row


# --------------------------------------------------------------------------- the parser


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, not {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _compression_arg(value: str) -> str | None:
    value = value.lower()
    if value not in ("auto", "none", "gzip", "zlib"):
        raise argparse.ArgumentTypeError(f"expected auto, none, gzip or zlib, not {value!r}")
    return None if value == "none" else value


def _add_compression_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compression",
        default="auto",
        type=_compression_arg,
        help="auto (default: detect from the first bytes), none, gzip or zlib",
    )


def _add_urls(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument(
        "urls",
        nargs="+" if required else "*",
        metavar="URL",
        help="shard files (TFRecord, WebDataset tar, Parquet, JSON lines; the format is detected by extension, "
        "then magic bytes): paths, fsspec URLs (s3://, gs://, https://...) or quoted globs such as "
        "'data/train-*.tfrecord' or 'data/train-{00000..00127}.tar'",
    )


def _sub(sub: Any, name: str, summary: str, description: str, exits: str) -> argparse.ArgumentParser:
    return sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=textwrap.fill(f"exit codes: {exits}", 79),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


_MANIFEST_HELP = """\
SOURCE is a manifest, a quoted glob of shard files, or one TFRecord or tar file.

A manifest lists the shards and their record counts: an Arrow IPC, Parquet or
JSON-lines file with a "url" column and optional "num_records" and "size"
columns (relative urls resolve against the manifest's directory; ShardWriter and
to_manifest store local shards that way, so a manifest reads the same from any
working directory). ShardWriter
writes one beside the shards it writes (train-%05d.tfrecord ->
train.manifest.arrow); ShardList(urls, num_records=...).to_manifest(path) writes
one for shards you already have.

A glob (it contains * ? [ or {a,b} / {000..127}) lists the files; their record
counts come from the index files beside them (`shardkit index` writes them).
Without counts only --balance none can be planned: whole shards are dealt out.
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``shardkit`` console script."""
    from shardkit._version import __version__

    parser = _Parser(
        prog="shardkit",
        description="shardkit: plan, inspect, verify, index and convert the shard files of a PyTorch pipeline "
        "(TFRecord, WebDataset tar, Parquet, JSON lines). Also runs as `python -m shardkit`.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    parser.add_argument("--traceback", action="store_true", help="also print the traceback of errors (bug reports)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = _sub(
        sub,
        "demo",
        "write a small dataset to a temp dir and show shardkit at work",
        "Write 6 TFRecord shards and a manifest, print the plan for 2 ranks x 2 workers, read them "
        "through DataLoaders and check that every rank gets the same number of batches.",
        "0 the demo's checks passed; 1 a check failed (a bug: please report it); "
        "2 bad arguments, or --workdir cannot be used (a file, not writable)",
    )
    demo.add_argument("--workdir", default=None, help="where to write the data (default: a temp dir)")
    demo.set_defaults(func=_cmd_demo)

    plan_cmd = _sub(
        sub,
        "plan",
        "print who reads what: each rank's and worker's record ranges",
        "Print each rank's and DataLoader worker's record ranges.\n\n" + _MANIFEST_HELP,
        "0 the plan was printed; 2 bad arguments, SOURCE cannot be read (missing, a directory, "
        "malformed, a glob matching nothing), or a balanced plan lacks record counts. "
        "plan reads no shard data, so it never exits 1.",
    )
    plan_cmd.add_argument(
        "source", metavar="SOURCE", help="a shard manifest, a quoted glob of shard files, or one shard file"
    )
    plan_cmd.add_argument("--world-size", type=_int_at_least(1), default=1, help="number of DDP ranks (default 1)")
    plan_cmd.add_argument(
        "--num-workers", type=_int_at_least(1), default=1, help="DataLoader workers per rank (default 1)"
    )
    plan_cmd.add_argument("--balance", choices=("none", "pad", "drop"), default="pad")
    plan_cmd.add_argument("--seed", type=_int_at_least(0), default=0)
    plan_cmd.add_argument("--epoch", type=_int_at_least(0), default=0)
    plan_cmd.add_argument("--shuffle", action="store_true")
    plan_cmd.add_argument("--show", type=_int_at_least(0), default=3, help="ranges to print per reader (default 3)")
    plan_cmd.set_defaults(func=_cmd_plan)

    inspect_cmd = _sub(
        sub,
        "inspect",
        "record count, sizes and schema of shard files (tar, Parquet, JSON lines, TFRecord)",
        "Read every record (checking CRCs unless --no-verify); print the count, sizes and compression, and "
        "whether the first records are tf.Example or tf.SequenceExample messages, with their features.",
        "0 every file was read; 1 corrupt data found (url, record index, byte offset on stderr); "
        "2 bad arguments or an input cannot be read. Every file is inspected even after a failure.",
    )
    _add_urls(inspect_cmd)
    inspect_cmd.add_argument(
        "--records", type=_int_at_least(0), default=10, help="records to read the schema from (default 10)"
    )
    inspect_cmd.add_argument("--no-verify", action="store_true", help="skip the CRC checks (faster; says so)")
    _add_compression_option(inspect_cmd)
    inspect_cmd.set_defaults(func=_cmd_inspect)

    verify_cmd = _sub(
        sub,
        "verify",
        "check every record of shard files (tar, Parquet, JSON lines, TFRecord); exit 1 on corruption",
        "Check every length and data CRC of every file, and that each holds the record count its "
        "manifest (--manifest) or index file gives. Each bad file is reported on its own line with "
        "the record index and byte offset of the damage, and the remaining files are still checked.",
        "0 every file is sound; 1 at least one file is corrupt, or contradicts its manifest or index "
        "file (record count, byte size); 2 bad arguments or an input cannot be read (2 wins over 1).",
    )
    _add_urls(verify_cmd, required=False)
    verify_cmd.add_argument(
        "--manifest",
        help="also verify every shard this manifest lists, and that each holds the record count "
        "and byte size the manifest gives",
    )
    _add_compression_option(verify_cmd)
    verify_cmd.set_defaults(func=_cmd_verify)

    index_cmd = _sub(
        sub,
        "index",
        "write an index file (record byte offsets) beside each shard file (tar, JSON lines, TFRecord)",
        "Write <file>.idx beside each file: the byte offset of every record (length CRCs checked), "
        "written under a temporary name and renamed into place.",
        "0 every index was written; 1 a file is corrupt (no index written for it); 2 bad arguments or "
        "an input cannot be read (2 wins over 1). Every file is indexed even after a failure.",
    )
    _add_urls(index_cmd)
    _add_compression_option(index_cmd)
    index_cmd.set_defaults(func=_cmd_index)

    convert_cmd = _sub(
        sub,
        "convert",
        "rewrite shard files in another format (tfrecord, tar, parquet, jsonl), with a manifest",
        "Read every record of the files SRC names (a path or a quoted glob; each file's format detected "
        "by extension and magic bytes), in order, and write them into shards DST_PATTERN % 0, % 1, ... "
        "of --format, rolled over by --max-records / --max-bytes, each published by rename, then the "
        "manifest with the record counts. Tar samples keep their keys; rows and lines get their running "
        "number as key. tf.Example features become columns, fields or members (see --decode), and back.",
        "0 converted; 1 a source file is corrupt (url, record index, byte offset on stderr; no manifest "
        "is written); 2 bad arguments, an unreadable source, or a record the target format cannot hold.",
    )
    convert_cmd.add_argument("source", metavar="SRC", help="a shard file or a quoted glob of them")
    convert_cmd.add_argument(
        "pattern", metavar="DST_PATTERN", help="output shards, with an integer field: 'out/train-%%05d.tar'"
    )
    convert_cmd.add_argument("--format", required=True, choices=("tfrecord", "tar", "parquet", "jsonl"))
    convert_cmd.add_argument(
        "--decode",
        choices=("example", "raw"),
        default=None,
        help="example: tf.Example features become Parquet columns, JSON fields or tar members, and are "
        "encoded back into tf.Examples when writing TFRecord; raw: TFRecord records stay opaque bytes "
        "(a 'record' column or member). Default: example when the first TFRecord records are tf.Examples",
    )
    convert_cmd.add_argument("--max-records", type=_int_at_least(1), default=None, help="records per shard at most")
    convert_cmd.add_argument("--max-bytes", type=_int_at_least(1), default=None, help="bytes per shard, about")
    convert_cmd.set_defaults(func=_cmd_convert)
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; a usage error exits 2 with one line naming the sub-command it concerns."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = subparsers.choices[args.command]
    if extra:  # argparse would blame the top-level parser: "shardkit: error: ..."
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "verify" and not args.urls and not args.manifest:
        command.error("give URL arguments, --manifest, or both")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardkit`` console script; returns the exit code (:data:`EXIT_CODES`)."""
    args = _parse(argv)
    try:
        return int(args.func(args) or EXIT_OK)
    except KeyboardInterrupt:
        print(f"shardkit {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - one line, never a traceback (unless --traceback)
        if isinstance(error, BrokenPipeError) and _stdout_closed():
            return _closed_pipe()
        return _fail(args, error)


def _stdout_closed() -> bool:
    """Whether a BrokenPipeError came from stdout (its reader, ``head`` say, has exited) rather than from
    a socket: the write end of a pipe without a reader polls as an error (POLLERR)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or stdout is no file
        return False


def _closed_pipe() -> int:
    """End quietly after stdout's reader went away, as command-line tools do on SIGPIPE: point stdout
    at /dev/null so that flushing it at exit does not print "Exception ignored ... BrokenPipeError"."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_PIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
