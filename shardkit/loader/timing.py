"""Where a worker's time goes: per-stage timing of a pipeline, cheap enough to stay on.

Timing every sample at every stage costs two clock reads and a Python call per
stage and sample (about 0.35 us here), a few percent of a 10 us sample. So a
worker times exactly what is cheap to time, once per micro-batch: pulling the
micro-batch through the pipeline, collating it, saving the dataset's state,
and the time it spends outside, waiting for the main process to ask for more
(``idle``). Each of these ends where the next begins, so one clock read marks
both: four reads per micro-batch, and the figures travel as one tuple.

How the pipeline's share splits over its stages is *sampled*: in one
micro-batch of every :data:`SAMPLE_EVERY` (and the first of each iteration;
every one when tracing), a timing proxy is put between each stage's iterator
and its input's, found by identity among the iterator's attributes
(``Pipeline._iterator`` is the live iterator of each stage), for its first
:data:`SAMPLED` samples only (all of them when tracing), and taken out again
before the rest are pulled plainly and before anything else looks at the
iterators (the state is saved after). Each proxy measures its input's
inclusive time; a stage's self time is its inclusive time less its inputs'.
The pipeline's exact time is then split in the sampled proportions, so stage
times always add up to at most the worker's busy time, itself at most its wall
time. The shares are estimates (an epoch of 20,000 samples in micro-batches of
64 times 96 samples at each stage); the totals are exact. The proxies cost
about 0.3-1 us per sample and stage (a stage's reads of its input's
``position`` go through the proxy's own property, not ``__getattr__``), paid by
``SAMPLED`` samples in ``SAMPLE_EVERY`` micro-batches: a sampled micro-batch
of the quickstart path costs about 50 us more than another (set-up included),
0.1 % of the time of the ``SAMPLE_EVERY`` micro-batches. With the clock reads,
the figures each message carries and the main process's per-step clock,
accounting costs under 1 % there (``benchmarks/stalls.py`` prints each part,
CPU time, and their sum against the 1 % target).

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
SAMPLE_EVERY = 64
#: Samples of a sampled micro-batch pulled through the timing proxies (all of them when tracing).
SAMPLED = 16

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
        item = next(self._it)  # the last, raising StopIteration, is not counted: one call in an epoch
        self.ns += _now() - start
        return item

    @property
    def position(self) -> Any:
        """Its iterator's (None if it has none): the attribute stages read of their input at every sample
        (``.shuffle()``, ``.map()``), looked up here rather than through ``__getattr__``, which Python calls
        only after a failed lookup (about 1 us a read)."""
        return getattr(self._it, "position", None)

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
        if owner is None:
            continue
        for upstream in node.upstream:
            edge = _find(owner, getattr(upstream, "_iterator", None), index[id(upstream)])
            if edge is not None:
                edges.append(edge)
                children[i].append(edge.child)
    return edges, children


def _find(owner: Any, target: Any, child: int) -> _Edge | None:
    """The attribute of ``owner`` (or item of a list in one) that holds ``target``.

    Read by name, never through ``vars(owner)``: reading an instance's ``__dict__``
    makes CPython (3.11, 3.12) store its attributes in a dict from then on, which
    makes every attribute read in the stage's ``__next__`` twice as slow for the
    rest of the iteration (measured: 7-10 % of the quickstart path). The names
    tried are those its class's ``__init__`` methods use.
    """
    if target is None:
        return None
    for attr in _attribute_names(type(owner)):
        value = getattr(owner, attr, None)
        if value is target:
            return _Edge(owner, attr, None, child, target)
        if type(value) is list:
            for position, item in enumerate(value):
                if item is target:
                    return _Edge(owner, attr, position, child, target)
    return None


_names: dict[type, tuple[str, ...]] = {}


def _attribute_names(kind: type) -> tuple[str, ...]:
    """The names the ``__init__`` methods of ``kind`` and its bases use, less the class's
    methods and properties (reading a property could run code)."""
    names = _names.get(kind)
    if names is None:
        found: dict[str, None] = {}
        for klass in kind.__mro__:
            code = getattr(klass.__dict__.get("__init__"), "__code__", None)
            for name in code.co_names if code is not None else ():
                if not hasattr(getattr(kind, name, None), "__get__"):
                    found[name] = None
        names = _names[kind] = tuple(found)
    return names


class WorkerClock:
    """One iteration's figures in one worker (see the module docstring); ``figures()`` is what
    travels to the main process with each message, cumulative, as a tuple of ints (nanoseconds):
    :data:`FIGURES`, then the sampled self time of each of ``names``.

    A micro-batch's steps are :meth:`take`, :meth:`collated`, optionally :meth:`state`,
    then :meth:`figures` as its message leaves; the next :meth:`take` ends the idle time."""

    def __init__(self, dataset: Any, trace: bool = False) -> None:
        self.dataset = dataset
        self.names = stage_names(dataset)
        self.trace = trace
        #: With ``trace``: per micro-batch since the last message, (start, pipeline ns, stage ns, collate ns, state ns).
        self.events: list[tuple[int, int, tuple[int, ...], int, int]] = []
        self._start = self._mark = _now()  # the mark: when the latest step ended
        self._left: int | None = None  # when the latest message left (None: none has yet)
        self._counts = [0] * len(FIGURES)
        self._sampled = [0] * len(self.names)
        self._last: tuple[int, ...] = ()  # the sampled stage times of the latest micro-batch
        self._taken = 0  # the latest take's start
        self.state_ns = 0  #: what the latest :meth:`state` took
        self._busy_at_state = 0  # pipeline and collate time when the latest state was saved
        #: With ``trace``: the latest micro-batch's pipeline ns, sampled stage ns, collate ns and state ns.
        self._steps: tuple[int, tuple[int, ...], int, int] = (0, (), 0, 0)

    def take(self, samples: Iterator[Any], size: int) -> list[Any]:
        """The next ``size`` items of ``samples`` (the root iterator), timed."""
        counts = self._counts
        start = self._taken = _now()
        if self._left is not None:
            counts[4] += start - self._left  # idle: since the last message left
            self._left = None
        sampled = self.trace or counts[6] % SAMPLE_EVERY == 0
        chunk = self._sample(samples, size) if sampled else list(islice(samples, size))
        self._mark = end = _now()
        counts[1] += end - start
        if sampled and chunk:
            counts[7] += end - start
        if self.trace and chunk:
            self._steps = (max(end - start, 1), self._last, 0, 0)
        return chunk

    def _sample(self, samples: Iterator[Any], size: int) -> list[Any]:
        """Pull the first :data:`SAMPLED` items through timing proxies, the rest plainly."""
        root = _Timed(samples)
        edges, children = _edges(self.dataset)
        try:
            chunk = list(islice(root, size if self.trace else min(size, SAMPLED)))
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
        if len(chunk) < size:
            chunk += islice(samples, size - len(chunk))
        return chunk

    def collated(self, count: int) -> None:
        """The micro-batch just taken, of ``count`` samples, is collated."""
        counts = self._counts
        end = _now()
        counts[2] += end - self._mark
        if self.trace:
            self._steps = (*self._steps[:2], end - self._mark, 0)
        self._mark = end
        counts[5] += count
        counts[6] += 1

    def busy_since_state(self) -> int:
        """Pipeline and collate time since the latest :meth:`state` (since the start before any)."""
        return self._counts[1] + self._counts[2] - self._busy_at_state

    def state(self, saver: Any) -> Any:
        """``saver()``, timed: the dataset's state sent with this micro-batch."""
        state = saver()
        end = _now()
        self.state_ns = end - self._mark
        self._busy_at_state = self._counts[1] + self._counts[2]
        self._counts[3] += end - self._mark
        if self.trace:
            self._steps = (*self._steps[:3], end - self._mark)
        self._mark = end
        return state

    def figures(self) -> tuple[Any, ...]:
        """The cumulative figures, as a message leaves (its wait for the main process begins)."""
        counts = self._counts
        self._left = mark = self._mark
        counts[0] = mark - self._start
        figures = (*counts, *self._sampled)
        if not self.trace:
            return figures
        if self._steps[0]:  # a micro-batch since the last message (not the end marker)
            self.events.append((self._taken, *self._steps))
            self._steps = (0, (), 0, 0)
        events, self.events = self.events, []
        return (*figures, events)


#: The clock of every figure: ``time.perf_counter_ns()`` (one monotonic clock for every process), itself
#: rather than a function calling it: a Python frame per read was a third of the main process's per-step cost.
now = _now
