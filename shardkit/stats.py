"""Per-shard counts of what the readers did, summed over every worker.

Workers are separate processes, so the counts live in a shared-memory tensor
that the dataset carries to its workers (fork, spawn or forkserver alike, as
with :class:`~shardkit.epoch.SharedEpoch`). Two readers can finish ranges of
the same shard at once (a split shard, or padding), so each update holds a
lock. The lock must not depend on anything a user or a temp cleaner can
remove mid-run, so it is a POSIX record lock (``lockf``) on an *unlinked*
temporary file: no name exists to delete. POSIX locks belong to a process,
so a forked worker that inherits the descriptor still excludes its parent;
spawn and forkserver workers receive a duplicate of the descriptor through
multiprocessing's own descriptor passing while they are being started. A copy
made by plain pickling has its own counters (the tensor is copied), so it
gets its own lock. A thread lock beside it covers threads of one process,
which POSIX locks do not tell apart.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
from dataclasses import dataclass

import numpy as np
import torch

READ, SKIPPED, ERRORS, MISSING, PADDED = range(5)
_COUNTERS = 5  # the order of SharedStats.add's delta


@dataclass(frozen=True)
class ReadStats:
    """A snapshot of what the readers of one dataset did, per shard.

    * ``read[i]``: records of shard ``i`` that were yielded.
    * ``skipped[i]``: records of shard ``i`` left out because they were
      corrupt, did not decode or could not be read (under ``on_error="skip"``).
    * ``missing[i]``: records the plan expected of shard ``i`` that the shard
      does not hold: it ended before its planned record count (the counts in
      the manifest, ``num_records=``, the counts cache or the index are stale).
    * ``padded[i]``: samples yielded *in place of* skipped or missing records
      of shard ``i``, so that every rank still yields its planned number of
      samples (``balance="pad"``/``"drop"`` with ``on_error="skip"``). Each
      is a repeat of the sample the same reader yielded just before (or, if
      it had yielded none yet, of the first readable record of its rank's
      part, else of the dataset). Under ``balance="none"`` nothing is padded.
    * ``errors[i]``: errors met in shard ``i``, including a shard found to
      hold records past its planned count (those are not read, and not
      counted: the plan does not cover them).

    For every shard whose count is known, ``read + skipped + missing`` is the
    number of its records the plan gave to the readers counted here. When a
    shard fails where its record count is unknown, the records it still held
    cannot be counted: ``errors`` says it happened.
    """

    read: np.ndarray
    skipped: np.ndarray
    errors: np.ndarray
    missing: np.ndarray
    padded: np.ndarray

    @property
    def total_read(self) -> int:
        return int(self.read.sum())

    @property
    def total_skipped(self) -> int:
        return int(self.skipped.sum())

    @property
    def total_errors(self) -> int:
        return int(self.errors.sum())

    @property
    def total_missing(self) -> int:
        return int(self.missing.sum())

    @property
    def total_padded(self) -> int:
        return int(self.padded.sum())

    def failed_shards(self) -> list[int]:
        """Indices of the shards where anything was skipped, missing or went wrong."""
        return np.flatnonzero((self.skipped > 0) | (self.errors > 0) | (self.missing > 0)).tolist()


class SharedStats:
    """The shared counters behind :class:`ReadStats`."""

    def __init__(self, num_shards: int) -> None:
        self._counts = torch.zeros((num_shards, _COUNTERS), dtype=torch.int64).share_memory_()
        self._open_lock()

    def _open_lock(self, fd: int | None = None) -> None:
        if fd is None:
            fd, path = tempfile.mkstemp(prefix="shardkit-stats-", suffix=".lock")
            os.unlink(path)  # nothing left to delete: the lock lives as long as a descriptor does
        # A file object, not a bare number: once closed (when garbage collection
        # reaches it before a reader's last update), fileno() raises instead of
        # naming whatever file reuses the number.
        self._file = os.fdopen(fd, "r+b", buffering=0)
        self._thread_lock = threading.Lock()

    def __getstate__(self) -> dict[str, object]:
        from multiprocessing import context, reduction

        state: dict[str, object] = {"counts": self._counts, "lock": None}
        if context.get_spawning_popen() is not None:  # starting a worker: it shares counters and lock
            state["lock"] = reduction.DupFd(self._file.fileno())
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self._counts = state["counts"]  # type: ignore[assignment]
        lock = state["lock"]
        self._open_lock(None if lock is None else lock.detach())  # type: ignore[attr-defined]

    def add(
        self, shard: int, *, read: int = 0, skipped: int = 0, errors: int = 0, missing: int = 0, padded: int = 0
    ) -> None:
        """Add to shard ``shard``'s counters, atomically across processes and threads."""
        delta = torch.tensor((read, skipped, errors, missing, padded), dtype=torch.int64)
        with self._thread_lock:
            try:
                fd = self._file.fileno()
            except ValueError:  # closed: this object is being garbage collected with its last reader
                return
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                self._counts[shard] += delta
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)

    def reset(self) -> None:
        """Zero every counter (a new epoch starts counting afresh)."""
        self._counts.zero_()

    def snapshot(self) -> ReadStats:
        counts = self._counts.numpy().copy()
        return ReadStats(
            read=counts[:, READ],
            skipped=counts[:, SKIPPED],
            errors=counts[:, ERRORS],
            missing=counts[:, MISSING],
            padded=counts[:, PADDED],
        )
