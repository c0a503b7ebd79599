"""Where a scheduled ``interleave`` stands: the cursor that follows a
:class:`~shardkit.planning.Schedule`, and its part of the interleave's state.

An ``interleave(datasets, weights=Schedule(...))`` reads its weights at the
mixture's *global* position. Each reader (one DataLoader worker of one rank)
estimates that position from what it has yielded itself as
``base + yielded * readers`` (:func:`~shardkit.planning.schedule.global_position`):
the plan deals every reader an equal part, so readers advance in step. The
source of each sample is drawn with the low-discrepancy
:func:`~shardkit.planning.schedule.weyl_uniforms` from a start seeded per
reader and epoch, so every window of the mix follows the weights closely.

The cursor's node (the ``"schedule"`` key of the interleave's node) holds:

* ``schedule``: the schedule as plain data (a state is resumed only under the same one);
* ``draws``: how many sources this reader has drawn (its place in the sequence);
* ``yielded``: units (samples, or tokens of the key) this reader has yielded
  since ``base``; summed when nodes merge;
* ``base``: the global position every reader of this run started from (the
  same in all of them); a reader restored from a merged node starts at
  ``base + yielded`` of that node;
* ``realised`` / ``scheduled``: per source, the units yielded and the units
  the schedule asked for (its weights at each sample's position, times the
  sample's units), since ``base``; ``realised_before`` / ``scheduled_before``
  the same before ``base``. :func:`mixture_shares` sums them over every
  worker and rank of a state into the realised and scheduled shares.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

from shardkit.planning.schedule import GOLDEN_STEP, Schedule, global_position
from shardkit.stateful import SEQUENCE, State, StateError, field, whole_number

__all__ = ["ScheduleCursor", "mixture_shares"]

SCHEDULE = "schedule"  #: the interleave node's key holding the cursor's node (None without a schedule)


class ScheduleCursor:
    """The draws and counts of one reader of a scheduled interleave; see the module docstring."""

    PLAN = "schedule"
    DRAWS = "draws"
    YIELDED = "yielded"
    BASE = "base"
    REALISED = "realised"
    SCHEDULED = "scheduled"
    REALISED_BEFORE = "realised_before"
    SCHEDULED_BEFORE = "scheduled_before"

    def __init__(self, schedule: Schedule, start: float, readers: int) -> None:
        self._schedule = schedule
        self._positions = schedule.positions.tolist()
        self._rows = schedule.weights.tolist()
        self._start = start
        self._readers = readers
        sources = schedule.sources
        self._draws = self._yielded = self._base = 0
        self._realised, self._scheduled = [0] * sources, [0.0] * sources
        self._realised_before, self._scheduled_before = [0] * sources, [0.0] * sources
        self._weights: list[float] = []

    def weights(self) -> list[float]:
        """The schedule's weights (unnormalised) at this reader's estimate of the global position."""
        position = global_position(self._base, self._yielded, self._readers)
        at = bisect_right(self._positions, position)
        if at == 0:
            return list(self._rows[0])
        if at == len(self._positions):
            return list(self._rows[-1])
        left, right = self._positions[at - 1], self._positions[at]
        t = (position - left) / (right - left)
        return [a + (b - a) * t for a, b in zip(self._rows[at - 1], self._rows[at])]

    def draw(self, live: Sequence[int]) -> int:
        """The slot in ``live`` (indices of the sources not yet exhausted) to read next."""
        self._weights = _scaled(self.weights())
        point = math.modf(self._start + self._draws * GOLDEN_STEP)[0]
        self._draws += 1
        cumulative, total = [], 0.0
        for index in live:
            total += self._weights[index]
            cumulative.append(total)
        if total == 0:  # the schedule gives the live sources no weight here: read them evenly
            return min(int(point * len(live)), len(live) - 1)
        return min(bisect_right(cumulative, point * total), len(live) - 1)

    def count(self, index: int, sample: Any) -> None:
        """Count ``sample``, read from source ``index`` after :meth:`draw`."""
        units = self._units(sample)
        self._yielded += units
        self._realised[index] += units
        total = sum(self._weights)
        for source, weight in enumerate(self._weights):
            self._scheduled[source] += units * weight / total

    def _units(self, sample: Any) -> int:
        if self._schedule.unit == "samples":
            return 1
        key = self._schedule.key
        try:
            return len(sample[key])
        except (KeyError, IndexError, TypeError):
            raise StateError(
                f"a Schedule(unit='tokens') counts the tokens of {key!r}, but a sample "
                f"({type(sample).__name__}) has no sized {key!r}; pass Schedule(..., key=...) naming the token array"
            ) from None

    def state_dict(self) -> State:
        return {
            self.PLAN: self._schedule.to_plain(),
            self.DRAWS: self._draws,
            self.YIELDED: self._yielded,
            self.BASE: self._base,
            self.REALISED: list(self._realised),
            self.SCHEDULED: list(self._scheduled),
            self.REALISED_BEFORE: list(self._realised_before),
            self.SCHEDULED_BEFORE: list(self._scheduled_before),
        }

    def restore(self, saved: State, own: bool) -> None:
        """Continue this reader's own node exactly, or start a reader of a merged one at its end."""
        self._realised_before, self._scheduled_before = saved[self.REALISED_BEFORE], saved[self.SCHEDULED_BEFORE]
        if own:
            self._draws, self._yielded, self._base = saved[self.DRAWS], saved[self.YIELDED], saved[self.BASE]
            self._realised, self._scheduled = list(saved[self.REALISED]), list(saved[self.SCHEDULED])
            return
        self._base = saved[self.BASE] + saved[self.YIELDED]
        self._realised_before = [a + b for a, b in zip(saved[self.REALISED_BEFORE], saved[self.REALISED])]
        self._scheduled_before = [a + b for a, b in zip(saved[self.SCHEDULED_BEFORE], saved[self.SCHEDULED])]

    @classmethod
    def check_state(cls, saved: Any, schedule: Schedule | None, where: str) -> None:
        """The cursor node of a loaded interleave state, against the stage's schedule."""
        if schedule is None:
            if saved is not None:
                raise StateError(f"{where}: the state was saved by an interleave with a Schedule, this one has none")
            return
        if type(saved) is not dict:
            raise StateError(f"{where}: the state has no Schedule position; it was saved without weights=Schedule")
        if saved.get(cls.PLAN) != schedule.to_plain():
            raise StateError(f"{where}: the state was saved under another schedule: {saved.get(cls.PLAN)!r:.120}")
        for key in (cls.DRAWS, cls.YIELDED, cls.BASE):
            whole_number(saved, key, f"{where} (schedule)")
        for key, kinds in _COUNTS.items():
            values = field(saved, key, f"{where} (schedule)", *SEQUENCE)
            if len(values) != schedule.sources or any(type(v) not in kinds or v < 0 for v in values):
                raise StateError(
                    f"{where}: state['schedule'][{key!r}] must be {schedule.sources} numbers >= 0, got {values!r:.80}"
                )

    @classmethod
    def merge(cls, nodes: Sequence[State | None]) -> State | None:
        """One node from every worker's (or rank's): counts summed, ``base`` shared, draws restarted."""
        if all(n is None for n in nodes):
            return None
        if any(n is None for n in nodes):
            raise StateError("cannot merge interleave states saved with and without a Schedule")
        first = nodes[0]
        for key in (cls.PLAN, cls.BASE, cls.REALISED_BEFORE, cls.SCHEDULED_BEFORE):
            if any(n[key] != first[key] for n in nodes):  # type: ignore[index]
                raise StateError(f"cannot merge scheduled interleave states with different {key!r}")
        return {
            **first,  # type: ignore[dict-item]
            cls.DRAWS: 0,
            cls.YIELDED: sum(n[cls.YIELDED] for n in nodes),  # type: ignore[index]
            cls.REALISED: [sum(column) for column in zip(*(n[cls.REALISED] for n in nodes))],  # type: ignore[index]
            cls.SCHEDULED: [sum(column) for column in zip(*(n[cls.SCHEDULED] for n in nodes))],  # type: ignore[index]
        }


