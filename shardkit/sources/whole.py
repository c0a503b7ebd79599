"""Positions without record counts: which whole shards a reader has left, and where it is in the ones it began.

When some record count is unknown a planned source deals whole shards
(:func:`~shardkit.planning.plan_whole_shards`): the shards with a count other than 0, in an
order drawn from ``(seed, epoch)`` (the *global order*), dealt round the ranks and then
round each rank's workers. A reader's position in that plan needs no count: it is the
*items* (entries of its rank's part of the global order) it has not finished, and, for
the shards it began, how many records it has read of each. That is the ``"planned"`` node
of a count-free source, told apart by its fingerprint (``"split": "shards"``, no record
total):

- ``shards``: the items left, as ``[first, stop, step]`` runs (``range(first, stop,
  step)``, sorted and disjoint): a fresh worker's part of its rank is one run with the
  worker count as its step, so a node stays a few runs long whatever the shard count.
  Indices are of the rank's items (a rank node, per worker or merged) or of the global
  order (a global node, ``rank`` None, from :func:`merge_ranks`).
- ``started``: ``[index, records read, identity]`` for each item left that was begun
  (a worker has one at a time; a merge keeps every worker's). The identity
  (:func:`~shardkit.io.identity.identity` of the file when it was saved, or None where
  none is known) binds the record count to the file: a restore refuses a begun shard
  that was replaced or truncated since (reading on from record *n* of another file would
  be a silent short read or a wrong one), naming it.
- ``base``: after a resume on another world size, the global node (``shards``,
  ``started``) the epoch's items were dealt from; a rank's items are then every
  ``world_size``-th item left in it.

So a worker's own node resumes it exactly (same order), a rank's merged node resumes with
any worker count (the items left dealt round the workers), and a global node with any
world size (dealt round the ranks): exactly once, without counting a record. What needs
counts is refused by the source with the fix named: equal per-rank counts
(``balance="pad"``/``"drop"``) over a state saved without them.

Pure functions over numpy and plain data: the iterator in :mod:`~shardkit.sources.ranges`
keeps the cursor, the source (:mod:`~shardkit.sources.planned`) plans with them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

import numpy as np

from shardkit.stateful import (
    EPOCH,
    SEQUENCE,
    SHARE,
    State,
    StateError,
    check_all_shares,
    check_share,
    field,
    node,
    same_value,
    short,
    whole_number,
)

SPLIT: Final = "split"  #: fingerprint key: ``"shards"`` in a count-free source's fingerprint
SHARDS: Final = "shards"  #: node key: the items left, as ``[first, stop, step]`` runs
STARTED: Final = "started"  #: node key: ``[index, records read, identity]`` of each begun item left
BASE: Final = "base"  #: node key: the global node this epoch's items were dealt from
WORLD_SIZE: Final = "world_size"
RANK: Final = "rank"
FINGERPRINT: Final = "fingerprint"


def count_free(fingerprint: Any) -> bool:
    """Whether a saved fingerprint is a count-free source's (whole shards, positions by shard)."""
    return isinstance(fingerprint, dict) and fingerprint.get(SPLIT) == "shards"


class Items(NamedTuple):
    """A reader's items in order: ``indices`` in its node's space (rank items, or global items for a
    global node), ``order`` (position in the global order) and ``started`` (index -> [read, identity])."""

    indices: np.ndarray
    order: np.ndarray
    started: dict[int, tuple[int, str | None]]


# -- runs: sorted index sets in a few [first, stop, step] triples -----------------------------------


def runs_of(indices: np.ndarray) -> list[list[int]]:
    """Sorted unique ``indices`` as ``[first, stop, step]`` runs (greedy: each run as long as its step holds)."""
    a = np.asarray(indices, dtype=np.int64)
    if len(a) == 0:
        return []
    d = np.diff(a)
    change = np.flatnonzero(d[1:] != d[:-1]) + 1  # where a new step begins in d
    out, i, n = [], 0, len(a)
    while i < n:
        if i == n - 1:
            out.append([int(a[i]), int(a[i]) + 1, 1])
            break
        end = int(change[np.searchsorted(change, i, side="right")]) if len(change) and change[-1] > i else n - 1
        out.append([int(a[i]), int(a[end]) + 1, int(d[i])])
        i = end + 1
    return out


