"""The ``shardkit`` command line: one sub-command per job.

Each sub-command is a ``_cmd_<name>(args) -> int`` function registered in
:func:`build_parser`; heavy imports happen inside the function so that
``shardkit --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _cmd_demo(args: argparse.Namespace) -> int:
    from shardkit.demo import run_demo

    return run_demo(workdir=args.workdir)


def _cmd_plan(args: argparse.Namespace) -> int:
    from shardkit.shardlist import ShardList

    options = {"seed": args.seed, "epoch": args.epoch, "shuffle": args.shuffle, "balance": args.balance}
    shards = ShardList.from_manifest(args.manifest)
    print(format_plan(shards, args.world_size, args.num_workers, show=args.show, **options))
    return 0


def format_plan(shards: Any, world_size: int, num_workers: int, *, show: int = 3, **options: Any) -> str:
    """A table of who reads what: each reader's record count and first ranges."""
    from shardkit.planning import plan
    from shardkit.topology import Topology

    counts = shards.table.column("num_records")
    known = counts.null_count == 0
    lines = [
        f"{len(shards)} shards, {shards.total_records if known else 'unknown'} records; "
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
                f"{shards[r.shard].rsplit('/', 1)[-1]}[{r.start}:{'' if r.stop is None else r.stop}]" for r in ranges[:show]
            )
            more = f" ... (+{len(ranges) - show})" if len(ranges) > show else ""
            records = str(sum(sizes)) if len(sizes) == len(ranges) else "?"
            lines.append(f"{rank:>4} {worker:>6} {records:>10} {len(ranges):>7}  {shown}{more}")
        rank_totals.append(rank_total)
    if known:
        lines.append("records per rank: " + ", ".join(str(t) for t in rank_totals))
    return "\n".join(lines)


def _progress_bar(url: str, compression: str | None, storage_options: dict | None = None) -> Any:
    """A tqdm bar over a TFRecord file's bytes (total unknown if it is compressed)."""
    import fsspec
    from tqdm import tqdm

    from shardkit.formats.io import open_raw
    from shardkit.formats.tfrecord import detect_compression

    if compression == "auto":
        with open_raw(url, "rb", storage_options) as raw:
            compression = detect_compression(raw.read(12))
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    total = fs.size(path) if compression is None else None
    return tqdm(total=total, unit="B", unit_scale=True, desc=url, leave=False, disable=None)


def _with_progress(url: str, compression: str | None, job: Callable[[Callable[[int], None]], Any]) -> Any:
    """Run ``job(progress)`` with a progress bar that ``progress(bytes_done)`` advances."""
    with _progress_bar(url, compression) as bar:
        return job(lambda done: bar.update(done - bar.n))


def _feature_schema(records: list[bytes]) -> dict[str, tuple[str, int, int]]:
    """Feature name -> (kind, fewest values, most values) over tf.Example records."""
    import numpy as np

    from shardkit.formats.example import decode_example

    schema: dict[str, tuple[str, int, int]] = {}
    for record in records:
        for name, value in decode_example(record).items():
            if isinstance(value, np.ndarray):
                kind = "int64" if value.dtype == np.int64 else "float"
            else:
                kind = "bytes" if value else "empty"
            old_kind, low, high = schema.get(name, (kind, len(value), len(value)))
            if old_kind != kind:
                kind = f"{old_kind}|{kind}" if kind not in old_kind.split("|") else old_kind
            schema[name] = (kind, min(low, len(value)), max(high, len(value)))
    return schema


