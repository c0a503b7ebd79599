"""The epoch a pipeline is reading, shared with DataLoader workers.

Three pieces:

* :class:`SharedEpoch` holds the epoch in shared memory. DataLoader workers,
  including persistent ones, read the same memory, so a ``set_epoch`` in the
  main process is seen by every worker at its next ``__iter__``. A plain
  attribute would live in the worker's pickled or forked copy and never change
  (the bug behind WebDataset #172 and HF #6673).

* *Passes count epochs when nobody calls* ``set_epoch``. Trainers (Lightning,
  Accelerate, the Hugging Face ``Trainer``) drive the epochs themselves and
  never call the dataset's ``set_epoch``, so without this every epoch would
  repeat the first one's order. Each reader slot (the main process, or
  DataLoader worker ``w``) has a pass counter in the same shared memory: the
  ``k``-th pass a slot opens (``k`` from 0) reads epoch ``k``. The counters
  belong to the object built in the main process, so they survive
  non-persistent workers being started afresh each epoch, and persistent
  workers see them too. Ranks agree because each makes the same number of
  passes. An explicit ``set_epoch`` always wins; loading a state makes the next
  pass read the state's epoch (:func:`resume_at`).

  A pass is opened once, at the outermost ``Pipeline.__iter__``
  (:func:`open_pass`): a :class:`~contextvars.ContextVar` marks the opening so
  that the stages below it (sources, ``.shuffle``, ``interleave``) and the later
  passes of a ``.repeat()`` all read the same epoch instead of each counting.

* An *epoch offset* local to the running iteration: ``.repeat()`` makes pass
  ``k`` over its upstream with the offset raised by ``k``, so a source that
  reports ``shared.effective()`` as its epoch gives every pass its own shuffle
  order and seeds without touching the shared value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

from shardkit.errors import ShardkitError, check_int
from shardkit.trainers import check_not_in_accelerate

_T = TypeVar("_T")

_EPOCH_OFFSET: ContextVar[int] = ContextVar("shardkit_epoch_offset", default=0)
_IN_PASS: ContextVar[bool] = ContextVar("shardkit_in_pass", default=False)
_LOADING: ContextVar[bool] = ContextVar("shardkit_loading_state", default=False)

#: Reader slots with a pass counter: the main process and this many DataLoader workers.
MAX_WORKERS = 256
_EXPLICIT = 0  # layout of the shared tensor: the explicit epoch, then (base, passes) per reader slot
_READERS = 1 + MAX_WORKERS
_NEVER_SET = -1


class EpochError(ShardkitError, ValueError):
    """An epoch that is not a non-negative int, or a worker beyond the counted slots."""


#: The epoch lives in an int64 shared-memory tensor: a larger one cannot be stored.
MAX_EPOCH = 2**63 - 1


def check_epoch(epoch: int) -> int:
    """Return ``epoch`` if it is an int in ``[0, MAX_EPOCH]``, else raise :class:`EpochError`."""
    return check_int("epoch", epoch, minimum=0, maximum=MAX_EPOCH, error=EpochError)


def reader_slot() -> int:
    """The pass-counter slot of this process: 0 in the main process, ``1 + worker id`` in a DataLoader worker."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None:
        return 0
    if info.id >= MAX_WORKERS:
        raise EpochError(
            f"DataLoader worker {info.id}: shardkit counts epochs for at most {MAX_WORKERS} workers per loader; "
            f"use num_workers <= {MAX_WORKERS}"
        )
    return 1 + info.id


