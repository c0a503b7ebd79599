"""Who reads what: a pure plan from shard record counts to record ranges.

The plan is a function of the record counts, the :class:`~shardkit.Topology`
and ``(seed, epoch, shuffle, balance)`` only — no I/O, no global state — so
every rank and every worker computes the same global picture and takes its own
part of it without talking to the others.

How it works (all vectorised with numpy):

1. **The stream.** The shards' records are laid end to end in one global
   stream of ``N`` records. Without shuffling the shards keep their order. With
   shuffling, shards larger than a *block* (about ``N / (8 * world_size)``
   records) are cut into blocks, and the blocks are permuted with a generator
   seeded from ``(seed, epoch)``: identical on every rank, different each
   epoch, and long contiguous ranges stay long.
2. **Ranks.** Rank ``r`` gets a contiguous chunk of the stream. ``"none"``
   splits ``N`` as evenly as possible; ``"pad"`` gives every rank
   ``ceil(N / R)`` records, wrapping round to the start of the stream for the
   few (fewer than ``R``) missing ones, as ``DistributedSampler`` does;
   ``"drop"`` gives every rank ``floor(N / R)`` and leaves out the last
   ``N mod R`` records of the stream.
3. **Workers.** Each rank's chunk is split evenly over its workers, worker
   ``w`` getting ``C // W + (w < C % W)`` records. Under ``"pad"`` and
   ``"drop"`` every rank has the same ``C``, so worker ``w`` reads the same
   number of records on every rank, and so emits the same number of batches —
   the condition for DDP not to hang at the end of an epoch.

A shard is therefore split only where a reader's span begins or ends inside
it (or, when shuffling, into blocks): whole shards and long sequential reads
are the rule, and no reader is left empty while there are records for it.

**Sample-level shuffling** (what the datasets' ``shuffle=True`` does) takes
two more steps. The plan is called with ``block_size=SHUFFLE_BLOCK``: blocks
are at most that many records, so each reader's part of the stream is a run
of many small blocks from all over the dataset (the stream still depends on
the world size only, never on the number of workers). The reader then
cuts its part into windows of ``SHUFFLE_WINDOW`` consecutive positions,
reads a window sequentially (one sequential read per block) and yields it
in the order :func:`window_order` gives, seeded from ``(seed, epoch, rank,
first position of the window)``. A window holds about ``window / block``
blocks from random places, so neighbours in the output are rarely from the
same block (measured on 32 x 4,096 records: 0.05% of neighbours adjacent in
storage, jump entropy 0.97 of a uniform permutation's, 0.96x the throughput
of ``shuffle=False``; see ``benchmarks/shuffle.py``). Smaller blocks shuffle
better but cost one more read each (an open and an index lookup); a larger
window shuffles better but holds more samples. Memory: one window of samples per reader.

The package's modules, top to bottom: :mod:`~shardkit.planning.plans` (the
plan functions), :mod:`~shardkit.planning.stream` (the global stream and the
window order), :mod:`~shardkit.planning.ranges` (what a plan returns) and
:mod:`~shardkit.planning.intervals` (splitting positions over ranks and
workers, and the interval arithmetic of resuming). Every name is imported
from here.
"""

from shardkit.planning.intervals import (
    BALANCES,
    Balance,
    PlanError,
    positions_union,
    rank_span,
    reader_counts,
    share,
    split_remaining,
    take,
    through,
    union,
    worker_span,
)
from shardkit.planning.plans import plan, plan_intervals, plan_whole_shards
from shardkit.planning.ranges import PlannedRanges, Range, WholeShards
from shardkit.planning.schedule import Schedule, ScheduleError
from shardkit.planning.stream import SHUFFLE_BLOCK, SHUFFLE_WINDOW, window_order

__all__ = [
    "BALANCES",
    "SHUFFLE_BLOCK",
    "SHUFFLE_WINDOW",
    "Balance",
    "PlanError",
    "PlannedRanges",
    "Range",
    "Schedule",
    "ScheduleError",
    "WholeShards",
    "plan",
    "plan_intervals",
    "plan_whole_shards",
    "positions_union",
    "rank_span",
    "reader_counts",
    "share",
    "split_remaining",
    "take",
    "through",
    "union",
    "window_order",
    "worker_span",
]
