"""Chainable wrappers: every shardkit dataset is a :class:`Pipeline`, and the stages it chains.

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
and checks its settings, here) and its iterator, a
:class:`~shardkit.state.StageIterator` in a module of its own below this one
(:mod:`.mapping`, :mod:`.shuffling`, :mod:`.batching`, :mod:`.repeating`)
that keeps beside ``__next__`` everything about the stage's state: the keys
(as constants), ``state_dict``, ``restore``, the schema of a loaded node and
how the nodes of all workers (and ranks) merge. :meth:`Pipeline.__iter__`
checks once whether a loaded state applies to the iteration it opens. The
format is described in :mod:`shardkit.state`.

The base and the single-input stages share this module because the fluent
methods (``.map`` ...) build the stages and the stages subclass the base.
:func:`~shardkit.pipeline.interleave`, the stage with several inputs, sits
above it in :mod:`.mixing`.

Each stage also says how many samples every DataLoader worker yields from
it per pass (:meth:`Pipeline.reader_lengths`), which the length guards of
:mod:`shardkit.trainers` ask for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, default_collate

from shardkit.epoch import check_epoch, load_outermost, open_pass
from shardkit.errors import ShardkitError, UnknownLengthError, check_int
from shardkit.pipeline.batching import _BatchIterator
from shardkit.pipeline.blocks import token_dtype
from shardkit.pipeline.mapping import _FilteredRecords, _FilterIterator, _MapIterator, _MappedRecords
from shardkit.pipeline.packing import STRATEGIES, _PackIterator
from shardkit.pipeline.repeating import _RepeatIterator
from shardkit.pipeline.shuffling import _ShuffleIterator
from shardkit.seeding import SHUFFLE_STREAM, check_seed, generator
from shardkit.stateful import EPOCH, Records, Resume, StageIterator, State, StateError, applies, check
from shardkit.topology import Topology
from shardkit.trainers import batch_len, check_not_in_accelerate

__all__ = ["Batch", "Filter", "Map", "Pack", "Pipeline", "PipelineError", "Repeat", "Shuffle", "UnknownLengthError"]


class PipelineError(ShardkitError, ValueError):
    """An argument to a pipeline wrapper that cannot work."""


def _check_callable(name: str, value: object) -> None:
    if not callable(value):
        raise PipelineError(f"{name} must be callable, got {value!r} ({type(value).__name__})")


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


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

    def pack(
        self,
        seq_len: int,
        *,
        key: str = "input_ids",
        strategy: str = "concat",
        pad_id: int = 0,
        buffer_size: int | None = None,
        dtype: Any = None,
        position_ids: bool = False,
        document_ids: bool = False,
    ) -> Pipeline:
        """Pack the token arrays at ``key`` of the samples into blocks of ``seq_len`` tokens.

        Each block is ``{"input_ids": Tensor[seq_len]}`` in the documents' own dtype (int32 and uint16
        stay so), or in ``dtype`` (a numpy or torch integer dtype, e.g. ``torch.int64`` for an embedding
        that wants it); a token that does not fit it is an error, never a wrap-round. Asked for,
        ``position_ids=True`` adds each token's position in its document (0 at its start) and
        ``document_ids=True`` its document's index within the block (``-1`` on padding), both
        ``LongTensor[seq_len]``, from which a block-diagonal attention mask or ``cu_seqlens`` follow
        (see ``docs/pretraining.md``). Samples' other keys are not carried over.

        ``strategy="concat"`` cuts the stream of documents every ``seq_len`` tokens (only each reader's
        last block is padded with ``pad_id``); ``"best_fit"`` keeps documents whole (longer ones cut into
        ``seq_len`` pieces) and fills blocks best-fit from a buffer of ``buffer_size`` documents (default
        256). The tokens not yet packed are saved in the state (by their documents' positions where the
        input reads records again), so resume is exact; see :mod:`shardkit.pipeline.packing`.
        """
        return Pack(
            self, seq_len, key=key, strategy=strategy, pad_id=pad_id, buffer_size=buffer_size, dtype=dtype,
            position_ids=position_ids, document_ids=document_ids,
        )  # fmt: skip

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

    def reader_lengths(self, num_workers: int) -> list[int] | None:
        """Samples each of ``num_workers`` DataLoader workers yields from this
        pipeline per pass on this rank, or None where the split is not known
        (by default: a stage says so by overriding this)."""
        return None

    def records(self) -> Records | None:
        """How this pipeline's items are made again from the positions of their records, for a
        stage that holds items by position in a saved state (:mod:`shardkit.stateful.positions`);
        None (the default) where they cannot be: the holder then saves the items themselves."""
        return None

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


class Map(_Wrapper):
    """``fn(sample)`` for every sample; see :meth:`Pipeline.map`."""

    _iterator_type = _MapIterator

    def __init__(self, upstream: Pipeline, fn: Callable[[Any], Any]) -> None:
        super().__init__(upstream)
        _check_callable("map(fn)", fn)
        self.fn = fn

    def __len__(self) -> int:
        return len(self.source)

    def reader_lengths(self, num_workers: int) -> list[int] | None:
        """Each worker maps as many samples as it reads."""
        return self.source.reader_lengths(num_workers)

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        return _MapIterator(iter(self.source), self.fn, self.seed, self.epoch)

    def records(self) -> Records | None:
        """The input's records, mapped again (see :mod:`shardkit.pipeline.mapping`)."""
        inner = self.source.records()
        return None if inner is None else _MappedRecords(inner, self.fn, self.seed, self.epoch, _name(self.fn))

    def __repr__(self) -> str:
        return f"{self.source!r}.map({_name(self.fn)})"


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

    def records(self) -> Records | None:
        """The input's records, each checked to pass again (see :mod:`shardkit.pipeline.mapping`)."""
        inner = self.source.records()
        return None if inner is None else _FilteredRecords(inner, self.predicate, _name(self.predicate))

    def __repr__(self) -> str:
        return f"{self.source!r}.filter({_name(self.predicate)})"


