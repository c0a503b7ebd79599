"""shuffle_quality scores storage order, uniform shuffles and buffer shuffles as documented."""

from __future__ import annotations

import numpy as np
import pytest

import shardkit
from shardkit.quality import shuffle_quality


def buffer_shuffle(n: int, buffer: int, seed: int = 0) -> list[int]:
    """What a shuffle buffer of ``buffer`` samples makes of positions read in storage order."""
    rng, held, out = np.random.default_rng(seed), [], []
    for position in range(n):
        held.append(position)
        if len(held) == buffer:
            pick = int(rng.integers(len(held)))
            held[pick], held[-1] = held[-1], held[pick]
            out.append(held.pop())
    rng.shuffle(held)
    return out + held


def test_storage_order_scores_all_adjacent_and_no_entropy() -> None:
    quality = shuffle_quality(np.arange(10_000))
    assert quality == (10_000, 1.0, 0.0)


def test_a_uniform_permutation_scores_about_one() -> None:
    quality = shuffle_quality(np.random.default_rng(42).permutation(50_000))
    assert quality.adjacent_fraction < 0.001
    assert 0.98 < quality.difference_entropy < 1.02


def test_a_buffer_shuffle_scores_between_and_improves_with_the_buffer() -> None:
    small, large = (shuffle_quality(buffer_shuffle(50_000, size)) for size in (10, 2_000))
    assert 0.0 < small.difference_entropy < large.difference_entropy < 0.95
    assert large.adjacent_fraction < small.adjacent_fraction < 0.2


def test_the_score_is_deterministic_and_exported() -> None:
    order = buffer_shuffle(5_000, 100, seed=3)
    assert shardkit.shuffle_quality(order) == shuffle_quality(list(order))


@pytest.mark.parametrize("order", [[1, 2], [[1, 2], [3, 4]], [0.5, 1.5, 2.5], ["a", "b", "c"]])
def test_an_order_that_is_not_integer_positions_is_refused_with_the_fix(order: object) -> None:
    with pytest.raises(shardkit.ShardkitError, match="storage positions|at least 3"):
        shuffle_quality(order)  # type: ignore[arg-type]
