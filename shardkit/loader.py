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
  along the batch dimension and concatenating (one copy per batch, none per
  sample). The tensors of a micro-batch travel in a *slab*: each worker keeps
  a small ring of reusable shared-memory buffers, collates every tensor
  (numbers and numpy arrays included) straight into a free one and sends only
  the slot number and shapes; the main process maps each slab once, copies
  the batch out and marks the slot free in a shared flag array. DataLoader
  instead creates a new shared-memory segment per tensor per batch and passes
  its file descriptor over a socket (about 1 ms a batch, whatever its size).
  A worker that finds no free slot sends the micro-batch the DataLoader way,
  so a slow consumer never blocks it. The buffers are torch's unlinked
  shared memory: nothing stays in ``/dev/shm`` when a process dies, and each
  ring is dropped with its epoch. A custom ``collate_fn`` may depend on the whole batch (padding to
  the longest sample, custom batch classes), so micro-batches then travel as
  lists of samples and ``collate_fn`` is called once per output batch, in the
  main process, exactly as DataLoader would call it.

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

import copy
import math
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info
from torch.utils.data._utils.collate import collate, default_collate_fn_map
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

from shardkit.epoch import resume_at
from shardkit.errors import ShardkitError
from shardkit.pipeline import Pipeline
from shardkit.state import State, StateError, applies, check, decode, encode, field, merge, node, validate, whole_number

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
            the main process. ``None`` collates with ``default_collate`` in the
            workers and joins micro-batches in the main process.
        drop_last: drop the last batch of an epoch if it is not full.
        seed: seeds the placement of the workers' shares in each batch.
        micro_batch_size: samples per message from a worker (with workers);
            defaults to ``batch_size``. The main process holds one or two
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
        if not isinstance(dataset, IterableDataset):
            raise LoaderError(
                f"MixedLoader mixes the streams of an IterableDataset's workers; got "
                f"{type(dataset).__name__}. For a map-style dataset use "
                "torch.utils.data.DataLoader(dataset, shuffle=True)."
            )
        _check_int("batch_size", batch_size, minimum=1)
        _check_int("num_workers", num_workers, minimum=0)
        _check_int("seed", seed, minimum=0)
        if micro_batch_size is not None:
            _check_int("micro_batch_size", micro_batch_size, minimum=1)
        if collate_fn is not None and not callable(collate_fn):
            raise LoaderError(f"collate_fn must be callable or None, got {collate_fn!r}")
        if not isinstance(drop_last, bool):
            raise LoaderError(f"drop_last must be a bool, got {drop_last!r}")
        if not isinstance(resumable, bool):
            raise LoaderError(f"resumable must be a bool, got {resumable!r}")
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

        if num_workers == 0:
            self._pin = False
            self._loader = DataLoader(
                dataset,
                batch_size=batch_size,
                drop_last=drop_last,
                collate_fn=collate_fn,
                **dataloader_kwargs,
            )
            return
        pin = bool(dataloader_kwargs.pop("pin_memory", False))
        dataloader_kwargs.pop("pin_memory_device", None)
        self._pin = pin and _accelerator_available()
        if pin and not self._pin:
            warnings.warn(
                "MixedLoader: pin_memory=True but no accelerator is available; batches will not be pinned",
                stacklevel=2,
            )
        slots = _SLAB_SPARE_SLOTS + (dataloader_kwargs.get("prefetch_factor") or 2) if collate_fn is None else 0
        self._loader = DataLoader(
            _MicroBatches(dataset, self.micro_batch_size, collate=collate_fn is None, resumable=resumable, slots=slots),
            batch_size=None,
            num_workers=num_workers,
            collate_fn=_as_is,
            **dataloader_kwargs,
        )

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch for the next iteration and forward it to
        ``dataset.set_epoch`` when the dataset has one."""
        _check_int("epoch", epoch, minimum=0)
        self.epoch = epoch
        self._epoch_set = True
        set_dataset_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_dataset_epoch):
            set_dataset_epoch(epoch)

    def __len__(self) -> int:
        """Batches in one epoch, from ``len(dataset)`` (samples this rank reads)."""
        if not hasattr(self.dataset, "__len__"):
            raise TypeError(
                f"MixedLoader has no len(): {type(self.dataset).__name__} does not define "
                "__len__ (the number of samples this rank reads)"
            )
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
        if self.num_workers == 0:
            if resume is not None:
                self._resume_in_process(resume)
            return iter(self._loader)
        micro_batches = self._loader.dataset
        if resume is not None:
            saved = resume["workers"]
            same = resume["num_workers"] == self.num_workers
            micro_batches.states = list(saved) if same else [merge(saved)] * self.num_workers
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
        if self.num_workers == 0:
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
        if self.num_workers == 0 and state["carry"]:
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
    micro-batches travel in a new :class:`_SlabRing` per iteration, whose
    flag array goes with the first message."""

    def __init__(self, dataset: IterableDataset, size: int, *, collate: bool, resumable: bool, slots: int = 0) -> None:
        self.dataset = dataset
        self.size = size
        self.collate = collate
        self.resumable = resumable
        self.slots = slots
        self.states: list[State] | None = None

    def __iter__(self) -> Iterator[Message]:
        info = get_worker_info()
        assert info is not None, "_MicroBatches runs only in DataLoader workers"
        worker = info.id
        states, self.states = self.states, None
        if states is not None:
            self.dataset.load_state_dict(states[worker])  # type: ignore[attr-defined]
        samples = iter(self.dataset)
        saver = _StateSaver(self.dataset, self.resumable)
        ring = _SlabRing(self.slots) if self.collate and self.slots else None
        yield worker, _START, None if ring is None else ring.flags, saver()
        while chunk := list(islice(samples, self.size)):
            if not self.collate:
                payload: Any = chunk
            else:
                payload = default_collate(chunk) if ring is None else ring.collate(chunk)
            yield worker, len(chunk), payload, saver()
        yield worker, 0, None, saver()