class Shuffle(_Wrapper):
    """A seeded shuffle buffer; see :meth:`Pipeline.shuffle`."""

    _iterator_type = _ShuffleIterator

    def __init__(self, upstream: Pipeline, buffer_size: int, seed: int | None = None) -> None:
        super().__init__(upstream)
        self.buffer_size = check_int("shuffle(buffer_size)", buffer_size, minimum=1, error=PipelineError)
        self.shuffle_seed = None if seed is None else check_seed(seed, "shuffle(seed)")

    def __len__(self) -> int:
        return len(self.source)

    def reader_lengths(self, num_workers: int) -> list[int] | None:
        """Each worker shuffles its own samples: as many as it reads."""
        return self.source.reader_lengths(num_workers)

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        seed = self.seed if self.shuffle_seed is None else self.shuffle_seed
        epoch, topology = self.epoch, self.topology()
        rng = generator(seed, epoch, topology, SHUFFLE_STREAM)
        records = self.source.records()
        iterator = _ShuffleIterator(iter(self.source), self.buffer_size, rng, epoch, topology, records)
        if resume is not None:
            iterator.restore(resume)
        return iterator

    def records(self) -> Records | None:
        """A shuffle's item is its input's item of the same record."""
        return self.source.records()

    def __repr__(self) -> str:
        return f"{self.source!r}.shuffle({self.buffer_size}, seed={self.shuffle_seed})"


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
        split is not known (see :meth:`Pipeline.reader_lengths`) fall
        back to ``len(upstream)`` batched once, exact with one reader only."""
        exact = batch_len(self)  # per DataLoader worker, each with its own last batch
        if exact is not None:
            return exact
        samples = len(self.source)
        if self.drop_last:
            return samples // self.batch_size
        return math.ceil(samples / self.batch_size)

    def reader_lengths(self, num_workers: int) -> list[int] | None:
        """Each worker batches its own samples, ending with its own partial batch."""
        inner = self.source.reader_lengths(num_workers)
        if inner is None:
            return None
        size, drop = self.batch_size, self.drop_last
        return [n // size if drop else math.ceil(n / size) for n in inner]

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        return _BatchIterator(iter(self.source), self.batch_size, self.collate_fn, self.drop_last)

    def __repr__(self) -> str:
        return f"{self.source!r}.batch({self.batch_size}, drop_last={self.drop_last})"


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

    def reader_lengths(self, num_workers: int) -> list[int] | None:
        """``count`` passes of each worker's samples; None for an endless repeat."""
        if self.count is None:
            return None
        inner = self.source.reader_lengths(num_workers)
        return None if inner is None else [self.count * n for n in inner]

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        return _RepeatIterator(self.source, self.count, self.epoch, resume)

    def __repr__(self) -> str:
        return f"{self.source!r}.repeat({self.count})"


