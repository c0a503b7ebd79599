"""Run an expensive launch once per test session, however pytest-xdist spreads the tests that read it.

A module-scoped fixture runs once per xdist worker that gets one of the module's tests, and
``--dist worksteal`` splits a module between workers when one runs dry: the launch behind the
fixture (torchruns, gloo ranks, a benchmark interpreter) then runs twice, each copy taking a core
from the other. :func:`once` runs ``produce`` in the first worker to ask and keeps its result as
JSON in the session's shared temp folder (the parent of every worker's basetemp), under a lock; a
worker asking later waits for that result and reads it. Without xdist it is a plain call.

The result must be JSON (plain data: nothing is pickled). A failure is kept too, as its message,
and raised again in every worker that asks, so a broken launch fails each test that needs it once,
not once per worker.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from filelock import FileLock


def once(factory: pytest.TempPathFactory, name: str, produce: Callable[[], Any]) -> Any:
    """``produce()`` run once in the session (all xdist workers), its JSON result shared by name."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return produce()
    folder = factory.getbasetemp().parent  # every worker's basetemp is a child of the session's
    path = folder / f"once-{name}.json"
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            try:
                kept = {"result": produce()}
            except Exception as error:  # kept for every worker: each raises the same, none runs it again
                kept = {"error": f"{type(error).__name__}: {error}"}
            partial = path.with_suffix(".partial")
            partial.write_text(json.dumps(kept))
            os.replace(partial, path)  # a worker that dies mid-write leaves no half result to read
        kept = json.loads(path.read_text())
    if "error" in kept:
        raise RuntimeError(f"the shared launch {name!r} failed (in the worker that ran it): {kept['error']}")
    return kept["result"]


@contextlib.contextmanager
def one_at_a_time(factory: pytest.TempPathFactory, name: str) -> Iterator[None]:
    """Hold the session's lock ``name`` (all xdist workers): tests that each need gigabytes of memory
    run one after another, so three workers cannot together take more than the machine has."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield
        return
    with FileLock(str(factory.getbasetemp().parent / f"exclusive-{name}.lock")):
        yield