#: Slots of a worker's slab ring beyond the DataLoader's ``prefetch_factor``
#: messages in flight: the main process holds up to two micro-batches per
#: worker, and the worker collates one.
_SLAB_SPARE_SLOTS = 3
#: Byte alignment of each tensor inside a slab (any dtype can view it).
_SLAB_ALIGN = 64


@dataclass(frozen=True, slots=True)
class _InSlab:
    """Where one collated tensor of a micro-batch lies in its slab."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class _SlabBatch:
    """A micro-batch in slot ``slot`` of its worker's ring: ``skeleton`` is what
    ``default_collate`` makes, with :class:`_InSlab` for each tensor. ``slab``
    is sent only when the slot holds a new buffer (the main process keeps it)."""

    slot: int
    slab: torch.Tensor | None
    skeleton: Any


class _NotInSlab(Exception):
    """A tensor the slab cannot hold (sparse, nested, quantized, a subclass, not on the CPU)."""


class _SlabLayout:
    """Lays out one micro-batch's collated tensors in a slab: the collate
    functions return :class:`_InSlab` places and :meth:`write` fills them."""

    def __init__(self) -> None:
        self.size = 0
        self._writes: list[tuple[_InSlab, Any]] = []
        self.fn_map: dict[Any, Callable[..., Any]] = dict(default_collate_fn_map)
        self.fn_map[torch.Tensor] = self._stack
        for kind in (int, float, (np.bool_, np.number, np.object_)):
            self.fn_map[kind] = self._wrap(default_collate_fn_map[kind])

    def _place(self, shape: tuple[int, ...], dtype: torch.dtype, numel: int, source: Any) -> _InSlab:
        place = _InSlab(self.size, shape, dtype)
        nbytes = numel * dtype.itemsize
        self.size += -(-nbytes // _SLAB_ALIGN) * _SLAB_ALIGN
        self._writes.append((place, source))
        return place

    def _stack(self, batch: Sequence[torch.Tensor], **_: Any) -> _InSlab:
        elem = batch[0]
        if type(elem) is not torch.Tensor or elem.layout != torch.strided or elem.device.type != "cpu":
            raise _NotInSlab  # subclasses keep their type, as default_collate keeps it
        if elem.is_nested or elem.is_quantized:
            raise _NotInSlab
        return self._place((len(batch), *elem.shape), elem.dtype, len(batch) * elem.numel(), batch)

    def _wrap(self, make_tensor: Callable[..., Any]) -> Callable[..., Any]:
        def in_slab(batch: list[Any], **kwargs: Any) -> _InSlab:
            tensor = make_tensor(batch, **kwargs)
            return self._place(tuple(tensor.shape), tensor.dtype, tensor.numel(), tensor)

        return in_slab

    def write(self, slab: torch.Tensor) -> None:
        for place, source in self._writes:
            view = _slab_view(slab, place)
            if isinstance(source, torch.Tensor):
                view.copy_(source)
            else:  # a list or tuple of samples' tensors
                torch.stack(source, 0, out=view)


def _slab_view(slab: torch.Tensor, place: _InSlab) -> torch.Tensor:
    numel = math.prod(place.shape)
    return slab[place.offset : place.offset + numel * place.dtype.itemsize].view(place.dtype).view(place.shape)


class _SlabRing:
    """A worker's reusable shared-memory buffers and their busy flags.

    The worker sets a slot's flag when it fills it, the main process clears
    it once the micro-batch is copied out: each side writes one transition
    only. Buffers grow (a new one in the slot, sent along) when a
    micro-batch does not fit.
    """

    def __init__(self, slots: int) -> None:
        self.flags = torch.zeros(slots, dtype=torch.uint8).share_memory_()
        self._busy = self.flags.numpy()
        self._slabs: list[torch.Tensor | None] = [None] * slots

    def collate(self, chunk: list[Any]) -> Any:
        """``default_collate(chunk)``, its tensors in a free slot; as
        DataLoader sends it when no slot is free or a tensor cannot go in one."""
        free = np.flatnonzero(self._busy == 0)
        if not len(free):
            return default_collate(chunk)
        layout = _SlabLayout()
        try:
            skeleton = collate(chunk, collate_fn_map=layout.fn_map)
        except _NotInSlab:
            return default_collate(chunk)
        slot = int(free[0])
        slab = self._slabs[slot]
        new = slab is None or len(slab) < layout.size
        if new:  # with room to spare, so that sizes that vary a little do not reallocate
            slab = torch.empty(layout.size + layout.size // 8 + _SLAB_ALIGN, dtype=torch.uint8).share_memory_()
            self._slabs[slot] = slab
        assert slab is not None
        self._busy[slot] = 1
        layout.write(slab)
        return _SlabBatch(slot, slab if new else None, skeleton)


def _from_slab(value: Any, slab: torch.Tensor) -> Any:
    """A slab batch's skeleton with each :class:`_InSlab` replaced by a view of ``slab``."""
    if type(value) is _InSlab:
        return _slab_view(slab, value)
    if isinstance(value, Mapping):
        return _same_mapping_type(value, {key: _from_slab(item, slab) for key, item in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_from_slab(item, slab) for item in value))
    if isinstance(value, (list, tuple)) and not (value and isinstance(value[0], (str, bytes))):
        return type(value)(_from_slab(item, slab) for item in value)
    return value


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
    if worker is not None and not 0 <= worker < num_workers:
        raise StateError(f"{where}: worker {worker} is not one of the saving loader's {num_workers} workers")
    count = whole_number(tail, "count", where, 1)
    if "payload" not in tail:
        raise StateError(f"{where} has no 'payload'")
    samples = decode(tail["payload"])
    if loader.collate_fn is not None:
        length, form = (len(samples) if type(samples) is list else None), "a list of samples (for collate_fn)"
    else:
        length, form = _collated_length(samples), "a collated micro-batch"
    if length != count:
        raise StateError(
            f"{where}: the carried samples must be {form} of {count} samples; got {_describe(samples, length)}"
        )
    return samples


