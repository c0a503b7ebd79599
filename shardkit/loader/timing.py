"""Where a worker's time goes: per-stage timing of a pipeline, cheap enough to stay on.

Timing every sample at every stage costs two clock reads and a Python call per
stage and sample (about 0.35 us here), a few percent of a 10 us sample. So a
worker times exactly what is cheap to time, once per micro-batch: pulling the
micro-batch through the pipeline, collating it, saving the dataset's state,
and the time it spends outside, waiting for the main process to ask for more
(``idle``). How the pipeline's share splits over its stages is *sampled*: in
one micro-batch of every :data:`SAMPLE_EVERY` (and the first of each
iteration; every one when tracing), a timing proxy is put between each stage's
iterator and its input's, found by identity among the iterator's attributes
(``Pipeline._iterator`` is the live iterator of each stage), and taken out
again before anything else looks at the iterators (the state is saved after).
Each proxy measures its input's inclusive time; a stage's self time is its
inclusive time less its inputs'. The pipeline's exact time is then split in the
sampled proportions, so stage times always add up to at most the worker's busy
time, itself at most its wall time.

A stage is named by what it does: ``read TFRecordDataset`` (the source: read,
fetch and decode), ``map(to_tensors)`` (its function's name), ``filter(...)``,
``shuffle``, ``batch``, ``pack``, ``repeat``, ``interleave``; a name met twice
gets ``#2``. An input whose iterator cannot be found (a stage that wraps it in
an object of its own) is counted in the stage that reads it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from itertools import islice
from typing import Any

from shardkit.pipeline import Pipeline

#: One micro-batch in this many has its stages timed (the first of each iteration always).
SAMPLE_EVERY = 32

#: What a worker's figures hold, in order, before one sampled self time per stage.
FIGURES = ("elapsed", "pipeline", "collate", "state", "idle", "samples", "micro_batches", "sampled")

_now = time.perf_counter_ns


def stage_names(dataset: Any) -> list[str]:
    """The names of the stages of ``dataset``, outermost first (one for a dataset that is not a Pipeline)."""
    names: list[str] = []
    for node in _nodes(dataset):
        name = _stage_name(node)
        taken = sum(1 for other in names if other == name or other.startswith(name + "#"))
        names.append(name if not taken else f"{name}#{taken + 1}")
    return names


def _nodes(dataset: Any) -> list[Any]:
    """The stages of ``dataset`` depth first, outermost first."""
    nodes = [dataset]
    for upstream in getattr(dataset, "upstream", ()) if isinstance(dataset, Pipeline) else ():
        nodes.extend(_nodes(upstream))
    return nodes


def _stage_name(node: Any) -> str:
    kind = type(node).__name__
    if not isinstance(node, Pipeline) or not node.upstream:
        return f"read {kind}"
    fn = getattr(node, "fn", None) if kind == "Map" else getattr(node, "predicate", None)
    if fn is not None:
        return f"{kind.lower()}({getattr(fn, '__name__', None) or type(fn).__name__})"
    return {"_Interleave": "interleave", "Interleave": "interleave"}.get(kind, kind.lower().lstrip("_"))


class _Timed:
    """An iterator's stand-in that adds the time of each ``next`` to ``ns``."""

    __slots__ = ("_it", "ns")

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it
        self.ns = 0

    def __iter__(self) -> _Timed:
        return self

    def __next__(self) -> Any:
        start = _now()
        try:
            return next(self._it)
        finally:
            self.ns += _now() - start

    def __getattr__(self, name: str) -> Any:  # anything else a stage asks of its input
        return getattr(self._it, name)


class _Edge:
    """Where a stage's iterator holds its input's: put a proxy there, and take it out."""

    def __init__(self, owner: Any, attr: str, index: int | None, child: int, original: Any) -> None:
        self.owner, self.attr, self.index, self.child, self.original = owner, attr, index, child, original
        self.proxy = _Timed(original)
        self._set(self.proxy)

    def _set(self, value: Any) -> None:
        if self.index is None:
            setattr(self.owner, self.attr, value)
        else:
            getattr(self.owner, self.attr)[self.index] = value

    def remove(self) -> None:
        current = getattr(self.owner, self.attr)
        if self.index is not None:
            current = current[self.index] if self.index < len(current) else None
        if current is self.proxy:  # a stage that started a new input (repeat's next pass) keeps it
            self._set(self.original)


