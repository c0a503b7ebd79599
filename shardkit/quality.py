"""How well shuffled an order is, measured on the order a loader really yields.

Shard readers are fast because they read records in storage order, and for
the same reason they shuffle poorly: a model that sees neighbouring records
in a row learns from correlated batches. Two numbers say how much of storage
order survives in an output order (a sequence of storage positions: the
global index of each record in storage order, shard after shard):

* ``adjacent_fraction``: the fraction of neighbouring output pairs that were
  also neighbours in storage (``|b - a| == 1``). File order gives 1.0; a
  uniformly random permutation of ``n`` records about ``2 / n``.
* ``difference_entropy``: the Shannon entropy of the distribution of
  ``|b - a|`` over neighbouring pairs (the measure MosaicML Streaming uses),
  divided by the same statistic for uniformly random permutations of the same
  positions. A uniform shuffle scores about 1.0; file order 0; a local buffer
  shuffle of ``B`` samples over sequential reads about ``log(B) / log(n)``,
  because its jumps never exceed the buffer's span.

Both are pure functions of the order, so the same code scores shardkit and
any other loader on the same data (``benchmarks/shuffle.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from shardkit.errors import ShardkitError

#: Seeded uniform permutations averaged for the reference entropy; fixed so
#: that the score of an order is a deterministic number.
REFERENCE_SEEDS = (0, 1, 2)


class ShuffleQuality(NamedTuple):
    """Scores of one order; see the module docstring."""

    samples: int
    adjacent_fraction: float
    difference_entropy: float


def shuffle_quality(order: Sequence[int] | np.ndarray) -> ShuffleQuality:
    """Score ``order``, a sequence of storage positions (ints, repeats allowed).

    Example:
        >>> shuffle_quality(range(1000)).adjacent_fraction
        1.0
        >>> round(shuffle_quality(np.random.default_rng(5).permutation(1000)).difference_entropy, 1)
        1.0

    Raises:
        ShardkitError: ``order`` is not one-dimensional integers, or has fewer than 3 entries.
    """
    positions = _positions(order)
    jumps = np.abs(np.diff(positions))
    reference = [
        _entropy(np.abs(np.diff(np.random.default_rng(seed).permutation(positions)))) for seed in REFERENCE_SEEDS
    ]
    return ShuffleQuality(
        samples=len(positions),
        adjacent_fraction=float(np.count_nonzero(jumps == 1) / len(jumps)),
        difference_entropy=max(0.0, _entropy(jumps) / float(np.mean(reference))),
    )


def _positions(order: Sequence[int] | np.ndarray) -> np.ndarray:
    positions = np.asarray(order)
    if positions.ndim != 1 or not np.issubdtype(positions.dtype, np.integer):
        raise ShardkitError(
            f"shuffle_quality needs a 1-d sequence of integer storage positions, got dtype "
            f"{positions.dtype} with shape {positions.shape}; map sample ids to their global record index first"
        )
    if len(positions) < 3:
        raise ShardkitError(f"shuffle_quality needs at least 3 positions to score an order, got {len(positions)}")
    return positions.astype(np.int64, copy=False)


def _entropy(values: np.ndarray) -> float:
    """Shannon entropy (bits) of the empirical distribution of ``values``."""
    _, counts = np.unique(values, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())