def _collated_length(value: Any) -> int | None:
    """The number of samples in a ``default_collate`` output, read as :func:`_join`
    reads it; None if ``value`` is not one, or its parts disagree."""
    if isinstance(value, torch.Tensor):
        return len(value) if value.dim() else None
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, bytes)) for v in value):
        return len(value)
    if isinstance(value, Mapping) or isinstance(value, list):
        lengths = {_collated_length(v) for v in (value.values() if isinstance(value, Mapping) else value)}
        return lengths.pop() if len(lengths) == 1 else None
    return None


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
        self._batch_size = loader.batch_size
        self._collate_fn = loader.collate_fn
        self._drop_last = loader.drop_last
        self._pin = loader._pin
        self._epoch_key = _mix64(_mix64(loader.seed) ^ loader.epoch)
        self._workers = workers = loader.num_workers
        # Per queue: deque of [payload, offset, count, dataset state after it, carried,
        # slab slot or None] and samples left in it. Queues past the workers' hold
        # restored tails.
        self._pending: list[deque[list[Any]]] = [deque() for _ in range(workers)]
        # Per worker: its slab ring's busy flags and buffers by slot; slots to free
        # once the batch being made is copied out of them.
        self._flags: list[Any] = [None] * workers
        self._slabs: list[dict[int, torch.Tensor]] = [{} for _ in range(workers)]
        self._release: list[tuple[int, int]] = []
        self._available = [0] * workers
        self._done = [False] * workers
        # Per worker: its dataset state past the entries that left its queue
        # (None until its first message), and after its last message.
        self._base: list[Any] = [None] * workers
        self._final: list[Any] = [None] * workers
        self.batch_index = 0
        self._finished = False
        if resume is not None:
            self._restore(resume, tails)

    def _restore(self, state: State, tails: Sequence[Any]) -> None:
        """Resume the position of ``state``, whose carried samples ``tails`` holds decoded."""
        self.batch_index = state["batch_index"]
        self._finished = state["finished"]
        if self._finished:
            self._source = None
        same = state["num_workers"] == self._workers
        for tail, samples in zip(state["carry"], tails):
            worker = tail["worker"] if same and tail["worker"] is not None else None
            if worker is None:
                worker = len(self._pending)
                self._pending.append(deque())
                self._available.append(0)
                self._done.append(True)
            dataset_state = state["workers"][worker] if worker < self._workers else None
            self._pending[worker].appendleft([samples, 0, tail["count"], dataset_state, True, None])
            self._available[worker] += tail["count"]

    def state_dict(self) -> State:
        """The loader's state: see :meth:`MixedLoader.state_dict`."""
        while self._source is not None and any(base is None for base in self._base):
            self._pull()  # every worker's starting state, for those that delivered nothing yet
        workers: list[Any] = []
        carry: list[dict[str, Any]] = []
        for worker, queue in enumerate(self._pending):
            real = worker < self._workers
            state = self._base[worker] if real else None
            if real and not queue and self._done[worker]:
                state = self._final[worker]
            if queue and (queue[0][1] > 0 or queue[0][4]):  # cut part-way, or a restored tail
                payload, start, count, after = queue[0][:4]
                collated = self._collate_fn is None
                tail = {"worker": worker if real else None, "count": count - start}
                carry.append({**tail, "payload": encode(_tail(payload, start, count, collated=collated))})
                state = after
            if real:
                if not isinstance(state, dict):
                    reason = state if isinstance(state, str) else "a worker sent no state"
                    raise StateError(f"MixedLoader cannot save its position: {reason}")
                workers.append(state)
        return _loader_state(self, batch_index=self.batch_index, finished=self._finished, workers=workers, carry=carry)

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        shares = self._allocate()
        size = sum(shares.values())
        if size == 0 or (self._drop_last and size < self._batch_size):
            self._finished = True
            self._source = None  # lets the DataLoader shut its workers down
            for queue in self._pending:  # a dropped last batch
                queue.clear()
            self._slabs = [{} for _ in self._slabs]  # unmaps the workers' rings now, not with the loader
            self._flags = [None] * len(self._flags)
            raise StopIteration
        parts = [part for worker, share in shares.items() for part in self._take(worker, share)]
        if self._collate_fn is None:
            batch = _join(parts, copy=any(flags is not None for flags in self._flags))
        else:
            batch = self._collate_fn([s for payload, a, b in parts for s in payload[a:b]])
        for worker, slot in self._release:  # the batch holds copies now
            self._flags[worker][slot] = 0
        self._release.clear()
        self.batch_index += 1
        return _pin_memory(batch) if self._pin else batch

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
            shares = _water_fill(self._batch_size, active, caps)
            if all(shares[w] <= self._available[w] for w in active):
                return shares
            self._pull()

    def _pull(self) -> None:
        """Receive one message from the workers."""
        try:
            worker, count, payload, state = next(self._source)  # type: ignore[arg-type]
        except StopIteration:
            # Every worker ends with an end marker; this only guards against a hang.
            self._done = [True] * len(self._done)
            self._source = None
            return
        if count == _START:
            self._base[worker] = state
            if payload is not None:  # the busy flags of the worker's slab ring
                self._flags[worker] = payload.numpy()
        elif count == 0:
            self._done[worker] = True
            self._final[worker] = state
        else:
            slot = None
            if isinstance(payload, _SlabBatch):
                slot = payload.slot
                if payload.slab is not None:
                    self._slabs[worker][slot] = payload.slab
                payload = _from_slab(payload.skeleton, self._slabs[worker][slot])
            self._pending[worker].append([payload, 0, count, state, False, slot])
            self._available[worker] += count

    def _take(self, worker: int, share: int) -> list[tuple[Any, int, int]]:
        """Remove ``share`` samples from a worker's queue as (payload, start, stop) slices."""
        parts = []
        queue = self._pending[worker]
        self._available[worker] -= share
        while share:
            entry = queue[0]
            payload, start, count, state = entry[:4]
            stop = min(count, start + share)
            parts.append((payload, start, stop))
            share -= stop - start
            if stop == count:
                queue.popleft()
                if worker < self._workers:
                    self._base[worker] = state
                if entry[5] is not None:
                    self._release.append((worker, entry[5]))
            else:
                entry[1] = stop
        return parts


