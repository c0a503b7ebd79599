"""``shardkit plan``: print who reads what, from a manifest or from shard files and their indexes.

It reads no shard data: the record counts come from the manifest, the index
files beside the shards, or Parquet footers.
"""

from __future__ import annotations

import argparse
from typing import Any

from shardkit.cli.exits import EXIT_OK, fail
from shardkit.cli.files import GLOB_CHARS, dataset_shards, index_counts, shard_indices
from shardkit.cli.paths import is_url, shown
from shardkit.cli.picture_plan import MAX_SHARDS, plan_picture
from shardkit.cli.render import format_plan, plural, shown_path
from shardkit.cli.svg import PictureError, check_writable, write_atomic
from shardkit.errors import ShardkitError


class PlanSourceError(ShardkitError):
    """SOURCE is neither a manifest nor shard files: an index file, or a file in no known format."""


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        if args.picture:
            check_writable(args.picture)  # before the plan: a wrong path costs nothing to find
        shards, counts_from = _load_shards(args.source)
    except PictureError as error:
        return fail(args, error)
    except Exception as error:  # noqa: BLE001 - named after the source, then main's one line
        return fail(args, error, args.source)
    options = {"seed": args.seed, "epoch": args.epoch, "shuffle": args.shuffle, "balance": args.balance}
    text = format_plan(
        shards,
        args.world_size,
        args.num_workers,
        show=args.show,
        shown_as=lambda url: shown(url, args.source),
        **options,
    )
    print(f"record counts: {counts_from}")
    print(text)
    if args.picture:
        try:
            _write_picture(args.picture, shards, args.world_size, args.num_workers, options)
        except PictureError as error:
            return fail(args, error)
        print(f"picture: {args.picture}")
    return EXIT_OK


def _write_picture(path: str, shards: Any, world_size: int, num_workers: int, options: dict[str, Any]) -> None:
    import numpy as np

    column = shards.table.column("num_records")
    counts = np.asarray(column.fill_null(-1).to_numpy(), dtype=np.int64)
    labels = [shown_path(url) for url in shards.urls()[:MAX_SHARDS]]
    write_atomic(path, plan_picture(counts, labels, world_size, num_workers, **options))


def _load_shards(source: str) -> tuple[Any, str]:
    """The ShardList ``source`` names (a glob, else a manifest) and where its counts came from."""
    from shardkit.shardlist import ShardList

    in_place = None if GLOB_CHARS.search(source) else dataset_shards(source)
    if in_place is not None:
        return in_place, "from the dataset's own index (LitData index.json, Lance manifest)"
    if not GLOB_CHARS.search(source) and not _is_shard_file(source):
        return ShardList.from_manifest(source), "from the manifest"
    shards = ShardList.from_glob(source)
    if GLOB_CHARS.search(source):
        shards = _without_companions(shards, source)
    counts = index_counts(shards.urls())
    found = sum(count is not None for count in counts)
    if found == 0:
        return shards, "unknown (no index files; write them with `shardkit index`)"
    return shards.with_num_records(counts), f"from index files ({found} of {plural(len(counts), 'shard')})"


def _without_companions(shards: Any, source: str) -> Any:
    """``shards`` without the index and manifest files a glob such as ``data/*`` picks up (by name: plan
    reads no shard data), each reported as ``skipped``, as verify does."""
    kept = shard_indices(shards.urls(), source)
    if not kept:
        raise PlanSourceError(f"{source}: matches only index and manifest files; give the shards or a manifest")
    return shards if len(kept) == len(shards) else shards.select(kept)


def _is_shard_file(source: str) -> bool:
    """Whether ``source`` is a TFRecord or tar shard (planned as a list of one) rather than a manifest.

    Parquet and JSON lines files stay manifests: both formats hold manifests too. A file that cannot be
    opened, an index file, and a file in no known format are errors here, in one line each.
    """
    from shardkit.formats.base import FormatError
    from shardkit.formats.registry import format_for
    from shardkit.formats.sniff import SNIFF_BYTES, kind_of, not_a_shard
    from shardkit.io.files import open_raw, sniff_compression

    if is_url(source):  # remote: as before, its reader says what is wrong
        return _remote_shard(source)
    with open_raw(source, "rb") as f:  # an unreadable file says so (OSError: one line), not "not a manifest"
        head = f.read(SNIFF_BYTES)
    if (what := not_a_shard(source, head)) is not None and not what.startswith("an Arrow"):
        raise PlanSourceError(f"{source}: {what}; plan reads a manifest, a quoted glob of shards or one shard")
    kind = kind_of(head)
    if kind is not None and kind[0].startswith("a Megatron"):
        raise PlanSourceError(f"{source}: {kind[0]}; plan reads a manifest, a quoted glob of shards or one shard")
    try:
        fmt = format_for(source, head)
    except FormatError:
        if kind is None and sniff_compression(head) is None:
            raise PlanSourceError(
                f"{source}: format not recognised: neither a manifest (Arrow IPC, Parquet, JSON lines) nor a "
                "TFRecord or tar shard"
            ) from None
        return False  # a manifest (Arrow IPC, perhaps compressed): reading it reports what is wrong
    return fmt.name in ("tfrecord", "tar")


def _remote_shard(source: str) -> bool:
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
