"""Stall accounting of a :class:`~shardkit.MixedLoader`: did the training loop wait for data, and why.

The main process times each step at its two ends (:class:`StallMeter`): the
time spent inside ``next(loader)`` is *wait*, the time between one ``next``
returning and the next call is *compute* (the training step). Four clock reads
per batch, nothing per sample. Of the wait, the time spent receiving the
workers' messages (waiting for them and unpickling) is *receive*; the rest is
the main process's own work (*assemble*: cutting and copying the batch, a
``collate_fn``, pinning). Each worker's figures arrive with its messages
(:mod:`shardkit.loader.timing`) and are summed per stage by :func:`summarise`.

Totals count from the loader's construction; the recent window is the last
:data:`WINDOW` steps. Time between epochs (after a ``StopIteration`` until the
next ``next``) is neither wait nor compute.

Under a process group, :func:`gather` collects every rank's
:class:`LoaderStats` through the job's key-value store, as
:mod:`shardkit.ranks` does with states, but bounded: a rank that does
not call it within ``timeout`` is reported missing, never waited for longer,
and nothing is raised (statistics must not stop a training run). The ranks
meet under a key made of the loader's serial number in its process, the epoch,
the step count and how many gathers were made at that step, so a rank that
skipped one gather does not shift the later ones.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from shardkit.jobstore import group_store, tidy_keys
from shardkit.loader.timing import FIGURES, now

__all__ = ["GatheredStats", "LoaderStats", "StallMeter", "WorkerStats", "chrome_trace", "gather", "summarise"]

#: Steps in the recent window of :class:`LoaderStats`.
WINDOW = 100
#: Seconds :func:`gather` waits for the other ranks by default.
GATHER_TIMEOUT = 10.0

_NS = 1e-9
_serials = itertools.count()
_serial_lock = threading.Lock()


@dataclass(frozen=True)
class WorkerStats:
    """One DataLoader worker's time, summed over the epochs it ran.

    ``busy_seconds`` is pulling micro-batches through the pipeline, collating
    them and saving the dataset's state; ``idle_seconds`` is waiting for the
    main process to ask for the next micro-batch (its prefetch was full);
    ``stages`` splits the busy time by stage (see :mod:`shardkit.loader.timing`),
    with ``collate`` and ``state`` (the dataset state sent with each message).
    """

    worker: int
    elapsed_seconds: float
    busy_seconds: float
    idle_seconds: float
    samples: int
    stages: dict[str, float]

    @property
    def utilisation(self) -> float:
        """Busy time over the worker's wall time (0 before it ran)."""
        return min(self.busy_seconds / self.elapsed_seconds, 1.0) if self.elapsed_seconds > 0 else 0.0


@dataclass(frozen=True)
class LoaderStats:
    """Where a MixedLoader's time went on one rank (see the module docstring).

    ``stages`` sums each stage's seconds over the workers (workers run in
    parallel, so the sum may exceed the wall time; each worker's does not).
    """

    rank: int
    steps: int
    wait_seconds: float
    compute_seconds: float
    recent_steps: int
    recent_wait_seconds: float
    recent_compute_seconds: float
    receive_seconds: float
    assemble_seconds: float
    stages: dict[str, float] = field(default_factory=dict)
    workers: tuple[WorkerStats, ...] = ()
    #: With ``num_workers="auto"``: the count now and every change, with its reason (plain data).
    autotune: dict[str, Any] | None = None
    #: How a saved state holds the undelivered samples of cut micro-batches: ``"positions"`` (their
    #: records', read again on restore), ``"restart"`` (not at all: each worker's state is made at the
    #: delivered point from a restart point, :mod:`shardkit.loader.restart`; data where none serves),
    #: ``"data"`` (the samples, encoded: the dataset cannot read its records again) or None
    #: (``resumable=False``). See :mod:`shardkit.loader.loader_state`.
    carried_as: str | None = None

    @property
    def wait_ratio(self) -> float:
        """The share of the loop's time spent waiting for batches (0 before any step)."""
        return _ratio(self.wait_seconds, self.compute_seconds)

    @property
    def recent_wait_ratio(self) -> float:
        """The wait ratio of the last :data:`WINDOW` steps."""
        return _ratio(self.recent_wait_seconds, self.recent_compute_seconds)

    @property
    def slowest_stage(self) -> tuple[str, float] | None:
        """The stage the workers spent most time in, with its seconds; None without worker figures."""
        if not self.stages:
            return None
        name = max(self.stages, key=self.stages.__getitem__)
        return name, self.stages[name]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON): what :func:`gather` sends."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoaderStats:
        workers = tuple(WorkerStats(**worker) for worker in data.get("workers", ()))
        return cls(**{**data, "workers": workers})


def _ratio(wait: float, compute: float) -> float:
    return wait / (wait + compute) if wait + compute > 0 else 0.0


