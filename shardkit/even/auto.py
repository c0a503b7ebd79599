"""``even_batches(every="auto")``: windows that keep the epoch's agreements within :data:`SHARE` of its steps.

An agreement costs about one round trip on the side group whatever its
window holds, and an epoch pays it once per window, the first one (waited
for before the first batch, overlapping nothing) included. So the windows
are chosen from two measurements and one budget:

* ``round_trip``: one agreement, measured once per side group when it is
  made (the fastest of a few waited for at once,
  :attr:`shardkit.even.group._Side.round_trip`);
* ``step``: the median time the training loop spends between batches (from
  handing one over to being asked for the next) over the epoch's first
  :data:`MEASURED` steps (the median: a first step may compile or warm caches);
* the budget: the epoch's agreements so far, the next one included, cost at
  most ``share * step * batches``, ``batches`` being the steps up to the end
  of the window that next agreement follows (:func:`auto_window`).

Each agreement carries every rank's proposal for the window after the next
(0 while it has measured no step) and the ranks take the largest, so the
windows are the same on every rank even when one rank's steps are slower,
and the agreements stay at the same steps everywhere. Windows are powers of
two. The first has :data:`FIRST_WINDOW` (2) batches, so that the second
agreement, posted as the second batch is handed over, already carries one
measured step; it covers a blind window of :data:`BLIND_GROWTH` times the
first (16: the first batch waits for one round trip, the first window's two
fetches and half of the next window's), and windows stay that many times
the one before while no rank has measured a step. A first step slower than
the rest (compiling, warming caches) only makes the third window smaller
than needed: the next agreement proposes from the median of 17 steps. After, each window is at most
:data:`GROWTH` times the one before it (so a rank fetches at most that many
batches per step while windows grow) and at most :data:`AUTO_MAX`. The
budget counts every agreement since the epoch began, so the first windows'
agreements are paid back by larger windows next. Far into a long epoch the
windows settle where one agreement costs ``share`` of its window's steps
(``round_trip / (share * step)`` batches, rounded to a power of two).

Why few agreements, and not only cheap ones: on two ranks sharing two cores
(benchmarks/even_batches.py) an agreement overlapped with a step whose
all-reduce keeps the CPU busy slows that step by about as much as a
blocking round trip would (gloo's threads for the two all-reduces take
turns on the cores), so each agreement costs about a round trip wherever
it is waited for, and the epoch pays per agreement, not per batch.

What that bounds: at the end of every window chosen from measured steps,
the epoch's agreements so far cost at most ``share`` of its steps so far,
unless the window was at its largest (:data:`AUTO_MAX`, or :data:`GROWTH`
times the one before). Not bounded: the 18 batches of the first two windows
(2 agreements, the first one waited for before the first batch), a round
trip longer than ``share * AUTO_MAX`` steps (1.28 steps: the windows stay
at 256), and an epoch that ends inside a window, which pays its last
agreement over fewer steps than the window planned. So an epoch of 200
steps of 1.3 ms with 0.6 ms round trips takes windows 2, 16 and 256 (cut
at 182): 3 agreements, 0.7% of its steps, where windows 1, 4, 16 and 256
(this module before) took 4 (0.9%), and doubling up to a window of 64
took 10 (2.3%); with 100 ms steps, windows of 2, 16, then 1 and 2 (0.50%).

A rank holds up to the rest of its window plus the next one's batches,
and a state saves them; so a measured window is also at most what keeps
``2 * window - 1`` batches of the size of the epoch's first within
:data:`HELD_BYTES` (:func:`held_limit`; 256 MiB: windows of at most 16
batches of 32 3x224x224 uint8 images, 4.8 MB a batch, where the round trips
alone may ask for 256). Pass a fixed ``every`` to bound it otherwise.

Each epoch measures and chooses again (an evaluation loop's steps are not
training's). Which batches an epoch yields does not depend on its windows, so
a resumed epoch yields the uninterrupted one's batches whatever it chose; the
agreement count and the steps measured are saved in the state all the same,
so a resumed epoch goes on with the same budget.
"""

from __future__ import annotations

import statistics

