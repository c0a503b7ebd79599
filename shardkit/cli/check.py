"""``shardkit inspect``, ``verify`` and ``index``: read every record of shard files, and say
what they hold, whether they are sound, or where each record starts.

Each reads the files one at a time through :func:`~shardkit.cli.files.each_file`:
a bad file is reported on its own line and the next one is still read.
TFRecord files are read here (with a progress bar over their bytes); every
other format reads (and so checks) itself.
"""

from __future__ import annotations

import argparse
from typing import Any

from shardkit.cli.exits import MismatchError, fail
from shardkit.cli.files import detect_compression, each_file, format_of, index_counts, with_progress
from shardkit.cli.paths import key, shown
from shardkit.errors import ShardkitError

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
    if fmt.name == "megatron":
        from shardkit.formats.megatron import bin_url, describe

        print(f"{bin_url(url)}: {describe(fmt, url)}; format: megatron; every document checked and read")
        if first is not None:
            tokens = first["input_ids"]
            print(f"first document: {len(tokens)} tokens {tokens[:8].tolist()}{' ...' if len(tokens) > 8 else ''}")
        return
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

    fmt = format_of(url, args.format, args.compression)
    if fmt is not None:
        return _inspect_format(url, fmt, args)

    if args.compression == "auto":
        compression, how = detect_compression(url), "detected"
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


def cmd_inspect(args: argparse.Namespace) -> int:
    return each_file(args, lambda url: _inspect_one(url, args))


# --------------------------------------------------------------------------- verify, index


def cmd_verify(args: argparse.Namespace) -> int:
    from shardkit.shardlist import ShardList

    expected: dict[str, tuple[int | None, int | None]] = {}  # by paths.key: a file named in any form
    listed: list[str] = []
    if args.manifest:
        try:
            shards = ShardList.from_manifest(args.manifest)
        except Exception as error:  # noqa: BLE001 - one line, exit 2
            return fail(args, error, args.manifest)
        counts, sizes = (shards.table.column(name).to_pylist() for name in ("num_records", "size"))
        listed = [shown(url, args.manifest) for url in shards.urls()]
        expected = {key(url): pair for url, pair in zip(shards.urls(), zip(counts, sizes))}

    def verify(url: str) -> None:
        _verify_one(url, args, *expected.get(key(url), (None, None)))

    return each_file(args, verify, listed=listed)


def _verify_one(url: str, args: argparse.Namespace, count: int | None, size: int | None) -> None:
    """Check every CRC of ``url``, then its record count against the manifest and its index file."""
    import fsspec

    from shardkit.formats.tfrecord import verify_tfrecord
    from shardkit.io.retry import retried_call

    where = f"the manifest {args.manifest}"
    fs, path = fsspec.core.url_to_fs(url)
    if size is not None and (actual := retried_call(fs, "size", path)) != size:
        raise MismatchError(f"{url}: {actual} bytes, but {where} says {size}; the file changed since it was listed")
    fmt = format_of(url, args.format, args.compression)
    if fmt is not None:  # tar, Parquet, JSON lines: reading every record checks it
        found = sum(1 for _ in fmt.read(url))
    else:
        found = with_progress(
            url,
            args.compression,
            lambda progress: verify_tfrecord(url, compression=args.compression, progress=progress),
        )
    if count is not None and found != count:
        raise MismatchError(f"{url}: {found} records, but {where} says {count}")
    indexed = index_counts([url])[0]
    if indexed is not None and found != indexed:
        raise MismatchError(
            f"{url}: {found} records, but its index file says {indexed}; rebuild it with shardkit index"
        )
    checked = " (count matches the manifest)" if count is not None else ""
    print(f"ok {url}: {found} records{checked}")


def cmd_index(args: argparse.Namespace) -> int:
    return each_file(args, lambda url: _index_one(url, args))


def _index_one(url: str, args: argparse.Namespace) -> None:
    """Write ``url``'s index (each format writes its own by rename); Parquet needs none."""
    fmt = format_of(url, args.format, args.compression)
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
        with_progress(
            url, compression, lambda progress: build_index(url, partial, compression=compression, progress=progress)
        )
        publish(partial, target, None)
    finally:
        remove_if_present(partial, None)
    return target
