"""Per-shard counts of records read and skipped, summed over every worker.

Workers are separate processes, so the counts live in a shared-memory tensor
that the dataset carries to its workers (fork, spawn or forkserver alike, as
with :class:`~shardkit.epoch.SharedEpoch`). Two readers can finish ranges of
the same shard at once (a split shard, or padding), so each update takes an
``flock`` on a small lock file named by path: it pickles as a string and works
under every start method.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from dataclasses import dataclass

import numpy as np
import torch

from shardkit.tempfiles import delete_with

READ, SKIPPED, ERRORS = 0, 1, 2


@dataclass(frozen=True)
class ReadStats:
    """A snapshot of what the readers of one dataset did, per shard.

    ``read[i]`` records were yielded from shard ``i``; ``skipped[i]`` records
    were left out because they were corrupt or unreadable (under
    ``on_error="skip"``); ``errors[i]`` errors were met in it. When a shard
    fails where its record count is unknown, the records it still held cannot
    be counted: ``errors`` says it happened.
    """

    read: np.ndarray
    skipped: np.ndarray
    errors: np.ndarray

    @property
    def total_read(self) -> int:
        return int(self.read.sum())

    @property
    def total_skipped(self) -> int:
        return int(self.skipped.sum())

    @property
    def total_errors(self) -> int:
        return int(self.errors.sum())

    def failed_shards(self) -> list[int]:
        """Indices of the shards where anything was skipped or went wrong."""
        return np.flatnonzero((self.skipped > 0) | (self.errors > 0)).tolist()


class SharedStats:
    """The shared counters behind :class:`ReadStats`."""

    def __init__(self, num_shards: int) -> None:
        self._counts = torch.zeros((num_shards, 3), dtype=torch.int64).share_memory_()
        fd, self._lock_path = tempfile.mkstemp(prefix="shardkit-stats-", suffix=".lock")
        os.close(fd)
        self._finalizer = delete_with(self, self._lock_path)

    def __getstate__(self) -> dict[str, object]:
        return {"counts": self._counts, "lock_path": self._lock_path}

    def __setstate__(self, state: dict[str, object]) -> None:
        self._counts = state["counts"]  # type: ignore[assignment]
        self._lock_path = state["lock_path"]  # type: ignore[assignment]
        self._finalizer = None

    def add(self, shard: int, *, read: int = 0, skipped: int = 0, errors: int = 0) -> None:
        """Add to shard ``shard``'s counters, atomically across processes."""
        with open(self._lock_path, "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            row = self._counts[shard]
            row[READ] += read
            row[SKIPPED] += skipped
            row[ERRORS] += errors

    def reset(self) -> None:
        """Zero every counter (a new epoch starts counting afresh)."""
        self._counts.zero_()

    def snapshot(self) -> ReadStats:
        counts = self._counts.numpy().copy()
        return ReadStats(read=counts[:, READ], skipped=counts[:, SKIPPED], errors=counts[:, ERRORS])
