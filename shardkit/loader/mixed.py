"""MixedLoader: DataLoader batches that mix every worker's stream in equal shares.

A plain :class:`~torch.utils.data.DataLoader` over an ``IterableDataset`` builds
each batch inside one worker, so a batch holds samples from that worker's one or
two shards only. :class:`MixedLoader` keeps the workers but has each of them
ship *micro-batches* tagged with its worker id; the main process keeps one
queue of pending samples per worker and cuts every output batch from all
workers that still have data, in equal shares.

How a batch is made:

* Shares are water-filled: with ``k`` workers that still have data each gives
  ``floor`` or ``ceil`` of ``batch_size / k``; a worker that has fewer samples
  left gives all of them and the others fill the rest. Every batch is full
  except the last one of the epoch, so an epoch of ``n`` samples has
  ``ceil(n / batch_size)`` batches (``floor`` with ``drop_last``) whatever the
  workers' counts: ranks that read the same number of samples yield the same
  number of batches.
* Which workers give the ``ceil`` share, and the order of the workers' blocks
  inside the batch, come from a hash of ``(seed, epoch, batch_index, worker)``.
  Assembly depends only on what each worker yields, never on arrival timing,
  so the same seed and data give the same batches.
* Without ``collate_fn``, workers apply ``default_collate`` to each
  micro-batch and the main process re-collates by slicing the micro-batches
  along the batch dimension and concatenating (:mod:`shardkit.loader.collate`: one
  copy per batch, none per sample). The micro-batches travel through a ring
  of reusable shared-memory slabs per worker (:mod:`shardkit.loader.slabs`) instead
  of DataLoader's new segment per tensor per batch. A custom ``collate_fn``
  may depend on the whole batch (padding to the longest sample, custom batch
  classes), so micro-batches then travel as lists of samples and
  ``collate_fn`` is called once per output batch, in the main process,
  exactly as DataLoader would call it.
* Over a dataset that yields column batches (its ``column_batches`` is true:
  ``TFRecordDataset(features=..., batch_size=...)``,
  ``ParquetDataset(batch_size=...)``), each of the dataset's
  batches is one micro-batch: the worker writes its columns into a slab
  (bytes as a values buffer and offsets) and the main process cuts every
  batch from row ranges of them (:mod:`shardkit.loader.columns`), with no work per
  sample anywhere. Batches are dicts of a tensor per numeric column and a
  ``pyarrow.LargeBinaryArray`` per bytes column (a Parquet column of strings,
  bytes or lists comes as the numpy array the dataset made, sent with the
  message rather than through the slab); the dataset's batch_size
  sets the micro-batch (1024 records is a good start for small records).
  Without workers the same assembly runs in the main process.

Resuming (:meth:`MixedLoader.state_dict` / :meth:`MixedLoader.load_state_dict`):
every message from a worker carries its dataset's state after that
micro-batch, and the main process knows which samples went out in batches.
The saved state holds, per worker, the dataset state just past what was
delivered, and, when a micro-batch was cut part-way, its undelivered tail as
encoded samples (at most one micro-batch per worker; samples still waiting in
whole micro-batches are read again instead). Restored with the same number of
workers, each worker resumes its own state and the batches are the ones the
uninterrupted run would have made. With another number, the worker states
are merged (:func:`shardkit.state.merge`) and split anew: exactly the samples
not yet delivered follow, in another order.
"""

from __future__ import annotations

import math
import pickle
import signal
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

from shardkit.epoch import resume_at
from shardkit.errors import ShardkitError, WorkerDiedError, check_int
from shardkit.loader import columns
from shardkit.loader.collate import Part, collated_length, join, tail
from shardkit.loader.slabs import SPARE_SLOTS, SlabBatch, SlabRing, from_slab, view
from shardkit.pipeline import Pipeline
from shardkit.stateful import (
    State,
    StateError,
    applies,
    check,
    decode,
    encode,
    field,
    merge,
    node,
    validate,
    whole_number,
)

__all__ = ["LoaderError", "MixedLoader"]

#: DataLoader arguments that MixedLoader hands to its DataLoader unchanged.
PASSTHROUGH_KWARGS = frozenset(
    {
        "pin_memory",
        "pin_memory_device",
        "persistent_workers",
        "prefetch_factor",
        "multiprocessing_context",
        "timeout",
        "worker_init_fn",
        "generator",
    }
)


class LoaderError(ShardkitError, ValueError):
    """A MixedLoader argument that cannot work."""