@dataclass(frozen=True)
class GatheredStats:
    """Every rank's :class:`LoaderStats` (None for a rank that did not answer in time)."""

    ranks: tuple[LoaderStats | None, ...]

    @property
    def missing(self) -> list[int]:
        return [rank for rank, stats in enumerate(self.ranks) if stats is None]

    @property
    def straggler(self) -> int | None:
        """The rank that waited longest for its batches: under DDP the others wait for it
        in the gradient all-reduce, which their loaders count as compute."""
        answered = [(stats.wait_seconds, rank) for rank, stats in enumerate(self.ranks) if stats is not None]
        return max(answered)[1] if answered else None

    def summary(self) -> str:
        """One line naming the straggling rank, its wait and its slowest stage."""
        rank = self.straggler
        if rank is None:
            return "no rank answered"
        stats = self.ranks[rank]
        assert stats is not None
        slowest = stats.slowest_stage
        stage = f"; its slowest stage: {slowest[0]} ({slowest[1]:.2f} s over its workers)" if slowest else ""
        missing = f"; rank(s) {', '.join(map(str, self.missing))} did not answer" if self.missing else ""
        return (
            f"rank {rank} waits most for data: {stats.wait_seconds:.2f} s "
            f"({stats.wait_ratio:.0%} of its loop){stage}{missing}"
        )


class StallMeter:
    """The main process's clock of one loader: steps, wait and compute, and the workers'
    figures of finished epochs (the running epoch's are read from its mixer)."""

    def __init__(self, trace: bool = False) -> None:
        with _serial_lock:
            self.serial = next(_serials)
        self.trace = trace
        self.steps = 0
        self.wait_ns = self.compute_ns = self.receive_ns = 0
        # The recent window: each step's wait and compute, in rings written in place (no object per step).
        self._recent_wait = [0] * WINDOW
        self._recent_compute = [0] * WINDOW
        self.workers: dict[int, dict[str, Any]] = {}  # finished epochs' figures per worker
        #: With ``trace``: per step (start, wait ns, compute ns before it), in the main process.
        self.events: list[tuple[int, int, int]] = []
        self.worker_events: dict[int, list[Any]] = {}
        self.worker_names: dict[int, tuple[str, ...]] = {}
        self._left: int | None = None
        self._gathers: tuple[tuple[int, int], int] = ((-1, -1), 0)

    #: ``next(loader)`` was called (the time since the last batch was compute): the clock's reading, to pass
    #: to :meth:`left`. The clock itself, not a method calling it: one Python frame fewer per step.
    entered = staticmethod(now)

    def left(self, start: int, ended: bool = False) -> None:
        """``next(loader)`` returned a batch (or, ``ended``, raised StopIteration)."""
        end = now()
        wait = end - start
        compute = 0 if self._left is None else start - self._left
        self.wait_ns += wait
        self.compute_ns += compute
        if ended:
            self._left = None
            return
        self._left = end
        slot = self.steps % WINDOW
        self._recent_wait[slot] = wait
        self._recent_compute[slot] = compute
        self.steps += 1
        if self.trace:
            self.events.append((start, wait, compute))

    def fold(self, mixer: Any) -> None:
        """Add a finished (or abandoned) epoch's worker figures to the totals."""
        if mixer is None:
            return
        self.receive_ns += mixer.receive_ns
        mixer.receive_ns = 0
        for worker, figures in summarise(mixer.names, mixer.figures).items():
            self.workers[worker] = _added(self.workers.get(worker), figures)
        mixer.figures = [None] * len(mixer.figures)
        self.fold_events(mixer)

    def fold_events(self, mixer: Any) -> None:
        """Move the traced micro-batches the running epoch's ``mixer`` received here."""
        if mixer is None:
            return
        for worker, events in mixer.events.items():
            self.worker_events.setdefault(worker, []).extend(events)
        mixer.events = {}
        self.worker_names.update((w, tuple(names)) for w, names in enumerate(mixer.names) if names is not None)

    def stats(self, rank: int, mixer: Any) -> LoaderStats:
        """The figures so far, with those of the running epoch's ``mixer`` (None: no epoch running)."""
        workers = {worker: dict(figures) for worker, figures in self.workers.items()}
        receive = self.receive_ns
        if mixer is not None:
            receive += mixer.receive_ns
            for worker, figures in summarise(mixer.names, mixer.figures).items():
                workers[worker] = _added(workers.get(worker), figures)
        stages: dict[str, float] = {}
        for figures in workers.values():
            for name, seconds in figures["stages"].items():
                stages[name] = stages.get(name, 0.0) + seconds
        recent_wait, recent_compute = sum(self._recent_wait), sum(self._recent_compute)
        return LoaderStats(
            rank=rank,
            steps=self.steps,
            wait_seconds=self.wait_ns * _NS,
            compute_seconds=self.compute_ns * _NS,
            recent_steps=min(self.steps, WINDOW),
            recent_wait_seconds=recent_wait * _NS,
            recent_compute_seconds=recent_compute * _NS,
            receive_seconds=receive * _NS,
            assemble_seconds=max(self.wait_ns - receive, 0) * _NS,
            stages=stages,
            workers=tuple(WorkerStats(worker=w, **workers[w]) for w in sorted(workers)),
        )

    def gather_tag(self, epoch: int) -> str:
        """The key under which the ranks' gathers at this position meet."""
        position = (epoch, self.steps)
        last, count = self._gathers
        count = count + 1 if last == position else 0
        self._gathers = (position, count)
        return f"shardkit/stalls/{self.serial}/{epoch}/{self.steps}/{count}/"


