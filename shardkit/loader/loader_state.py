"""A :class:`~shardkit.MixedLoader`'s saved state: how it is made, and every check a
loaded one goes through before a worker is started with it.

A state (kind ``"mixed_loader"``) holds the ``epoch``, ``num_workers``,
``batch_size``, the ``batch_index``, whether the epoch has ``finished``,
``workers`` (each worker's dataset state at or past what was delivered) and
``carry``, at most one tail per worker of the samples between the two (see
the :mod:`shardkit.loader.mixed` docstring): the rest of a micro-batch cut
part-way, and, since a worker sends its state with some micro-batches only
(:mod:`shardkit.loader.micro_batches`), the whole micro-batches received
before the one its saved state came with. A tail is ``{"worker", "count"}``
(``worker`` None: a tail restored from another worker count) with its samples
in one of two forms:

* by position (where the dataset can read its records again,
  ``Pipeline.records()``): ``"positions"``, the samples' (shard, record)
  positions (about 11 bytes a sample whatever its size), or ``"runs"``, the
  same as runs of consecutive records (shard, first record, length; a few
  bytes a run), whichever is smaller, and ``"identities"``, a digest of each
  named shard's identity (:mod:`shardkit.stateful.positions`). Restored, they are read again in the main process
  (:func:`read_again`), through the pipeline's maps and filters, after the
  shards' identities are checked, and collated as a worker would;
* as data: ``"payload"``, the samples encoded (:func:`~shardkit.state.encode`),
  where they cannot be read again (a wrapped plain iterable, a ``.batch`` or
  ``interleave`` on top, column batches, a dataset that is no shardkit pipeline).

Optionally, ``"repeat": true`` when its samples are ``"pad"`` repeats, owed
to no later gather.

A worker whose dataset state was made at the delivered point
(:mod:`shardkit.loader.restart`) has no tail: its state is past exactly
what was delivered.

The states of all ranks combine (:func:`combine_loader_ranks`, through
:func:`shardkit.state.merge_ranks`) into one *global* state: ``workers``
holds one node, the global dataset state; ``carry`` every rank's tails
(repeats left out), each of worker None; ``num_workers`` is 0 and
``balance`` (present in a global state only) is the stream's balance, by
which each rank of a new world takes its part of the carried samples
(:func:`deal_carry`), so that ``"pad"``/``"drop"`` keep the ranks' counts,
hence their batch counts, equal.

Both the loader and its :class:`~shardkit.loader.mixer.Mixer` make states,
so what they read of a loader is the :class:`LoaderSettings` protocol rather
than the class, which sits above this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
from torch.utils.data import default_collate

from shardkit.loader import slab_columns
from shardkit.loader.collate import collated_length
from shardkit.loader.collate import tail as micro_batch_tail
from shardkit.pipeline import Pipeline
from shardkit.stateful import (
    Records,
    State,
    StateError,
    check,
    check_balance,
    check_identities,
    check_identities_field,
    combine_ranks,
    deal,
    decode,
    decode_positions,
    decode_runs,
    field,
    merge,
    node,
    same_value,
    stream_balance,
    validate,
    whole_number,
)
from shardkit.topology import Topology

KIND = "mixed_loader"
BALANCE = "balance"  #: state key of a global state only: the balance its carried samples are dealt by
REPEAT = "repeat"  #: tail key (optional): its samples are "pad" repeats, owed to no later gather
PAYLOAD = "payload"  #: tail key: its samples as data, encoded
POSITIONS = "positions"  #: tail key: its samples' record positions (an encoded [n, 2] array), read again on restore
RUNS = "runs"  #: tail key: its samples' record positions as runs of consecutive records (an encoded [k, 3] array)
IDENTITIES = "identities"  #: tail key (with positions or runs): the identities of the shards they name


class RecordedSettings(Protocol):
    """What a saved state records of the MixedLoader (or Mixer) that made it."""

    epoch: int
    num_workers: int
    batch_size: int


class LoaderSettings(RecordedSettings, Protocol):
    """What a loaded state is checked against."""

    dataset: Any
    collate_fn: Any
    _columns: bool


def loader_state(loader: RecordedSettings, **fields: Any) -> State:
    return node(
        KIND,
        epoch=loader.epoch,
        num_workers=loader.num_workers,
        batch_size=loader.batch_size,
        **fields,
    )


def check_loader_state(state: State, loader: LoaderSettings) -> list[Any]:
    """Check every field of a loaded MixedLoader state; returns its carried tails, decoded (a
    :class:`HeldTail` for one held by position: read again when the epoch starts).

    The workers' dataset states are checked as whole trees when the dataset is
    a shardkit pipeline (the dataset checks what depends on its files when a
    worker loads them); a carried tail must decode to ``count`` samples of
    the form this loader makes (collated, or a list for a ``collate_fn``).
    """
    where = "MixedLoader.load_state_dict()"
    num_workers, workers = check_recorded(state, where)
    for index, worker_state in enumerate(workers):
        if isinstance(loader.dataset, Pipeline):
            validate(worker_state, f"{where}: state['workers'][{index}]")
            check(worker_state, loader.dataset._state_kind, loader.dataset)
        elif not isinstance(worker_state, dict):
            raise StateError(f"{where}: state['workers'][{index}] must be a dict, got {type(worker_state).__name__}")
    carry = state["carry"]
    tails = [_check_tail(tail, index, num_workers, loader) for index, tail in enumerate(carry)]
    owners = [tail["worker"] for tail in carry if tail["worker"] is not None]
    if len(owners) != len(set(owners)):
        raise StateError(
            f"{where}: state['carry'] holds more than one tail of worker(s) {owners}; a worker has at most one"
        )
    return tails


def check_recorded(state: State, where: str) -> tuple[int, list[Any]]:
    """Check the fields of a MixedLoader state that need no loader; returns ``num_workers`` and ``workers``."""
    whole_number(state, "epoch", where)
    num_workers = whole_number(state, "num_workers", where)
    whole_number(state, "batch_size", where, 1)
    whole_number(state, "batch_index", where, -1)
    field(state, "finished", where, bool)
    workers = list(field(state, "workers", where, list, tuple))
    if len(workers) != max(num_workers, 1):
        raise StateError(f"{where}: the state has {len(workers)} worker states for num_workers={num_workers}")
    carry = field(state, "carry", where, list, tuple)
    if state["finished"] and carry:
        raise StateError(
            f"{where}: state['finished'] is true, but state['carry'] holds {len(carry)} tail(s) of undelivered "
            "samples; a finished epoch has delivered everything. The state was edited or is corrupt"
        )
    if BALANCE in state:
        check_balance(state, BALANCE, where)
        if num_workers != 0 or any(type(t) is dict and t.get("worker") is not None for t in state["carry"]):
            raise StateError(f"{where}: a global state (with 'balance') has num_workers 0 and tails of worker None")
    return num_workers, workers


def _check_tail(tail: Any, index: int, num_workers: int, loader: LoaderSettings) -> Any:
    where = f"MixedLoader.load_state_dict(): state['carry'][{index}]"
    if not isinstance(tail, dict):
        raise StateError(f"{where} must be a dict, got {type(tail).__name__}")
    worker = field(tail, "worker", where, int, type(None))
    if worker is not None and not 0 <= worker < max(num_workers, 1):
        raise StateError(f"{where}: worker {worker} is not one of the saving loader's {num_workers} workers")
    count = whole_number(tail, "count", where, 1)
    if REPEAT in tail:
        field(tail, REPEAT, where, bool)
    if sum(key in tail for key in (PAYLOAD, POSITIONS, RUNS)) != 1:
        raise StateError(f"{where} must hold its samples as one of 'payload' (data), 'positions' or 'runs'")
    if PAYLOAD not in tail:
        return _check_held(tail, count, where, loader)
    samples = decode(tail[PAYLOAD])
    if loader._columns:
        samples = slab_columns.from_plain(samples)
        length, form = slab_columns.columns_length(samples), "a column batch"
    elif loader.collate_fn is not None:
        length, form = (len(samples) if type(samples) is list else None), "a list of samples (for collate_fn)"
    else:
        length, form = collated_length(samples), "a collated micro-batch"
    if length != count:
        raise StateError(
            f"{where}: the carried samples must be {form} of {count} samples; got {_describe(samples, length)}"
        )
    return samples


class HeldTail(NamedTuple):
    """A loaded tail held by position: its samples' packed record positions and the identities of their shards."""

    positions: np.ndarray
    identities: dict[str, list[Any]]