def _edges(dataset: Any) -> tuple[list[_Edge], list[list[int]]]:
    """Proxies on every input of every stage whose iterator can be found, and each stage's timed inputs."""
    nodes = _nodes(dataset)
    index = {id(node): i for i, node in enumerate(nodes)}
    edges: list[_Edge] = []
    children: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        owner = getattr(node, "_iterator", None) if isinstance(node, Pipeline) else None
        if owner is None or not hasattr(owner, "__dict__"):
            continue
        for upstream in node.upstream:
            edge = _find(owner, getattr(upstream, "_iterator", None), index[id(upstream)])
            if edge is not None:
                edges.append(edge)
                children[i].append(edge.child)
    return edges, children


def _find(owner: Any, target: Any, child: int) -> _Edge | None:
    if target is None:
        return None
    for attr, value in vars(owner).items():
        if value is target:
            return _Edge(owner, attr, None, child, target)
        if type(value) is list:
            for position, item in enumerate(value):
                if item is target:
                    return _Edge(owner, attr, position, child, target)
    return None


class WorkerClock:
    """One iteration's figures in one worker (see the module docstring); ``figures()`` is what
    travels to the main process with each message, cumulative, as a tuple of ints (nanoseconds):
    :data:`FIGURES`, then the sampled self time of each of ``names``."""

    def __init__(self, dataset: Any, trace: bool = False) -> None:
        self.dataset = dataset
        self.names = stage_names(dataset)
        self.trace = trace
        #: With ``trace``: per micro-batch since the last message, (start, pipeline ns, stage ns, collate ns, state ns).
        self.events: list[tuple[int, int, tuple[int, ...], int, int]] = []
        self._chunk = (0, 0, 0)  # the latest micro-batch's start, pipeline ns and collate ns
        self._start = _now()
        self._counts = [0] * len(FIGURES)
        self._sampled = [0] * len(self.names)
        self._last: tuple[int, ...] = ()  # the sampled stage times of the latest micro-batch
        self._left_at = 0

    def take(self, samples: Iterator[Any], size: int) -> list[Any]:
        """The next ``size`` items of ``samples`` (the root iterator), timed."""
        counts = self._counts
        sampled = self.trace or counts[6] % SAMPLE_EVERY == 0
        start = _now()
        if sampled:
            chunk = self._sample(samples, size)
        else:
            chunk = list(islice(samples, size))
        took = _now() - start
        counts[1] += took
        if sampled and chunk:
            counts[7] += took
        self._chunk = (start, took, 0)
        return chunk

    def _sample(self, samples: Iterator[Any], size: int) -> list[Any]:
        root = _Timed(samples)
        edges, children = _edges(self.dataset)
        try:
            chunk = list(islice(root, size))
        finally:
            for edge in edges:
                edge.remove()
        inclusive = [0] * len(self.names)
        inclusive[0] = root.ns
        for edge in edges:
            inclusive[edge.child] = edge.proxy.ns
        own = [max(inclusive[i] - sum(inclusive[c] for c in kids), 0) for i, kids in enumerate(children)]
        for i, ns in enumerate(own):
            self._sampled[i] += ns
        self._last = tuple(own)
        return chunk

    def collated(self, start: int, count: int) -> None:
        """A micro-batch of ``count`` samples was collated since ``start`` (a ``now()``)."""
        took = _now() - start
        self._counts[2] += took
        self._chunk = (*self._chunk[:2], took)
        self._counts[5] += count
        self._counts[6] += 1

    def state(self, saver: Any) -> Any:
        start = _now()
        state = saver()
        took = _now() - start
        self._counts[3] += took
        if self.trace:
            chunk_start, pipeline, collate = self._chunk
            self.events.append((chunk_start, pipeline, self._last, collate, took))
        return state

    def figures(self) -> tuple[Any, ...]:
        """The cumulative figures, just before a message leaves (its wait for the main process begins)."""
        now = self._left_at = _now()
        self._counts[0] = now - self._start
        figures = (*self._counts, *self._sampled)
        if not self.trace:
            return figures
        events, self.events = self.events, []
        return (*figures, events)

    def resumed(self) -> None:
        """The main process asked for the next message: the time since the last one left was idle."""
        self._counts[4] += _now() - self._left_at


def now() -> int:
    """The clock of every figure: ``time.perf_counter_ns()`` (one monotonic clock for every process)."""
    return _now()
