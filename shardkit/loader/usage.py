"""What the machine and a loader's processes are doing, from ``/proc`` (Linux), for
``num_workers="auto"`` (:mod:`shardkit.loader.autotune`).

CPUs this process may run on, the memory available, a set of processes' CPU and run-queue
time (``/proc/PID/schedstat``) and proportional set size (``smaps_rollup``: a forked
worker's pages shared with the main process count once), this thread's CPU and run-queue
time, and how many CPUs sat idle between two readings of ``/proc/stat``. Elsewhere, or
when a file cannot be read, each returns None (or the portable figure it names) and the
tuner takes the bound that needs it as met.
"""

from __future__ import annotations

import math
import os
import time

__all__ = [
    "available_cpus",
    "cpu_times",
    "default_memory_bytes",
    "idle_cpus",
    "process_cpu_seconds",
    "process_memory_bytes",
    "thread_times",
]


def available_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_memory_bytes() -> int | None:
    """``Autotune.memory_bytes`` when None: a quarter of MemAvailable (None when not known)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 4
    except OSError:
        pass
    return None


def process_cpu_seconds(pids: list[int]) -> tuple[float, float | None] | None:
    """Seconds the processes ``pids`` ran on a CPU and waited in a run queue for one, summed
    (``/proc/PID/schedstat``; where it is missing, user + system time and None). None if there
    are no processes, or one cannot be read."""
    if not pids:
        return None
    cpu, queued = 0.0, 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat") as schedstat:
                on_cpu, waiting = schedstat.read().split()[:2]
            cpu, queued = cpu + int(on_cpu) * 1e-9, queued + int(waiting) * 1e-9
            continue
        except (OSError, ValueError):
            pass
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        cpu, queued = cpu + (int(fields[11]) + int(fields[12])) / ticks, math.nan  # utime, stime
    return cpu, None if math.isnan(queued) else queued


def thread_times() -> tuple[float, float | None]:
    """Seconds this thread ran on a CPU and waited in a run queue for one (``/proc/thread-self/schedstat``;
    where it is missing, :func:`time.thread_time` and None)."""
    try:
        with open("/proc/thread-self/schedstat") as schedstat:
            on_cpu, waiting = schedstat.read().split()[:2]
        return int(on_cpu) * 1e-9, int(waiting) * 1e-9
    except (OSError, ValueError):
        return time.thread_time(), None


def process_memory_bytes(pids: list[int]) -> int | None:
    """The processes' summed proportional set size (``smaps_rollup`` Pss; RSS where it is missing;
    None if there are none, or one cannot be read)."""
    if not pids:
        return None
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                total += next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))
            continue
        except (OSError, StopIteration):
            pass
        try:
            with open(f"/proc/{pid}/statm") as statm:
                total += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError):
            return None
    return total


def cpu_times() -> tuple[float, float] | None:
    """(idle, total) jiffies of the machine from ``/proc/stat`` (None when not readable)."""
    try:
        with open("/proc/stat") as stat:
            values = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return float(idle), float(sum(values[:8]))


def idle_cpus(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """CPUs idle on average between two :func:`cpu_times`, as a count within this process's affinity."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    share = (after[0] - before[0]) / (after[1] - before[1])
    machine = os.cpu_count() or 1
    return min(share * machine, available_cpus())
