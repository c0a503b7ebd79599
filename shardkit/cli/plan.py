"""``shardkit plan``: print who reads what, from a manifest or from shard files and their indexes.

It reads no shard data: the record counts come from the manifest, the index
files beside the shards, or Parquet footers.
"""

from __future__ import annotations

import argparse
from typing import Any

from shardkit.cli.exits import EXIT_OK, fail
from shardkit.cli.files import GLOB_CHARS, dataset_shards, index_counts
from shardkit.cli.render import format_plan, plural


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        shards, counts_from = _load_shards(args.source)
    except Exception as error:  # noqa: BLE001 - named after the source, then main's one line
        return fail(args, error, args.source)
    options = {"seed": args.seed, "epoch": args.epoch, "shuffle": args.shuffle, "balance": args.balance}
    text = format_plan(shards, args.world_size, args.num_workers, show=args.show, **options)
    print(f"record counts: {counts_from}")
    print(text)
    return EXIT_OK


def _load_shards(source: str) -> tuple[Any, str]:
    """The ShardList ``source`` names (a glob, else a manifest) and where its counts came from."""
    from shardkit.shardlist import ShardList

    in_place = None if GLOB_CHARS.search(source) else dataset_shards(source)
    if in_place is not None:
        return in_place, "from the dataset's own index (LitData index.json, Lance manifest)"
    if not GLOB_CHARS.search(source) and not _is_shard_file(source):
        return ShardList.from_manifest(source), "from the manifest"
    shards = ShardList.from_glob(source)
    counts = index_counts(shards.urls())
    found = sum(count is not None for count in counts)
    if found == 0:
        return shards, "unknown (no index files; write them with `shardkit index`)"
    return shards.with_num_records(counts), f"from index files ({found} of {plural(len(counts), 'shard')})"


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
