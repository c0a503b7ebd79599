"""Every rank's state in one checkpoint: a loader's state gathered over the ranks, each rank's own entry picked on load.

Trainers write the loader's ``state_dict()`` from rank 0 only (Lightning's
``dump_checkpoint`` and Accelerate's ``save_state`` call it on every rank and
keep rank 0's), so a state of one rank would resume every rank from rank 0's
position. Under an initialised process group of more than one rank,
:class:`~shardkit.MixedLoader` and :class:`~shardkit.StatefulDataLoader`
therefore return a ``"ranks"`` node, the same on every rank::

    {"version": 1, "kind": "ranks", "world_size": W, "states": [state of rank 0, ..., state of rank W - 1]}

Loaded with the same world size, each rank takes its own entry
(:func:`own_or_global`). On another world size, or without a process group,
the entries are merged into one global state (:func:`shardkit.state.merge_ranks`),
which resumes on any world size where the pipeline's stages can be split
over ranks. A loaded node is checked like every node (:func:`check_ranks`):
a missing or mistyped field is a ``StateError`` naming it.

How the states travel (:func:`gather`). Not through a collective of the
default group: ``state_dict()`` called on some ranks only (a checkpoint
written under ``if rank == 0``) would wait in it forever, and a collective
joined by some ranks only shifts the group's sequence, pairing the next
gradient all-reduce with it. Instead each rank's *k*-th gather puts its
state, as JSON (plain data, never pickle), in the job's key-value store (the
one ``init_process_group`` rendezvoused through,
:func:`shardkit.jobstore.group_store`) under ``shardkit/ranks/<k>/<rank>``,
and waits for the other ranks' keys for at most the job's timeout (the
store's: ``init_process_group(timeout=...)``), warning every
:data:`WARN_EVERY` seconds which ranks it waits for. A rank still missing
then is a ``StateError`` naming it and the fix: call ``state_dict()`` on
every rank, or save this rank's state alone (``state_dict(gather=False)``,
or ``gather_states=False`` when building the loader). A rank whose state
cannot be made posts its error instead, so the others raise at once rather
than at the timeout. The last rank to read the states removes the keys.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from shardkit.errors import redact
from shardkit.jobstore import WAIT, group_store, tidy_keys
from shardkit.stateful import State, StateError, check, field, node, whole_number

__all__ = ["RANKS", "STATES", "WORLD_SIZE", "check_ranks", "gather", "is_ranks", "own_or_global", "ranks_node"]

RANKS = "ranks"  #: the kind of the node holding every rank's state
WORLD_SIZE = "world_size"  #: the number of ranks that saved it
STATES = "states"  #: each rank's state, in rank order

#: Seconds between the warnings of a rank that waits for the others' states.
WARN_EVERY = 30.0

_OK, _ERROR = b"ok:", b"error:"
_count = itertools.count()  # this process's gathers: the k-th on every rank meet under the same keys
_count_lock = threading.Lock()


def ranks_node(states: Sequence[State]) -> State:
    """The ``"ranks"`` node holding ``states``, the state of rank ``r`` at index ``r``."""
    return node(RANKS, **{WORLD_SIZE: len(states), STATES: list(states)})


def is_ranks(state: object) -> bool:
    """Whether ``state`` is (meant to be) a ``"ranks"`` node."""
    return isinstance(state, dict) and state.get("kind") == RANKS


def check_ranks(state: object, where: str) -> list[State]:
    """The entries of a loaded ``"ranks"`` node, after checking every field of it
    (an entry itself is checked by the loader that loads it)."""
    checked = check(state, RANKS, where)
    world_size = whole_number(checked, WORLD_SIZE, where, 1)
    states = field(checked, STATES, where, list, tuple)
    if len(states) != world_size:
        raise StateError(
            f"{where}: state[{STATES!r}] holds {len(states)} states for world_size={world_size}; "
            "the state was edited or is corrupt"
        )
    for rank, entry in enumerate(states):
        if type(entry) is not dict:
            raise StateError(f"{where}: state[{STATES!r}][{rank}] must be a dict, got {type(entry).__name__}")
    return list(states)


def own_or_global(
    state: State, where: str, merge_ranks: Callable[[list[State]], State], place: tuple[int, int] | None = None
) -> State:
    """What a rank loads of a ``"ranks"`` node: its own entry when the world size is
    the one that saved it, else ``merge_ranks(entries)``, the global state of all.

    ``place`` is ``(rank, world_size)``; None reads the process group's (no group:
    a world of its own, which merges).
    """
    entries = check_ranks(state, where)
    if place is None:
        place = _place()
    if place is not None and place[1] == len(entries):
        return entries[place[0]]
    return merge_ranks(entries)


def gather(make_state: Callable[[], State], where: str, timeout: timedelta | None = None) -> State:
    """``make_state()`` of every rank in a ``"ranks"`` node, on every rank; without a
    process group of more than one rank, ``make_state()`` as it is.

    ``timeout`` (default: the job's) bounds the wait for the other ranks.

    Raises:
        StateError: a rank did not post its state within the timeout, a rank's
            state could not be made (its error, on every rank), or it is not JSON.
    """
    store = group_store()
    if store is None:
        return make_state()
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    with _count_lock:
        prefix = f"shardkit/ranks/{next(_count)}/"
    keys = [f"{prefix}{r}" for r in range(world_size)]
    store.set(keys[rank], _posted(make_state, rank, where, store, keys[rank]))
    _wait(store, keys, rank, where, _job_timeout(store) if timeout is None else timeout)
    values = [bytes(store.get(key)) for key in keys]
    tidy_keys(store, prefix, keys, world_size)
    states = []
    for other, value in enumerate(values):
        if value.startswith(_ERROR):
            message = value[len(_ERROR) :].decode(errors="replace")
            raise StateError(f"{where}: rank {other} could not save its state: {message}")
        states.append(json.loads(value[len(_OK) :]))
    return ranks_node(states)


def _posted(make_state: Callable[[], State], rank: int, where: str, store: Any, key: str) -> bytes:
    """What this rank posts: its state as JSON, or (posted, then raised) its error."""
    try:
        state = make_state()
        try:
            text = json.dumps(state)
        except (TypeError, ValueError) as error:
            raise StateError(
                f"{where}: rank {rank}'s state is not plain data ({error}); a state gathered over the ranks "
                "travels as JSON"
            ) from None
    except Exception as error:  # every rank must learn of it, or the others wait for the timeout
        store.set(key, _ERROR + f"{type(error).__name__}: {redact(str(error))}".encode())
        raise
    return _OK + text.encode()


def _wait(store: Any, keys: list[str], rank: int, where: str, timeout: timedelta) -> None:
    """Wait for every rank's key, warning every :data:`WARN_EVERY` s; raise naming the missing ranks."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=max(min(left, WARN_EVERY), 0.001)))
            return
        except Exception as error:  # noqa: BLE001 - a timed-out wait: which exception depends on the store
            missing = _missing(store, keys, rank, where, error)
        if not missing:
            return
        names = ", ".join(map(str, missing))
        if time.monotonic() >= deadline:
            _withdraw(store, keys[rank])
            raise StateError(
                f"{where} on rank {rank}: rank(s) {names} did not save their state within "
                f"{timeout.total_seconds():g} s. Under a process group every rank's state goes into one "
                "checkpoint, so call state_dict() on every rank (trainers do), not under `if rank == 0`; or "
                "save this rank's state alone with state_dict(gather=False), or build the loader with "
                "gather_states=False"
            )
        warnings.warn(
            f"{where} on rank {rank}: waiting for the state of rank(s) {names}; call state_dict() on every rank",
            stacklevel=4,
        )


def _missing(store: Any, keys: list[str], rank: int, where: str, error: Exception) -> list[int]:
    """The ranks whose keys are not in the store yet; a store that cannot answer is a StateError."""
    try:
        return [r for r, key in enumerate(keys) if not store.check([key])]
    except Exception as broken:  # noqa: BLE001 - the store lives on a rank or agent that may be gone
        raise StateError(
            f"{where} on rank {rank}: the job's store, through which the ranks' states are gathered, failed "
            f"({type(error).__name__}: {error}; then {type(broken).__name__}: {broken}); a rank or the launcher "
            "may have died"
        ) from None


def _withdraw(store: Any, key: str) -> None:
    """Remove this rank's posted state after a failed gather, so a late rank cannot take it as current."""
    try:
        store.delete_key(key)
    except Exception:  # noqa: BLE001, S110 - a store that cannot delete: the key is left, as it would be
        pass


def _job_timeout(store: Any) -> timedelta:
    """The job's timeout, which ``init_process_group`` gives its store; else :data:`shardkit.jobstore.WAIT`."""
    timeout = getattr(store, "timeout", None)
    return timeout if isinstance(timeout, timedelta) and timeout > timedelta(0) else WAIT


def _place() -> tuple[int, int] | None:
    """``(rank, world_size)`` of the initialised process group, or None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()