def expand(runs: Sequence[Sequence[int]]) -> np.ndarray:
    """The indices of ``runs``, in order."""
    parts = [np.arange(first, stop, step, dtype=np.int64) for first, stop, step in runs]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def check_runs(runs: Any, limit: int, where: str) -> None:
    """``runs`` must be sorted, disjoint ``[first, stop, step]`` int triples below ``limit`` (the shard count)."""
    previous = -1
    for run in runs:
        if type(run) not in SEQUENCE or len(run) != 3 or any(type(v) is not int for v in run):
            raise StateError(f"{where}: state[{SHARDS!r}] must hold [first, stop, step] runs of ints, got {short(run)}")
        first, stop, step = run
        if not (previous < first < stop <= limit and step >= 1):
            raise StateError(
                f"{where}: state[{SHARDS!r}] must hold sorted, disjoint runs of item indices below the dataset's "
                f"{limit} shards, each with a step >= 1; {short(run)} after item {previous} is not"
            )
        previous = first + (stop - 1 - first) // step * step


#: Most shards a count-free node may name: far past any dataset, small enough that expanding its runs stays bounded.
MOST_SHARDS: Final = 1 << 26


def _holds(runs: Sequence[Sequence[int]], firsts: list[int], item: int) -> bool:
    """Whether ``item`` is one of the (sorted, checked) ``runs``, whose first items are ``firsts``."""
    at = bisect.bisect_right(firsts, item) - 1
    if at < 0:
        return False
    first, stop, step = runs[at]
    return item < stop and (item - first) % step == 0


def _check_started(started: Any, runs: Sequence[Sequence[int]], where: str) -> None:
    firsts = [run[0] for run in runs]
    for entry in started:
        ok = type(entry) in SEQUENCE and len(entry) == 3
        ok = ok and type(entry[0]) is int and type(entry[1]) is int and entry[1] >= 0
        if not ok or type(entry[2]) not in (str, type(None)):
            raise StateError(
                f"{where}: state[{STARTED!r}] must hold [item, records read, identity] entries, got {short(entry)}"
            )
        if not _holds(runs, firsts, entry[0]):
            raise StateError(
                f"{where}: state[{STARTED!r}] names item {entry[0]}, which state[{SHARDS!r}] does not hold"
            )


def check_state(state: State, where: str) -> None:
    """The schema of a count-free ``"planned"`` node (see the module docstring)."""
    whole_number(state, EPOCH, where)
    world_size = whole_number(state, WORLD_SIZE, where, 1)
    rank = field(state, RANK, where, int, type(None))
    if rank is not None and not 0 <= rank < world_size:
        raise StateError(f"{where}: state['rank'] must be None or in 0..{world_size - 1}, got {rank}")
    limit = whole_number(state[FINGERPRINT], "shards", f"{where} (fingerprint)")
    if limit > MOST_SHARDS:
        raise StateError(f"{where}: the state names {limit} shards, more than {MOST_SHARDS}: it was edited")
    check_share(state, where)
    for part, name in ((state, where), *_base_part(state, rank, where)):
        runs = field(part, SHARDS, name, *SEQUENCE)
        check_runs(runs, limit, name)
        _check_started(field(part, STARTED, name, *SEQUENCE), runs, name)


def _base_part(state: State, rank: int | None, where: str) -> list[tuple[State, str]]:
    base = field(state, BASE, where, dict, type(None)) if BASE in state else None
    if base is None:
        return []
    if rank is None:
        raise StateError(f"{where}: a global state (rank None) has no base")
    whole_number(base, WORLD_SIZE, f"{where} (base)", 1)
    return [(base, f"{where} (base)")]


# -- a reader's items ----------------------------------------------------------------------------


def _started_map(entries: Sequence[Sequence[Any]]) -> dict[int, tuple[int, str | None]]:
    return {int(i): (int(read), identity) for i, read, identity in entries}


def rank_order(world_size: int, rank: int, count: int, base: State | None) -> tuple[np.ndarray, dict[int, Any]]:
    """Rank ``rank``'s items as positions in the global order (``count`` items in it; with a ``base``, its
    items left instead), and the begun ones by rank item: every ``world_size``-th from ``rank`` on."""
    if base is None:
        return np.arange(rank, count, world_size, dtype=np.int64), {}
    left = expand(base[SHARDS])
    mine = left[rank::world_size]
    began = _started_map(base[STARTED])
    where = {int(g): i for i, g in enumerate(mine.tolist()) if int(g) in began}
    return mine, {i: began[g] for g, i in where.items()}


