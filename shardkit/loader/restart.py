"""A worker's dataset state at the point its samples were delivered, made again from a restart point.

When :meth:`~shardkit.MixedLoader.state_dict` is called, a worker has made more samples than the
batches delivered: the rest of a micro-batch cut part-way, the micro-batches queued in the main
process and those in flight. Where their records can be read again the saved state names them by
position (:mod:`shardkit.loader.loader_state`); where they cannot (``.pack()`` blocks, a
``.batch``, ``interleave``, a wrapped plain iterable) they used to travel in the state as data,
about 8 KB a packed block of 2048 int32 tokens.

Instead, a worker of a pipeline whose sources read records again (:func:`restartable`; not a
wrapped plain iterable, whose samples stay data) keeps a few *restart points*: its dataset's state after a known number of its
samples, taken (never sent) whenever the work since the last one is at least
:data:`POINT_RATIO` times what a state costs (so keeping them costs at most about 1% of the
worker's time), and the state it started its iteration from. The main process asks for the state
at the *point*, the number of the worker's samples it has delivered (the ask's second slot in
shared memory, :mod:`shardkit.loader.micro_batches`); the worker loads its latest restart point at
or before it into a copy of its dataset, makes and drops the samples between the two (at most
:data:`MAX_SKIP`), and answers with the copy's state: the dataset's exact position at the point,
with nothing carried (and keeps it as a restart point, so the next save starts there).
A save thus costs making again the samples since the latest point (a few ms to tens of
ms for packed blocks), against encoding them and carrying them in the state. It runs in the
worker process that made the samples, so the copy reads the same shards as the same worker of
the same rank: the samples it makes again are the ones it made, provided the pipeline is deterministic given its state (the requirement a ``.map`` already meets
for records read again by position: its output a function of its input and ``record_seed()``).
The saved state is an ordinary one, so it merges over workers and ranks as any other (elastic
resume, ``merge_ranks``) and no new field is saved. Where no restart point lies within
:data:`MAX_SKIP` samples before the point, the worker answers with its state after the micro-batch
it sends, and the samples before it are carried as before.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass
from typing import Any

from shardkit.pipeline import Pipeline
from shardkit.stateful import State, StateError

#: A restart point is kept once the worker's work since the last is this many times what a state costs (~1%).
POINT_RATIO = 99.0
#: The most samples a worker makes again to answer an ask; further from a restart point, it carries them.
MAX_SKIP = 4096
#: Restart points a worker keeps (the latest ones; the point asked for is at most a few micro-batches back).
KEPT = 8


def restartable(dataset: Any) -> bool:
    """Whether a worker of ``dataset`` keeps restart points: a shardkit pipeline every source of which
    reads its records again (``records()``: shards, a map-style dataset). A wrapped plain iterable is
    not one: it may not give the same items twice (nor be copied), so what it made is carried as data."""
    if not isinstance(dataset, Pipeline):
        return False
    if not dataset.upstream:
        return dataset.records() is not None
    return all(restartable(upstream) for upstream in dataset.upstream)


@dataclass(frozen=True, slots=True)
class AtPoint:
    """A worker's answer to an ask (sent in a message's state slot): ``state``, its dataset's state after
    ``point`` of its samples (None where it cannot make it), and ``after``, its state after the
    micro-batch the answer comes with (None when ``state`` is given)."""

    point: int
    state: Any
    after: Any


class RestartPoints:
    """A worker's recent restart points: ``(samples made, dataset state)``, oldest first."""

    def __init__(self, dataset: Any) -> None:
        self._dataset = dataset
        self._replica: Any = None  # a copy of the dataset, made at the first answer, loaded anew for each
        self._points: deque[tuple[int, State]] = deque(maxlen=KEPT)
        self.made = 0  #: samples this iteration has made so far

    def keep(self, state: Any, made: int | None = None) -> None:
        """Keep ``state`` (the dataset's, after ``made`` samples, default :attr:`made`) as a restart point
        (not a failure message), in order."""
        if not isinstance(state, dict):
            return
        made = self.made if made is None else made
        place = sum(1 for kept, _ in self._points if kept <= made)
        if place == 0 and len(self._points) == KEPT:
            return  # older than every point kept
        if len(self._points) == KEPT:
            self._points.popleft()
            place -= 1
        self._points.insert(place, (made, state))

    def state_at(self, point: int) -> State | None:
        """The dataset's state after ``point`` of its samples; None without a restart point at most
        :data:`MAX_SKIP` samples before it.

        Raises:
            StateError: the samples made again end before the point (the shards changed under the run).
        """
        found = [(made, state) for made, state in self._points if made <= point <= self.made]
        if not found or point - found[-1][0] > MAX_SKIP:
            return None
        made, state = found[-1]
        if made == point:
            return state
        if self._replica is None:
            self._replica = copy.deepcopy(self._dataset)  # without its live iterator (Pipeline.__getstate__)
        exact = remade(self._replica, state, point - made, self._dataset)
        self.keep(exact, point)  # the next save, further on, starts from here
        return exact


def remade(replica: Any, state: State, skip: int, dataset: Any = None) -> State:
    """The state of ``replica`` (a copy of ``dataset``, with counters of its own: its reads are not
    counted twice) loaded with ``state`` after its next ``skip`` samples.

    Raises:
        StateError: the stream ends before ``skip`` samples.
    """
    dataset = replica if dataset is None else dataset
    replica.load_state_dict(state)
    samples = iter(replica)
    for made in range(skip):
        if next(samples, _END) is _END:
            raise StateError(
                f"MixedLoader.state_dict(): a worker of {dataset!r} made {skip} samples after a restart point, "
                f"but read again from it the stream ends after {made}: its shards ({_shards(dataset)}) changed "
                "while they were read (a file truncated or replaced), or the pipeline is not deterministic given "
                "its state; load the last state saved"
            )
    return replica.state_dict()


def _shards(dataset: Any) -> str:
    """The shard lists of ``dataset``'s sources, for an error (a ShardList names its first and last url)."""
    if not isinstance(dataset, Pipeline) or dataset.upstream:
        return ", ".join(_shards(upstream) for upstream in getattr(dataset, "upstream", ()))
    return repr(getattr(dataset, "shards", dataset))


_END = object()
