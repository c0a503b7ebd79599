"""Saved positions: the format of ``state_dict()``, its checks, and merging.

Every shardkit pipeline has ``state_dict()`` / ``load_state_dict(state)`` (the
Stateful protocol of torchdata's ``StatefulDataLoader``). A state is a tree of
plain dicts, one node per pipeline stage, that ``json`` and ``torch.save`` can
hold. Every node has ``"version"`` (:data:`VERSION`) and ``"kind"``; nodes
with inputs hold their state under ``"upstream"``.

Kinds (version 1):

* ``"planned"`` (shard files, map-style datasets): ``epoch``, ``world_size``,
  ``rank``, a ``fingerprint`` of the dataset (shard count, record count, seed,
  shuffle, balance; no file names), ``remaining``: the ``[start, stop)``
  intervals of positions of this rank's chunk still to read (see
  :func:`shardkit.planning.plan_intervals`), and ``share``: ``[worker,
  num_workers]`` when ``remaining`` is one DataLoader worker's own part, or
  None when it is the whole rank's. Positions count records, not samples: a
  record skipped under ``on_error="skip"`` counts as read.
* ``"stream"`` (``wrap`` of a plain iterable): ``items`` the reader has
  stepped past, whether it is ``done``, and its ``reader`` slot; resuming
  iterates the iterable again and skips them (it must repeat itself).
* ``"map"``, ``"filter"``, ``"batch"``: only ``upstream`` (a batch is built
  in one step, so there is never a partial one to save).
* ``"shuffle"``: the buffered samples (``buffer``: chunks encoded with
  :func:`encode`), the generator position (``rng``) and ``share``. The
  contents are saved rather than re-derived: exact and cheap to restore, at
  the cost of a state as large as the buffer.
* ``"repeat"``: the ``pass``, whether it has yielded (``yielded``) and the
  pass's ``upstream`` state (None once every pass is done).
* ``"interleave"``: per-input states (None for inputs never read), the
  ``live`` inputs, the generator position, ``stopped`` and ``share``.

Every stage that draws or reads also records the ``epoch`` its iteration
reads (inside ``repeat``, including the pass). A loaded state resumes an
iteration of that epoch; an iteration of a later epoch ignores it.

Samples are kept only where they cannot be read again: shuffle buffers, and
the undelivered tail of a micro-batch in :class:`~shardkit.MixedLoader`.
:func:`decode` unpickles them: load only states you wrote.

States of all DataLoader workers of one rank merge (:func:`merge`) into one
state of the rank (``share`` None) that any number of workers can resume:
each takes an even part of the remaining positions and of the buffered
samples. That is how :class:`~shardkit.MixedLoader` restores elastically.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from shardkit.errors import ShardkitError
from shardkit.planning import union

#: Version of the state format written by this shardkit.
VERSION = 1

State = dict[str, Any]


class StateError(ShardkitError, ValueError):
    """A state that cannot be saved, or that does not fit what it is loaded into."""


def node(kind: str, **fields: Any) -> State:
    """A state node of ``kind`` with the current :data:`VERSION`."""
    return {"version": VERSION, "kind": kind, **fields}


def check(state: object, kind: str, owner: object) -> State:
    """Return ``state`` if it is a version-1 node of ``kind``, else raise :class:`StateError`."""
    if not isinstance(state, dict):
        raise StateError(f"{owner!r}: a state must be a dict from state_dict(), got {type(state).__name__}")
    version = state.get("version")
    if version != VERSION:
        raise StateError(
            f"{owner!r}: state version {version!r} is not supported; this shardkit reads version {VERSION}"
        )
    if state.get("kind") != kind:
        raise StateError(
            f"{owner!r}: the state is of a {state.get('kind')!r} stage but this stage is {kind!r}; "
            "load the state into the same pipeline (same stages in the same order) that saved it"
        )
    return state


def expect_equal(owner: object, what: str, saved: object, actual: object) -> None:
    """Raise :class:`StateError` naming ``what`` if the saved and actual values differ."""
    if saved != actual:
        raise StateError(f"{owner!r}: the state was saved with {what} {saved!r}, but here it is {actual!r}")


def applies(state: State, epoch: int, owner: object) -> bool:
    """Whether a loaded ``state`` resumes an iteration of ``epoch``.

    A state of the same epoch does. A state of an earlier epoch does not: the
    epoch has moved on (``set_epoch``), and the iteration starts afresh. A
    state of a later epoch means ``set_epoch`` was not called: raised.
    """
    saved = state["epoch"]
    if saved == epoch:
        return True
    if saved < epoch:
        return False
    raise StateError(
        f"{owner!r}: the loaded state is of epoch {saved}, but this iteration reads epoch {epoch}; "
        f"call set_epoch({saved}) before iterating to finish that epoch"
    )


def own_share(state: State, worker_id: int, num_workers: int, owner: object) -> bool:
    """True if ``state`` is this worker's own part, False if it is the whole
    rank's (to be split among the workers); raises if it is another worker's."""
    share = state["share"]
    if share is None:
        return False
    if list(share) == [worker_id, num_workers]:
        return True
    raise StateError(
        f"{owner!r}: the state is DataLoader worker {share[0]}'s of {share[1]}, loaded into worker "
        f"{worker_id} of {num_workers}; restore each worker's state into the same worker (StatefulDataLoader "
        "does), or merge the states of all workers with shardkit.state.merge() to resume with any number"
    )


def share_of(worker_id: int, num_workers: int) -> list[int] | None:
    """The ``share`` a reader records: None when it is the rank's only worker."""
    return None if num_workers == 1 else [worker_id, num_workers]


