"""``MixedLoader(num_workers="auto", prefetch="auto")``: the worker count guessed from the first
batches, then a closed loop on the measured wait.

Many jobs are one long first epoch, so the count has to be right within a second, not
found by climbing one worker a window. **The opening**: the first epoch starts with no
worker; the main process reads the first batches itself (they are real batches: nothing is
thrown away) and times, per step, the making of a batch (wall, and the main thread's CPU
and run-queue time, ``/proc/thread-self/schedstat``) and the loop's compute (wall and CPU).
After :attr:`Autotune.opening_steps` steps and :attr:`Autotune.opening_seconds` seconds
(the first step, which opens the shards, not counted), :func:`guess` returns the count,
which the loader starts at once, through its own state as any change:

* **0** when the workers would save less than ``min_gain`` of a step: making a batch
  costs less than :attr:`Autotune.handover_seconds` (taking a batch from a worker) plus
  ``min_gain`` of the step (cheap records). No worker is tried for the rest of the run.
* else the count that would end the wait if each worker made batches as the main process
  did (``data / compute``, with a 10 % margin; 50 % when the making mostly waits on I/O,
  a remote read's time varying more), no more than fill this process's CPUs
  (``os.sched_getaffinity``) less the loop's own CPU use, each worker using the share of
  a CPU the main process's making used while it was not waiting for one (a CPU-bound
  ``.map``: one worker per CPU; a remote read: many per CPU), ``max_workers`` and the
  ceiling.

The guess is judged as a change is (below), against the opening; growing after it waits
for the next epoch (a restart of every worker holding remote reads costs seconds). Without
``resumable`` (or a dataset that cannot save its position) there is no opening: one worker.

Then the loader measures every step (:mod:`shardkit.loader.stalls`: the time the loop
waited in ``next()`` against its compute). Every window of steps (at least
:attr:`Autotune.window_steps` steps and :attr:`Autotune.window_seconds` seconds)
it also reads, from ``/proc``, the CPU time its workers used, how many of its CPUs sat idle,
and, only when it would add workers (:meth:`Tuner._judge`), their memory (proportional set
size: a forked worker's pages shared with the main process count once). From one window, and
the window before the last change, :func:`decide` returns the next worker count and why:

* **Go back** when the last change added workers and the loop did not get faster
  by at least ``min(min_gain, wait / 2)`` (half of what removing the wait
  entirely would have given): the added workers did not help. The count they
  reached becomes a ceiling that is never tried again, so the loop settles
  (back to 0, the main process: no workers are tried again). Going back is
  made at once only when the added workers made the loop slower (by
  ``min_gain`` against fewer workers, which must then be started again, or
  ``min_gain / 2`` against the main process); otherwise at the next epoch, when
  workers start anyway: a restart now would cost more than it saves.
  Likewise when a trial of 0 workers (below) made the loop slower by more than
  ``min_gain / 2``; if it did not, 0 is kept (a worker's memory saved) and 1
  becomes the ceiling.
* **Stay** while the loop waits less than :attr:`Autotune.wait_threshold` of
  its time: the data is not the bottleneck.
* **Try 0 workers** when the loop waits but its one worker is busy less than
  half of each step (reading, a ``.map``, a remote read's wait: its wall time):
  the worker is not what the loop waits for, handing its data over is (small
  records, a cheap pipeline), which reading in the main process does without.
  Tried once.
* **Grow** otherwise, to the count that would end the wait if each worker made
  data as fast as now (``n * step / compute``, with a 10 % margin), at most
  doubling, and no further than the first bound that binds: the CPUs (none
  when the workers spend at least half their busy time neither on a CPU nor
  in a run queue waiting for one, ``/proc/PID/schedstat``: they wait on I/O,
  a remote read, and more workers than CPUs help even on a busy machine;
  else the CPUs left idle, each new worker expected to use what one uses
  now, or, if more, as many as fill this process's CPUs when each wants a
  CPU for the share of its busy time it ran or waited for one: the kernel
  shares a busy machine's CPUs between runnable threads, so other jobs' load
  does not make one worker per CPU useless), the memory bound
  (:attr:`Autotune.memory_bytes`, the workers' memory), :attr:`Autotune.max_workers`,
  and the ceiling.

The first window after a change is not judged: new workers start and refill the queues the old
ones held; the next one, which judges the change, is twice as long, so that a step back is not
made on the noise of one window. Changes are rare by construction: one a window at most, at
most doubling, and none after a step back.

``prefetch="auto"`` (:func:`prefetch_for`) is a rule, not a loop: each worker keeps
``max(2, ceil(4 / workers))`` micro-batches in flight, at least four over all workers, so one
slow micro-batch (a shard opened, a remote read retried) does not stall the loop; more workers
interleave and need no more each.

:func:`guess` and :func:`decide` are pure functions of measured numbers; :class:`Tuner` keeps the
windows and the history, and :mod:`shardkit.loader.usage` reads ``/proc`` (Linux; elsewhere its
readings are None and the bounds that need them are taken as met: CPU not spare, so no growth).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardkit.errors import check_int
from shardkit.loader.usage import (
    available_cpus,
    cpu_times,
    default_memory_bytes,
    idle_cpus,
    process_cpu_seconds,
    process_memory_bytes,
    thread_times,
)

__all__ = ["Autotune", "Decision", "Tuner", "Window", "decide", "prefetch_for"]

AUTO = "auto"
#: What the loader reports at a window's ends: its workers' pids, and their busy seconds so far (None: not known).
Probe = tuple[list[int], float | None]
#: Margin on the worker count that would just end the wait.
MARGIN = 1.1
#: The first guess's margin when the data mostly waits on I/O: such workers cost little CPU, and a
#: remote read's time varies more than a computation's.
IO_MARGIN = 1.5
#: Workers that spend this share of their busy time waiting on I/O are not bound by the CPUs.
IO_BOUND = 0.5
#: The window that judges a change is this many windows long: a step back is not made on noise.
JUDGED_WINDOWS = 2
#: A worker is assumed to use at least this share of a CPU (a count from an idle window is not infinite).
MIN_WORKER_CPU = 0.05


@dataclass(frozen=True)
class Autotune:
    """Settings of ``num_workers="auto"``; ``MixedLoader(autotune=...)`` takes one.

    ``start``: the worker count of the first epoch; None (the default): the
    first batches are read in the main process and the count is guessed from
    them (see the module docstring); a resumed state's count when it has one.
    ``max_workers``: never more (None: twice the CPUs this
    process may run on, at least 2). ``memory_bytes``: the workers' memory
    (proportional set size, summed) that a new worker count must stay under
    (None: a quarter of the memory available when the loader is built).
    ``wait_threshold``: the share of the loop's time spent waiting for data
    above which workers are added. ``min_gain``: the speed-up a change must
    bring to be kept. ``window_steps``/``window_seconds``: a window is at least
    this many steps and seconds. ``opening_steps``/``opening_seconds``: the
    first batches read in the main process before the first guess (after one
    more that opens the shards). ``handover_seconds``: what taking one batch
    from the workers costs the main process, which it would not spend making
    the batch itself; workers are started only when they would save more.
    """

    start: int | None = None
    max_workers: int | None = None
    memory_bytes: int | None = None
    wait_threshold: float = 0.1
    min_gain: float = 0.1
    window_steps: int = 20
    window_seconds: float = 0.5
    opening_steps: int = 4
    opening_seconds: float = 0.25
    handover_seconds: float = 0.002

    def __post_init__(self) -> None:
        if self.start is not None and (
            isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0
        ):
            raise ValueError(f"Autotune(start=...) must be None or an int >= 0, got {self.start!r}")
        for name in ("window_steps", "opening_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Autotune({name}=...) must be an int >= 1, got {value!r}")
        for name in ("max_workers", "memory_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Autotune({name}=...) must be None or an int >= 1, got {value!r}")
        for name in ("wait_threshold", "min_gain", "window_seconds", "opening_seconds", "handover_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"Autotune({name}=...) must be a number >= 0, got {value!r}")


@dataclass(frozen=True)
class Window:
    """What one window of steps measured, with ``workers`` workers running.

    ``worker_cpu_seconds``: CPU time the workers used in the window (None: not
    known). ``idle_cpus``: CPUs of this process's affinity left idle, on
    average over the window, by every process on the machine (None: not
    known). ``worker_memory_bytes``: the workers' memory at the window's end.
    ``worker_busy_seconds``: the wall time the workers spent making data
    (reading, a ``.map``, collating; waiting on a remote read counts), summed.
    ``worker_queued_seconds``: the time they were ready to run but waited for a
    CPU (run queue), summed. ``compute_cpu_seconds``: the main thread's CPU
    time in the loop's compute (known in a probe only).

    The opening (the first batches, read in the main process) is a window of 0
    workers whose "worker" is the main thread's reading: its busy, CPU and
    queued seconds are the main thread's inside ``next()``.
    """

    workers: int
    steps: int
    wait_seconds: float
    compute_seconds: float
    worker_cpu_seconds: float | None = None
    idle_cpus: float | None = None
    worker_memory_bytes: int | None = None
    worker_busy_seconds: float | None = None
    worker_queued_seconds: float | None = None
    compute_cpu_seconds: float | None = None

    @property
    def seconds(self) -> float:
        return self.wait_seconds + self.compute_seconds

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def wait_ratio(self) -> float:
        return self.wait_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def io_share(self) -> float | None:
        """The share of the workers' busy time spent neither on a CPU nor waiting for one:
        waiting on I/O (None when not known)."""
        cpu, queued, busy = self.worker_cpu_seconds, self.worker_queued_seconds, self.worker_busy_seconds
        if cpu is None or queued is None or busy is None or busy <= 0:
            return None
        return max(0.0, 1 - (cpu + queued) / busy)


@dataclass(frozen=True)
class Decision:
    """The worker count to run next and why; ``back`` when it undoes a change that did not help,
    ``deferred`` when it is made at the next epoch: restarting workers now would cost more than it saves."""

    workers: int
    reason: str
    back: bool = False
    deferred: bool = False


@dataclass(frozen=True)
class Limits:
    """The bounds a worker count stays within: ``max_workers``, ``memory_bytes``, ``ceiling``
    (the lowest count that was tried and did not help) and ``floor`` (the count that reading
    in the main process, 0 workers, was tried from and lost to), and ``cpus``: the CPUs this
    process may run on (None: not known)."""

    max_workers: int
    memory_bytes: int | None
    ceiling: int | None = None
    floor: int = 0
    cpus: int | None = None


def guess(opening: Window, settings: Autotune, limits: Limits) -> Decision:
    """The first worker count, from ``opening``: the first batches, read in the main process (a
    window of 0 workers; see the module docstring)."""
    data, compute = opening.wait_seconds / max(opening.steps, 1), opening.compute_seconds / max(opening.steps, 1)
    handover = settings.handover_seconds
    measured = f"the main process made a batch in {data * 1e3:.3g} ms, its loop computed {compute * 1e3:.3g} ms"
    if data < handover + settings.min_gain * (compute + handover):  # workers would save less than min_gain
        return Decision(0, f"{measured}: workers would save less than {settings.min_gain:.0%}; 0 workers")
    io = opening.io_share
    margin = IO_MARGIN if io is not None and io >= IO_BOUND else MARGIN
    wanted = 2**31 if compute <= 0 else math.ceil(min(margin * data / compute, 2**31))  # a tiny compute: no inf
    bounds = [(wanted, f"{wanted} would end the wait"), (limits.max_workers, f"max_workers is {limits.max_workers}")]
    bounds.append(_cpu_room(opening, limits))
    if limits.ceiling is not None:
        bounds.append((limits.ceiling - 1, f"{limits.ceiling} workers were tried and did not help"))
    target, bound = min(bounds, key=lambda bound: bound[0])
    target = max(target, 1)
    return Decision(
        target, f"{measured} (the loop waited {opening.wait_ratio:.0%} of its time): 0 -> {target} workers, {bound}"
    )


def _cpu_room(opening: Window, limits: Limits) -> tuple[int, str]:
    """How many workers making batches as the main process did the CPUs hold: each uses the share
    of a CPU the main process's reading used while it was not waiting for one; the CPUs are
    this process's, less what the loop's own compute uses."""
    cpus = limits.cpus or 1
    cpu, busy, queued = opening.worker_cpu_seconds, opening.worker_busy_seconds, opening.worker_queued_seconds or 0.0
    share = 1.0 if cpu is None or busy is None else min(1.0, cpu / max(busy - queued, cpu, 1e-9))
    share = max(share, MIN_WORKER_CPU)
    main = 0.0
    if opening.compute_cpu_seconds is not None and opening.compute_seconds > 0:
        main = min(1.0, opening.compute_cpu_seconds / opening.compute_seconds)
    room = max(1.0, cpus - main)
    fits = max(1, int(room / share + 0.5))
    return fits, f"{fits} fill {room:.3g} CPUs (a worker uses {share:.2f} of one)"


def decide(window: Window, before: Window | None, settings: Autotune, limits: Limits) -> Decision:
    """The next worker count after ``window`` (see the module docstring); ``before`` is the last
    judged window before the change that led to ``window``'s count (None: no change yet)."""
    n = window.workers
    judged = _judge_change(window, before, settings) if before is not None else None
    if judged is not None:
        return judged
    if window.wait_ratio < settings.wait_threshold:
        return Decision(n, f"the loop waited {window.wait_ratio:.0%} of its time for data: enough workers")
    if n == 1 and limits.floor == 0 and window.worker_busy_seconds is not None:
        busy, step = window.worker_busy_seconds / window.steps, window.seconds / window.steps
        if busy < step / 2:  # the worker is not what the loop waits for: handing its data over is
            return Decision(
                0,
                f"the loop waited {window.wait_ratio:.0%} of its time, its one worker worked {busy * 1e3:.3g} ms "
                f"of a {step * 1e3:.3g} ms step: 1 -> 0 workers (reading in the main process) on trial",
            )
    target, bound = _grow_bounds(window, settings, limits)
    if target <= n:
        return Decision(n, f"the loop waited {window.wait_ratio:.0%} of its time, but {bound}")
    return Decision(target, f"the loop waited {window.wait_ratio:.0%} of its time for data: {n} -> {target} workers")


