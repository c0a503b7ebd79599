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

A stage is two classes: the pipeline (an ``IterableDataset`` that only holds
its settings) and its iterator, a :class:`~shardkit.state.StageIterator` that
keeps beside ``__next__`` everything about the stage's state: the keys (as
constants), ``state_dict``, ``load_state_dict``, the schema of a loaded node
and how the nodes of all workers (and ranks) merge. :meth:`Pipeline.__iter__`
checks once whether a loaded state applies to the iteration it opens. The
format is described in :mod:`shardkit.state`; :func:`interleave` lives in
:mod:`shardkit.interleaving`.
"""

from __future__ import annotations

import importlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import IterableDataset, default_collate

from shardkit.epoch import call_with_epoch_offset, check_epoch, epoch_offset, load_outermost, open_pass
from shardkit.errors import ShardkitError, check_int
from shardkit.seeding import SHUFFLE_STREAM, check_seed, generator
from shardkit.stateful import (
    DRAW_BLOCK,
    EPOCH,
    RNG,
    SHARE,
    UPSTREAM,
    PassThroughIterator,
    Resume,
    StageIterator,
    State,
    StateError,
    applies,
    check,
    check_all_shares,
    check_draws,
    check_inputs_epoch,
    check_share,
    decode,
    encode,
    field,
    generator_state,
    merge,
    node,
    restore_generator,
    same_value,
    share_field,
    upstream_state,
    whole_number,
)
from shardkit.topology import Topology

if TYPE_CHECKING:  # at run time, module __getattr__ below: shardkit.interleaving builds on this module
    from shardkit.interleaving import Interleave, interleave

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

_UNIFORM_BLOCK = DRAW_BLOCK  # one Generator call per this many draws: a scalar call costs ~1 us


class PipelineError(ShardkitError, ValueError):
    """An argument to a pipeline wrapper that cannot work."""


class UnknownLengthError(ShardkitError, TypeError):
    """``len()`` of a stream whose length is unbounded or not known in advance.

    A :class:`TypeError`, as Python expects from ``__len__``, so ``list(ds)``
    and ``operator.length_hint`` still work.
    """


def _check_callable(name: str, value: object) -> None:
    if not callable(value):
        raise PipelineError(f"{name} must be callable, got {value!r} ({type(value).__name__})")


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class Uniforms:
    """Uniform floats in [0, 1) from ``rng``, drawn a block at a time.

    The sequence is fixed by the generator's state, so a position in it is
    (generator state at the block's start, index in the block).
    """

    GENERATOR = "generator"  #: state key: the generator's state at the start of the current block
    NEXT = "next"  #: state key: the index of the next draw in the block

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self._block: list[float] = []
        self._next = 0
        self._block_start: dict[str, Any] | None = None

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
            return {self.GENERATOR: generator_state(self._rng), self.NEXT: 0}
        return {self.GENERATOR: self._block_start, self.NEXT: self._next}

    def load_state_dict(self, state: State) -> None:
        """Continue the sequence at the position :meth:`state_dict` saved (checked by ``check_draws``)."""
        self._rng = restore_generator(state[self.GENERATOR])
        self._block, self._next, self._block_start = [], 0, None
        if state[self.NEXT]:
            self._draw_block()
            self._next = state[self.NEXT]


def _discard_pending(pipeline: Pipeline) -> None:
    """Forget the loaded states of ``pipeline`` and everything upstream of it."""
    pipeline._pending = None
    for upstream in pipeline.upstream:
        _discard_pending(upstream)


class Pipeline(IterableDataset):
    """Base of every shardkit dataset.

    Sources (no inputs) leave ``upstream`` empty and override ``__iter__``,
    ``set_epoch``, ``epoch``, ``seed`` and ``topology``. Wrappers hold their
    inputs in ``upstream`` and inherit the plumbing, which asks the first one.

    A stage that can be resumed names its iterator class in ``_iterator_type``
    (a :class:`~shardkit.state.StageIterator`, which owns the stage's state)
    and implements ``_open(resume)``.
    """

    upstream: tuple[Pipeline, ...] = ()

    #: The iterator class of this stage, which owns its state node; None: a stage without one.
    _iterator_type: type[StageIterator] | None = None
    _iterator: Any = None
    _pending: State | None = None

    @property
    def _state_kind(self) -> str:
        """The ``kind`` of this stage's state node (its iterator's); see :mod:`shardkit.state`."""
        return "" if self._iterator_type is None else self._iterator_type.KIND

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
        loaded, self._pending = self._pending, None
        iterator = open_pass(self, self._open_loaded, loaded)  # counts the epoch once per pass (shardkit.epoch)
        self._iterator = iterator
        return iterator

    def _open_loaded(self, loaded: State | None) -> Iterator[Any]:
        return self._open(self._resume(loaded))

    def _resume(self, loaded: State | None) -> Resume | None:
        """The one check of whether a loaded state resumes the iteration being opened.

        A node that records an epoch resumes an iteration of that epoch; of an
        earlier one, the iteration starts afresh and the inputs' loaded states
        (of the old epoch) are dropped with it; of a later one, raises
        (:func:`~shardkit.state.applies`). Whose the state is (this worker's or
        the whole rank's) the :class:`~shardkit.state.Resume` answers.
        """
        if loaded is None:
            return None
        if EPOCH in loaded and not applies(loaded, self.epoch, self):
            for upstream in self.upstream:
                _discard_pending(upstream)
            return None
        return Resume(loaded, self.topology(), self)

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        """A new iterator, continuing from ``resume`` (this stage's loaded node that applies), if any."""
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
        """Pass the inputs' parts of ``state`` to the inputs (the iterator class says which is whose)."""
        if self._iterator_type is None:
            raise StateError(f"{self!r} has no saved position to load (it defines no _iterator_type)")
        for upstream, part in self._iterator_type.inputs_to_load(self, state):
            upstream.load_state_dict(part)

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


class _MapIterator(PassThroughIterator):
    """Its node is only ``upstream``: a sample is mapped in the step that reads it."""

    KIND = "map"

    def __init__(self, source: Iterator[Any], fn: Callable[[Any], Any]) -> None:
        super().__init__(source)
        self._fn = fn

    def __next__(self) -> Any:
        return self._fn(next(self._source))


class Map(_Wrapper):
    """``fn(sample)`` for every sample; see :meth:`Pipeline.map`."""

    _iterator_type = _MapIterator

    def __init__(self, upstream: Pipeline, fn: Callable[[Any], Any]) -> None:
        super().__init__(upstream)
        _check_callable("map(fn)", fn)
        self.fn = fn

    def __len__(self) -> int:
        return len(self.source)

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        return _MapIterator(iter(self.source), self.fn)

    def __repr__(self) -> str:
        return f"{self.source!r}.map({_name(self.fn)})"


# -- filter -------------------------------------------------------------------


class _FilterIterator(PassThroughIterator):
    """Its node is only ``upstream``: a step reads until a sample is accepted."""

    KIND = "filter"

    def __init__(self, source: Iterator[Any], predicate: Callable[[Any], object]) -> None:
        super().__init__(source)
        self._predicate = predicate

    def __next__(self) -> Any:
        while True:
            sample = next(self._source)
            if self._predicate(sample):
                return sample


class Filter(_Wrapper):
    """The samples ``predicate`` accepts; see :meth:`Pipeline.filter`."""

    _iterator_type = _FilterIterator

    def __init__(self, upstream: Pipeline, predicate: Callable[[Any], object]) -> None:
        super().__init__(upstream)
        _check_callable("filter(predicate)", predicate)
        self.predicate = predicate

    def __len__(self) -> int:
        raise self._unknown_length("filter() drops a number of samples known only after reading them")

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        return _FilterIterator(iter(self.source), self.predicate)

    def __repr__(self) -> str:
        return f"{self.source!r}.filter({_name(self.predicate)})"


# -- shuffle ------------------------------------------------------------------


class _ShuffleIterator(StageIterator):
    """Keeps ``buffer_size`` samples; each step pulls one in and hands a random one out.

    Its node: ``epoch``, the buffered ``samples`` (each encoded with
    :func:`~shardkit.state.encode`), the draw position ``rng``, ``share`` and
    ``upstream``. The contents are saved rather than re-derived: exact and
    cheap to restore, at the cost of a state as large as the buffer.
    """

    KIND = "shuffle"
    SAMPLES = "samples"  #: state key: the buffered samples, encoded
    #: state key of a merged node only: how many workers' buffers its samples pool (absent: one)
    POOLED = "pooled"
    _PICKLED = "buffer"  # state key of shardkit <= 0.x: samples pickled, refused

    def __init__(
        self, source: Iterator[Any], buffer_size: int, rng: np.random.Generator, epoch: int, topology: Topology
    ) -> None:
        self._source = source
        self._buffer_size = buffer_size
        self._uniforms = Uniforms(rng)
        self._buffer: list[Any] = []
        self._exhausted = False
        self._epoch = epoch
        self._topology = topology

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

    def state_dict(self) -> State:
        """The buffered samples are saved (encoded as plain data), so a restore is exact without re-reading.

        Raises:
            StateError: a buffered sample is of a type a state cannot hold (see :func:`shardkit.state.encode`).
        """
        return node(
            self.KIND,
            **{
                EPOCH: self._epoch,
                self.SAMPLES: [encode(sample) for sample in self._buffer],
                RNG: self._uniforms.state_dict(),
                SHARE: share_field(self._topology),
                UPSTREAM: upstream_state(self._source),
            },
        )

    def restore(self, resume: Resume) -> None:
        """Refill the buffer (and, for this worker's own state, the draws) from the state.

        A whole-rank state's buffered samples are dealt out: worker ``w`` of
        ``n`` takes every ``n``-th one from the ``w``-th on.
        """
        self._buffer = resume.part([decode(sample) for sample in resume.state[self.SAMPLES]])
        draws = resume.draws()
        if draws is not None:
            self._uniforms.load_state_dict(draws)

    @classmethod
    def check_state(cls, state: State, where: str) -> None:
        if cls._PICKLED in state and cls.SAMPLES not in state:
            raise StateError(
                f"{where}: this shuffle state keeps its samples pickled ('buffer', written by an earlier "
                "shardkit); it is refused because unpickling can run code. Start the epoch afresh"
            )
        whole_number(state, EPOCH, where)
        field(state, cls.SAMPLES, where, list)
        check_draws(state, where)
        check_share(state, where)
        if cls.POOLED in state and whole_number(state, cls.POOLED, where, 1) > 1 and state[SHARE] is not None:
            raise StateError(f"{where}: state['pooled'] > 1 is a merged state's, whose 'share' is None")
        check_inputs_epoch(state, [field(state, UPSTREAM, where, dict)], where)

    @classmethod
    def inputs_to_load(cls, stage: Any, state: State) -> list[tuple[Any, State]]:
        """Also checks that the samples fit the buffers they came from: a worker's
        buffer holds at most ``buffer_size``, a merge of ``pooled`` of them that many times."""
        pooled = state.get(cls.POOLED, 1)
        held, room = len(state[cls.SAMPLES]), stage.buffer_size * pooled
        if held > room:
            buffers = "the buffer" if pooled == 1 else f"{pooled} buffers"
            raise StateError(
                f"{stage!r}: state['samples'] holds {held} samples, more than {buffers} of {stage!r} hold "
                f"({room}); the state is of a larger shuffle buffer, or it was edited"
            )
        return super().inputs_to_load(stage, state)

    @classmethod
    def merge(cls, states: Sequence[State]) -> State:
        """The workers' buffers pooled; the draws start afresh."""
        check_all_shares(states)
        return node(
            cls.KIND,
            **{
                EPOCH: same_value(states, EPOCH),
                cls.SAMPLES: [sample for s in states for sample in s[cls.SAMPLES]],
                cls.POOLED: sum(s.get(cls.POOLED, 1) for s in states),
                RNG: None,
                SHARE: None,
                UPSTREAM: merge([s[UPSTREAM] for s in states]),
            },
        )


class Shuffle(_Wrapper):
    """A seeded shuffle buffer; see :meth:`Pipeline.shuffle`."""

    _iterator_type = _ShuffleIterator

    def __init__(self, upstream: Pipeline, buffer_size: int, seed: int | None = None) -> None:
        super().__init__(upstream)
        self.buffer_size = check_int("shuffle(buffer_size)", buffer_size, minimum=1, error=PipelineError)
        self.shuffle_seed = None if seed is None else check_seed(seed, "shuffle(seed)")

    def __len__(self) -> int:
        return len(self.source)

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        seed = self.seed if self.shuffle_seed is None else self.shuffle_seed
        epoch, topology = self.epoch, self.topology()
        rng = generator(seed, epoch, topology, SHUFFLE_STREAM)
        iterator = _ShuffleIterator(iter(self.source), self.buffer_size, rng, epoch, topology)
        if resume is not None:
            iterator.restore(resume)
        return iterator

    def __repr__(self) -> str:
        return f"{self.source!r}.shuffle({self.buffer_size}, seed={self.shuffle_seed})"


# -- batch --------------------------------------------------------------------


class _BatchIterator(PassThroughIterator):
    """Its node is only ``upstream``: a batch is made in one step, so no partial batch is ever pending."""

    KIND = "batch"

    def __init__(
        self,
        source: Iterator[Any],
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any],
        drop_last: bool,
    ) -> None:
        super().__init__(source)
        self._batch_size = batch_size
        self._collate_fn = collate_fn
        self._drop_last = drop_last

    def __next__(self) -> Any:
        samples = list(itertools.islice(self._source, self._batch_size))
        if not samples or (self._drop_last and len(samples) < self._batch_size):
            raise StopIteration
        return self._collate_fn(samples)


class Batch(_Wrapper):
    """Collated groups of samples; see :meth:`Pipeline.batch`."""

    _iterator_type = _BatchIterator

    def __init__(
        self,
        upstream: Pipeline,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__(upstream)
        self.batch_size = check_int("batch(batch_size)", batch_size, minimum=1, error=PipelineError)
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

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        return _BatchIterator(iter(self.source), self.batch_size, self.collate_fn, self.drop_last)

    def __repr__(self) -> str:
        return f"{self.source!r}.batch({self.batch_size}, drop_last={self.drop_last})"


# -- repeat -------------------------------------------------------------------


class _RepeatIterator(StageIterator):
    """Runs the passes; its node: ``epoch``, the ``pass``, whether the pass has
    ``yielded`` yet, and the pass's ``upstream`` node (None once every pass is done)."""

    KIND = "repeat"
    PASS = "pass"  #: state key: passes finished before the current one
    YIELDED = "yielded"  #: state key: whether the current pass has yielded (an empty pass ends an endless repeat)

    def __init__(self, upstream: Pipeline, count: int | None, epoch: int, resume: Resume | None = None) -> None:
        self._upstream = upstream
        self._count = count
        self._epoch = epoch
        outer = epoch_offset()
        self._first_offset = outer if count is None else outer * count
        self._pass = 0
        self._yielded_this_pass = 0
        self._source: Iterator[Any] | None = None
        if resume is not None:  # before the pass is opened: the loaded upstream state resumes that pass
            self.restore(resume)
        if resume is None or resume.state[UPSTREAM] is not None:
            self._source = self._start_pass()

    def _start_pass(self) -> Iterator[Any]:
        return call_with_epoch_offset(self._first_offset + self._pass, iter, self._upstream)

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

    def state_dict(self) -> State:
        """The pass, whether it has yielded yet, and the pass's upstream state (None when done)."""
        upstream = None if self._source is None else upstream_state(self._source)
        return node(
            self.KIND,
            **{
                EPOCH: self._epoch,
                self.PASS: self._pass,
                self.YIELDED: self._yielded_this_pass > 0,
                UPSTREAM: upstream,
            },
        )

    def restore(self, resume: Resume) -> None:
        """Go to the saved pass; called by ``__init__`` before the pass's upstream iterator is opened."""
        self._pass = resume.state[self.PASS]
        self._yielded_this_pass = int(resume.state[self.YIELDED])

    @classmethod
    def inputs_to_load(cls, stage: Any, state: State) -> list[tuple[Any, State]]:
        passes, upstream = state[cls.PASS], state[UPSTREAM]  # upstream None: every pass is done
        count = stage.count
        if count is not None and (passes > count or (passes == count and upstream is not None)):
            raise StateError(
                f"{stage!r}: the state is in pass {passes}, but this repeat() makes {count} passes; "
                "load the state into the same pipeline that saved it"
            )
        return [] if upstream is None else [(stage.source, upstream)]

    @classmethod
    def check_state(cls, state: State, where: str) -> None:
        whole_number(state, EPOCH, where)
        passes = whole_number(state, cls.PASS, where)
        yielded = field(state, cls.YIELDED, where, bool)
        upstream = field(state, UPSTREAM, where, dict, type(None))
        # No upstream means every pass is done, which happens only right after a pass ends.
        if upstream is None and (yielded or passes == 0):
            raise StateError(
                f"{where}: a repeat() state without an upstream state must be past a finished pass "
                f"(pass >= 1, yielded False), got pass {passes}, yielded {yielded}"
            )

    @classmethod
    def merge(cls, states: Sequence[State]) -> State:
        """Workers in the same pass merge; in different passes they cannot be split anew."""
        passes = [s[cls.PASS] for s in states]
        if any(p != passes[0] for p in passes):
            raise StateError(
                f"workers are in different repeat() passes {passes}; such a state resumes only with the "
                "same number of workers"
            )
        upstreams = [s[UPSTREAM] for s in states]
        if any(u is None for u in upstreams) != all(u is None for u in upstreams):
            raise StateError("cannot merge repeat() states where some workers have finished and others not")
        return node(
            cls.KIND,
            **{
                EPOCH: same_value(states, EPOCH),
                cls.PASS: passes[0],
                cls.YIELDED: any(s[cls.YIELDED] for s in states),
                UPSTREAM: None if upstreams[0] is None else merge(upstreams),
            },
        )


class Repeat(_Wrapper):
    """Back-to-back passes over the upstream; see :meth:`Pipeline.repeat`.

    Pass ``k`` creates and advances the upstream iterator with the epoch
    offset (:func:`shardkit.epoch.epoch_offset`) raised by ``k``; sources add
    it to their shared epoch, so the shared value itself never changes.
    Nested repeats compose: inside an outer pass ``j``, an inner
    ``repeat(count)`` numbers its passes from ``j * count``.
    """

    _iterator_type = _RepeatIterator

    def __init__(self, upstream: Pipeline, count: int | None = None) -> None:
        super().__init__(upstream)
        self.count = None if count is None else check_int("repeat(count)", count, minimum=1, error=PipelineError)

    def __len__(self) -> int:
        if self.count is None:
            raise self._unknown_length("repeat() without a count never ends; pass repeat(count) for a finite length")
        return self.count * len(self.source)

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        return _RepeatIterator(self.source, self.count, self.epoch, resume)

    def __repr__(self) -> str:
        return f"{self.source!r}.repeat({self.count})"


def __getattr__(name: str) -> Any:
    """``interleave``, ``Interleave`` and ``STOP_RULES`` live in :mod:`shardkit.interleaving`
    (imported when first asked for: it builds on this module)."""
    if name in ("interleave", "Interleave", "STOP_RULES"):
        module = importlib.import_module("shardkit.interleaving")
        return getattr(module, name)
    raise AttributeError(f"module 'shardkit.pipeline' has no attribute {name!r}")
