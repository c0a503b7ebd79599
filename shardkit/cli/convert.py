"""``shardkit convert``: rewrite shard files in another format, with a manifest.

A Lance destination (``--format lance``) is one new dataset directory, not a
series of shards: written whole beside its name and renamed into place
(:func:`shardkit.writer.write_lance`); its own manifest holds the counts.

Records keep their order; tf.Example features become columns, fields or tar
members and back (:mod:`shardkit.formats.example_rows`), and a record the
target format cannot hold faithfully is an error, never a silent change.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from shardkit.cli.exits import EXIT_OK, fail, one_line
from shardkit.cli.files import GLOB_CHARS, expand, format_of, shard_indices
from shardkit.cli.outputs import OutputError, check_outputs
from shardkit.cli.paths import shown
from shardkit.errors import ShardkitError


def cmd_convert(args: argparse.Namespace) -> int:
    """Read every record of SRC's files in order and write them as DST shards, with a manifest."""
    from shardkit.writer import LanceWriteError, ShardWriter, default_manifest_path

    # A local pattern is made absolute so that the manifest's urls do not depend on where it is read from.
    pattern = args.pattern if "://" in args.pattern else os.path.abspath(args.pattern)
    lance_out = args.format == "lance"
    try:
        urls = expand(args.source)
        if GLOB_CHARS.search(args.source):  # a glob such as d/* picks up index and manifest files
            urls = [urls[i] for i in shard_indices(urls, args.source)]
        if not urls:
            raise ConvertSourceError(f"{args.source}: matches only index and manifest files; give the shards")
        if lance_out:
            _check_lance_output(args)
        else:
            check_outputs(args.source, urls, args.pattern, default_manifest_path(args.pattern))
        readers = [(url, _source_format(url)) for url in urls]
        writer = (
            None
            if lance_out
            else ShardWriter(pattern, format=args.format, max_records=args.max_records, max_bytes=args.max_bytes)
        )
    except Exception as error:  # noqa: BLE001 - one line, exit 2
        return fail(args, error, None if isinstance(error, (OutputError, LanceWriteError)) else args.source)
    try:
        convert = _record_converter(args.decode, readers, args.format)
    except Exception as error:  # noqa: BLE001 - one line, exit 2
        return fail(args, error, args.source)
    if writer is None:
        return _convert_to_lance(args, readers, convert)
    if args.ray is not None:
        return _convert_on_ray(args, pattern, urls, convert)
    return _convert_to_shards(args, readers, convert, writer)


def _convert_to_shards(
    args: argparse.Namespace, readers: list[tuple[str, Any]], convert: Callable[..., Any], writer: Any
) -> int:
    """Every record of ``readers``, converted, through ``writer`` (a ShardWriter): shards, then the manifest."""
    from tqdm import tqdm

    count = 0
    with tqdm(unit=" records", desc=f"{args.source} -> {args.format}", leave=True, disable=None) as bar, writer:
        for url, fmt in readers:
            for record in fmt.read(url):
                writer.write(convert(record, count, url, fmt.name))
                count += 1
                bar.update()
    shards = writer.shards
    assert shards is not None
    manifest = shown(writer.manifest, args.pattern)
    print(f"{count} records from {len(readers)} files -> {len(shards)} {args.format} shards; manifest {manifest}")
    return EXIT_OK


def _check_lance_output(args: argparse.Namespace) -> None:
    """Refuse, before anything is read, a Lance destination that cannot be written whole."""
    from shardkit.writer import LanceWriteError, new_lance_directory

    if args.ray is not None:
        raise LanceWriteError("--ray writes shard files; a Lance dataset is written by one process (leave out --ray)")
    new_lance_directory(args.pattern, create=False)


def _convert_to_lance(args: argparse.Namespace, readers: list[tuple[str, Any]], convert: Callable[..., Any]) -> int:
    """Every record of ``readers``, converted to a row, as the new Lance dataset DST (written whole, then
    renamed into place: :func:`shardkit.writer.write_lance`)."""
    from tqdm import tqdm

    from shardkit.writer import write_lance

    count = 0

    def rows() -> Iterator[Any]:
        nonlocal count
        with tqdm(unit=" records", desc=f"{args.source} -> lance", leave=True, disable=None) as bar:
            for url, fmt in readers:
                for record in fmt.read(url):
                    yield convert(record, count, url, fmt.name)
                    count += 1
                    bar.update()

    schema = _source_schema(readers)
    written = write_lance(rows(), args.pattern, schema=schema, max_records=args.max_records, max_bytes=args.max_bytes)
    print(
        f"{written.records} records from {len(readers)} files -> {written.fragments} lance fragments; "
        f"dataset {args.pattern}"
    )
    return EXIT_OK


