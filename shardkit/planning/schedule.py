"""Mixture schedules: the weights of an ``interleave`` as a function of how far
the mixture has gone, in samples or in tokens.

Papers state mixtures as "90% web, 10% code for the first 100B tokens, then
annealed to 50/50". A :class:`Schedule` holds such points and answers
:meth:`Schedule.weights_at` for any position: linear interpolation between
points, constant before the first and after the last.

The position is the *global* one: what every reader of the mixture (all ranks,
all DataLoader workers) has yielded together, not what one reader has. No
reader sees the others, so each estimates it from the plan: readers advance
in step, so the global position when a reader has yielded ``n`` units is
``base + n * readers`` (:func:`global_position`), ``base`` being the position
that a resumed state had reached (the sum over the readers that saved it).
Resuming on another world size or number of workers therefore continues the
schedule where all readers together had left it.

Which source a reader reads next is drawn from the weights with a
low-discrepancy sequence (:func:`weyl_uniforms`: ``frac(start + k * g)`` with
``g`` the golden ratio's fractional part and ``start`` drawn from the seed)
rather than independent uniforms: the share of each source over any window
of ``n`` draws is then within about ``log(n) / n`` of its weight instead of
``1 / sqrt(n)``, so the realised mixture follows the schedule closely even in
short windows, and it is still deterministic from the seed.

Pure functions over numpy; nothing here reads data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardkit.errors import ShardkitError

__all__ = ["UNITS", "Schedule", "ScheduleError", "global_position", "normalised", "scaled", "weyl_uniforms"]

#: What a schedule's positions count: samples yielded, or tokens of a key in them.
UNITS = ("samples", "tokens")
#: The fractional part of the golden ratio: the step of the most evenly spread Weyl sequence.
GOLDEN_STEP = (math.sqrt(5.0) - 1.0) / 2.0
_MAX_POSITION = 2**63 - 1


class ScheduleError(ShardkitError, ValueError):
    """A mixture schedule that cannot be followed (the message names the bad point or value)."""


class Schedule:
    """Mixture weights that change with the position of the mixture.

    ``points`` is a list of ``(position, weights)`` pairs with increasing
    positions (whole numbers of ``unit``, the first usually 0) and one weight
    per source (finite, >= 0, not all 0; they need not sum to 1). Between two
    points the weights are interpolated linearly; before the first and after
    the last they stay as there. ``unit="tokens"`` counts the tokens (the
    length of ``samples[key]``) the mixture has yielded; ``"samples"`` counts samples.

    Example:
        >>> from shardkit import Schedule
        >>> s = Schedule([(0, [0.9, 0.1]), (1000, [0.5, 0.5])])
        >>> s.weights_at(500).round(3).tolist()
        [0.7, 0.3]
    """

    def __init__(
        self,
        points: Sequence[tuple[int, Sequence[float]]],
        *,
        unit: str = "samples",
        key: str = "input_ids",
    ) -> None:
        if unit not in UNITS:
            raise ScheduleError(f"Schedule(unit) must be one of {UNITS}, got {unit!r}")
        if not isinstance(key, str) or not key:
            raise ScheduleError(f"Schedule(key) must be a non-empty str naming the token array, got {key!r}")
        positions, weights = _check_points(points)
        self.unit = unit
        self.key = key
        self.positions = positions
        self.weights = weights

    @property
    def sources(self) -> int:
        """How many sources the schedule weighs."""
        return int(self.weights.shape[1])

    def weights_at(self, position: float) -> np.ndarray:
        """The weights at ``position``, normalised to sum to 1."""
        return normalised(np.array([np.interp(position, self.positions, column) for column in self.weights.T]))

    def shares(self, positions: np.ndarray) -> np.ndarray:
        """:meth:`weights_at` for many positions at once: one normalised row per position."""
        points = np.asarray(positions, dtype=np.float64)
        return normalised(np.stack([np.interp(points, self.positions, column) for column in self.weights.T], axis=-1))

    def to_plain(self) -> dict[str, Any]:
        """The schedule as plain data (what a state records to check it is resumed under the same one)."""
        return {
            "unit": self.unit,
            "key": self.key,
            "points": [[int(p), [float(w) for w in row]] for p, row in zip(self.positions, self.weights)],
        }

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and self.to_plain() == other.to_plain()

    def __hash__(self) -> int:
        return hash(repr(self))

    def __repr__(self) -> str:
        points = ", ".join(f"({int(p)}, {[float(w) for w in row]})" for p, row in zip(self.positions, self.weights))
        return f"Schedule([{points}], unit={self.unit!r}, key={self.key!r})"


def _check_points(points: Any) -> tuple[np.ndarray, np.ndarray]:
    """Positions (float64, increasing) and weights (one row per point) from ``points``, or ScheduleError."""
    if isinstance(points, (str, bytes)) or not isinstance(points, Sequence) or not points:
        raise ScheduleError(f"Schedule(points) must be a non-empty list of (position, weights), got {points!r:.80}")
    positions: list[int] = []
    rows: list[list[float]] = []
    for index, point in enumerate(points):
        if not isinstance(point, Sequence) or len(point) != 2:
            raise ScheduleError(f"Schedule point {index} must be a (position, weights) pair, got {point!r:.80}")
        position, weights = point
        if type(position) is not int and not isinstance(position, np.integer) or not 0 <= position <= _MAX_POSITION:
            raise ScheduleError(f"Schedule point {index}: the position must be a whole number >= 0, got {position!r}")
        if positions and position <= positions[-1]:
            raise ScheduleError(
                f"Schedule point {index}: positions must increase, got {position} after {positions[-1]}"
            )
        positions.append(int(position))
        rows.append(_check_weights(weights, index, len(rows[0]) if rows else None))
    return np.array(positions, dtype=np.float64), np.array(rows, dtype=np.float64)


def _check_weights(weights: Any, index: int, count: int | None) -> list[float]:
    try:
        row = [float(w) for w in weights]
    except (TypeError, ValueError):
        raise ScheduleError(f"Schedule point {index}: weights must be a list of numbers, got {weights!r:.80}") from None
    if count is not None and len(row) != count:
        raise ScheduleError(f"Schedule point {index} has {len(row)} weights, point 0 has {count}; give one per source")
    if not row or any(not math.isfinite(w) or w < 0 for w in row) or sum(row) == 0:
        raise ScheduleError(f"Schedule point {index}: weights must be finite, >= 0 and not all 0, got {row!r:.80}")
    return row


def scaled(weights: np.ndarray) -> np.ndarray:
    """``weights`` (rows on the last axis, each >= 0) times a power of two per row that brings its largest into [0.5, 1).

    Any sum of a scaled row is then finite (at most its length), and small
    weights leave the subnormal range, where a draw ``u * total`` could only
    land on a few values: ``[1e308, 1e308]`` summed to infinity, so every
    draw came from the last source. A power of two changes no ratio, so rows
    that summed fine before scale to sums and draws bit-for-bit the same
    (weights below 2**-1074 of the largest, shares under 1e-300, become 0).
    A row of zeros stays zeros.
    """
    rows = np.asarray(weights, dtype=np.float64)
    _, exponents = np.frexp(rows.max(axis=-1, keepdims=True))
    return np.ldexp(rows, -exponents)


def normalised(weights: np.ndarray) -> np.ndarray:
    """``weights`` (rows on the last axis, each >= 0, not all 0) as shares summing to 1; finite for any finite weights."""
    rows = scaled(weights)
    return rows / rows.sum(axis=-1, keepdims=True)


def global_position(base: int, own: int, readers: int) -> int:
    """The mixture's global position when this reader has yielded ``own`` units
    of the ``readers`` that read it in step, ``base`` having been reached before
    (by the readers of the run a state was saved in)."""
    return base + own * readers


def weyl_uniforms(start: float, first: int, count: int) -> np.ndarray:
    """Draws ``first .. first + count - 1`` of the low-discrepancy sequence
    ``frac(start + k * GOLDEN_STEP)``, each in [0, 1)."""
    k = np.arange(first, first + count, dtype=np.float64)
    return np.modf(start + k * GOLDEN_STEP)[0]