def _check_held(tail: dict[str, Any], count: int, where: str, loader: LoaderSettings) -> HeldTail:
    if loader._columns:
        raise StateError(
            f"{where} holds samples by position, but this loader's dataset yields column batches, whose rows "
            "are carried as data; load the state into a loader over the dataset that saved it"
        )
    identities = check_identities_field(field(tail, IDENTITIES, where, dict), where)
    if RUNS in tail:
        return HeldTail(decode_runs(tail[RUNS], count, where), identities)
    positions = decode_positions(tail[POSITIONS], where)
    if len(positions) != count:
        raise StateError(f"{where}: 'positions' names {len(positions)} samples, but 'count' is {count}")
    return HeldTail(positions, identities)


def records_of(dataset: Any) -> Records | None:
    """How ``dataset`` makes its items again from their records' positions (``Pipeline.records()``); None: it cannot."""
    method = getattr(dataset, "records", None)
    found = method() if callable(method) else None
    return found if isinstance(found, Records) else None


def read_again(held: HeldTail, loader: LoaderSettings) -> Any:
    """The samples of a tail held by position, read again through the loader's dataset and collated
    as its workers collate a micro-batch (a list of samples for a ``collate_fn``).

    Raises:
        StateError: the dataset cannot read records again, a named shard is not the file it was
            (:func:`~shardkit.stateful.check_identities`), or a record cannot be made again as it was.
    """
    records = records_of(loader.dataset)
    if records is None:
        raise StateError(
            f"MixedLoader.load_state_dict(): the state holds carried samples by their records' positions, but "
            f"{loader.dataset!r} cannot read records again; load the state into a loader over the pipeline that saved it"
        )
    check_identities(records, held.identities, loader.dataset)
    samples = records.fetch(held.positions)
    return samples if loader.collate_fn is not None else default_collate(samples)