def _source_schema(readers: list[tuple[str, Any]]) -> Any:
    """The Arrow schema every source file has, when all are local Parquet files or fragments of one Lance
    dataset version (so a Lance destination keeps their types: int32 stays int32, a vector a fixed-size
    list); None otherwise (the first rows decide)."""
    names = {fmt.name for _, fmt in readers}
    if names == {"parquet"} and not any("://" in url for url, _ in readers):
        import pyarrow.parquet as pq

        schemas = {pq.read_schema(url).remove_metadata() for url, _ in readers}
    elif names == {"lance"}:
        from shardkit.formats.lance import parse_fragment_url

        places = [(parse_fragment_url(url), fmt) for url, fmt in readers]
        schemas = {fmt.dataset(where.uri, where.version).schema for where, fmt in places}
    else:
        return None
    return schemas.pop() if len(schemas) == 1 else None


class RayUnavailableError(ShardkitError):
    """``--ray`` was given, but Ray is not installed or its cluster cannot be reached."""


def _convert_on_ray(args: argparse.Namespace, pattern: str, urls: list[str], convert: Callable[..., Any]) -> int:
    """The conversion as Ray write tasks, one per source file (:func:`shardkit.ray.write_shards`), on a
    local cluster or the one at ``args.ray``; shards ``DST_PATTERN``'s field as ``TTTTT-KKKKK``."""
    try:
        import ray

        from shardkit.ray import write_shards
    except ImportError as error:
        return fail(args, RayUnavailableError(f"--ray needs Ray: pip install 'shardkit[ray]' ({error})"))
    try:
        _check_reachable(args.ray)
        start_ray(ray, args.ray)
        logging.getLogger("ray.data").setLevel(logging.WARNING)  # its progress bars stay; its INFO lines go
    except Exception as error:  # noqa: BLE001 - ConnectionError, or Ray's own kinds: one line, exit 2
        where = f"the Ray cluster at {args.ray}" if args.ray else "a local Ray cluster"
        return fail(args, RayUnavailableError(f"cannot start or reach {where}: {one_line(str(error))}"))
    try:
        firsts = _first_numbers(urls) if args.format == "tar" else [0] * len(urls)
        files = ray.data.from_items(
            [{"url": u, "first": f} for u, f in zip(urls, firsts)], override_num_blocks=len(urls)
        )
        shards = write_shards(
            files, pattern, format=args.format, max_records=args.max_records, max_bytes=args.max_bytes,
            to_records=FileRecords(convert), index=False,
        )  # fmt: skip
    except Exception as error:  # noqa: BLE001 - one line; the cause's exit code (1 for corrupt data)
        return fail(args, _cause(error))
    finally:
        ray.shutdown()
    from shardkit.writer import default_manifest_path

    manifest = shown(default_manifest_path(pattern), args.pattern)
    count = shards.total_records
    print(f"{count} records from {len(urls)} files -> {len(shards)} {args.format} shards; manifest {manifest}")
    return EXIT_OK


_CONNECT_SECONDS = 10.0

#: Starts of a new local Ray cluster tried: Ray waits a fixed 30 s for its raylet to register, which a busy
#: machine can exceed (seen under a loaded test run); a start that timed out is shut down and tried again.
LOCAL_STARTS = 3
_START_TIMEOUT = "timed out during startup"


def start_ray(ray: Any, address: str | None) -> None:
    """``ray.init`` at ``address``, or a new local cluster (tried :data:`LOCAL_STARTS` times while Ray says its
    start timed out, saying so on stderr); any other failure, or a cluster at an address, raises at once."""
    for attempt in range(1, LOCAL_STARTS + 1):
        try:
            ray.init(address=address or "local", logging_level=logging.ERROR, include_dashboard=False)
            return
        except Exception as error:
            if address or attempt == LOCAL_STARTS or _START_TIMEOUT not in str(error):
                raise
            ray.shutdown()
            print(
                f"shardkit convert: the local Ray cluster did not start in time (a busy machine?); "
                f"starting it again ({attempt + 1} of {LOCAL_STARTS})",
                file=sys.stderr,
            )


def _check_reachable(address: str) -> None:
    """Refuse a ``host:port`` (or ``ray://host:port``) nothing answers on within 10 s: ``ray.init`` would wait
    for that cluster for many minutes. ``auto`` and a local cluster are Ray's to find."""
    import socket

    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=_CONNECT_SECONDS).close()
    except OSError as error:
        raise ConnectionError(f"nothing answers at {target} ({error.strerror or error})") from None


