"""Saved positions: the format of ``state_dict()``, its checks, and merging.

Every shardkit pipeline has ``state_dict()`` / ``load_state_dict(state)`` (the
Stateful protocol of torchdata's ``StatefulDataLoader``). A state is a tree of
plain dicts, one node per pipeline stage, that ``json`` and ``torch.save`` can
hold. Every node has ``"version"`` (:data:`VERSION`) and ``"kind"``; nodes
with inputs hold their state under ``"upstream"``.

Each kind belongs to one stage's iterator class (a :class:`StageIterator`;
``"planned"`` and ``"stream"`` in :mod:`shardkit.sources`, the others in the
modules of :mod:`shardkit.pipeline`), which holds its keys as constants and,
beside ``__next__``, how the node is saved, restored, checked and merged;
defining the class registers the kind. The class's docstring is the node's
schema: every key and what it holds, written once, there. This module holds
what all stages share: the node envelope, the checks common to several
kinds, the sample encoding, and :func:`merge` / :func:`merge_ranks`, which
hand each node to its kind's class; it imports every built-in stage, so a
state merged or checked here knows every kind.

Keys several kinds share mean the same in each: ``epoch`` (below),
``upstream`` (the inputs' nodes), ``share`` (``[worker, num_workers]`` when
the node is one DataLoader worker's own part, None when it is the whole
rank's) and ``rng`` (a draw position: a numpy generator state and an index
in its block, None after a merge).

Every stage that draws or reads also records the ``epoch`` its iteration
reads (inside ``repeat``, including the pass). A loaded state resumes an
iteration of that epoch; an iteration of a later epoch ignores it.

Samples are kept only where they cannot be read again: a shuffle buffer holds
its records' positions (:mod:`shardkit.stateful.positions`, read again on
restore) where the pipeline below it can read them again, else its samples;
pack pieces and the undelivered tail of a micro-batch in
:class:`~shardkit.MixedLoader` are kept as samples.

States are plain data, and only ours. Samples are saved as a tagged tree of
JSON values (:func:`encode`), never pickled: tensors (dense, CPU), numpy
arrays and scalars of non-object dtypes, str, bytes, int, float, bool, None,
and lists, tuples and dicts of them; anything else (another class, a dict
subclass, a namedtuple) is refused when the state is saved, naming the type.
:func:`decode` builds only those types, so loading a state never runs code.
Every loaded node is checked (:func:`check`, :func:`validate`) before it is
used: a missing key, a wrong type, an interval out of order or out of the
rank's chunk, an unknown kind or version, a negative epoch, an int that does
not fit in 64 bits (outside samples and generator states) or a share that
does not fit is a :class:`StateError` naming the field, never a ``KeyError``
deep in an iterator or an epoch that silently ends early.

States of all DataLoader workers of one rank merge (:func:`merge`) into one
state of the rank (``share`` None) that any number of workers can resume:
each takes an even part of the remaining positions and of the buffered
samples. That is how :class:`~shardkit.MixedLoader` restores elastically.

The states of all ranks combine (:func:`merge_ranks`, or :func:`gather`
through the process group) into one *global* ``"planned"`` state: ``rank``
None, ``remaining`` in positions of the epoch's global stream (records not
delivered by any rank; repeats that ``"pad"`` planned are not owed), and
``world_size`` the world size that stream was planned for. It loads on any
world size and number of workers: each rank takes its part with
:func:`~shardkit.planning.split_remaining` (``"pad"``/``"drop"`` equalise
the counts again), and a state it saves later carries that global state as
``base`` (its positions count within its part), so it can be gathered again.

What only memory holds joins the global remainder too. A ``.shuffle(n)``
node pools every rank's buffered samples (``balance`` marks the global
node); each rank of the new world takes its part of the pool with
:func:`deal` by the stream's balance, then each of its workers every
``num_workers``-th of that, so under ``"pad"``/``"drop"`` every new rank
gets the same count of held samples as of positions, and the same count per
worker: batch counts stay equal. ``"pad"`` may deal a held sample twice;
such a repeat is marked (``repeats``) and a later gather owes it to no one.
An ``interleave`` combines each input's nodes on its own and restarts its
draws; a ``repeat`` combines the nodes of the pass every rank is in. A
:class:`~shardkit.MixedLoader` state combines into a global
``"mixed_loader"`` state whose ``workers`` is the global dataset state and
whose ``carry`` pools the tails of cut micro-batches, dealt the same way
(:mod:`shardkit.loader.loader_state`); it loads into a MixedLoader on any
world size and ``num_workers``, 0 included. Merging is exact again after an
elastic resume: a state saved on the new world gathers once more.

What still keeps per-rank positions: a ``wrap`` of a plain iterable, ranks
in different ``repeat`` passes, and an ``interleave(stop="first_exhausted")``
that has stopped on some ranks only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The built-in stages register their state kinds when their modules are imported;
# importing them here means any state merged or checked through this module knows
# every kind, even in a process that built no pipeline.
import shardkit.pipeline  # noqa: F401
import shardkit.sources  # noqa: F401
from shardkit.loader.loader_state import KIND as LOADER_KIND
from shardkit.loader.loader_state import combine_loader_ranks
from shardkit.stateful import *  # noqa: F403  (the node protocol and the codec, for stages written by users)
from shardkit.stateful import State, StateError, check, combine_ranks, field, merge, whole_number
from shardkit.stateful import __all__ as _stateful_names

# -- combining the states of all ranks -----------------------------------------


def merge_ranks(states: Sequence[State | Sequence[State]]) -> State:
    """One global state from the states of every rank (rank order not needed).

    Each item is one rank's state: a whole-rank state (``share`` None, as
    :func:`merge` makes), the list of its workers' states (merged here), or
    a :class:`~shardkit.MixedLoader` state (then all are, and the result is
    a global MixedLoader state, with the tails of cut micro-batches pooled).
    The result holds, in global stream positions, exactly the records no
    rank has delivered yet (``rank`` None, ``world_size`` the world size the
    epoch's stream was planned for), and loads into the same pipeline on
    any world size and number of workers: each rank takes its part with
    :func:`~shardkit.planning.split_remaining`, so ``"pad"``/``"drop"``
    give every new rank the same count again. Buffered samples (shuffle
    buffers, cut micro-batches) are pooled and dealt the same way (see the
    module docstring). Repeats that ``"pad"`` had planned and not yet
    delivered are not owed: they are left out.

    Raises:
        StateError: states of different pipelines or epochs, a rank missing
            or given twice, positions two ranks both hold, or stages whose
            state cannot be split over ranks (a ``wrap`` of a plain
            iterable, ranks in different ``repeat`` passes, an interleave
            stopped on some ranks only).
    """
    if not states:
        raise StateError("merge_ranks() needs the state of every rank, got none")
    if any(isinstance(s, dict) and s.get("kind") == LOADER_KIND for s in states):
        return combine_loader_ranks(states)
    wholes = [merge(list(s)) if isinstance(s, (list, tuple)) else merge([s]) for s in states]  # type: ignore[list-item]
    return combine_ranks(wholes)


def gather(state: State | Sequence[State], group: Any = None) -> State:
    """The global state of all ranks, on every rank, through the process group.

    ``state`` is this rank's pipeline state (or the list of its DataLoader
    workers' states, or a :class:`~shardkit.MixedLoader` state); the states travel as JSON-able objects with
    ``all_gather_object``. Without an initialised process group, the state
    of this one rank is made global. A state that already holds every
    rank's (a loader's ``state_dict()`` under a process group, see
    :mod:`shardkit.ranks`) is merged as it is, with no collective.
    Save the result (one file suffices, any rank) and load it with
    ``load_state_dict`` on any world size; see :func:`merge_ranks` for what
    it holds and raises.
    """
    import torch.distributed as dist

    if isinstance(state, dict) and state.get("kind") == "ranks":
        return merge_ranks(_rank_entries(state))
    if not (dist.is_available() and dist.is_initialized()):
        return merge_ranks([state])
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, state, group=group)
    return merge_ranks(gathered)


def _rank_entries(state: State) -> list[State]:
    """The entries of a ``"ranks"`` node (every rank's state), checked: the node's layout
    is :mod:`shardkit.ranks`'s, which sits above this module."""
    where = "gather()"
    world_size = whole_number(check(state, "ranks", where), "world_size", where, 1)
    entries = field(state, "states", where, list, tuple)
    if len(entries) != world_size:
        raise StateError(f"{where}: state['states'] holds {len(entries)} states for world_size={world_size}")
    return list(entries)


__all__ = [*_stateful_names, "gather", "merge_ranks"]