def summarise(names: Sequence[Any], figures: Sequence[Any]) -> dict[int, dict[str, Any]]:
    """Each worker's figures (``timing.WorkerClock.figures()``) as seconds per stage."""
    result: dict[int, dict[str, Any]] = {}
    for worker, (stage_names, counts) in enumerate(zip(names, figures)):
        if counts is None or stage_names is None:
            continue
        base = dict(zip(FIGURES, counts))
        sampled = list(counts[len(FIGURES) : len(FIGURES) + len(stage_names)])
        total = sum(sampled)
        shares = [ns / total for ns in sampled] if total else [1.0] + [0.0] * (len(stage_names) - 1)
        stages = {name: base["pipeline"] * share * _NS for name, share in zip(stage_names, shares)}
        stages.update(collate=base["collate"] * _NS, state=base["state"] * _NS)
        result[worker] = {
            "elapsed_seconds": base["elapsed"] * _NS,
            "busy_seconds": (base["pipeline"] + base["collate"] + base["state"]) * _NS,
            "idle_seconds": base["idle"] * _NS,
            "samples": int(base["samples"]),
            "stages": stages,
        }
    return result


def _added(total: dict[str, Any] | None, more: dict[str, Any]) -> dict[str, Any]:
    if total is None:
        return {**more, "stages": dict(more["stages"])}
    stages = dict(total["stages"])
    for name, seconds in more["stages"].items():
        stages[name] = stages.get(name, 0.0) + seconds
    summed = {key: total[key] + more[key] for key in ("elapsed_seconds", "busy_seconds", "idle_seconds", "samples")}
    return {**summed, "stages": stages}


def gather(stats: LoaderStats, tag: str, timeout: float = GATHER_TIMEOUT) -> GatheredStats:
    """Every rank's ``stats`` through the job's store (see the module docstring); without a
    process group of more than one rank, this rank's alone."""
    store = group_store()
    if store is None:
        return GatheredStats((stats,))
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    keys = [f"{tag}{r}" for r in range(world_size)]
    store.set(keys[rank], json.dumps(stats.to_dict()).encode())
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001, S110 - a timed-out wait: which exception depends on the store
        pass
    ranks: list[LoaderStats | None] = []
    for key in keys:
        try:
            present = store.check([key])
            ranks.append(LoaderStats.from_dict(json.loads(bytes(store.get(key)))) if present else None)
        except Exception:  # noqa: BLE001 - a store that cannot answer: that rank is reported missing
            ranks.append(None)
    tidy_keys(store, tag, keys, world_size)
    return GatheredStats(tuple(ranks))


def chrome_trace(meter: StallMeter) -> dict[str, Any]:
    """The traced steps and micro-batches as a Chrome trace / Perfetto timeline
    (``{"traceEvents": [...]}``, complete events, microseconds).

    Process 0 is the main process: each step's ``wait`` and the ``compute`` before
    it. Process ``w + 1`` is worker ``w``, one thread per stage: each micro-batch's
    time in each stage, laid end to end from its start, source first (the stages
    run sample by sample, interleaved; the timeline shows each one's sum), then
    ``collate`` and ``state``.
    """
    starts = [start for start, _, _ in meter.events]
    starts += [event[0] for events in meter.worker_events.values() for event in events]
    origin = min(starts, default=0)
    events: list[dict[str, Any]] = [*_meta(0, "main process", {0: "loop"})]
    for start, wait, compute in meter.events:
        events.append(_complete("compute", 0, 0, start - compute - origin, compute))
        events.append(_complete("wait", 0, 0, start - origin, wait))
    for worker, worker_events in sorted(meter.worker_events.items()):
        names = meter.worker_names.get(worker, ())
        order = [*reversed(range(len(names))), len(names), len(names) + 1]  # source first, then collate, state
        labels = [*names, "collate", "state"]
        events += _meta(worker + 1, f"worker {worker}", {tid: labels[tid] for tid in order})
        for start, pipeline, own, collate, state in worker_events:
            total = sum(own)
            spans = [pipeline * ns / total if total else 0 for ns in own] + [collate, state]
            at = start - origin
            for tid in order:
                if spans[tid] > 0:
                    events.append(_complete(labels[tid], worker + 1, tid, at, spans[tid]))
                    at += spans[tid]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _complete(name: str, pid: int, tid: int, start_ns: float, duration_ns: float) -> dict[str, Any]:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start_ns / 1e3, "dur": duration_ns / 1e3}


def _meta(pid: int, process: str, threads: dict[int, str]) -> list[dict[str, Any]]:
    """The metadata events naming a process and its threads (and keeping the threads in ``threads``' order)."""
    events = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}}]
    for rank, (tid, name) in enumerate(threads.items()):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": rank}})
    return events
