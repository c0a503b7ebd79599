"""The plan as ``shardkit plan`` and ``shardkit demo`` print it: a table of who reads what."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def format_plan(
    shards: Any,
    world_size: int,
    num_workers: int,
    *,
    show: int = 3,
    shown_as: Callable[[str], str] | None = None,
    **options: Any,
) -> str:
    """A table of who reads what: each reader's record count and first ranges, each shard named by
    ``shown_as(url)`` (default: relative to the working directory when under it)."""
    name = shown_as or shown_path
    from shardkit.planning import plan
    from shardkit.topology import Topology

    counts = shards.table.column("num_records")
    known = counts.null_count == 0
    lines = [
        f"{plural(len(shards), 'shard')}, {shards.total_records if known else 'unknown'} records; "
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
                f"{name(shards[r.shard])}[{r.start}:{'' if r.stop is None else r.stop}]" for r in ranges[:show]
            )
            more = f" ... (+{len(ranges) - show})" if len(ranges) > show else ""
            records = str(sum(sizes)) if len(sizes) == len(ranges) else "?"
            lines.append(f"{rank:>4} {worker:>6} {records:>10} {len(ranges):>7}  {shown}{more}")
        rank_totals.append(rank_total)
    if known:
        lines.append("records per rank: " + ", ".join(str(t) for t in rank_totals))
    return "\n".join(lines)


def shown_path(url: str) -> str:
    """``url`` as the plan prints it: a local file relative to the working directory when under it, so
    that a wrong directory shows (``data/data/t-00000.tfrecord``); anything else in full."""
    if "://" in url or not os.path.isabs(url):
        return url
    relative = os.path.relpath(url)
    return url if relative.startswith("..") else relative