class Pack(_Wrapper):
    """Token arrays packed into blocks of ``seq_len``; see :meth:`Pipeline.pack`.

    Its length is not known before the documents are read (blocks depend on
    their token counts), so ``len()`` raises :class:`UnknownLengthError` and
    :meth:`reader_lengths` is None.
    """

    _iterator_type = _PackIterator

    #: ``buffer_size`` of ``strategy="best_fit"`` when not given: blocks >= 99% full on typical documents.
    DEFAULT_BUFFER = 256

    def __init__(
        self,
        upstream: Pipeline,
        seq_len: int,
        *,
        key: str = "input_ids",
        strategy: str = "concat",
        pad_id: int = 0,
        buffer_size: int | None = None,
        dtype: Any = None,
        position_ids: bool = False,
        document_ids: bool = False,
    ) -> None:
        super().__init__(upstream)
        self.seq_len = check_int("pack(seq_len)", seq_len, minimum=1, error=PipelineError)
        if not isinstance(key, str):
            raise PipelineError(f"pack(key) must be a str, the name of the token array, got {key!r}")
        if strategy not in STRATEGIES:
            raise PipelineError(f"pack(strategy) must be one of {list(STRATEGIES)}, got {strategy!r}")
        if strategy == "concat" and buffer_size is not None:
            raise PipelineError(
                "pack(buffer_size) applies to strategy='best_fit' only; concat holds no buffer, drop buffer_size"
            )
        self.key, self.strategy = key, strategy
        self.pad_id = check_int("pack(pad_id)", pad_id, minimum=-(2**63), maximum=2**63 - 1, error=PipelineError)
        size = self.DEFAULT_BUFFER if buffer_size is None else buffer_size
        self.buffer_size = check_int("pack(buffer_size)", size, minimum=1, error=PipelineError)
        self.dtype = token_dtype(dtype, PipelineError)
        for name, value in (("position_ids", position_ids), ("document_ids", document_ids)):
            if not isinstance(value, bool):
                raise PipelineError(f"pack({name}) must be True or False, got {value!r}")
        self.position_ids, self.document_ids = position_ids, document_ids
        if self.dtype is not None:
            info = np.iinfo(self.dtype)
            if not info.min <= self.pad_id <= info.max:
                raise PipelineError(
                    f"pack(pad_id={self.pad_id}) does not fit pack(dtype={self.dtype}); pass a pad_id in "
                    f"[{info.min}, {info.max}] or a dtype that holds it"
                )

    def __len__(self) -> int:
        raise self._unknown_length("pack() makes a number of blocks known only after reading the documents")

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        iterator = _PackIterator(
            iter(self.source),
            seq_len=self.seq_len,
            key=self.key,
            strategy=self.strategy,
            pad_id=self.pad_id,
            buffer_size=self.buffer_size,
            epoch=self.epoch,
            topology=self.topology(),
            dtype=self.dtype,
            position_ids=self.position_ids,
            document_ids=self.document_ids,
            records=self.source.records(),
        )
        if resume is not None:
            iterator.restore(resume)
        return iterator

    def __repr__(self) -> str:
        buffer = f", buffer_size={self.buffer_size}" if self.strategy == "best_fit" else ""
        extra = "".join(f", {name}=True" for name in ("position_ids", "document_ids") if getattr(self, name))
        extra += f", dtype={self.dtype.name}" if self.dtype is not None else ""
        return f"{self.source!r}.pack({self.seq_len}, key={self.key!r}, strategy={self.strategy!r}{buffer}{extra})"