def reader_items(
    state: State | None, own: bool, world_size: int, rank: int, worker: int, workers: int, count: int
) -> Items:
    """The items a reader reads, in order: its deal of its rank's items (a fresh pass, or a global
    ``state``), or of the items a rank ``state`` left (``own``: the worker's own node, read as saved)."""
    base = None if state is None else (_as_base(state) if state[RANK] is None else state.get(BASE))
    order, began = rank_order(world_size, rank, count, base)
    if state is None or state[RANK] is None:
        index = np.arange(worker, len(order), workers, dtype=np.int64)
    else:
        left = expand(state[SHARDS])
        index = left if own else left[worker::workers]
        began = _started_map(state[STARTED])
    if len(index) and int(index.max()) >= len(order):
        raise StateError(
            f"the state names item {int(index.max())} of rank {rank}, which has {len(order)}; "
            "the state is not of this dataset, or it was edited"
        )
    wanted = set(index.tolist())
    return Items(index, order[index], {i: v for i, v in began.items() if i in wanted})


def _as_base(state: State) -> State:
    return {WORLD_SIZE: state[WORLD_SIZE], SHARDS: state[SHARDS], STARTED: state[STARTED]}


def base_of(state: State | None) -> State | None:
    """The base a reader's nodes carry after resuming from ``state`` (a global node becomes it)."""
    if state is None:
        return None
    return _as_base(state) if state[RANK] is None else state.get(BASE)


# -- merging -------------------------------------------------------------------------------------


def _union(states: Sequence[State], index_of: Any, what: str) -> tuple[np.ndarray, list[list[Any]]]:
    """The items left of every node (``index_of(state, indices)`` maps them into one space), checked disjoint."""
    parts = [index_of(s, expand(s[SHARDS])) for s in states]
    items = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    unique = np.unique(items)
    if len(unique) != len(items):
        raise StateError(f"cannot merge {what} states that both hold the same shard: each item is one reader's")
    started = [
        [int(index_of(s, np.asarray([i], np.int64))[0]), read, identity]
        for s in states
        for i, read, identity in s[STARTED]
    ]
    return unique, sorted(started)


def merge(states: Sequence[State]) -> State:
    """The workers' items left united into one whole-rank node (resumes with any worker count)."""
    check_all_shares(states)
    fields = {key: same_value(states, key) for key in (EPOCH, WORLD_SIZE, RANK, FINGERPRINT)}
    if states[0].get(BASE) is not None:
        fields[BASE] = same_value(states, BASE)
    items, started = _union(states, lambda _, indices: indices, "worker")
    return node("planned", **fields, **{SHARDS: runs_of(items), STARTED: started, SHARE: None})


def merge_ranks(states: Sequence[State]) -> State:
    """Every rank's items left, as positions in the global order (``rank`` None): resumes on any world size."""
    fields = {key: same_value(states, key) for key in (EPOCH, WORLD_SIZE, FINGERPRINT)}
    world_size = fields[WORLD_SIZE]
    ranks = sorted(s[RANK] for s in states)
    if ranks != list(range(world_size)):
        raise StateError(
            f"merge_ranks needs the state of every rank 0..{world_size - 1} exactly once, got ranks {ranks}"
        )
    bases = [s.get(BASE) for s in states]
    if any(b != bases[0] for b in bases):
        raise StateError("cannot merge rank states resumed from different global states")
    base = bases[0]
    orders = {s[RANK]: rank_order(world_size, s[RANK], 0, base)[0] for s in states} if base is not None else {}

    def global_index(state: State, indices: np.ndarray) -> np.ndarray:
        if base is None:
            return state[RANK] + indices * world_size
        order = orders[state[RANK]]
        if len(indices) and int(indices.max()) >= len(order):
            raise StateError(f"rank {state[RANK]}'s state names an item its base does not deal it")
        return order[indices]

    items, started = _union(states, global_index, "rank")
    return node(
        "planned",
        **{EPOCH: fields[EPOCH], WORLD_SIZE: world_size, RANK: None, FINGERPRINT: fields[FINGERPRINT]},
        **{SHARDS: runs_of(items), STARTED: started, SHARE: None},
    )