#: The cursor's per-source counts and the types their values may have (a float sum can be a whole 0.0).
_COUNTS = {
    ScheduleCursor.REALISED: (int,),
    ScheduleCursor.SCHEDULED: (float, int),
    ScheduleCursor.REALISED_BEFORE: (int,),
    ScheduleCursor.SCHEDULED_BEFORE: (float, int),
}


def mixture_shares(state: Any) -> dict[str, Any] | None:
    """The realised and scheduled shares of each source of the first scheduled
    interleave in ``state`` (a pipeline's, a MixedLoader's, a list of workers'
    or ranks', or a gathered one), summed over every reader it holds; None
    when it holds no scheduled interleave."""
    nodes: list[State] = []
    _collect(state, nodes)
    if not nodes:
        return None
    merged = ScheduleCursor.merge(nodes)
    assert merged is not None
    realised = [a + b for a, b in zip(merged[ScheduleCursor.REALISED_BEFORE], merged[ScheduleCursor.REALISED])]
    scheduled = [a + b for a, b in zip(merged[ScheduleCursor.SCHEDULED_BEFORE], merged[ScheduleCursor.SCHEDULED])]
    total = sum(realised) or 1
    return {
        "realised": [r / total for r in realised],
        "scheduled": [s / total for s in scheduled],
        "units": sum(realised),
    }


def _collect(value: Any, nodes: list[State]) -> None:
    """Every scheduled interleave's cursor node in ``value``, depth first."""
    if isinstance(value, dict):
        if value.get("kind") == "interleave" and isinstance(value.get(SCHEDULE), dict):
            nodes.append(value[SCHEDULE])
            return
        for item in value.values():
            _collect(item, nodes)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, nodes)


def _scaled(weights: list[float]) -> list[float]:
    """:func:`~shardkit.planning.schedule.scaled` for one row, in plain floats (it runs once per sample)."""
    _, exponent = math.frexp(max(weights))
    return [math.ldexp(w, -exponent) for w in weights]