class SharedEpoch:
    """An epoch number in shared memory that survives pickling to DataLoader workers.

    The values live in an ``int64`` tensor moved to shared memory: the epoch
    given to :meth:`set` (-1 while never set), then per reader slot the epoch
    its counting starts from and the passes it has opened. Under ``fork`` workers
    inherit the mapping; under ``spawn`` and ``forkserver`` DataLoader pickles
    the dataset with torch's multiprocessing pickler, which sends the shared
    storage rather than a copy. Either way :meth:`set` in the main process, and
    the passes counted in earlier workers, are visible to the worker that calls
    ``__iter__`` next. (A plain :func:`pickle.dumps` copies the values instead.)

    Example:
        >>> from shardkit.epoch import SharedEpoch
        >>> epoch = SharedEpoch()
        >>> epoch.set(3)
        >>> epoch.get()
        3
    """

    def __init__(self, epoch: int | None = None) -> None:
        self._value = torch.zeros(1 + 2 * _READERS, dtype=torch.int64)
        self._value[_EXPLICIT] = _NEVER_SET if epoch is None else check_epoch(epoch)
        self._value.share_memory_()

    @property
    def explicit(self) -> bool:
        """Whether :meth:`set` was called (then passes are not counted)."""
        return int(self._value[_EXPLICIT]) != _NEVER_SET

    def get(self) -> int:
        """The epoch of this reader now: the one given to :meth:`set`, else the
        epoch of its current (or latest) pass: base + passes opened - 1."""
        explicit = int(self._value[_EXPLICIT])
        if explicit != _NEVER_SET:
            return explicit
        base, passes = self._slot(reader_slot())
        return int(base) + max(int(passes) - 1, 0)

    def set(self, epoch: int) -> None:
        """Store ``epoch`` where every worker sharing this object will read it."""
        self._value[_EXPLICIT] = check_epoch(epoch)

    def begin_pass(self) -> None:
        """Count a new pass of this reader slot (its epoch goes up by one, after the first)."""
        self._value[2 + 2 * reader_slot()] += 1

    def _slot(self, slot: int) -> torch.Tensor:
        return self._value[1 + 2 * slot : 3 + 2 * slot]

    def resume_at(self, epoch: int) -> None:
        """Make the next pass read ``epoch`` (unless :meth:`set` wins): of every
        reader when called in the main process, of this worker in a worker
        (which loads its own state, as ``StatefulDataLoader`` does, while the
        others may already be reading)."""
        slot = reader_slot()
        slots = self._value[1:].view(_READERS, 2) if slot == 0 else self._slot(slot).view(1, 2)
        slots[:, 0] = check_epoch(epoch)
        slots[:, 1] = 0

    def effective(self) -> int:
        """The epoch this iteration reads: :meth:`get` plus the offset of the
        enclosing ``.repeat()`` pass (see :func:`epoch_offset`).

        Sources report this from their ``epoch`` property.
        """
        return self.get() + _EPOCH_OFFSET.get()

    def __repr__(self) -> str:
        return f"SharedEpoch({self.get()}{'' if self.explicit else ', counted'})"


def shared_epochs(pipeline: Any) -> list[SharedEpoch]:
    """The :class:`SharedEpoch` of every source below ``pipeline`` (each once)."""
    found: dict[int, SharedEpoch] = {}
    stack = [pipeline]
    while stack:
        stage = stack.pop()
        shared = stage.__dict__.get("_epoch") if hasattr(stage, "__dict__") else None
        if isinstance(shared, SharedEpoch):
            found.setdefault(id(shared), shared)
        stack.extend(getattr(stage, "upstream", ()))
    return list(found.values())


def open_pass(pipeline: Any, open_fn: Callable[..., Iterator[Any]], *args: object) -> Iterator[Any]:
    """Call ``open_fn(*args)`` as the opening of a pass over ``pipeline``.

    At the outermost ``__iter__`` (not inside another pass being opened or
    run by ``.repeat()``) every source below counts a pass first, so all the
    stages opened inside read the same epoch.
    """
    if _IN_PASS.get():
        return open_fn(*args)
    check_not_in_accelerate(pipeline)  # Accelerate's wrappers would lose data: fail at once
    for shared in shared_epochs(pipeline):
        shared.begin_pass()
    token = _IN_PASS.set(True)
    try:
        return open_fn(*args)
    finally:
        _IN_PASS.reset(token)


def load_outermost(pipeline: Any, state: Any, load_fn: Callable[..., None], *args: object) -> None:
    """Call ``load_fn(*args)``; at the outermost ``load_state_dict``, also make
    the next pass of every source below ``pipeline`` read the state's epoch."""
    if _LOADING.get():
        return load_fn(*args)
    token = _LOADING.set(True)
    try:
        load_fn(*args)
    finally:
        _LOADING.reset(token)
    epoch = state_epoch(state)
    if epoch is not None:
        resume_at(pipeline, epoch)


def state_epoch(state: Any) -> int | None:
    """The epoch of the outermost node of ``state`` that records one (following first inputs)."""
    while isinstance(state, dict):
        if isinstance(state.get("epoch"), int):
            return state["epoch"]
        upstream = state.get("upstream")
        state = upstream[0] if isinstance(upstream, list) and upstream else upstream
    return None


def resume_at(pipeline: Any, epoch: int) -> None:
    """Make the next pass over ``pipeline`` read ``epoch`` in every reader, where ``set_epoch`` was never called."""
    for shared in shared_epochs(pipeline):
        shared.resume_at(epoch)


def epoch_offset() -> int:
    """How many epochs the running ``.repeat()`` passes add; 0 outside any repeat."""
    return _EPOCH_OFFSET.get()


def call_with_epoch_offset(offset: int, fn: Callable[..., _T], *args: object) -> _T:
    """Call ``fn(*args)`` with :func:`epoch_offset` returning ``offset``.

    The offset is a :class:`contextvars.ContextVar`, restored when ``fn``
    returns, so it reaches code that runs synchronously inside ``fn`` (creating
    and advancing upstream iterators) and nothing else. The call also counts as
    inside the running pass, so a ``.repeat()`` opening its upstream again does
    not count a new epoch.
    """
    token = _EPOCH_OFFSET.set(offset)
    in_pass = _IN_PASS.set(True)
    try:
        return fn(*args)
    finally:
        _IN_PASS.reset(in_pass)
        _EPOCH_OFFSET.reset(token)