#: The share of the steps' time the agreements of an epoch may take.
SHARE = 0.005

#: The largest window "auto" picks.
AUTO_MAX = 256

#: The first window of an epoch: two batches, so that the second agreement carries a measured step.
FIRST_WINDOW = 2


def first_window(every: int | str) -> int:
    """The first window of an epoch under ``every``: :data:`FIRST_WINDOW` under ``"auto"``, else one batch
    (windows then double up to ``every``)."""
    return 1 if isinstance(every, int) else FIRST_WINDOW


#: Before any rank has measured a step, each window is this many times the one before.
BLIND_GROWTH = 8

#: Once measured, a window is at most this many times the one before (batches fetched per step while growing).
GROWTH = 16

#: Steps measured per epoch (at most): the step time is their median.
MEASURED = 32

#: The bytes of batches a rank may hold ahead under a measured window (see :func:`held_limit`).
HELD_BYTES = 256 * 2**20

#: How deep :func:`batch_bytes` looks into nested containers of a batch.
_DEPTH = 8


def batch_bytes(batch: object, depth: int = _DEPTH) -> int:
    """The bytes a batch holds: its arrays' and tensors' ``nbytes`` and its strings' lengths, summed
    through dicts, lists and tuples (``depth`` levels; deeper or other objects count 0)."""
    nbytes = getattr(batch, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(batch, (bytes, bytearray, str)):
        return len(batch)
    if depth <= 0:
        return 0
    if isinstance(batch, dict):
        return sum(batch_bytes(value, depth - 1) for value in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_bytes(value, depth - 1) for value in batch)
    return 0


def held_limit(nbytes: int, budget: int | None = None) -> int:
    """The largest power-of-two window whose ``2 * window - 1`` held batches of ``nbytes`` stay within
    ``budget`` (:data:`HELD_BYTES` by default; at least 1, at most :data:`AUTO_MAX`; ``nbytes`` 0, unknown: :data:`AUTO_MAX`)."""
    if nbytes <= 0:
        return AUTO_MAX
    fits = ((HELD_BYTES if budget is None else budget) // nbytes + 1) // 2
    window = 1
    while window * 2 <= min(fits, AUTO_MAX):
        window *= 2
    return window


def auto_window(
    round_trip: float,
    step: float,
    *,
    agreements: int = 1,
    batches: int = 0,
    share: float = SHARE,
    largest: int = AUTO_MAX,
) -> int:
    """The smallest power of two ``w`` in ``[1, largest]`` with ``agreements * round_trip <= share * step * (batches + w)``.

    ``agreements`` is the epoch's agreements up to and including the one that
    will follow the window chosen, ``batches`` the steps before that window
    starts. With the defaults (one agreement, no steps before) it is the
    smallest window whose one agreement costs at most ``share`` of its steps.
    ``largest`` when no window up to it keeps within the budget. A longer
    ``step`` never gives a larger window.
    """
    window = 1
    while window < largest and agreements * round_trip > share * step * (batches + window):
        window *= 2
    return min(window, largest)


def next_window(current: int, agreed: int, every: int) -> int:
    """The size of the window after ``current``: ``agreed`` (the largest proposal, 0 for none) under
    ``every="auto"`` (``every`` 0), else double ``current`` up to ``every``."""
    if every:
        return min(every, current * 2)
    return agreed or min(current * BLIND_GROWTH, AUTO_MAX)


def proposal(
    round_trip: float, gaps: list[float], *, agreements: int, batches: int, current: int, nbytes: int = 0
) -> int:
    """This rank's proposal for the window after ``current``: 0 while it has measured no step.

    ``agreements`` counts the one being posted; the window proposed follows
    it, so its agreement is the next one and the steps before it are the
    ``batches`` yielded so far plus ``current``'s. ``nbytes``, a batch's size, bounds it by :func:`held_limit`.
    """
    if not gaps:
        return 0
    largest = min(AUTO_MAX, current * GROWTH, held_limit(nbytes))
    return auto_window(
        round_trip, statistics.median(gaps), agreements=agreements + 1, batches=batches + current, largest=largest
    )