class MixedLoader:
    """Batches over an ``IterableDataset`` in which every worker still holding
    data contributes an equal share.

    Args:
        dataset: the ``IterableDataset`` to read; each DataLoader worker
            iterates its own copy, as with a plain DataLoader.
        batch_size: samples per batch.
        num_workers: DataLoader worker processes; 0 reads in the main process
            and batches the stream plainly.
        collate_fn: called once per output batch with its list of samples, in
            the main process (not for column batches: see the module docstring). ``None`` collates with ``default_collate`` in the
            workers and joins micro-batches in the main process.
        drop_last: drop the last batch of an epoch if it is not full.
        seed: seeds the placement of the workers' shares in each batch.
        micro_batch_size: samples per message from a worker (with workers);
            defaults to ``batch_size``; for column batches, the dataset's
            batch_size is the micro-batch and this must stay None. The main process holds one or two
            micro-batches per worker; smaller values shorten that and the
            wait for the first batch, at the cost of more messages, which
            cost most when samples are small. Without ``collate_fn`` each
            worker keeps ``prefetch_factor + 3`` shared-memory slabs the size
            of one collated micro-batch for the epoch (5 x 4.8 MB for 32
            3x224x224 uint8 images).
        resumable: track the position for :meth:`state_dict`. Each worker
            then sends its dataset's state with every micro-batch: about
            25 us for a source, but a ``.shuffle(n)`` buffer inside the
            dataset is encoded whole into every message. With large samples
            in a large buffer, shuffle before decoding, or pass False when
            you do not resume. Saved samples (a shuffle buffer, the cut
            tail of a micro-batch) are plain data, never pickled (see
            :func:`shardkit.state.encode` for the types a state holds);
            ``state_dict()`` raises :class:`~shardkit.state.StateError` for
            samples of other types.
        **dataloader_kwargs: passed to the underlying DataLoader; any of
            ``pin_memory``, ``pin_memory_device``, ``persistent_workers``,
            ``prefetch_factor`` (counted in micro-batches),
            ``multiprocessing_context``, ``timeout``, ``worker_init_fn``,
            ``generator``. With workers, pinning applies to the assembled
            batches in the main process. (``in_order`` is not offered: batches
            need every worker's share, so letting fast workers run ahead
            would only grow the samples held in the main process.)
    """

    def __init__(
        self,
        dataset: IterableDataset,
        batch_size: int,
        *,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        seed: int = 0,
        micro_batch_size: int | None = None,
        resumable: bool = True,
        **dataloader_kwargs: Any,
    ) -> None:
        _check_arguments(dataset, batch_size, num_workers, collate_fn, drop_last, seed, micro_batch_size, resumable)
        self._columns = _column_batches(dataset, collate_fn, micro_batch_size)
        unknown = sorted(set(dataloader_kwargs) - PASSTHROUGH_KWARGS)
        if unknown:
            raise TypeError(
                f"MixedLoader got unexpected keyword argument(s) {', '.join(unknown)}; "
                f"it passes only {', '.join(sorted(PASSTHROUGH_KWARGS))} to DataLoader "
                "and does its own batching, so sampler, shuffle and batch_sampler do not apply"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.seed = seed
        self.micro_batch_size = batch_size if micro_batch_size is None else micro_batch_size
        self.resumable = resumable
        self.epoch = 0
        self._pin = False
        self._micro_batches: _MicroBatches | None = None
        if num_workers == 0 and not self._columns:
            self._loader = DataLoader(
                dataset, batch_size=batch_size, drop_last=drop_last, collate_fn=collate_fn, **dataloader_kwargs
            )
        else:
            self._loader = self._worker_loader(dataloader_kwargs)

    def _worker_loader(self, dataloader_kwargs: dict[str, Any]) -> DataLoader:
        """The DataLoader whose workers send micro-batches. Pinning is done here, on
        assembled batches: DataLoader's pin thread would pin micro-batches that are
        then copied out again."""
        pin = bool(dataloader_kwargs.pop("pin_memory", False))
        dataloader_kwargs.pop("pin_memory_device", None)
        self._pin = pin and _accelerator_available()
        if pin and not self._pin:
            warnings.warn(
                "MixedLoader: pin_memory=True but no accelerator is available; batches will not be pinned",
                stacklevel=3,
            )
        collate = self.collate_fn is None
        slots = SPARE_SLOTS + (dataloader_kwargs.get("prefetch_factor") or 2) if collate and self.num_workers else 0
        self._micro_batches = _MicroBatches(
            self.dataset,
            self.micro_batch_size,
            collate=collate,
            resumable=self.resumable,
            slots=slots,
            columns=self._columns,
        )
        return DataLoader(
            self._micro_batches, batch_size=None, num_workers=self.num_workers, collate_fn=_as_is, **dataloader_kwargs
        )

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch for the next iteration and forward it to
        ``dataset.set_epoch`` when the dataset has one."""
        check_int("epoch", epoch, minimum=0, error=LoaderError)
        self.epoch = epoch
        self._epoch_set = True
        set_dataset_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_dataset_epoch):
            set_dataset_epoch(epoch)

    def __len__(self) -> int:
        """Batches in one epoch, from ``len(dataset)`` (samples this rank reads; for
        column batches the dataset's ``num_samples()``)."""
        count = getattr(self.dataset, "num_samples", None) if self._columns else None
        if callable(count):
            samples: int = count()  # pyright: ignore[reportAssignmentType]  (TFRecordDataset.num_samples)
        elif self._columns:  # its len() counts column batches, not samples
            raise TypeError(
                f"MixedLoader has no len(): {type(self.dataset).__name__} yields column batches and has no "
                "num_samples() (the number of samples this rank reads); drive training by a number of steps"
            )
        elif not hasattr(self.dataset, "__len__"):
            raise TypeError(
                f"MixedLoader has no len(): {type(self.dataset).__name__} does not define "
                "__len__ (the number of samples this rank reads)"
            )
        else:
            samples = len(self.dataset)  # type: ignore[arg-type]
        if self.drop_last:
            return samples // self.batch_size
        return math.ceil(samples / self.batch_size)

    _resume: State | None = None
    _tails: tuple[Any, ...] = ()  # the loaded state's carried tails, decoded
    _mixer: _Mixer | None = None
    _iterated = False
    _epoch_set = False  # until set_epoch, iteration k is epoch k, like the dataset's passes (shardkit.epoch)
    _passes = 0

    def __iter__(self) -> Iterator[Any]:
        """Iterate one epoch of batches, resuming a state given to :meth:`load_state_dict`."""
        resume, self._resume = self._resume, None
        if not self._epoch_set:
            self.epoch, self._passes = self._passes, self._passes + 1
        if resume is not None and not applies(resume, self.epoch, self):
            resume = None
        self._iterated = True
        micro_batches = self._micro_batches
        if micro_batches is None:  # no workers, samples
            if resume is not None:
                self._resume_in_process(resume)
            return iter(self._loader)
        if resume is not None:
            saved = resume["workers"]
            same = resume["num_workers"] == self.num_workers
            micro_batches.states = list(saved) if same else [merge(saved)] * max(self.num_workers, 1)
        try:
            source = iter(self._loader)  # starts the workers, each with its copy of the states
        finally:
            micro_batches.states = None
        self._mixer = _Mixer(self, source, resume, self._tails if resume is not None else ())
        return self._mixer

    def state_dict(self) -> State:
        """What the batches returned so far have delivered, as plain data.

        Call it between batches (in the training loop, with the model's
        checkpoint). It holds the epoch, the batch index, each worker's
        dataset state and the encoded undelivered tail of at most one
        micro-batch per worker; see the module docstring. The dataset must
        be Stateful (every shardkit pipeline is).

        Raises:
            StateError: before any iteration (and no state loaded), or when
                the dataset cannot save its position.
        """
        if not self._iterated:
            if self._resume is not None:
                return self._resume
            raise StateError("MixedLoader.state_dict(): nothing has been iterated yet, so there is no position to save")
        if not self.resumable:
            raise StateError("MixedLoader cannot save its position: it was built with resumable=False")
        if self._micro_batches is None:
            workers = [_dataset_state(self.dataset)]
            return _loader_state(self, batch_index=-1, finished=False, workers=workers, carry=[])
        assert self._mixer is not None
        return self._mixer.state_dict()

    def load_state_dict(self, state: State) -> None:
        """Resume from ``state`` (from :meth:`state_dict`) at the next iteration.

        Sets the epoch to the state's (and the dataset's, through
        ``set_epoch``) when ``set_epoch`` was called before; iterate, then go
        on with ``set_epoch(epoch + 1)``. Without ``set_epoch`` the next
        iteration reads the state's epoch and later ones count on from it.
        ``num_workers`` may differ from the saving loader's: the remaining
        samples are then split anew (exactly once; in another order).
        Call it before the first iteration: persistent workers that are
        already running cannot be given a state.

        Raises:
            StateError: a state of another kind or version, of a dataset it
                does not fit (see :meth:`shardkit.pipeline.Pipeline.load_state_dict`),
                or given after persistent workers started.
        """
        check(state, "mixed_loader", self)
        tails = _check_loader_state(state, self)
        if self.num_workers and getattr(self._loader, "_iterator", None) is not None:
            raise StateError(
                "MixedLoader.load_state_dict() after persistent workers have started; "
                "build a new MixedLoader and load the state before iterating it"
            )
        if self._micro_batches is None and state["carry"]:
            raise StateError(
                "this state holds samples cut out of micro-batches, which only a MixedLoader with "
                "num_workers >= 1 can deliver; restore it with workers"
            )
        if self._epoch_set:
            self.set_epoch(state["epoch"])
        else:  # counted epochs: the next iteration reads the state's, the one after it the next
            self._passes = state["epoch"]
            resume_at(self.dataset, state["epoch"])
        self._resume = state
        self._tails = tuple(tails)

    def _resume_in_process(self, state: State) -> None:
        saved = state["workers"]
        load = getattr(self.dataset, "load_state_dict", None)
        if load is None:
            raise StateError(f"{type(self.dataset).__name__} has no load_state_dict(); it cannot resume")
        load(saved[0] if len(saved) == 1 else merge(saved))


#: ``count`` of the message a worker sends first, with its dataset's starting state.
_START = -1

Message = tuple[int, int, Any, Any]


class _MicroBatches(IterableDataset):
    """Runs in each worker: sends ``(worker_id, -1, None, state)`` first, then
    the dataset's stream cut into micro-batches ``(worker_id, count, payload,
    state)``, and ends with ``(worker_id, 0, None, state)``, so the main
    process knows when a worker has no more data. ``state`` is the dataset's
    state after the message (None if it has none; a string saying why if it
    cannot save one). ``states``, when set, are loaded into each worker's
    dataset before its next iteration, once. With ``slots``, collated
    micro-batches travel in a new :class:`~shardkit.loader.slabs.SlabRing` per
    iteration, whose flag array goes with the first message. With ``columns``
    each of the dataset's column batches is one micro-batch
    (:mod:`shardkit.loader.columns`); without workers (columns only) it runs in the
    main process as worker 0."""

    def __init__(
        self,
        dataset: IterableDataset,
        size: int,
        *,
        collate: bool,
        resumable: bool,
        slots: int = 0,
        columns: bool = False,
    ) -> None:
        self.dataset = dataset
        self.size = size
        self.collate = collate
        self.resumable = resumable
        self.slots = slots
        self.columns = columns
        self.states: list[State] | None = None

    def __iter__(self) -> Iterator[Message]:
        info = get_worker_info()
        assert info is not None or self.columns, "_MicroBatches of samples runs only in DataLoader workers"
        states, self.states = self.states, None  # now: in the main process, the caller clears them next
        return self._messages(0 if info is None else info.id, states)

    def _messages(self, worker: int, states: list[State] | None) -> Iterator[Message]:
        if states is not None:
            self.dataset.load_state_dict(states[worker])  # type: ignore[attr-defined]
        samples = iter(self.dataset)
        saver = _StateSaver(self.dataset, self.resumable)
        ring = SlabRing(self.slots) if self.collate and self.slots else None
        yield worker, _START, None if ring is None else ring.flags, saver()
        chunks = self._column_chunks(samples, ring) if self.columns else self._chunks(samples, ring)
        for count, payload in chunks:
            yield worker, count, payload, saver()
        yield worker, 0, None, saver()

    def _chunks(self, samples: Iterator[Any], ring: SlabRing | None) -> Iterator[tuple[int, Any]]:
        while chunk := list(islice(samples, self.size)):
            if not self.collate:
                yield len(chunk), chunk
            else:
                yield len(chunk), default_collate(chunk) if ring is None else ring.collate(chunk)

    @staticmethod
    def _column_chunks(batches: Iterator[Any], ring: SlabRing | None) -> Iterator[tuple[int, Any]]:
        for batch in batches:
            parts = columns.as_parts(batch)
            count = columns.columns_length(parts)
            if count:  # 0 would read as the end marker
                yield count, parts if ring is None else ring.put(parts)


class _StateSaver:
    """Calls ``dataset.state_dict()``; after a failure, returns its message instead of retrying."""

    def __init__(self, dataset: IterableDataset, resumable: bool = True) -> None:
        stateful = callable(getattr(dataset, "state_dict", None)) and callable(
            getattr(dataset, "load_state_dict", None)
        )
        self._dataset = dataset
        self._failure: str | None = None
        if not stateful:
            self._failure = f"{type(dataset).__name__} has no state_dict()/load_state_dict()"
        elif not resumable:
            self._failure = "it was built with resumable=False"

    def __call__(self) -> State | str:
        if self._failure is None:
            try:
                return self._dataset.state_dict()  # type: ignore[attr-defined]
            except StateError as error:
                self._failure = str(error)
        return self._failure


def _check_arguments(
    dataset: Any,
    batch_size: Any,
    num_workers: Any,
    collate_fn: Any,
    drop_last: Any,
    seed: Any,
    micro_batch_size: Any,
    resumable: Any,
) -> None:
    """Raise :class:`LoaderError` naming the first MixedLoader argument that cannot work."""
    if not isinstance(dataset, IterableDataset):
        raise LoaderError(
            f"MixedLoader mixes the streams of an IterableDataset's workers; got "
            f"{type(dataset).__name__}. For a map-style dataset use "
            "torch.utils.data.DataLoader(dataset, shuffle=True)."
        )
    for name, value, minimum in (("batch_size", batch_size, 1), ("num_workers", num_workers, 0), ("seed", seed, 0)):
        check_int(name, value, minimum=minimum, error=LoaderError)
    if micro_batch_size is not None:
        check_int("micro_batch_size", micro_batch_size, minimum=1, error=LoaderError)
    if collate_fn is not None and not callable(collate_fn):
        raise LoaderError(f"collate_fn must be callable or None, got {collate_fn!r}")
    for name, flag in (("drop_last", drop_last), ("resumable", resumable)):
        if not isinstance(flag, bool):
            raise LoaderError(f"{name} must be a bool (True or False), got {flag!r}")


def _column_batches(dataset: Any, collate_fn: Any, micro_batch_size: Any) -> bool:
    """Whether ``dataset`` yields column batches (its ``column_batches`` is true), checking
    the arguments that do not apply to them."""
    if not getattr(dataset, "column_batches", False):
        return False
    if collate_fn is not None:
        raise LoaderError(
            f"{type(dataset).__name__} yields column batches, which MixedLoader cuts into batches itself; "
            "collate_fn applies to samples: pass collate_fn=None, or build the dataset without features"
        )
    if micro_batch_size is not None:
        raise LoaderError(
            f"{type(dataset).__name__} yields column batches: each of them is one micro-batch, so set their "
            f"size with the dataset's batch_size (now {getattr(dataset, 'batch_size', None)}), not micro_batch_size"
        )
    return True


def _loader_state(loader: MixedLoader | _Mixer, **fields: Any) -> State:
    return node(
        "mixed_loader",
        epoch=loader.epoch,
        num_workers=loader.num_workers,
        batch_size=loader.batch_size,
        **fields,
    )


def _dataset_state(dataset: IterableDataset) -> State:
    state = _StateSaver(dataset)()
    if isinstance(state, str):
        raise StateError(f"MixedLoader cannot save its position: {state}")
    return state


def _check_loader_state(state: State, loader: MixedLoader) -> list[Any]:
    """Check every field of a loaded MixedLoader state; returns its carried tails, decoded.

    The workers' dataset states are checked as whole trees when the dataset is
    a shardkit pipeline (the dataset checks what depends on its files when a
    worker loads them); a carried tail must decode to ``count`` samples of
    the form this loader makes (collated, or a list for a ``collate_fn``).
    """
    where = "MixedLoader.load_state_dict()"
    whole_number(state, "epoch", where)
    num_workers = whole_number(state, "num_workers", where)
    whole_number(state, "batch_size", where, 1)
    whole_number(state, "batch_index", where, -1)
    field(state, "finished", where, bool)
    workers = field(state, "workers", where, list, tuple)
    if len(workers) != max(num_workers, 1):
        raise StateError(f"{where}: the state has {len(workers)} worker states for num_workers={num_workers}")
    for index, worker_state in enumerate(workers):
        if isinstance(loader.dataset, Pipeline):
            validate(worker_state, f"{where}: state['workers'][{index}]")
            check(worker_state, loader.dataset._state_kind, loader.dataset)
        elif not isinstance(worker_state, dict):
            raise StateError(f"{where}: state['workers'][{index}] must be a dict, got {type(worker_state).__name__}")
    carry = field(state, "carry", where, list, tuple)
    if state["finished"] and carry:
        raise StateError(
            f"{where}: state['finished'] is true, but state['carry'] holds {len(carry)} tail(s) of undelivered "
            "samples; a finished epoch has delivered everything. The state was edited or is corrupt"
        )
    tails = [_check_tail(tail, index, num_workers, loader) for index, tail in enumerate(carry)]
    owners = [tail["worker"] for tail in carry if tail["worker"] is not None]
    if len(owners) != len(set(owners)):
        raise StateError(
            f"{where}: state['carry'] holds more than one tail of worker(s) {owners}; a worker has at most one"
        )
    return tails


def _check_tail(tail: Any, index: int, num_workers: int, loader: MixedLoader) -> Any:
    where = f"MixedLoader.load_state_dict(): state['carry'][{index}]"
    if not isinstance(tail, dict):
        raise StateError(f"{where} must be a dict, got {type(tail).__name__}")
    worker = field(tail, "worker", where, int, type(None))
    if worker is not None and not 0 <= worker < max(num_workers, 1):
        raise StateError(f"{where}: worker {worker} is not one of the saving loader's {num_workers} workers")
    count = whole_number(tail, "count", where, 1)
    if "payload" not in tail:
        raise StateError(f"{where} has no 'payload'")
    samples = decode(tail["payload"])
    if loader._columns:
        samples = columns.from_plain(samples)
        length, form = columns.columns_length(samples), "a column batch"
    elif loader.collate_fn is not None:
        length, form = (len(samples) if type(samples) is list else None), "a list of samples (for collate_fn)"
    else:
        length, form = collated_length(samples), "a collated micro-batch"
    if length != count:
        raise StateError(
            f"{where}: the carried samples must be {form} of {count} samples; got {_describe(samples, length)}"
        )
    return samples


def _describe(samples: Any, length: int | None) -> str:
    return f"a {type(samples).__name__}" + ("" if length is None else f" of {length}")


def _accelerator_available() -> bool:
    """Whether pinned memory can be used, as DataLoader decides it."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is None:
        return torch.cuda.is_available()
    return bool(accelerator.is_available())


def _as_is(message: Any) -> Any:
    """DataLoader collate_fn for ready-made messages (module level so spawn can pickle it)."""
    return message


@dataclass(slots=True)
class _Pending:
    """A micro-batch in a queue of the main process, of which ``start:count`` is left."""

    payload: Any  # collated, or a list of samples (with a collate_fn)
    count: int
    state: Any  # the worker's dataset state after this micro-batch
    start: int = 0
    carried: bool = False  # a restored tail: saved again even when nothing of it was taken
    slot: int | None = None  # the slab slot it lies in, freed once the batch holds copies of it


class _Mixer(Iterator[Any]):
    """One epoch of assembly. All state lives here (pending micro-batches per
    worker, which workers are done, the batch index, each worker's dataset
    state past what was delivered) so that it can be saved and restored.

    A restored state's undelivered tails go first: into their worker's queue
    when the worker count is the same, else into extra queues of their own
    (one per tail, already done) that the water-filling drains like workers.
    """

    def __init__(
        self,
        loader: MixedLoader,
        source: Iterator[Message],
        resume: State | None = None,
        tails: Sequence[Any] = (),
    ) -> None:
        self.epoch, self.num_workers, self.batch_size = loader.epoch, loader.num_workers, loader.batch_size
        self._source: Iterator[Message] | None = source
        self._dataloader = loader._loader
        self._dataset = loader.dataset  # named when a worker dies
        self._collate_fn = loader.collate_fn
        self._columns = loader._columns
        self._drop_last = loader.drop_last
        self._pin = loader._pin
        self._epoch_key = _mix64(_mix64(loader.seed) ^ loader.epoch)
        self._workers = workers = max(loader.num_workers, 1)  # without workers, columns come from worker 0
        # Per queue: its micro-batches and the samples left in them. Queues past
        # the workers' hold restored tails.
        self._pending: list[deque[_Pending]] = [deque() for _ in range(workers)]
        self._available = [0] * workers
        self._done = [False] * workers
        # Per worker: its slab ring's busy flags and buffers by slot; slots to free
        # once the batch being made is copied out of them.
        self._flags: list[Any] = [None] * workers
        self._slabs: list[dict[int, torch.Tensor]] = [{} for _ in range(workers)]
        self._release: list[tuple[int, int]] = []
        # Per worker: its dataset state past the entries that left its queue
        # (None until its first message), and after its last message.
        self._base: list[Any] = [None] * workers
        self._final: list[Any] = [None] * workers
        self.batch_index = 0
        self._finished = False
        self._unconfirmed = False  # a restored finished state, not yet read to its end
        if resume is not None:
            self._restore(resume, tails)

    def _restore(self, state: State, tails: Sequence[Any]) -> None:
        """Resume the position of ``state``, whose carried samples ``tails`` holds decoded."""
        self.batch_index = state["batch_index"]
        # A finished state's workers resume past their last sample: they are read
        # to their end markers to prove it (_confirm_finished) rather than trusted.
        self._unconfirmed = state["finished"]
        same = state["num_workers"] == self.num_workers
        for saved, samples in zip(state["carry"], tails):
            worker = saved["worker"] if same and saved["worker"] is not None else None
            if worker is None:
                worker = len(self._pending)
                self._pending.append(deque())
                self._available.append(0)
                self._done.append(True)
            dataset_state = state["workers"][worker] if worker < self._workers else None
            self._pending[worker].appendleft(_Pending(samples, saved["count"], dataset_state, carried=True))
            self._available[worker] += saved["count"]

    def _confirm_finished(self) -> None:
        """Read a restored finished state's workers to their end; any sample is a :class:`StateError`."""
        self._unconfirmed = False
        while self._source is not None and not all(self._done[: self._workers]):
            self._pull()
            holding = [worker for worker, left in enumerate(self._available) if left]
            if holding:
                self._stop_workers()
                raise StateError(
                    f"MixedLoader.load_state_dict(): state['finished'] is true, but worker {holding[0]} still "
                    "holds samples: its dataset state resumes before the end of the epoch. The state was edited "
                    "or is corrupt; load a state saved by state_dict()"
                )
        self._finish()

    def state_dict(self) -> State:
        """The loader's state: see :meth:`MixedLoader.state_dict`."""
        if self._unconfirmed:
            self._confirm_finished()
        while self._source is not None and any(base is None for base in self._base):
            self._pull()  # every worker's starting state, for those that delivered nothing yet
        workers: list[Any] = []
        carry: list[dict[str, Any]] = []
        for worker, queue in enumerate(self._pending):
            real = worker < self._workers
            state = self._base[worker] if real else None
            if real and not queue and self._done[worker]:
                state = self._final[worker]
            if queue and (queue[0].start > 0 or queue[0].carried):  # cut part-way, or a restored tail
                carry.append(self._carried(queue[0], worker if real else None))
                state = queue[0].state
            if real:
                if not isinstance(state, dict):
                    reason = state if isinstance(state, str) else "a worker sent no state"
                    raise StateError(f"MixedLoader cannot save its position: {reason}")
                workers.append(state)
        return _loader_state(self, batch_index=self.batch_index, finished=self._finished, workers=workers, carry=carry)

    def _carried(self, entry: _Pending, worker: int | None) -> dict[str, Any]:
        """The saved form of the undelivered rest of a micro-batch."""
        if self._columns:
            rest: Any = columns.plain(columns.tail(entry.payload, entry.start, entry.count))
        else:
            rest = tail(entry.payload, entry.start, entry.count, collated=self._collate_fn is None)
        return {"worker": worker, "count": entry.count - entry.start, "payload": encode(rest)}

    def __next__(self) -> Any:
        if self._unconfirmed:
            self._confirm_finished()
        if self._finished:
            raise StopIteration
        shares = self._allocate()
        size = sum(shares.values())
        if size == 0 or (self._drop_last and size < self.batch_size):
            self._finish()
            raise StopIteration
        parts = [part for worker, share in shares.items() for part in self._take(worker, share)]
        if self._columns:
            batch = columns.join_columns(parts)  # copies: the slabs are released below
        elif self._collate_fn is None:
            batch = join(parts, copy=any(flags is not None for flags in self._flags))
        else:
            batch = self._collate_fn([s for payload, a, b in parts for s in payload[a:b]])
        for worker, slot in self._release:  # the batch holds copies now
            self._flags[worker][slot] = 0
        self._release.clear()
        self.batch_index += 1
        return _pin_memory(batch) if self._pin else batch

    def _finish(self) -> None:
        self._finished = True
        self._source = None  # lets the DataLoader shut its workers down
        for queue in self._pending:  # a dropped last batch
            queue.clear()
        self._slabs = [{} for _ in self._slabs]  # unmaps the workers' rings now, not with the loader
        self._flags = [None] * len(self._flags)

    def _stop_workers(self) -> None:
        """Shut the workers down now: one of them raised.

        The error's traceback holds the DataLoader iterator. Left to the cycle
        collector (a caught error kept in a variable, a test's ``raises``), the
        iterator's queues are finalized before the iterator itself, so its
        workers never receive their exit message and DataLoader waits 5 s per
        worker before terminating them. Persistent workers are started anew
        next epoch.
        """
        shutdown = getattr(self._source, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        if getattr(self._dataloader, "_iterator", None) is self._source:
            self._dataloader._iterator = None
        self._finish()  # drops the source too

    def _died_worker(self, error: BaseException) -> WorkerDiedError | None:
        """The error naming the worker that died, if ``error`` comes from a worker's death.

        A worker killed while its message is read shows as whatever the read met: a
        stream or connection cut short (``EOFError``, ``ConnectionError``, a truncated
        pickle), or DataLoader's ``RuntimeError`` naming a pid. The dead process may not
        be reaped yet, so it is waited for a moment.
        """
        if not _may_be_a_death(error):
            return None
        processes = list(getattr(self._source, "_workers", None) or ())
        deadline = time.monotonic() + _DEATH_WAIT
        while True:
            dead = [(worker, process) for worker, process in enumerate(processes) if not process.is_alive()]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        if not dead:
            return None
        worker, process = dead[0]
        return WorkerDiedError(
            f"MixedLoader: DataLoader worker {worker} (pid {process.pid}) died, {_ending(process.exitcode)}, "
            f"while reading {self._dataset!r} (the main process was receiving its micro-batches and met "
            f"{type(error).__name__}: {error}). What it had not delivered is lost from this iteration; "
            "load the last state_dict() to resume. A worker killed by SIGKILL was often killed for memory"
        )

    def _allocate(self) -> dict[int, int]:
        """Shares of the next batch per worker, in placement order, pulling
        messages until every worker's share is known to be available.

        A worker that may still send data counts as unlimited, so shares only
        change when a worker is known to run dry. Workers are ordered by a
        per-worker key, which leaves the relative order of the others alone
        whether or not a finished worker's end marker has arrived yet: the
        result depends on what each worker yields, not on arrival order.
        """
        while True:
            key = _mix64(self._epoch_key ^ self.batch_index)
            active = [w for w, left in enumerate(self._available) if left or not self._done[w]]
            active.sort(key=lambda w: _mix64(key ^ w))
            caps = {w: self._available[w] if self._done[w] else None for w in active}
            shares = _water_fill(self.batch_size, active, caps)
            if all(shares[w] <= self._available[w] for w in active):
                return shares
            self._pull()

    def _pull(self) -> None:
        """Receive one message from the workers."""
        assert self._source is not None, "a finished epoch pulls no messages"
        try:
            worker, count, payload, state = next(self._source)
        except StopIteration:
            # Every worker ends with an end marker; this only guards against a hang.
            self._done = [True] * len(self._done)
            self._source = None
            return
        except BaseException as error:
            died = self._died_worker(error)
            self._stop_workers()
            if died is not None:
                raise died from error
            raise
        if count == _START:
            self._base[worker] = state
            if payload is not None:  # the busy flags of the worker's slab ring
                self._flags[worker] = payload.numpy()
        elif count == 0:
            self._done[worker] = True
            self._final[worker] = state
        else:
            self._queue(worker, count, payload, state)

    def _queue(self, worker: int, count: int, payload: Any, state: Any) -> None:
        """Queue a micro-batch; one in a slab becomes views of the slab, mapped once per slot."""
        slot = None
        if isinstance(payload, SlabBatch):
            slot = payload.slot
            if payload.slab is not None:
                self._slabs[worker][slot] = payload.slab
            slab = self._slabs[worker][slot]
            if self._columns:
                payload = columns.from_slab(payload.skeleton, lambda place: view(slab, place))
            else:
                payload = from_slab(payload.skeleton, slab)
        self._pending[worker].append(_Pending(payload, count, state, slot=slot))
        self._available[worker] += count

    def _take(self, worker: int, share: int) -> list[Part]:
        """Remove ``share`` samples from a worker's queue as (payload, start, stop) slices."""
        parts: list[Part] = []
        queue = self._pending[worker]
        self._available[worker] -= share
        while share:
            entry = queue[0]
            stop = min(entry.count, entry.start + share)
            parts.append((entry.payload, entry.start, stop))
            share -= stop - entry.start
            entry.start = stop
            if stop == entry.count:
                queue.popleft()
                if worker < self._workers:
                    self._base[worker] = entry.state
                if entry.slot is not None:
                    self._release.append((worker, entry.slot))
        return parts


#: Seconds to wait for a worker that broke off a message to be seen dead.
_DEATH_WAIT = 2.0


def _may_be_a_death(error: BaseException) -> bool:
    """Whether ``error``, met receiving a message, may come from its worker's death; not an
    error a worker raised (DataLoader raises it again with "Caught ... in DataLoader worker process")."""
    text = str(error)
    if "in DataLoader worker process" in text:
        return False
    if isinstance(error, (EOFError, OSError, pickle.UnpicklingError)):
        return True
    return isinstance(error, RuntimeError) and "DataLoader worker (pid" in text


def _ending(exitcode: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal)."""
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _water_fill(total: int, order: list[int], caps: dict[int, int | None]) -> dict[int, int]:
    """Split ``total`` over ``order`` as evenly as possible without exceeding a
    worker's cap (``None``: unlimited); the first workers in ``order`` get the
    larger shares. Returns shares keyed in ``order``."""
    shares = dict.fromkeys(order, 0)
    open_workers = list(order)
    remaining = total
    while open_workers:
        low, extra = divmod(remaining, len(open_workers))
        capped = [w for w in open_workers if (cap := caps[w]) is not None and cap <= low]
        if not capped:
            for rank, w in enumerate(open_workers):
                shares[w] = low + (rank < extra)
            break
        for w in capped:
            shares[w] = caps[w]  # type: ignore[assignment]
            remaining -= shares[w]
        open_workers = [w for w in open_workers if w not in capped]
    return shares


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """SplitMix64 finaliser: a fast, well-spread 64-bit hash of an integer."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)
