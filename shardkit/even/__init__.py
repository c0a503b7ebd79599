"""even_batches: every rank of a process group yields the same number of batches.

Two jobs, two modules: :mod:`.wrapper` holds :func:`even_batches` (what the
ranks agree on, windows, resuming) and :mod:`.group` the gloo side group the
agreement travels on (its timeout, and naming the ranks that stalled or died).
"""

from shardkit.even.wrapper import EvenBatches, EvenBatchesError, EvenStats, even_batches

__all__ = ["EvenBatches", "EvenBatchesError", "EvenStats", "even_batches"]
