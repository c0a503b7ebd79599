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

Remote retries (:mod:`shardkit.io.counters`) are counted per process, by the fetch
threads, which do not know which dataset asked. Each time a reader of this
dataset finishes a range (and when :meth:`SharedStats.snapshot` is taken), the
process's retries since the last such sweep are added to two more shared
counters: ``retries`` and ``retry_wait_seconds`` in :class:`ReadStats` are then
the sums over the main process and every DataLoader worker. A forked worker
starts its remote counters at zero (:mod:`shardkit.io.counters` resets them after
fork), so nothing the parent counted is added twice. Two datasets read in the
same process share that process's retries: each is added to whichever sweeps
first, so the sum over datasets is exact.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.context import get_spawning_popen  # pyright: ignore[reportAttributeAccessIssue]
from typing import Any

import numpy as np
import torch

from shardkit.io.counters import remote_stats

READ, SKIPPED, ERRORS, MISSING, PADDED = range(5)
_COUNTERS = 5  # the order of SharedStats.add's delta
#: The remote counters swept into the shared ones, in their order there.
REMOTE_COUNTERS = ("retries", "retry_wait_seconds")


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
    * ``retries``, ``retry_wait_seconds``: remote requests retried after a
      transient failure and the seconds spent waiting before those retries
      (see :class:`~shardkit.io.remote.RetryPolicy`), summed over this process
      and its DataLoader workers; counted as each range is finished.

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
    retries: int = 0
    retry_wait_seconds: float = 0.0

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
        self._remote = torch.zeros(len(REMOTE_COUNTERS), dtype=torch.float64).share_memory_()
        self._open_lock()

    def _open_lock(self, fd: int | None = None) -> None:
        if fd is None:
            fd, path = tempfile.mkstemp(prefix="shardkit-stats-", suffix=".lock")
            os.unlink(path)  # nothing left to delete: the lock lives as long as a descriptor does
        # A file object, not a bare number: once closed (when garbage collection
        # reaches it before a reader's last update), fileno() raises instead of
        # naming whatever file reuses the number.
        self._file = os.fdopen(fd, "r+b", buffering=0)
        # Closed with this object, explicitly: a file left to its own finaliser warns (ResourceWarning).
        weakref.finalize(self, self._file.close)
        self._thread_lock = threading.Lock()
        # The process's remote counters already swept (or there before this object): (pid, values).
        self._swept = (os.getpid(), _remote_counts())

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = {"counts": self._counts, "remote": self._remote, "lock": None}
        if get_spawning_popen() is not None:  # starting a worker: it shares counters and lock
            state["lock"] = reduction.DupFd(self._file.fileno())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._counts = state["counts"]
        self._remote = state["remote"]
        lock = state["lock"]
        self._open_lock(None if lock is None else lock.detach())

    def add(
        self, shard: int, *, read: int = 0, skipped: int = 0, errors: int = 0, missing: int = 0, padded: int = 0
    ) -> None:
        """Add to shard ``shard``'s counters, atomically across processes and threads
        (and sweep this process's remote retries in; see the module docstring)."""
        delta = torch.tensor((read, skipped, errors, missing, padded), dtype=torch.int64)
        with self._locked() as fd:
            if fd is not None:
                self._counts[shard] += delta
                self._sweep_remote()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int | None]:
        """Hold the thread and process locks; yields None when this object is being garbage collected."""
        with self._thread_lock:
            try:
                fd = self._file.fileno()
            except ValueError:  # closed: this object is being garbage collected with its last reader
                yield None
                return
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                yield fd
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)

    def _sweep_remote(self) -> None:
        """Add this process's remote retries since the last sweep (call with the locks held)."""
        pid, before = self._swept
        now = _remote_counts()
        if pid != os.getpid():  # a forked worker: its counters started at zero
            before = (0.0,) * len(REMOTE_COUNTERS)
        if now != before:
            self._remote += torch.tensor([a - b for a, b in zip(now, before)], dtype=torch.float64)
        self._swept = (os.getpid(), now)

    def reset(self) -> None:
        """Zero every counter (a new epoch starts counting afresh)."""
        with self._locked():
            self._counts.zero_()
            self._remote.zero_()
            self._swept = (os.getpid(), _remote_counts())

    def snapshot(self) -> ReadStats:
        with self._locked() as fd:
            if fd is not None:
                self._sweep_remote()
        counts = self._counts.numpy().copy()
        retries, waited = self._remote.tolist()
        return ReadStats(
            read=counts[:, READ],
            skipped=counts[:, SKIPPED],
            errors=counts[:, ERRORS],
            missing=counts[:, MISSING],
            padded=counts[:, PADDED],
            retries=int(round(retries)),
            retry_wait_seconds=float(waited),
        )


def _remote_counts() -> tuple[float, ...]:
    counts = remote_stats()
    return tuple(float(counts[name]) for name in REMOTE_COUNTERS)
