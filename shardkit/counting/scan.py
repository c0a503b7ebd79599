"""Counting records by a scan: each shard's count through the format's ``count_fn``, shared out over the ranks.

Only what a scan needs is here; which shards are counted, and whether their
counts are already known, is decided above (:mod:`shardkit.counting.resolve`).
Counting is collective when ``torch.distributed`` is initialised: every rank
counts its share of the same missing shards and the counts are all-gathered,
so either every rank enters the gather or none does. A shard that breaks while
counted under ``on_error="skip"`` counts as what reading it yields
(:func:`readable_count`), so the plan reads exactly what the shard holds.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, Literal, NamedTuple

import numpy as np

from shardkit.errors import CorruptRecordError, redact, redact_url
from shardkit.shardlist import ShardList

__all__ = [
    "CountFn",
    "Counted",
    "Counts",
    "OnError",
    "ReadFn",
    "Salvage",
    "StoredCountFn",
    "count_shards",
    "in_process_group",
    "count_or_salvage",
    "readable_count",
    "union_over_ranks",
]

CountFn = Callable[[str], int]
StoredCountFn = Callable[[str], "int | None"]
#: ``read_fn(url, start, stop)``, a source's reader.
ReadFn = Callable[[str, int, "int | None"], Iterable[Any]]
OnError = Literal["raise", "skip"]


class Salvage(NamedTuple):
    """How a source counts a shard it finds damaged under ``on_error="skip"``: as the records its reader
    (``read``, the source's ``read_fn``) yields before the break (:func:`readable_count`). ``damaged(url,
    count)`` is told of each such shard in the process that counted it: a source counts the error there of
    one that reads as empty, since no plan then opens it."""

    read: ReadFn
    damaged: Callable[[str, int], None] | None = None


def in_process_group() -> bool:
    """Whether this is a rank's main process in an initialised process group (where collectives run)."""
    import torch.distributed as dist
    from torch.utils.data import get_worker_info

    return dist.is_available() and dist.is_initialized() and get_worker_info() is None


def union_over_ranks(missing: np.ndarray) -> np.ndarray:
    """The shards any rank lacks a count for: every rank then counts its share of the same set,
    so the all-gather in :func:`count_shards` is entered by all ranks or by none."""
    if not in_process_group():
        return missing
    import torch.distributed as dist

    gathered: list[np.ndarray | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, missing)
    return np.unique(np.concatenate([part for part in gathered if part is not None]))


class Counted(NamedTuple):
    """One shard's count (None: it has none stored), and whether it was taken from a damaged file."""

    records: int | None
    damaged: bool


class Counts(NamedTuple):
    """The counts of the shards counted, in order, and a mask of those taken from damaged files."""

    counts: np.ndarray
    damaged: np.ndarray


def count_or_salvage(
    count_fn: Callable[[str], int | None], url: str, *, on_error: OnError, salvage: Salvage | None
) -> Counted:
    """``count_fn(url)``; under ``on_error="skip"`` a file it finds damaged counts as what reading it yields."""
    try:
        count = count_fn(url)
    except CorruptRecordError as error:  # damage to the file: other errors (an index that does not fit) still raise
        if on_error == "raise" or salvage is None:
            raise
        readable = readable_count(url, salvage.read, error)
        if salvage.damaged is not None:
            salvage.damaged(url, readable)
        return Counted(readable, True)
    return Counted(None if count is None else int(count), False)


def readable_count(url: str, read_fn: ReadFn, broke: CorruptRecordError) -> int:
    """The records ``read_fn`` yields from ``url`` before it breaks, for a shard whose count ``broke``
    (``on_error="skip"``), with a warning naming the shard, where and why. A bad record read past (a
    :class:`~shardkit.formats.base.BadRecord`) counts: it keeps its place, as when the shard is read. So
    the plan reads exactly what the shard holds and its ranks stay equal; reading it counts the break."""
    count, reason = 0, broke
    try:
        for _ in read_fn(url, 0, None):
            count += 1
    except Exception as error:  # noqa: BLE001 - where reading breaks is the count
        reason = error
    where = "" if str(reason) == str(broke) else f" ({redact(str(reason))})"  # the same break: said once
    named = "" if url in str(broke) else f"{redact_url(url)}: "  # a CorruptRecordError's text starts with its url
    warnings.warn(
        f"shardkit: cannot count the records of a shard: {named}{redact(str(broke))}. It is counted as the "
        f"{count} records reading yields before it breaks{where} (on_error='skip'); reading it counts the break "
        "in stats(). Restore or rewrite the file to read it whole",
        stacklevel=2,
    )
    return count


def count_shards(shards: ShardList, missing: np.ndarray, count_fn: Callable[[str], Counted]) -> Counts:
    """Count the ``missing`` shards, shared out over the ranks when distributed."""
    import torch.distributed as dist

    distributed = in_process_group()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    mine = missing[rank::world]
    local: dict[int, Counted] = {}
    with _counting_bar(len(mine)) as bar:
        for i in mine:
            local[int(i)] = count_fn(shards[int(i)])
            bar.update()
    if distributed:
        gathered: list[dict[int, Counted] | None] = [None] * world
        dist.all_gather_object(gathered, local)
        for part in gathered:
            local.update(part or {})
    found = [local[int(i)] for i in missing]
    return Counts(
        np.array([int(f.records or 0) for f in found], dtype=np.int64), np.array([f.damaged for f in found], dtype=bool)
    )


def _counting_bar(total: int) -> Any:
    """A bar over the shards this process counts, left on screen with its throughput (a pass over many
    shards takes minutes): only when stderr is a terminal (``disable=None``), never in a DataLoader
    worker (the workers' bars would overwrite each other and the loader's output)."""
    from torch.utils.data import get_worker_info
    from tqdm import tqdm

    in_worker = get_worker_info() is not None
    return tqdm(
        total=total, unit=" shards", desc="shardkit: counting records", leave=True, disable=True if in_worker else None
    )