def encode(value: Any) -> str:
    """``value`` (samples: tensors, arrays, any picklable object) as a base64 string."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode(text: str) -> Any:
    """The value :func:`encode` made ``text`` from. Only decode states you trust: it unpickles."""
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=False)


def generator_state(rng: np.random.Generator) -> dict[str, Any]:
    """The position of a numpy generator, as plain data."""
    return rng.bit_generator.state


def restore_generator(state: dict[str, Any]) -> np.random.Generator:
    """A numpy generator at the position :func:`generator_state` saved."""
    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = state
    return np.random.Generator(bit_generator)


# -- merging the states of all workers of a rank --------------------------------


def merge(states: Sequence[State]) -> State:
    """One state for the whole rank from the states of all its DataLoader workers.

    The result resumes with any number of workers: every stage's ``share`` is
    None, remaining positions are united, buffered samples pooled, and
    generator positions dropped (workers restart their draws from the epoch's
    seed; which samples come is exact, their order after the restore is not
    the uninterrupted one).

    Raises:
        StateError: for states of different pipelines, epochs or ranks, an
            incomplete set of workers, or stages that cannot be split anew
            (``wrap`` of a plain iterable, workers in different ``repeat``
            passes, a ``stop="first_exhausted"`` interleave that has stopped).
    """
    if not states:
        raise StateError("merge() needs the state of every worker, got none")
    kinds = {s.get("kind") for s in states}
    if len(kinds) != 1:
        raise StateError(f"cannot merge states of different stages {sorted(map(str, kinds))}")
    kind = states[0]["kind"]
    merger = _MERGERS.get(kind)
    if merger is None:
        raise StateError(f"unknown state kind {kind!r}")
    if len(states) == 1 and kind != "stream":
        states = [_whole(states[0])]
    return merger(states)


def _whole(state: State) -> State:
    """A one-worker state: its share is the whole rank."""
    share = state.get("share")
    if share is not None and share[1] != 1:
        raise StateError(
            f"this state is worker {share[0]}'s of {share[1]}; merge needs the states of all {share[1]} workers"
        )
    return state


def _same(states: Sequence[State], key: str) -> Any:
    values = [s[key] for s in states]
    if any(v != values[0] for v in values):
        raise StateError(f"cannot merge worker states with different {key}: {values}")
    return values[0]


def _check_shares(states: Sequence[State]) -> None:
    shares = [s.get("share") for s in states]
    if all(share is None for share in shares):
        return
    if any(share is None for share in shares):
        raise StateError("cannot merge a whole-rank state with per-worker states")
    count = shares[0][1]
    if sorted(tuple(s) for s in shares) != [(w, count) for w in range(count)]:
        raise StateError(f"merge needs the states of all {count} workers exactly once, got shares {shares}")


def _merge_upstreams(states: Sequence[State]) -> State:
    return merge([s["upstream"] for s in states])


def _merge_pass_through(states: Sequence[State]) -> State:
    return node(states[0]["kind"], upstream=_merge_upstreams(states))


def _merge_planned(states: Sequence[State]) -> State:
    _check_shares(states)
    fields = {key: _same(states, key) for key in ("epoch", "world_size", "rank", "fingerprint")}
    remaining = union([interval for s in states for interval in s["remaining"]])
    return node("planned", **fields, remaining=[list(i) for i in remaining], share=None)


def _merge_stream(states: Sequence[State]) -> State:
    if len(states) == 1:
        return states[0]
    raise StateError(
        "a wrap() of a plain iterable resumes only into the same reader slot (same num_workers): "
        "its readers keep every n-th item, so their positions cannot be split anew. "
        "Wrap a map-style dataset or use shard files to resume with another number of workers"
    )


def _merge_shuffle(states: Sequence[State]) -> State:
    _check_shares(states)
    return node(
        "shuffle",
        epoch=_same(states, "epoch"),
        buffer=[chunk for s in states for chunk in s["buffer"]],
        rng=None,
        share=None,
        upstream=_merge_upstreams(states),
    )


def _merge_repeat(states: Sequence[State]) -> State:
    passes = [s["pass"] for s in states]
    if any(p != passes[0] for p in passes):
        raise StateError(
            f"workers are in different repeat() passes {passes}; such a state resumes only with the "
            "same number of workers"
        )
    upstreams = [s["upstream"] for s in states]
    if any(u is None for u in upstreams) != all(u is None for u in upstreams):
        raise StateError("cannot merge repeat() states where some workers have finished and others not")
    return node(
        "repeat",
        epoch=_same(states, "epoch"),
        **{"pass": passes[0]},
        yielded=any(s["yielded"] for s in states),
        upstream=None if upstreams[0] is None else merge(upstreams),
    )


def _merge_interleave(states: Sequence[State]) -> State:
    _check_shares(states)
    stopped = [s["stopped"] for s in states]
    if any(stopped) and not all(stopped):
        raise StateError(
            "an interleave(stop='first_exhausted') has stopped in some workers: where the mix ends "
            "depends on each worker's draws, so the state resumes only with the same number of workers"
        )
    inputs = []
    for index in range(len(states[0]["upstream"])):
        parts = [s["upstream"][index] for s in states if s["upstream"][index] is not None]
        inputs.append(merge(parts) if parts else None)
    return node(
        "interleave",
        epoch=_same(states, "epoch"),
        upstream=inputs,
        live=sorted({i for s in states for i in s["live"]}),
        rng=None,
        stopped=all(stopped),
        share=None,
    )


_MERGERS: dict[str, Callable[[Sequence[State]], State]] = {
    "planned": _merge_planned,
    "stream": _merge_stream,
    "map": _merge_pass_through,
    "filter": _merge_pass_through,
    "batch": _merge_pass_through,
    "shuffle": _merge_shuffle,
    "repeat": _merge_repeat,
    "interleave": _merge_interleave,
}

__all__ = ["VERSION", "State", "StateError", "decode", "encode", "merge"]
