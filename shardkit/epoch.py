"""The epoch a pipeline is reading, shared with DataLoader workers.

Two pieces:

* :class:`SharedEpoch` holds the epoch set by ``set_epoch`` in shared memory.
  DataLoader workers, including persistent ones, read the same memory, so a
  ``set_epoch`` in the main process is seen by every worker at its next
  ``__iter__``. A plain attribute would live in the worker's pickled or forked
  copy and never change (the bug behind WebDataset #172 and HF #6673).

* An *epoch offset* local to the running iteration: ``.repeat()`` makes pass
  ``k`` over its upstream with the offset raised by ``k``, so a source that
  reports ``shared.effective()`` as its epoch gives every pass its own shuffle
  order and seeds without touching the shared value.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import TypeVar

import torch

from shardkit.errors import ShardkitError

_T = TypeVar("_T")

_EPOCH_OFFSET: ContextVar[int] = ContextVar("shardkit_epoch_offset", default=0)


class EpochError(ShardkitError, ValueError):
    """An epoch that is not a non-negative int."""


def check_epoch(epoch: int) -> int:
    """Return ``epoch`` if it is a non-negative int, else raise :class:`EpochError`."""
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise EpochError(f"epoch must be an int, got {epoch!r} ({type(epoch).__name__})")
    if epoch < 0:
        raise EpochError(f"epoch must be >= 0, got {epoch}")
    return epoch


class SharedEpoch:
    """An epoch number in shared memory that survives pickling to DataLoader workers.

    The value lives in a 0-d ``int64`` tensor moved to shared memory. Under
    ``fork`` workers inherit the mapping; under ``spawn`` and ``forkserver``
    DataLoader pickles the dataset with torch's multiprocessing pickler, which
    sends the shared storage rather than a copy. Either way :meth:`set` in the
    main process is visible to a persistent worker the next time it calls
    ``__iter__``. (A plain :func:`pickle.dumps` copies the value instead.)

    Example:
        >>> from shardkit.epoch import SharedEpoch
        >>> epoch = SharedEpoch()
        >>> epoch.set(3)
        >>> epoch.get()
        3
    """

    def __init__(self, epoch: int = 0) -> None:
        self._value = torch.tensor(check_epoch(epoch), dtype=torch.int64).share_memory_()

    def get(self) -> int:
        """The epoch last passed to :meth:`set`, as stored in shared memory."""
        return int(self._value.item())

    def set(self, epoch: int) -> None:
        """Store ``epoch`` where every worker sharing this object will read it."""
        self._value.fill_(check_epoch(epoch))

    def effective(self) -> int:
        """The epoch this iteration reads: :meth:`get` plus the offset of the
        enclosing ``.repeat()`` pass (see :func:`epoch_offset`).

        Sources report this from their ``epoch`` property.
        """
        return self.get() + _EPOCH_OFFSET.get()

    def __repr__(self) -> str:
        return f"SharedEpoch({self.get()})"


def epoch_offset() -> int:
    """How many epochs the running ``.repeat()`` passes add; 0 outside any repeat."""
    return _EPOCH_OFFSET.get()


def call_with_epoch_offset(offset: int, fn: Callable[..., _T], *args: object) -> _T:
    """Call ``fn(*args)`` with :func:`epoch_offset` returning ``offset``.

    The offset is a :class:`contextvars.ContextVar`, restored when ``fn``
    returns, so it reaches code that runs synchronously inside ``fn`` (creating
    and advancing upstream iterators) and nothing else.
    """
    token = _EPOCH_OFFSET.set(offset)
    try:
        return fn(*args)
    finally:
        _EPOCH_OFFSET.reset(token)
