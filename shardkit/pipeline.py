"""Chainable wrappers: every shardkit dataset is a :class:`Pipeline`.

``source.shuffle(1000).map(decode).batch(32)`` builds a chain of pipelines,
each an :class:`~torch.utils.data.IterableDataset` holding its inputs in
``upstream``. Chain methods return new objects and never change the one they
are called on.

Plumbing shared along a chain, all answered by the source at the root:

* ``set_epoch(e)`` on any pipeline reaches every source below it;
* ``epoch``, ``seed`` and ``topology()`` are read from the first upstream;
* randomness (shuffle buffers, interleave draws) is seeded from
  (seed, epoch, rank, worker), read when iteration starts, so it differs per
  reader and per epoch and repeats across runs.

Each ``__iter__`` returns an iterator object that keeps its cursor in
attributes (no generator frames), so its position can be saved and restored:
every pipeline has ``state_dict()`` (where its latest iteration in this
process stands) and ``load_state_dict(state)`` (resume there at the next
``__iter__``), the Stateful protocol of torchdata's ``StatefulDataLoader``.
The format is described in :mod:`shardkit.state`.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, default_collate

from shardkit.epoch import call_with_epoch_offset, check_epoch, epoch_offset, load_outermost, open_pass
from shardkit.errors import ShardkitError
from shardkit.seeding import INTERLEAVE_STREAM, SHUFFLE_STREAM, check_seed, generator
from shardkit.state import (
    DRAW_BLOCK,
    State,
    StateError,
    applies,
    check,
    decode,
    encode,
    generator_state,
    node,
    own_share,
    restore_generator,
    share_of,
)
from shardkit.topology import Topology

__all__ = [
    "Batch",
    "Filter",
    "Interleave",
    "Map",
    "Pipeline",
    "PipelineError",
    "Repeat",
    "Shuffle",
    "UnknownLengthError",
    "interleave",
]

STOP_RULES = ("first_exhausted", "all_exhausted")
_UNIFORM_BLOCK = DRAW_BLOCK  # one Generator call per this many draws: a scalar call costs ~1 us


class PipelineError(ShardkitError, ValueError):
    """An argument to a pipeline wrapper that cannot work."""


class UnknownLengthError(ShardkitError, TypeError):
    """``len()`` of a stream whose length is unbounded or not known in advance.

    A :class:`TypeError`, as Python expects from ``__len__``, so ``list(ds)``
    and ``operator.length_hint`` still work.
    """


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PipelineError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise PipelineError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_callable(name: str, value: object) -> None:
    if not callable(value):
        raise PipelineError(f"{name} must be callable, got {value!r} ({type(value).__name__})")


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class _Uniforms:
    """Uniform floats in [0, 1) from ``rng``, drawn a block at a time.

    The sequence is fixed by the generator's state, so a position in it is
    (generator state at the block's start, index in the block).
    """

    def __init__(self, rng: np.random.Generator, state: State | None = None) -> None:
        self._rng = rng
        self._block: list[float] = []
        self._next = 0
        self._block_start: dict[str, Any] | None = None
        if state is not None:
            self._rng = restore_generator(state["generator"])
            if state["next"]:
                self._draw_block()
                self._next = state["next"]

    def _draw_block(self) -> None:
        self._block_start = generator_state(self._rng)
        self._block = self._rng.random(_UNIFORM_BLOCK).tolist()
        self._next = 0

    def draw(self) -> float:
        if self._next == len(self._block):
            self._draw_block()
        value = self._block[self._next]
        self._next += 1
        return value

    def state_dict(self) -> State:
        """The position in the sequence: generator state at the block's start and index in it."""
        if self._block_start is None:
            return {"generator": generator_state(self._rng), "next": 0}
        return {"generator": self._block_start, "next": self._next}


def _discard_pending(pipeline: Pipeline) -> None:
    """Forget the loaded states of ``pipeline`` and everything upstream of it."""
    pipeline._pending = None
    for upstream in pipeline.upstream:
        _discard_pending(upstream)


def _same_reader(state: State, own: bool, topology: Topology) -> bool:
    """Whether ``state`` continues this reader's own draws: its own worker
    state, or a one-worker state resumed by one worker (merged states drop
    the generator position)."""
    return own or (topology.num_workers == 1 and state["rng"] is not None)


def _iterator_state(iterator: Iterator[Any]) -> State:
    """The state of an upstream iterator, which must be a shardkit one."""
    state_dict = getattr(iterator, "state_dict", None)
    if state_dict is None:
        raise StateError(
            f"cannot save the position of a {type(iterator).__name__}: it has no state_dict(). "
            "Pipelines whose __iter__ returns a generator cannot be resumed; return an iterator "
            "object that keeps its cursor in attributes and implements state_dict()"
        )
    return state_dict()


class Pipeline(IterableDataset):
    """Base of every shardkit dataset.

    Sources (no inputs) leave ``upstream`` empty and override ``__iter__``,
    ``set_epoch``, ``epoch``, ``seed`` and ``topology``. Wrappers hold their
    inputs in ``upstream`` and inherit the plumbing, which asks the first one.
    """

    upstream: tuple[Pipeline, ...] = ()

    #: The ``kind`` of this stage's state node; see :mod:`shardkit.state`.
    _state_kind = ""
    _iterator: Any = None
    _pending: State | None = None

    # -- chaining ------------------------------------------------------------

    def map(self, fn: Callable[[Any], Any]) -> Pipeline:
        """Apply ``fn`` to every sample."""
        return Map(self, fn)

    def filter(self, predicate: Callable[[Any], object]) -> Pipeline:
        """Keep the samples for which ``predicate(sample)`` is truthy."""
        return Filter(self, predicate)

    def shuffle(self, buffer_size: int, seed: int | None = None) -> Pipeline:
        """Shuffle through a buffer of ``buffer_size`` samples.

        The order is drawn from (``seed``, epoch, rank, worker); ``seed=None``
        uses the source's seed. Same topology and epoch, same order; another
        epoch, another order.
        """
        return Shuffle(self, buffer_size, seed)

    def batch(
        self,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
    ) -> Pipeline:
        """Group samples into lists of ``batch_size`` and collate each.

        ``collate_fn=None`` uses :func:`torch.utils.data.default_collate`. The
        last, shorter batch is kept unless ``drop_last``.
        """
        return Batch(self, batch_size, collate_fn, drop_last)

    def repeat(self, count: int | None = None) -> Pipeline:
        """Pass over the data ``count`` times, or forever with ``None``.

        Passes run back to back in the same worker, so there is no stall at an
        epoch boundary. Pass ``k`` reads epoch ``epoch + k``: shuffles and
        worker seeds change every pass. An infinite repeat stops if a whole
        pass yields nothing, instead of spinning.
        """
        return Repeat(self, count)

    # -- plumbing ------------------------------------------------------------

    def _first_upstream(self, what: str) -> Pipeline:
        if not self.upstream:
            raise NotImplementedError(
                f"{type(self).__name__} has no upstream, so it is a source and must override {what}"
            )
        return self.upstream[0]

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of every source below this pipeline.

        Optional: until it is called, every pass counts as the next epoch
        (pass ``k`` of each reader reads epoch ``k``, see :mod:`shardkit.epoch`),
        which is what trainers that never call it need. Once called, it wins,
        so call it before every epoch. It reaches persistent DataLoader
        workers through shared memory.
        """
        check_epoch(epoch)
        if not self.upstream:
            raise NotImplementedError(f"{type(self).__name__} is a source and must override set_epoch")
        for upstream in self.upstream:
            upstream.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch iteration reads now (inside ``.repeat()``, including its pass)."""
        return self._first_upstream("epoch").epoch

    @property
    def seed(self) -> int:
        """The base seed randomness is derived from."""
        return self._first_upstream("seed").seed

    def topology(self) -> Topology:
        """The reader iterating this pipeline, detected when called."""
        return self._first_upstream("topology()").topology()

    def _unknown_length(self, reason: str) -> UnknownLengthError:
        return UnknownLengthError(
            f"len() is undefined for {self!r}: {reason}. Iterate it to count samples, "
            "or drive training by a fixed number of steps rather than len(loader)"
        )

    def __len__(self) -> int:
        raise self._unknown_length(f"{type(self).__name__} is an unbounded or unknown-length stream")

    def __iter__(self) -> Iterator[Any]:
        """Start an iteration, resuming a state given to :meth:`load_state_dict`."""
        state, self._pending = self._pending, None
        iterator = open_pass(self, self._open, state)  # counts the epoch once per pass (shardkit.epoch)
        self._iterator = iterator
        return iterator

    def _open(self, state: State | None) -> Iterator[Any]:
        """A new iterator; ``state`` is this stage's loaded state node, if any."""
        raise NotImplementedError(f"{type(self).__name__} must implement __iter__ or _open")

    # -- state ---------------------------------------------------------------

    def state_dict(self) -> State:
        """Where the latest iteration of this pipeline in this process stands.

        Plain data (dicts, lists, ints, strings) that ``json`` and
        ``torch.save`` can hold; see :mod:`shardkit.state` for the format.
        Before any iteration it is the state given to :meth:`load_state_dict`.
        With DataLoader workers, each worker's copy has its own: save the
        loader's state (``StatefulDataLoader.state_dict()``,
        :meth:`MixedLoader.state_dict`) instead.
        """
        if self._iterator is not None:
            return self._iterator.state_dict()
        if self._pending is not None:
            return self._pending
        raise StateError(
            f"{self!r} has not been iterated in this process, so it has no position to save; "
            "with DataLoader workers save the loader's state (StatefulDataLoader or MixedLoader)"
        )

    def load_state_dict(self, state: State) -> None:
        """Resume from ``state`` (from :meth:`state_dict`) at the next ``__iter__``.

        It applies to the next iteration here and in every DataLoader worker
        started from this object afterwards. Where ``set_epoch`` was never
        called, the next pass reads the state's epoch and counting goes on
        from there; after an explicit ``set_epoch``, call
        ``set_epoch(state["epoch"])`` too (an iteration of a later epoch
        ignores the state; of an earlier one, raises).

        Raises:
            StateError: the state is of another pipeline, another dataset
                (shards, records, seed, shuffle, balance) or version.
        """
        check(state, self._state_kind, self)
        load_outermost(self, state, self._load_upstream, state)  # the next pass reads the state's epoch
        self._pending = state

    def _load_upstream(self, state: State) -> None:
        """Pass the inputs' parts of ``state`` to the inputs."""
        self._first_upstream("load_state_dict").load_state_dict(state["upstream"])

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the live iterator (DataLoader workers make their own)."""
        from shardkit.trainers import check_not_in_accelerate

        check_not_in_accelerate(self)  # pickled for a spawned worker of Accelerate's loader
        state = self.__dict__.copy()
        state.pop("_iterator", None)
        return state


class _Wrapper(Pipeline):
    """A pipeline with exactly one input."""

    def __init__(self, upstream: Pipeline) -> None:
        if not isinstance(upstream, Pipeline):
            raise PipelineError(
                f"{type(self).__name__} needs a shardkit Pipeline upstream, got {type(upstream).__name__}; "
                "turn other datasets into one with shardkit.wrap(...)"
            )
        self.upstream = (upstream,)

    @property
    def source(self) -> Pipeline:
        """The single input of this wrapper."""
        return self.upstream[0]


# -- map ----------------------------------------------------------------------


class Map(_Wrapper):
    """``fn(sample)`` for every sample; see :meth:`Pipeline.map`."""

    def __init__(self, upstream: Pipeline, fn: Callable[[Any], Any]) -> None:
        super().__init__(upstream)
        _check_callable("map(fn)", fn)
        self.fn = fn

    _state_kind = "map"

    def __len__(self) -> int:
        return len(self.source)

    def _open(self, state: State | None) -> Iterator[Any]:
        return _MapIterator(iter(self.source), self.fn)

    def __repr__(self) -> str:
        return f"{self.source!r}.map({_name(self.fn)})"


class _MapIterator:
    def __init__(self, source: Iterator[Any], fn: Callable[[Any], Any]) -> None:
        self._source = source
        self._fn = fn

    def __iter__(self) -> _MapIterator:
        return self

    def __next__(self) -> Any:
        return self._fn(next(self._source))

    def state_dict(self) -> State:
        return node("map", upstream=_iterator_state(self._source))


# -- filter -------------------------------------------------------------------


class Filter(_Wrapper):
    """The samples ``predicate`` accepts; see :meth:`Pipeline.filter`."""

    def __init__(self, upstream: Pipeline, predicate: Callable[[Any], object]) -> None:
        super().__init__(upstream)
        _check_callable("filter(predicate)", predicate)
        self.predicate = predicate

    def __len__(self) -> int:
        raise self._unknown_length("filter() drops a number of samples known only after reading them")

    _state_kind = "filter"

    def _open(self, state: State | None) -> Iterator[Any]:
        return _FilterIterator(iter(self.source), self.predicate)

    def __repr__(self) -> str:
        return f"{self.source!r}.filter({_name(self.predicate)})"


class _FilterIterator:
    def __init__(self, source: Iterator[Any], predicate: Callable[[Any], object]) -> None:
        self._source = source
        self._predicate = predicate

    def __iter__(self) -> _FilterIterator:
        return self

    def __next__(self) -> Any:
        while True:
            sample = next(self._source)
            if self._predicate(sample):
                return sample

    def state_dict(self) -> State:
        return node("filter", upstream=_iterator_state(self._source))


# -- shuffle ------------------------------------------------------------------


class Shuffle(_Wrapper):
    """A seeded shuffle buffer; see :meth:`Pipeline.shuffle`."""

    def __init__(self, upstream: Pipeline, buffer_size: int, seed: int | None = None) -> None:
        super().__init__(upstream)
        self.buffer_size = _check_int("shuffle(buffer_size)", buffer_size, 1)
        self.shuffle_seed = None if seed is None else check_seed(seed, "shuffle(seed)")

    def __len__(self) -> int:
        return len(self.source)

    _state_kind = "shuffle"

    def _open(self, state: State | None) -> Iterator[Any]:
        seed = self.seed if self.shuffle_seed is None else self.shuffle_seed
        epoch, topology = self.epoch, self.topology()
        rng = generator(seed, epoch, topology, SHUFFLE_STREAM)
        iterator = _ShuffleIterator(iter(self.source), self.buffer_size, rng, epoch, topology)
        if state is not None and applies(state, epoch, self):
            iterator.restore(state, own_share(state, topology.worker_id, topology.num_workers, self))
        return iterator

    def __repr__(self) -> str:
        return f"{self.source!r}.shuffle({self.buffer_size}, seed={self.shuffle_seed})"


class _ShuffleIterator:
    """Keeps ``buffer_size`` samples; each step pulls one in and hands a random one out."""

    def __init__(
        self, source: Iterator[Any], buffer_size: int, rng: np.random.Generator, epoch: int, topology: Topology
    ) -> None:
        self._source = source
        self._buffer_size = buffer_size
        self._uniforms = _Uniforms(rng)
        self._buffer: list[Any] = []
        self._exhausted = False
        self._epoch = epoch
        self._topology = topology

    def restore(self, state: State, own: bool) -> None:
        """Refill the buffer (and, for this worker's own state, the draws) from ``state``.

        A whole-rank state's buffered samples are dealt out: worker ``w`` of
        ``n`` takes every ``n``-th one from the ``w``-th on.
        """
        buffered = [decode(sample) for sample in state["samples"]]
        topology = self._topology
        self._buffer = buffered if own else buffered[topology.worker_id :: topology.num_workers]
        if _same_reader(state, own, topology):
            self._uniforms = _Uniforms(self._uniforms._rng, state["rng"])

    def state_dict(self) -> State:
        """The buffered samples are saved (encoded as plain data), so a restore is exact without re-reading.

        Raises:
            StateError: a buffered sample is of a type a state cannot hold (see :func:`shardkit.state.encode`).
        """
        topology = self._topology
        return node(
            "shuffle",
            epoch=self._epoch,
            samples=[encode(sample) for sample in self._buffer],
            rng=self._uniforms.state_dict(),
            share=share_of(topology.worker_id, topology.num_workers),
            upstream=_iterator_state(self._source),
        )

    def __iter__(self) -> _ShuffleIterator:
        return self

    def __next__(self) -> Any:
        buffer = self._buffer
        while not self._exhausted and len(buffer) < self._buffer_size:
            try:
                buffer.append(next(self._source))
            except StopIteration:
                self._exhausted = True
        if not buffer:
            raise StopIteration
        pick = int(self._uniforms.draw() * len(buffer))
        sample = buffer[pick]
        buffer[pick] = buffer[-1]
        buffer.pop()
        return sample


# -- batch --------------------------------------------------------------------


class Batch(_Wrapper):
    """Collated groups of samples; see :meth:`Pipeline.batch`."""

    def __init__(
        self,
        upstream: Pipeline,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__(upstream)
        self.batch_size = _check_int("batch(batch_size)", batch_size, 1)
        if collate_fn is not None:
            _check_callable("batch(collate_fn)", collate_fn)
        if not isinstance(drop_last, bool):
            raise PipelineError(f"batch(drop_last) must be a bool, got {drop_last!r}")
        self.collate_fn = default_collate if collate_fn is None else collate_fn
        self.drop_last = drop_last

    def __len__(self) -> int:
        """Batches per pass on this rank: each DataLoader worker batches its own
        share, so this sums every worker's batches (the workers of the
        DataLoader asking, one outside a DataLoader). Upstream stages whose
        split is not known (see :func:`shardkit.trainers.reader_lengths`) fall
        back to ``len(upstream)`` batched once, exact with one reader only."""
        from shardkit.trainers import batch_len

        exact = batch_len(self)  # per DataLoader worker, each with its own last batch
        if exact is not None:
            return exact
        samples = len(self.source)
        if self.drop_last:
            return samples // self.batch_size
        return math.ceil(samples / self.batch_size)

    _state_kind = "batch"

    def _open(self, state: State | None) -> Iterator[Any]:
        return _BatchIterator(iter(self.source), self.batch_size, self.collate_fn, self.drop_last)

    def __repr__(self) -> str:
        return f"{self.source!r}.batch({self.batch_size}, drop_last={self.drop_last})"


class _BatchIterator:
    def __init__(
        self,
        source: Iterator[Any],
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any],
        drop_last: bool,
    ) -> None:
        self._source = source
        self._batch_size = batch_size
        self._collate_fn = collate_fn
        self._drop_last = drop_last

    def __iter__(self) -> _BatchIterator:
        return self

    def __next__(self) -> Any:
        samples = list(itertools.islice(self._source, self._batch_size))
        if not samples or (self._drop_last and len(samples) < self._batch_size):
            raise StopIteration
        return self._collate_fn(samples)

    def state_dict(self) -> State:
        """A batch is made in one step, so no partial batch is ever pending."""
        return node("batch", upstream=_iterator_state(self._source))


# -- repeat -------------------------------------------------------------------


class Repeat(_Wrapper):
    """Back-to-back passes over the upstream; see :meth:`Pipeline.repeat`.

    Pass ``k`` creates and advances the upstream iterator with the epoch
    offset (:func:`shardkit.epoch.epoch_offset`) raised by ``k``; sources add
    it to their shared epoch, so the shared value itself never changes.
    Nested repeats compose: inside an outer pass ``j``, an inner
    ``repeat(count)`` numbers its passes from ``j * count``.
    """

    def __init__(self, upstream: Pipeline, count: int | None = None) -> None:
        super().__init__(upstream)
        self.count = None if count is None else _check_int("repeat(count)", count, 1)

    def __len__(self) -> int:
        if self.count is None:
            raise self._unknown_length("repeat() without a count never ends; pass repeat(count) for a finite length")
        return self.count * len(self.source)

    _state_kind = "repeat"

    def _open(self, state: State | None) -> Iterator[Any]:
        epoch = self.epoch
        if state is not None and not applies(state, epoch, self):
            # The inputs' states are of later passes of an old epoch, whose
            # epoch numbers a pass of this epoch may share: drop them.
            _discard_pending(self.source)
            state = None
        return _RepeatIterator(self.source, self.count, epoch, state)

    def _load_upstream(self, state: State) -> None:
        passes, done = state["pass"], state["upstream"] is None  # None: every pass is done
        if self.count is not None and (passes > self.count or (passes == self.count and not done)):
            raise StateError(
                f"{self!r}: the state is in pass {passes}, but this repeat() makes {self.count} passes; "
                "load the state into the same pipeline that saved it"
            )
        if not done:
            self.source.load_state_dict(state["upstream"])

    def __repr__(self) -> str:
        return f"{self.source!r}.repeat({self.count})"


class _RepeatIterator:
    def __init__(self, upstream: Pipeline, count: int | None, epoch: int, state: State | None = None) -> None:
        self._upstream = upstream
        self._count = count
        self._epoch = epoch
        outer = epoch_offset()
        self._first_offset = outer if count is None else outer * count
        self._pass = 0
        self._yielded_this_pass = 0
        if state is not None:
            self._pass = state["pass"]
            self._yielded_this_pass = int(state["yielded"])
        self._source: Iterator[Any] | None = None
        if state is None or state["upstream"] is not None:
            self._source = self._start_pass()

    def state_dict(self) -> State:
        """The pass, whether it has yielded yet, and the pass's upstream state (None when done)."""
        upstream = None if self._source is None else _iterator_state(self._source)
        return node(
            "repeat", epoch=self._epoch, **{"pass": self._pass}, yielded=self._yielded_this_pass > 0, upstream=upstream
        )

    def _start_pass(self) -> Iterator[Any]:
        return call_with_epoch_offset(self._first_offset + self._pass, iter, self._upstream)

    def __iter__(self) -> _RepeatIterator:
        return self

    def __next__(self) -> Any:
        while self._source is not None:
            try:
                sample = call_with_epoch_offset(self._first_offset + self._pass, next, self._source)
            except StopIteration:
                empty_pass = self._yielded_this_pass == 0
                self._pass += 1
                self._yielded_this_pass = 0
                done = self._count is not None and self._pass >= self._count
                self._source = None if empty_pass or done else self._start_pass()
                continue
            self._yielded_this_pass += 1
            return sample
        raise StopIteration


# -- interleave -----------------------------------------------------------------


def interleave(
    datasets: Sequence[Pipeline],
    weights: Sequence[float] | None = None,
    *,
    seed: int = 0,
    stop: str = "first_exhausted",
) -> Pipeline:
    """Mix several pipelines, drawing the next source at random by ``weights``.

    Draws are seeded from (``seed``, epoch, rank, worker): deterministic for a
    given topology and epoch, different per epoch. ``weights=None`` mixes
    evenly; weights need not sum to 1. A source with weight 0 is never read.
    ``stop="first_exhausted"`` ends when a drawn source runs out, so the mix
    follows the weights to the end; ``"all_exhausted"`` keeps drawing from the
    others, reweighted, until every source is spent. ``set_epoch`` reaches
    every source.
    """
    return Interleave(datasets, weights, seed=seed, stop=stop)


class Interleave(Pipeline):
    """Weighted random mixing of several pipelines; see :func:`interleave`.

    ``epoch`` and ``topology()`` come from the first dataset; ``seed`` is the
    mixing seed, which a ``.shuffle()`` chained after it also uses by default.
    """

    def __init__(
        self,
        datasets: Sequence[Pipeline],
        weights: Sequence[float] | None = None,
        *,
        seed: int = 0,
        stop: str = "first_exhausted",
    ) -> None:
        self.upstream = _check_datasets(datasets)
        self.weights = _check_weights(weights, len(self.upstream))
        self.mix_seed = check_seed(seed, "interleave(seed)")
        if stop not in STOP_RULES:
            raise PipelineError(f"interleave(stop) must be one of {STOP_RULES}, got {stop!r}")
        self.stop = stop

    @property
    def seed(self) -> int:
        """The mixing seed given to :func:`interleave`."""
        return self.mix_seed

    def __len__(self) -> int:
        if self.stop == "first_exhausted":
            raise self._unknown_length(
                "with stop='first_exhausted' it ends when a randomly drawn source runs out; "
                "stop='all_exhausted' has a length"
            )
        return sum(len(d) for d, w in zip(self.upstream, self.weights) if w > 0)

    _state_kind = "interleave"

    def _open(self, state: State | None) -> Iterator[Any]:
        epoch, topology = self.epoch, self.topology()
        rng = generator(self.mix_seed, epoch, topology, INTERLEAVE_STREAM)
        iterator = _InterleaveIterator(
            self.upstream, self.weights, rng, self.stop == "first_exhausted", epoch, topology
        )
        if state is not None and applies(state, epoch, self):
            iterator.restore(state, own_share(state, topology.worker_id, topology.num_workers, self))
        return iterator

    def _load_upstream(self, state: State) -> None:
        inputs = state["upstream"]
        if len(inputs) != len(self.upstream):
            raise StateError(f"{self!r}: the state has {len(inputs)} inputs, this interleave {len(self.upstream)}")
        for index, (dataset, part, weight) in enumerate(zip(self.upstream, inputs, self.weights)):
            if (part is None) != (weight == 0):  # every input that is read has a position
                saved = "no state" if part is None else "a state"
                raise StateError(f"{self!r}: the state has {saved} for input {index} of weight {weight}")
            if part is not None:
                dataset.load_state_dict(part)

    def __repr__(self) -> str:
        inputs = ", ".join(repr(d) for d in self.upstream)
        return f"interleave([{inputs}], weights={list(self.weights)}, seed={self.mix_seed}, stop={self.stop!r})"


def _check_datasets(datasets: Sequence[Pipeline]) -> tuple[Pipeline, ...]:
    if isinstance(datasets, Pipeline) or not isinstance(datasets, Sequence):
        raise PipelineError(
            f"interleave(datasets) takes a list of pipelines, got {type(datasets).__name__}; "
            "write interleave([a, b], ...)"
        )
    if not datasets:
        raise PipelineError("interleave(datasets) needs at least one dataset, got an empty list")
    for position, dataset in enumerate(datasets):
        if not isinstance(dataset, Pipeline):
            raise PipelineError(
                f"interleave(datasets[{position}]) is a {type(dataset).__name__}, not a shardkit Pipeline; "
                "turn it into one with shardkit.wrap(...)"
            )
    return tuple(datasets)


def _check_weights(weights: Sequence[float] | None, count: int) -> tuple[float, ...]:
    if weights is None:
        return (1.0,) * count
    try:
        values = [float(w) for w in weights]
    except (TypeError, ValueError):
        raise PipelineError(f"interleave(weights) must be a sequence of numbers, got {weights!r}") from None
    if len(values) != count:
        raise PipelineError(
            f"interleave got {count} datasets but {len(values)} weights; "
            "pass one weight per dataset, or weights=None to mix evenly"
        )
    for position, value in enumerate(values):
        if not math.isfinite(value) or value < 0:
            raise PipelineError(f"interleave(weights[{position}]) must be finite and >= 0, got {value}")
    if sum(values) == 0:
        raise PipelineError("interleave(weights) are all zero; give at least one dataset a positive weight")
    return tuple(values)


class _InterleaveIterator:
    """Draws a source for every sample from the cumulative weights of the live ones."""

    def __init__(
        self,
        datasets: tuple[Pipeline, ...],
        weights: tuple[float, ...],
        rng: np.random.Generator,
        stop_on_first: bool,
        epoch: int,
        topology: Topology,
    ) -> None:
        self._weights = weights
        self._uniforms = _Uniforms(rng)
        self._stop_on_first = stop_on_first
        self._epoch = epoch
        self._topology = topology
        self._sources = [iter(d) if w > 0 else None for d, w in zip(datasets, weights)]
        self._live = [i for i, w in enumerate(weights) if w > 0]
        self._cumulative = list(itertools.accumulate(weights[i] for i in self._live))
        self._stopped = False

    def restore(self, state: State, own: bool) -> None:
        """Take the live inputs (and, for this worker's own state, the draws) from ``state``."""
        self._live = [i for i in state["live"] if self._sources[i] is not None]
        self._cumulative = list(itertools.accumulate(self._weights[i] for i in self._live))
        self._stopped = bool(state["stopped"])
        if self._stopped:
            self._live = []
        if _same_reader(state, own, self._topology):
            self._uniforms = _Uniforms(self._uniforms._rng, state["rng"])

    def state_dict(self) -> State:
        """Every input's state (None for weight 0), the live inputs and the draws."""
        topology = self._topology
        return node(
            "interleave",
            epoch=self._epoch,
            upstream=[None if s is None else _iterator_state(s) for s in self._sources],
            live=list(self._live),
            rng=self._uniforms.state_dict(),
            stopped=self._stopped,
            share=share_of(topology.worker_id, topology.num_workers),
        )

    def __iter__(self) -> _InterleaveIterator:
        return self

    def _drop(self, index: int) -> None:
        self._live.remove(index)
        self._cumulative = list(itertools.accumulate(self._weights[i] for i in self._live))

    def __next__(self) -> Any:
        while self._live:
            point = self._uniforms.draw() * self._cumulative[-1]
            slot = min(bisect_right(self._cumulative, point), len(self._live) - 1)
            index = self._live[slot]
            source = self._sources[index]
            assert source is not None
            try:
                return next(source)
            except StopIteration:
                if self._stop_on_first:
                    self._live = []
                    self._stopped = True
                else:
                    self._drop(index)
        raise StopIteration
