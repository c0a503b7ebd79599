"""The ``shardkit`` command line: one sub-command per job.

Each sub-command is a ``_cmd_<name>(args) -> int`` function registered in
:func:`build_parser`; heavy imports happen inside the function so that
``shardkit --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_demo(args: argparse.Namespace) -> int:
    from shardkit.demo import run_demo

    return run_demo(workdir=args.workdir)


def _cmd_plan(args: argparse.Namespace) -> int:
    from shardkit.planning import plan
    from shardkit.shardlist import ShardList
    from shardkit.topology import Topology

    shards = ShardList.from_manifest(args.manifest)
    counts = shards.table.column("num_records")
    options = {"seed": args.seed, "epoch": args.epoch, "shuffle": args.shuffle, "balance": args.balance}
    print(
        f"{len(shards)} shards, {shards.total_records if counts.null_count == 0 else 'unknown'} records; "
        f"world_size={args.world_size}, num_workers={args.num_workers}, "
        + ", ".join(f"{k}={v}" for k, v in options.items())
    )
    print(f"{'rank':>4} {'worker':>6} {'records':>10} {'ranges':>7}  first ranges")
    rank_totals = []
    for rank in range(args.world_size):
        rank_total = 0
        for worker in range(args.num_workers):
            ranges = plan(counts, Topology(rank, args.world_size, worker, args.num_workers), **options)
            known = [r.stop - r.start for r in ranges if r.stop is not None]
            records = str(sum(known)) if len(known) == len(ranges) else "?"
            rank_total += sum(known)
            shown = ", ".join(
                f"{shards[r.shard].rsplit('/', 1)[-1]}[{r.start}:{'' if r.stop is None else r.stop}]"
                for r in ranges[: args.show]
            )
            more = f" ... (+{len(ranges) - args.show})" if len(ranges) > args.show else ""
            print(f"{rank:>4} {worker:>6} {records:>10} {len(ranges):>7}  {shown}{more}")
        rank_totals.append(rank_total)
    if counts.null_count == 0:
        print("records per rank: " + ", ".join(str(t) for t in rank_totals))
    return 0


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
