"""``shardkit convert``: rewrite shard files in another format, with a manifest.

Records keep their order; tf.Example features become columns, fields or tar
members and back (:mod:`shardkit.formats.example_rows`), and a record the
target format cannot hold faithfully is an error, never a silent change.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from shardkit.cli.exits import EXIT_OK, fail
from shardkit.cli.files import expand, format_of
from shardkit.cli.outputs import OutputError, check_outputs
from shardkit.cli.paths import shown
from shardkit.errors import ShardkitError


def cmd_convert(args: argparse.Namespace) -> int:
    """Read every record of SRC's files in order and write them as DST shards, with a manifest."""
    from tqdm import tqdm

    from shardkit.formats.registry import formats
    from shardkit.writer import ShardWriter, default_manifest_path

    # A local pattern is made absolute so that the manifest's urls do not depend on where it is read from.
    pattern = args.pattern if "://" in args.pattern else os.path.abspath(args.pattern)
    try:
        urls = expand(args.source)
        check_outputs(args.source, urls, args.pattern, default_manifest_path(args.pattern))
        readers = [(url, _source_format(url)) for url in urls]
        writer = ShardWriter(pattern, format=args.format, max_records=args.max_records, max_bytes=args.max_bytes)
    except Exception as error:  # noqa: BLE001 - one line, exit 2
        return fail(args, error, None if isinstance(error, OutputError) else args.source)
    target = formats()[args.format]
    try:
        convert = _record_converter(args.decode, readers, target.name)
    except Exception as error:  # noqa: BLE001 - one line, exit 2
        return fail(args, error, args.source)
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
    print(f"{count} records from {len(urls)} files -> {len(shards)} {args.format} shards; manifest {manifest}")
    return EXIT_OK


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
    scalars = rows.scalar_features(peek) if examples and target in ("parquet", "jsonl") else frozenset()

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