def _tail(payload: Any, start: int, stop: int, *, collated: bool) -> Any:
    """Samples ``start:stop`` of a micro-batch, in memory of their own (a slice
    of a tensor would otherwise save the whole micro-batch's storage)."""
    if not collated:
        return payload[start:stop]
    return _own_memory(_join([(payload, start, stop)]))


def _own_memory(value: Any) -> Any:
    """``value`` with every tensor in it copied."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, Mapping):
        return _same_mapping_type(value, {key: _own_memory(item) for key, item in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*map(_own_memory, value))
    if isinstance(value, (list, tuple)):
        return type(value)(map(_own_memory, value))
    return value


def _same_mapping_type(template: Mapping[Any, Any], values: dict[Any, Any]) -> Mapping[Any, Any]:
    """``values`` in a mapping of ``template``'s type where it can be copied and
    updated (as ``default_collate`` keeps the sample's mapping type), else a dict."""
    if isinstance(template, MutableMapping):
        clone = copy.copy(template)
        clone.update(values)
        return clone
    return values


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


def _join(parts: list[tuple[Any, int, int]], *, copy: bool = False) -> Any:
    """Join slices ``payload[start:stop]`` of ``default_collate`` outputs along
    the batch dimension, into what ``default_collate`` makes of all samples;
    with ``copy`` no tensor of the result shares memory with ``parts`` (whose
    slabs are about to be reused)."""
    first = parts[0][0]
    if isinstance(first, torch.Tensor):
        if len(parts) == 1 and not copy:
            tensor, start, stop = parts[0]
            return tensor if start == 0 and stop == len(tensor) else tensor[start:stop]
        return _concat([tensor[start:stop] for tensor, start, stop in parts])
    if isinstance(first, Mapping):
        joined = {key: _join([(p[key], a, b) for p, a, b in parts], copy=copy) for key in first}
        return _same_mapping_type(first, joined)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*_join_fields(parts, copy=copy))
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], (str, bytes)):
        # default_collate keeps strings and bytes as they come, along the batch:
        # a list at the top, a tuple inside a sequence (from zip).
        return type(first)(item for p, a, b in parts for item in p[a:b])
    if isinstance(first, list):
        # Any other list holds one collated value per field of the samples.
        return _join_fields(parts, copy=copy)
    raise TypeError(f"cannot join micro-batches of type {type(first).__name__}")


