"""``even_batches(every="auto")``: the smallest window whose agreements cost at most 1% of the steps.

An agreement costs about one round trip on the side group whatever its
window holds, so a window of ``w`` batches costs ``round_trip / w`` per
batch. ``"auto"`` picks the smallest power of two ``w`` (windows grow by
doubling, as with a fixed ``every``) with ``round_trip / w <= SHARE * step``,
at most :data:`AUTO_MAX` (a rank holds up to ``2 * w - 1`` batches ahead, and
a state saves them).

* ``round_trip`` is measured once per side group, when it is made: the
  fastest of a few agreements waited for at once
  (:attr:`shardkit.even.group._Side.round_trip`).
* ``step`` is the median time the training loop spends between batches
  (from handing one over to being asked for the next) over the epoch's first
  steps: the median, because a first step may compile or warm caches.
* The first windows are 1, 2, 4, 4 batches (:data:`PROBE`) while the steps
  are measured; the agreement posted for the fourth (:data:`DECIDE_AT`)
  carries each rank's proposal, and the ranks take the largest. Each rank
  measures its own steps, and a slow rank would propose another window: the
  choice travels in the agreement, so it is the same on every rank and the
  agreements stay at the same steps everywhere. The next windows double from
  4 up to the choice (or shrink to it at once).

Each epoch measures and chooses again (an evaluation loop's steps are not
training's). Which batches an epoch yields does not depend on its windows, so
a resumed epoch yields the uninterrupted one's batches whatever it chose; the
choice and the agreement count are saved in the state all the same, so a
resumed epoch goes on with the same windows.
"""

from __future__ import annotations

import statistics

#: The share of a step's time the agreements may take.
SHARE = 0.01

#: The largest window "auto" picks.
AUTO_MAX = 64

#: The window while the steps are being measured.
PROBE = 4

#: The agreement of an epoch (1 = the first) that carries the ranks' proposals.
DECIDE_AT = 4


def auto_window(round_trip: float, step: float | None, *, share: float = SHARE, largest: int = AUTO_MAX) -> int:
    """The smallest power of two ``w`` with ``round_trip / w <= share * step``, at most ``largest``.

    ``step`` None (no step measured: an epoch resumed just before the choice)
    proposes :data:`PROBE`, the window the epoch had, so the others decide.
    """
    if step is None:
        return min(PROBE, largest)
    window = 1
    while window < largest and round_trip > share * step * window:
        window *= 2
    return min(window, largest)


def median_step(gaps: list[float]) -> float | None:
    """The median of the measured times between batches, or None when none was measured."""
    return statistics.median(gaps) if gaps else None