def _judge_change(window: Window, before: Window, settings: Autotune) -> Decision | None:
    """Undo the change from ``before``'s count to ``window``'s if it did not help (None: keep it).

    More workers must bring ``min(min_gain, wait / 2)``; fewer (0, reading in the main
    process) may cost at most ``min_gain / 2``, for the memory they save. Workers that did
    not bring enough are stopped at once only when they made the loop slower (by
    ``min_gain / 2`` against the main process, ``min_gain`` against fewer workers, which
    must be started again); else at the next epoch: stopping them now would cost more than
    it saves."""
    n, old = window.workers, before.workers
    gain = window.steps_per_second / before.steps_per_second - 1 if before.steps_per_second > 0 else 0.0
    speeds = (
        f"{gain:+.0%} faster than {old} ({window.steps_per_second:.3g} against {before.steps_per_second:.3g} steps/s"
    )
    if old < n and before.wait_ratio >= settings.wait_threshold:
        needed = min(settings.min_gain, before.wait_ratio / 2)
        if gain < needed:
            later = gain >= -(settings.min_gain / 2 if old == 0 else settings.min_gain)
            when = " at the next epoch" if later else ""
            reason = f"{n} workers were {speeds}; a change must bring {needed:.0%}): back to {old}{when}"
            return Decision(old, reason, back=True, deferred=later)
    if old > n:
        if gain < -settings.min_gain / 2:
            return Decision(old, f"{n} workers were {speeds}): back to {old}", back=True)
        return Decision(n, f"{n} workers were {speeds}): {n} kept, {old} is not tried again")
    return None