#: Copies below this many elements run on one thread in torch too (its grain size).
_SERIAL_COPY_ELEMENTS = 32768


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` along dim 0, large copies done by numpy where the dtype allows.

    The main process shares the CPU with busy workers; torch's intra-op
    threads then spin and wait for each other, which made ``torch.cat`` of
    3x224x224 images 2-3x slower than numpy's single-threaded copy in
    ``benchmarks/mixing.py``.
    """
    if sum(t.numel() for t in tensors) < _SERIAL_COPY_ELEMENTS:
        return torch.cat(tensors)
    rows = sum(len(t) for t in tensors)
    out = torch.empty((rows, *tensors[0].shape[1:]), dtype=tensors[0].dtype)
    try:
        np.concatenate([t.numpy() for t in tensors], out=out.numpy())
    except TypeError:  # a dtype numpy lacks, such as bfloat16
        torch.cat(tensors, out=out)
    return out


def _join_fields(parts: list[tuple[Any, int, int]], *, copy: bool = False) -> list[Any]:
    return [_join([(p[i], a, b) for p, a, b in parts], copy=copy) for i in range(len(parts[0][0]))]


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """SplitMix64 finaliser: a fast, well-spread 64-bit hash of an integer."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LoaderError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise LoaderError(f"{name} must be >= {minimum}, got {value}")