def _describe(samples: Any, length: int | None) -> str:
    return f"a {type(samples).__name__}" + ("" if length is None else f" of {length}")


# -- every rank's state in one, and each new rank's part of it -------------------


def combine_loader_ranks(states: Sequence[Any]) -> State:
    """The global MixedLoader state of every rank's (see the module docstring).

    Each rank's workers' dataset states merge (:func:`~shardkit.state.merge`),
    then over the ranks (:func:`~shardkit.state.combine_ranks`); the tails
    of cut micro-batches are pooled, their ``"pad"`` repeats left out.
    The states of one global state loaded on every rank and not iterated
    since are that state again.
    """
    checked = []
    for rank, state in enumerate(states):
        if type(state) is not dict or state.get("kind") != KIND:
            raise StateError(f"merge_ranks(): state {rank} is not a MixedLoader state, but the others are")
        where = f"merge_ranks(): the MixedLoader state of rank {rank}"
        check_recorded(check(state, KIND, where), where)
        checked.append(state)
    if all(BALANCE in s for s in checked) and all(s == checked[0] for s in checked):
        return checked[0]  # loaded on every rank, nothing delivered since
    if any(BALANCE in s for s in checked):
        raise StateError(
            "merge_ranks() takes the states of the ranks, not a global state gathered already; a rank that "
            "loaded a gathered state and has taken no batch since saves that state again: gather after "
            "every rank has taken a batch (in a training loop they step together)"
        )
    dataset = combine_ranks([merge(s["workers"]) for s in checked])
    carry = [
        {"worker": None, **{key: value for key, value in tail.items() if key in _SAMPLE_KEYS}}
        for s in checked
        for tail in s["carry"]
        if not tail.get(REPEAT)
    ]
    return node(
        KIND,
        epoch=same_value(checked, "epoch"),
        num_workers=0,
        batch_size=same_value(checked, "batch_size"),
        batch_index=max(s["batch_index"] for s in checked),
        finished=all(s["finished"] for s in checked),
        workers=[dataset],
        carry=carry,
        **{BALANCE: stream_balance(dataset)},
    )


_SAMPLE_KEYS = frozenset({"count", PAYLOAD, POSITIONS, RUNS, IDENTITIES})  # what a pooled tail keeps


class Carried(NamedTuple):
    """A tail of carried samples to restore: its saved entry (``worker``, ``count``) and its samples, decoded
    (a :class:`HeldTail` where they are held by position, read again by the mixer)."""

    entry: dict[str, Any]
    samples: Any


def deal_carry(state: State, tails: Sequence[Any], loader: LoaderSettings) -> list[Carried]:
    """The tails to restore from ``state``: all of them, or of a global state this rank's
    part of the pooled samples (:func:`~shardkit.state.deal` by its ``balance``; the
    rank is the loader's dataset's), cut into runs of consecutive samples of one tail,
    "pad" repeats marked."""
    carry = list(state["carry"])
    if BALANCE not in state:
        return [Carried(entry, samples) for entry, samples in zip(carry, tails)]
    topology = topology_of(loader.dataset)
    starts, total = [], 0
    for entry in carry:
        starts.append(total)
        total += entry["count"]
    runs: list[list[int]] = []  # [tail, first, stop, repeat]
    for index in deal(total, topology.world_size, topology.rank, state[BALANCE]):
        position, repeat = index % total, int(index >= total)
        which = max(t for t, start in enumerate(starts) if start <= position)
        offset = position - starts[which]
        if runs and runs[-1][0] == which and runs[-1][2] == offset and runs[-1][3] == repeat:
            runs[-1][2] += 1
        else:
            runs.append([which, offset, offset + 1, repeat])
    return [
        Carried(
            {"worker": None, "count": stop - first, **({REPEAT: True} if repeat else {})},
            _slice(tails[which], first, stop, loader),
        )
        for which, first, stop, repeat in runs
    ]


def _slice(samples: Any, start: int, stop: int, loader: LoaderSettings) -> Any:
    """Samples ``start:stop`` of a decoded tail, in the tail's form."""
    if isinstance(samples, HeldTail):
        return HeldTail(samples.positions[start:stop], samples.identities)
    if loader._columns:
        return slab_columns.tail(samples, start, stop)
    return micro_batch_tail(samples, start, stop, collated=loader.collate_fn is None)


def topology_of(dataset: Any) -> Topology:
    """The rank (and world) a loader's dataset reads for: its own ``topology()`` if it has one."""
    topology = getattr(dataset, "topology", None)
    found = topology() if callable(topology) else None
    return found if isinstance(found, Topology) else Topology.current()
