"""Positions: how a stream of records is split over ranks and workers, and the interval
arithmetic over positions that resuming uses (what is left of an epoch, and
who reads it on a world of another size).

Intervals are ``(start, stop)`` pairs of positions, half open; functions
take them in any order and return them sorted and disjoint unless they say
otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from shardkit.errors import ShardkitError

Balance = Literal["none", "pad", "drop"]
BALANCES: tuple[str, ...] = ("none", "pad", "drop")


class PlanError(ShardkitError, ValueError):
    """The plan's inputs cannot give a correct plan; the message says why and what to do."""


def through(chunk: Sequence[Sequence[int]], start: int, stop: int) -> list[tuple[int, int]]:
    """Positions ``[start, stop)`` of a chunk (intervals of stream positions laid end to end) as stream intervals."""
    out: list[tuple[int, int]] = []
    for a, b in chunk:
        length = b - a
        if stop <= 0:
            break
        if start < length:
            out.append((a + max(start, 0), a + min(stop, length)))
        start, stop = start - length, stop - length
    return [(a, b) for a, b in out if b > a]


def split_remaining(
    remaining: Sequence[Sequence[int]], total: int, world_size: int, rank: int, balance: Balance
) -> list[tuple[int, int]]:
    """Rank ``rank``'s part of what is left of an epoch, on a new world of ``world_size`` ranks.

    ``remaining`` are sorted, disjoint intervals of global stream positions
    (``0 <= position < total``) not delivered yet, as a gathered state holds
    them. Their ``n`` positions, in order, are split as :func:`rank_span`
    splits a stream: ``"none"`` as evenly as possible (each position once);
    ``"pad"`` ``ceil(n / world_size)`` per rank, the last ranks repeating the
    first few remaining positions; ``"drop"`` ``floor(n / world_size)`` per
    rank, leaving out the last ``n mod world_size``. A repeat is returned as
    ``position + total``, which the stream reads as the same record (it wraps)
    and a later gather knows not to owe again.

    Example:
        >>> [split_remaining([(2, 5), (8, 10)], 10, 2, r, "pad") for r in (0, 1)]
        [[(2, 5)], [(8, 10), (12, 13)]]
    """
    merged = union(remaining)
    count = sum(stop - start for start, stop in merged)
    if count == 0:
        return []
    if balance == "drop" and count < world_size:
        return []  # nothing is left that every rank could have a share of: all ranks end the epoch
    start, size = rank_span(count, world_size, rank, balance)
    out: list[tuple[int, int]] = []
    lap = 0
    while size > 0:  # under "pad" the part may wrap round to the first remaining positions
        offset = start % count if lap == 0 else 0
        for a, b in merged:
            if size == 0:
                break
            if offset >= b - a:
                offset -= b - a
                continue
            take_here = min(size, b - a - offset)
            shift = total if lap or start >= count else 0  # a repeat: past the stream's end, wrapping
            out.append((a + offset + shift, a + offset + take_here + shift))
            size -= take_here
            offset = 0
        lap += 1
    return out


def take(intervals: Sequence[Sequence[int]], count: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The first ``count`` positions of ``intervals`` (in order) and the rest, both as intervals."""
    head: list[tuple[int, int]] = []
    rest: list[tuple[int, int]] = []
    for start, stop in intervals:
        start, stop = int(start), int(stop)
        take_here = max(0, min(count, stop - start))
        if take_here:
            head.append((start, start + take_here))
            count -= take_here
        if start + take_here < stop:
            rest.append((start + take_here, stop))
    return head, rest


def union(intervals: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint, non-empty ``(start, stop)`` intervals covering the same positions."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted((int(a), int(b)) for a, b in intervals if b > a):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def positions_union(positions: np.ndarray, intervals: Sequence[Sequence[int]]) -> list[list[int]]:
    """:func:`union` of single ``positions`` (any order, no repeats) and ``intervals``, as
    ``[start, stop]`` lists; vectorised, because a shuffle window's unyielded positions
    (thousands) are turned into intervals with every state a MixedLoader worker saves."""
    points = np.sort(np.asarray(positions, dtype=np.int64))
    spans = np.asarray([(a, b) for a, b in intervals if b > a], dtype=np.int64).reshape(-1, 2)
    starts = np.concatenate([points, spans[:, 0]])
    stops = np.concatenate([points + 1, spans[:, 1]])
    if not len(starts):
        return []
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], stops[order]
    reach = np.maximum.accumulate(stops)
    first = np.flatnonzero(np.concatenate([[True], starts[1:] > reach[:-1]]))  # each merged run's first piece
    ends = np.maximum.reduceat(stops, first)
    return np.stack([starts[first], ends], axis=1).tolist()


def share(intervals: Sequence[Sequence[int]], num_workers: int, worker_id: int) -> list[tuple[int, int]]:
    """Worker ``worker_id``'s part of the positions in ``intervals``.

    The positions, in order, are split as :func:`worker_span` splits a chunk:
    worker ``w`` gets the ``w``-th run of ``n // num_workers`` (or one more)
    of them, so the parts are disjoint, cover every position and differ in
    size by at most one.
    """
    merged = union(intervals)
    total = sum(stop - start for start, stop in merged)
    offset, size = worker_span(total, num_workers, worker_id)
    out: list[tuple[int, int]] = []
    for start, stop in merged:
        length = stop - start
        if offset >= length:
            offset -= length
            continue
        take = min(size, length - offset)
        if take <= 0:
            break
        out.append((start + offset, start + offset + take))
        size -= take
        offset = 0
    return out


def rank_span(total: int, world_size: int, rank: int, balance: Balance) -> tuple[int, int]:
    """``(start, size)`` of rank ``rank``'s chunk of a ``total``-record stream.

    Positions at or past ``total`` (only under ``"pad"``) wrap round to the
    start of the stream.
    """
    if balance == "none":
        base, extra = divmod(total, world_size)
        return rank * base + min(rank, extra), base + (rank < extra)
    if balance == "pad":
        per_rank = -(-total // world_size)
    elif balance == "drop":
        per_rank = total // world_size
        if per_rank == 0 and total > 0:
            raise PlanError(
                f"balance='drop' with {total} records over world_size={world_size} ranks "
                "leaves every rank empty; use balance='pad' (repeats records) or "
                "balance='none' (unequal ranks), or run on fewer ranks"
            )
    else:  # pragma: no cover - validated by the caller
        raise PlanError(f"unknown balance {balance!r}")
    return rank * per_rank, per_rank


def worker_span(rank_size: int, num_workers: int, worker_id: int) -> tuple[int, int]:
    """``(offset, size)`` of worker ``worker_id``'s part of a rank's chunk."""
    base, extra = divmod(rank_size, num_workers)
    return worker_id * base + min(worker_id, extra), base + (worker_id < extra)


def reader_counts(total: int, world_size: int, num_workers: int, balance: Balance) -> np.ndarray:
    """Records each reader gets, as an int64 array of shape ``(world_size, num_workers)``."""
    if balance not in BALANCES:
        raise PlanError(f"balance must be one of {BALANCES}, got {balance!r}")
    out = np.empty((world_size, num_workers), dtype=np.int64)
    for rank in range(world_size):
        _, size = rank_span(total, world_size, rank, balance)
        for worker in range(num_workers):
            out[rank, worker] = worker_span(size, num_workers, worker)[1]
    return out