def _first_numbers(urls: list[str]) -> list[int]:
    """Each file's first record's running number over all files (tar keys are running numbers)."""
    import itertools

    counts = [_source_format(url).count(url) for url in urls]
    return [0, *itertools.accumulate(counts)][: len(urls)]


class FileRecords:
    """``to_records`` for a row ``{"url", "first"}``: the file's records, converted as one process would."""

    def __init__(self, convert: Callable[..., Any]) -> None:
        self.convert = convert

    def __call__(self, row: dict[str, Any]) -> Iterator[Any]:
        url = row["url"]
        fmt = _source_format(url)
        for n, record in enumerate(fmt.read(url), start=row["first"]):
            yield self.convert(record, n, url, fmt.name)


def _cause(error: BaseException) -> BaseException:
    """The error a Ray task raised, out of Ray's wrappers (RayTaskError, UserCodeException): ours or an OSError."""
    seen = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ShardkitError, OSError)):
            return current
        current = getattr(current, "cause", None) or current.__cause__
    return error


def _source_format(url: str) -> Any:
    """The format to read ``url`` with: :func:`~shardkit.cli.files.format_of`'s checks (a file in no
    known format, or named TFRecord but holding another format, is an error), TFRecord included."""
    from shardkit.formats.registry import formats

    return format_of(url, option=False) or formats()["tfrecord"]


RECORD_FORMATS = ("tfrecord", "array_record")
"""Formats whose records are opaque bytes, usually serialized tf.Examples: each converts to the other as is."""
_NAMES = {"tfrecord": "TFRecord", "array_record": "ArrayRecord"}


class ConvertError(ShardkitError):
    """A record has no faithful form in the target format."""


class ConvertSourceError(ShardkitError):
    """SRC names no shard: only index and manifest files."""


_PEEK = 100  # records of the first TFRecord file that decide --decode and the Parquet columns


def _record_converter(decode: str | None, readers: list[tuple[str, Any]], target: str) -> Callable[..., Any]:
    """``convert(record, n, url, source_format)``: with ``decode`` "example" (the default when the first
    TFRecord records decode as tf.Examples, or when writing TFRecord from another format), tf.Example
    features become fields and back (:mod:`shardkit.formats.example_rows`); otherwise records stay opaque."""
    import itertools

    from shardkit.formats import example_rows as rows

    first = next(((url, fmt) for url, fmt in readers if fmt.name in RECORD_FORMATS), None)
    peek: list[Any] = []
    if target in RECORD_FORMATS:
        examples = decode != "raw"
    elif first is None or decode == "raw":
        examples = False
    else:
        peek = list(itertools.islice(first[1].read(first[0]), _PEEK))
        examples = decode == "example" or rows.looks_like_examples(peek[:10])
        if examples and not rows.looks_like_examples(peek):
            raise ConvertError(f"{first[0]}: the first records are not all tf.Examples; use --decode raw")
    scalars = rows.scalar_features(peek) if examples and target in ("parquet", "jsonl", "lance") else frozenset()

    def convert(record: Any, n: int, url: str, source: str) -> Any:
        if not examples or (source in RECORD_FORMATS) == (target in RECORD_FORMATS):
            return _converted(record, n, url, target)
        try:
            if target == "tar":
                return rows.sample_from_example(record, f"{n:09d}")
            if target not in RECORD_FORMATS:
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
    if target in RECORD_FORMATS:
        if isinstance(record, (bytes, bytearray)):
            return record
        raise ConvertError(
            f"{url}: record {n} is a {type(record).__name__}; {_NAMES[target]} shards are written from TFRecord "
            "or ArrayRecord (bytes) only"
        )
    if not isinstance(record, dict):
        record = {"record": record} if isinstance(record, (bytes, bytearray)) else {"value": record}
    if target == "tar":
        sample = {"__key__": record.get("__key__") or f"{n:09d}"}
        for key, value in record.items():
            if not key.startswith("__"):
                sample[key] = value if isinstance(value, (bytes, str)) else _json_member(value, key, n, url)
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


def _json_member(value: Any, key: str, n: int, url: str) -> bytes:
    """``value`` as the JSON bytes of a tar member; a value JSON has no form for is a located error."""
    try:
        return json.dumps(value).encode()
    except (TypeError, ValueError):
        raise ConvertError(
            f"{url}: record {n}: field {key!r} holds a {type(value).__name__}, which a tar member holds only as "
            "bytes, text or JSON; convert to parquet or tfrecord instead"
        ) from None
