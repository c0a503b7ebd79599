"""Bounds that only catch hangs: scaled by how busy the machine is when they start.

A test's wall-clock bound (a subprocess timeout, pytest-timeout's per-test bound)
is there to stop a hang, not to judge speed. On a shared machine at load 6-10 on
2 cores every process runs 3-5x slower than alone, so a fixed bound that a quiet
run meets with room to spare (the type check: 69 s alone, 120 s bound) fails a
correct test. :func:`hang_bound` stretches a bound by the run-queue length per
CPU (the one-minute load average over the CPUs this process may use), never
below the bound as written and at most :data:`MAX_STRETCH` times it, so a real
hang is still caught and its stacks printed.
"""

from __future__ import annotations

import os

MAX_STRETCH = 8.0
"""A bound is stretched at most this much: a hang on a machine at load 16 per CPU still ends."""


def load_per_cpu() -> float:
    """The one-minute load average per CPU this process may run on (0.0 where the OS does not say)."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return 0.0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return load / max(cpus, 1)


def stretch(load: float) -> float:
    """How much a bound is stretched at ``load`` runnable processes per CPU: 1 up to one per CPU,
    then proportional, at most :data:`MAX_STRETCH`.

    >>> stretch(0.3), stretch(1.0), stretch(2.5), stretch(100.0)
    (1.0, 1.0, 2.5, 8.0)
    """
    return min(max(1.0, load), MAX_STRETCH)


def hang_bound(seconds: float) -> float:
    """``seconds`` stretched by the machine's load now (see :func:`stretch`)."""
    return seconds * stretch(load_per_cpu())