def _grow_bounds(window: Window, settings: Autotune, limits: Limits) -> tuple[int, str]:
    """The count to grow to, and what bound it (for the reason when nothing can be added)."""
    n = window.workers
    if n == 0:  # reading in the main process: one worker, if a CPU is idle for it
        idle = window.idle_cpus
        bounds = [(1, "")]
        if limits.ceiling is not None:  # first, so that it is the reason given when it binds
            bounds.append((limits.ceiling - 1, "workers were tried, or guessed from the opening, and were not faster"))
        bounds.append((0 if idle is None or idle < 0.5 else 1, "no CPU is idle for a worker"))
        target, reason = min(bounds, key=lambda bound: bound[0])
        return target, reason or "no bound"
    wanted = n * 2 if window.compute_seconds <= 0 else n * window.seconds / window.compute_seconds * MARGIN
    bounds = [(min(2 * n, max(n + 1, math.ceil(wanted))), "")]
    bounds.append((limits.max_workers, f"max_workers is {limits.max_workers}"))
    if limits.ceiling is not None:
        bounds.append((limits.ceiling - 1, f"{limits.ceiling} workers were tried and did not help"))
    bounds.append(_cpu_bound(window, limits))
    if limits.memory_bytes is not None and window.worker_memory_bytes:
        each = window.worker_memory_bytes / n
        fits = int(limits.memory_bytes // each) if each > 0 else limits.max_workers
        bounds.append((fits, f"{fits + 1} workers of {each / 2**20:.0f} MiB each pass the memory bound"))
    target, reason = min(bounds, key=lambda bound: bound[0])
    return target, reason or "no bound"


def _cpu_bound(window: Window, limits: Limits) -> tuple[int, str]:
    """How many workers the CPUs allow: no bound when the workers mostly wait on I/O (on a busy
    machine too: they need little CPU); else each new one is expected to use what one uses now,
    out of the CPUs left idle, or as many as fill this process's CPUs when each wants a CPU
    for the share of its busy time it ran or waited for one (the kernel shares a busy machine's
    CPUs between runnable threads: other jobs' load does not make a CPU-bound worker useless)."""
    n = window.workers
    io = window.io_share
    if io is not None and io >= IO_BOUND:
        return 2**31, ""
    if window.idle_cpus is None or window.worker_cpu_seconds is None or window.seconds <= 0:
        return n, "the CPUs' use is not known here"
    each = max(window.worker_cpu_seconds / n / window.seconds, MIN_WORKER_CPU)
    more = int(window.idle_cpus / each + 0.5)
    fair, wants = n + more, ""
    cpu, queued, busy = window.worker_cpu_seconds, window.worker_queued_seconds, window.worker_busy_seconds
    if limits.cpus is not None and queued is not None and busy:
        share = max(min(1.0, (cpu + queued) / busy), MIN_WORKER_CPU)
        fair, wants = max(fair, int(limits.cpus / share + 0.5)), f"; {limits.cpus} CPUs, a worker wants {share:.2f}"
    return fair, f"no CPU to spare ({window.idle_cpus:.2f} idle, a worker uses {each:.2f}{wants})"


def prefetch_for(workers: int) -> int:
    """``prefetch="auto"``: micro-batches each worker keeps in flight (see the module docstring)."""
    return max(2, math.ceil(4 / max(workers, 1)))


def default_max_workers(cpus: int) -> int:
    """``Autotune.max_workers`` when None: twice the CPUs, at least 2."""
    return max(2, 2 * cpus)


@dataclass
class Tuner:
    """The windows and changes of one loader (mutable: the loader's, in the main process).

    The loader calls :meth:`step` after each batch with its totals; when a window
    is complete :meth:`step` measures it (``probe``: the workers' pids to read)
    and returns the :class:`Decision` if it changes the count. In the opening
    (``opening`` true: 0 workers, the count not chosen yet) the loader also calls
    :meth:`entered` as each ``next()`` begins, so that the main thread's CPU time
    splits into making the batches and the loop's compute.
    """

    settings: Autotune
    limits: Limits
    workers: int
    history: list[dict[str, Any]] = field(default_factory=list)
    last: str = "no window judged yet"  # the latest decision's reason, a stay's too
    _mark: tuple[int, int, int, float, Any, tuple[float, float] | None, float | None] | None = None
    _before: Window | None = None
    _skip: bool = True  # the first window after a start or change is not judged
    opening: bool = False
    _guessed: bool = False  # the count was guessed from an opening: growing waits for the next epoch
    # The opening's main-thread times: CPU and run-queue seconds at the last entry and exit of
    # next(), and the sums since its mark of [CPU in next(), run queue in next(), CPU between].
    _entry: tuple[float, float | None] | None = None
    _exit: tuple[float, float | None] | None = None
    _sums: list[float | None] = field(default_factory=lambda: [0.0, 0.0, 0.0])

    def restart(self, workers: int) -> None:
        """Workers were (re)started with ``workers``: a new first window (and no opening)."""
        self.workers, self._mark, self._skip, self.opening = workers, None, True, False

    def entered(self) -> None:
        """A ``next()`` begins: in the opening, the main thread's time since the last one ended is compute."""
        if not self.opening:
            return
        self._entry = thread_times()
        if self._exit is not None:
            self._sums[2] = _added(self._sums[2], self._entry[0] - self._exit[0])

    def step(self, steps: int, wait_ns: int, compute_ns: int, probe: Callable[[], Probe]) -> Decision | None:
        """After a batch: the totals of the loader's meter; a Decision when the count should change.
        ``probe`` (called at a window's ends only) gives the workers' pids and busy seconds so far."""
        if self.opening:
            return self._open(steps, wait_ns, compute_ns)
        if self._mark is None:
            pids, busy = probe()
            self._mark = (steps, wait_ns, compute_ns, time.monotonic(), process_cpu_seconds(pids), cpu_times(), busy)
            return None
        first, wait0, compute0, started, cpu0, times0, busy0 = self._mark
        elapsed = time.monotonic() - started
        longer = 1 if self._before is None or self._skip else JUDGED_WINDOWS  # a change is judged on more
        if steps - first < self.settings.window_steps * longer or elapsed < self.settings.window_seconds * longer:
            return None
        pids, busy = probe()
        cpu = process_cpu_seconds(pids)
        known = cpu is not None and cpu0 is not None
        window = Window(
            workers=self.workers,
            steps=steps - first,
            wait_seconds=(wait_ns - wait0) * 1e-9,
            compute_seconds=(compute_ns - compute0) * 1e-9,
            worker_cpu_seconds=cpu[0] - cpu0[0] if known else None,  # type: ignore[index]
            worker_queued_seconds=cpu[1] - cpu0[1] if known and cpu[1] is not None and cpu0[1] is not None else None,  # type: ignore[index,operator]
            idle_cpus=idle_cpus(times0, cpu_times()),
            worker_busy_seconds=None if busy is None or busy0 is None else busy - busy0,
        )
        self._mark = None
        if self._skip:
            self._skip = False
            return None
        return self._judge(window, steps, lambda: process_memory_bytes(pids))

    def _open(self, steps: int, wait_ns: int, compute_ns: int) -> Decision | None:
        """A step of the opening: sum the main thread's times; once it is long enough, the first guess.
        Its first step (the shards opened, the pipeline's first call) is not measured."""
        entry, self._exit = self._entry, thread_times()
        if entry is not None:
            cpu, queued = self._exit[0] - entry[0], _added(self._exit[1], None if entry[1] is None else -entry[1])
            self._sums[0], self._sums[1] = _added(self._sums[0], cpu), _added(self._sums[1], queued)
        if self._mark is None:
            self._mark = (steps, wait_ns, compute_ns, time.monotonic(), None, None, None)
            self._sums = [0.0, 0.0, 0.0]
            return None
        first, wait0, compute0, started = self._mark[:4]
        settings = self.settings
        if steps - first < settings.opening_steps or time.monotonic() - started < settings.opening_seconds:
            return None
        data_cpu, data_queued, compute_cpu = self._sums
        opening = Window(
            workers=0,
            steps=steps - first,
            wait_seconds=(wait_ns - wait0) * 1e-9,
            compute_seconds=(compute_ns - compute0) * 1e-9,
            worker_cpu_seconds=data_cpu,
            worker_busy_seconds=(wait_ns - wait0) * 1e-9,
            worker_queued_seconds=data_queued,
            compute_cpu_seconds=compute_cpu,
        )
        decision = guess(opening, settings, self.limits)
        self.restart(0)
        self.last = decision.reason
        if decision.workers == 0:  # workers would not pay for their hand-over: none are tried this run
            self.limits = dataclasses.replace(self.limits, ceiling=1)
            return None
        self._before, self._guessed = opening, True  # the guess is judged against the opening, as a change is
        self._record(decision, opening, steps)
        return decision

    def _judge(self, window: Window, steps: int, memory: Callable[[], int | None] = lambda: None) -> Decision | None:
        """Decide after ``window``; ``memory`` (the workers') is read only if it grows, the one case its
        bound binds (``smaps_rollup`` costs the main thread 10-20 ms per torch worker)."""
        decision = decide(window, self._before, self.settings, self.limits)
        if decision.workers > window.workers and not decision.back and window.worker_memory_bytes is None:
            window = dataclasses.replace(window, worker_memory_bytes=memory())
            decision = decide(window, self._before, self.settings, self.limits)
        if self._guessed and decision.workers > self.workers > 0 and not decision.back:
            # After the guess, growing restarts every worker: seconds when they hold remote reads.
            decision = dataclasses.replace(decision, reason=f"{decision.reason} at the next epoch", deferred=True)
        self.last = decision.reason
        if decision.back and decision.workers < window.workers:  # more did not help; workers at all, if 0 won
            self.limits = dataclasses.replace(self.limits, ceiling=window.workers if decision.workers else 1)
        elif decision.back:  # reading in the main process was slower
            self.limits = dataclasses.replace(self.limits, floor=decision.workers)
        elif self._before is not None and decision.workers == window.workers < self._before.workers:
            self.limits = dataclasses.replace(self.limits, ceiling=self._before.workers)  # fewer did as well
        # Judged against the next window only: after a step back or a stay the change is settled.
        self._before = window if decision.workers != self.workers and not decision.back else None
        if decision.workers == self.workers:
            return None
        self._record(decision, window, steps)
        return decision

    def _record(self, decision: Decision, window: Window, steps: int) -> None:
        """Keep a change in the history that ``stats()`` shows."""
        self.history.append(
            {
                "step": steps,
                "from": self.workers,
                "to": decision.workers,
                "reason": decision.reason,
                "wait_ratio": round(window.wait_ratio, 4),
                "steps_per_second": round(window.steps_per_second, 3),
            }
        )

    def summary(self, prefetch: int | None) -> dict[str, Any]:
        """What ``stats()`` shows: the count now, the prefetch, the bounds, every change and
        the latest decision's reason (why the count stays, when it does)."""
        return {
            "num_workers": self.workers,
            "prefetch": prefetch,
            "max_workers": self.limits.max_workers,
            "memory_bytes": self.limits.memory_bytes,
            "ceiling": self.limits.ceiling,
            "floor": self.limits.floor,
            "changes": [dict(change) for change in self.history],
            "last": self.last,
        }


# -- the loader's arguments ----------------------------------------------------------


def tuner_for(
    num_workers: int | str, settings: Autotune | None, error: type[Exception], mid_epoch: bool = True
) -> Tuner | None:
    """The tuner of ``num_workers="auto"`` (None for a fixed count), its bounds resolved now;
    ``error`` (the loader's) names an ``autotune`` argument that cannot work. ``mid_epoch``:
    whether the loader can change its count mid-epoch; without it there is no opening (its
    guess would wait for the next epoch): the first epoch runs one worker."""
    if num_workers != AUTO:
        if settings is not None:
            raise error(f'autotune={settings!r} applies to num_workers="auto" only, got num_workers={num_workers!r}')
        return None
    if settings is None:
        settings = Autotune()
    elif not isinstance(settings, Autotune):
        raise error(f"autotune must be a shardkit.loader.autotune.Autotune or None, got {settings!r}")
    cpus = available_cpus()
    max_workers = settings.max_workers or default_max_workers(cpus)
    memory = settings.memory_bytes or default_memory_bytes()
    opening = settings.start is None and mid_epoch
    start = 0 if opening else 1 if settings.start is None else settings.start
    tuner = Tuner(settings, Limits(max_workers, memory, cpus=cpus), min(start, max_workers))
    tuner.opening = opening
    return tuner


def check_prefetch(prefetch: Any, dataloader_kwargs: dict[str, Any], error: type[Exception]) -> bool:
    """Whether ``prefetch`` is "auto"; raise ``error`` naming a value that cannot work."""
    if prefetch is None:
        return False
    if prefetch != AUTO or not isinstance(prefetch, str):
        check_int("prefetch", prefetch, minimum=1, error=error, hint='or pass "auto" or None')
    if "prefetch_factor" in dataloader_kwargs:
        raise error(
            f"prefetch={prefetch!r} and prefetch_factor={dataloader_kwargs['prefetch_factor']!r} set the same "
            "thing (micro-batches each worker keeps in flight): pass one of them"
        )
    return prefetch == AUTO


def _added(total: float | None, more: float | None) -> float | None:
    return None if total is None or more is None else total + more