def _cmd_inspect(args: argparse.Namespace) -> int:
    import itertools

    from shardkit.errors import ShardkitError
    from shardkit.formats.tfrecord import read_tfrecord

    sizes = []
    first: list[bytes] = []
    for record in read_tfrecord(args.url, compression=args.compression, verify=False):
        sizes.append(len(record))
        if len(first) < args.records:
            first.append(record)
    print(f"{args.url}: {len(sizes)} records, {sum(sizes)} data bytes")
    if sizes:
        print(f"record size: min {min(sizes)}, mean {sum(sizes) / len(sizes):.1f}, max {max(sizes)} bytes")
    if not first:
        return 0
    try:
        schema = _feature_schema(first)
    except ShardkitError:
        print(f"the first {len(first)} records are not tf.Example messages")
        return 0
    print(f"features of the first {len(first)} records (tf.Example):")
    width = max(itertools.chain([7], map(len, schema)))
    for name, (kind, low, high) in sorted(schema.items()):
        count = str(low) if low == high else f"{low}..{high}"
        print(f"  {name:<{width}}  {kind:<6} x {count}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from shardkit.errors import CorruptRecordError
    from shardkit.formats.tfrecord import verify_tfrecord

    failed = 0
    for url in args.urls:
        try:
            count = _with_progress(
                url, args.compression, lambda progress: verify_tfrecord(url, compression=args.compression, progress=progress)
            )
        except CorruptRecordError as error:
            failed += 1
            print(f"CORRUPT {error}", file=sys.stderr)
        else:
            print(f"ok {url}: {count} records")
    return 1 if failed else 0


def _cmd_index(args: argparse.Namespace) -> int:
    from shardkit.formats.index import build_index

    for url in args.urls:
        path = _with_progress(
            url, args.compression, lambda progress: build_index(url, compression=args.compression, progress=progress)
        )
        print(f"{url} -> {path}")
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``shardkit`` console script."""
    parser = argparse.ArgumentParser(prog="shardkit", description=__doc__.splitlines()[0])
    from shardkit._version import __version__

    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="write a small dataset to a temp dir and show shardkit at work")
    demo.add_argument("--workdir", default=None, help="where to write the data (default: a temp dir)")
    demo.set_defaults(func=_cmd_demo)

    plan_cmd = sub.add_parser("plan", help="print who reads what: each rank's and worker's record ranges")
    plan_cmd.add_argument("manifest", help="a shard manifest (Arrow IPC, Parquet or JSON lines)")
    plan_cmd.add_argument("--world-size", type=int, default=1, help="number of DDP ranks (default 1)")
    plan_cmd.add_argument("--num-workers", type=int, default=1, help="DataLoader workers per rank (default 1)")
    plan_cmd.add_argument("--balance", choices=("none", "pad", "drop"), default="pad")
    plan_cmd.add_argument("--seed", type=int, default=0)
    plan_cmd.add_argument("--epoch", type=int, default=0)
    plan_cmd.add_argument("--shuffle", action="store_true")
    plan_cmd.add_argument("--show", type=int, default=3, help="ranges to print per reader (default 3)")
    plan_cmd.set_defaults(func=_cmd_plan)

    inspect_cmd = sub.add_parser("inspect", help="record count, sizes and feature schema of a TFRecord file")
    inspect_cmd.add_argument("url", help="a TFRecord file: path or fsspec URL")
    inspect_cmd.add_argument("--records", type=int, default=10, help="records to read the schema from (default 10)")
    _add_compression_option(inspect_cmd)
    inspect_cmd.set_defaults(func=_cmd_inspect)

    verify_cmd = sub.add_parser("verify", help="check every CRC of TFRecord files; exit 1 on corruption")
    verify_cmd.add_argument("urls", nargs="+", metavar="URL", help="TFRecord files: paths or fsspec URLs")
    _add_compression_option(verify_cmd)
    verify_cmd.set_defaults(func=_cmd_verify)

    index_cmd = sub.add_parser("index", help="write an index file (record byte offsets) beside each TFRecord file")
    index_cmd.add_argument("urls", nargs="+", metavar="URL", help="TFRecord files: paths or fsspec URLs")
    _add_compression_option(index_cmd)
    index_cmd.set_defaults(func=_cmd_index)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardkit`` console script."""
    from shardkit.errors import ShardkitError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ShardkitError as error:
        print(f"shardkit {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
