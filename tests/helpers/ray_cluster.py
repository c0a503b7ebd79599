"""A 2-node Ray cluster for the tests, driven from a child process of the pytest worker.

A Ray driver shares the fate of its raylet: in one CI run a raylet that died under load ("node down:
Not properly terminated") took the driver down with it, and the driver was the pytest-xdist worker.
So the driver runs in a child: :func:`run_cases` (pytest side) starts a ``tests/scripts`` module in a
session of its own; that module calls :func:`drive` (child side), which starts the cluster
(``ray.cluster_utils.Cluster``: a head and one more node, each a raylet with one CPU), runs the module's
cases one after another on it and writes one JSON line per event to ``events.jsonl``: the cluster up, a
case started, a case's result (plain data: paths, counts, exit codes) or its traceback. The tests assert
on the results and on the files the cases left; the child asserts nothing.

Only a start-up failure is tried again: a child that ended before it began its first case (a raylet or
the GCS that did not come up, a node down at start). From the first case on, whatever happens is the
tests' to judge, never retried: a case whose driver died has no result and its test fails with the
child's exit code and the end of its stderr. One run per session (``tests/helpers/once.py``) and one
cluster at a time over the xdist workers: two clusters on 2 cores is what made Ray's fixed start-up
bounds fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.load import hang_bound
from tests.helpers.once import once, one_at_a_time
from tests.helpers.processes import DUMP_SECONDS, REPO

OBJECT_STORE = 80 * 1024 * 1024  # bytes per node (Ray's smallest is 75 MiB): the tests move little through it
EVENTS = "events.jsonl"
START_TRIES = 3
"""Child processes started in all for one run, when the ones before failed to start the cluster."""

#: For the child and every process of its cluster (Ray's processes inherit it): no usage report; Ray
#: Train with no preemption watcher actor (a process fewer per fit) and no metrics; its controller
#: polling the workers every 0.5 s, not 2 s (a finished or dead worker is seen sooner).
CHILD_ENVIRONMENT = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "PYTHONFAULTHANDLER": "1",
}


# --------------------------------------------------------------------------- the pytest side


def run_cases(factory: pytest.TempPathFactory, script: str, timeout: float) -> dict[str, Any]:
    """Run ``tests/scripts/{script}.py`` (a driver that calls :func:`drive`) once in the session, in a
    child process, one cluster at a time; its results by case name, and ``folder``: where its cases wrote.
    ``timeout`` bounds one child (stretched by the load)."""

    def produce() -> dict[str, Any]:
        with one_at_a_time(factory, "ray-cluster"):
            return _run_child(factory, script, timeout)

    return once(factory, f"ray-{script}", produce)


def case_result(run: dict[str, Any], name: str) -> dict[str, Any]:
    """What case ``name`` of ``run`` returned; the test fails with the case's traceback where it raised,
    or with the child's exit and stderr where the child ended before the case did."""
    found = run["cases"].get(name)
    if found is None:
        pytest.fail(f"case {name!r}: the Ray driver (exit code {run['exit']}) ended before it did:\n{run['stderr']}")
    if "error" in found:
        pytest.fail(f"case {name!r} raised in the Ray driver:\n{found['error']}")
    return found["result"]


def _run_child(factory: pytest.TempPathFactory, script: str, timeout: float) -> dict[str, Any]:
    reasons = []
    for attempt in range(1, START_TRIES + 1):
        folder = factory.mktemp(f"ray-{script}-try{attempt}-")
        started = time.monotonic()
        code, stderr = _child(script, folder, timeout)
        events = [json.loads(line) for line in (folder / EVENTS).read_text().splitlines()] if (
            folder / EVENTS).exists() else []  # fmt: skip
        seconds = time.monotonic() - started
        if any("start" in event for event in events):
            cases = {e["case"]: e for e in events if "case" in e}
            up = next(e["up"] for e in events if "up" in e)
            print(f"\nRay driver {script}: cluster up in {up:.1f} s, {len(cases)} cases, exit {code}, {seconds:.1f} s")
            return {"folder": str(folder), "cases": cases, "exit": code, "stderr": stderr[-5000:]}
        reason = f"attempt {attempt}: the cluster did not start (exit code {code}, {seconds:.1f} s): {stderr[-1500:]}"
        print(f"\nRay driver {script}, {reason}")  # shown with the test's output: why a start was tried again
        reasons.append(reason)
    raise AssertionError(f"a 2-node Ray cluster did not start in {START_TRIES} child processes:\n" + "\n".join(reasons))


def child_environment() -> dict[str, str]:
    """This process's environment with :data:`CHILD_ENVIRONMENT`, and bytecode cached in the virtual
    environment's ``pycache`` (as scripts/test.sh sets it) when nothing says where: each of a fit's
    half-dozen Ray worker processes imports torch and Ray, and where ``PYTHONDONTWRITEBYTECODE`` is set
    (some container images) and nothing was compiled, each compiled them again."""
    env = {**os.environ, **CHILD_ENVIRONMENT, **start_bounds()}
    if "PYTHONPYCACHEPREFIX" not in env:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(sys.prefix) / "pycache")
    return env


def start_bounds() -> dict[str, str]:
    """Ray's fixed bound on starting a worker process, stretched by the load now (``tests/helpers/load.py``):
    a worker has 60 s to register with its raylet, else the raylet kills it.

    Ray Train's wait for a worker group's placement group (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, 60 s)
    is 10 s here, not stretched: it bounds only the placement of the group's resources, which took 0.00-1.1 s
    in 16 placements at load 11-20 on 2 cores (creating the workers after it, 38-41 s for two at load 19,
    has no such bound). The elastic case waits it out by design: Ray's view of the cluster (refreshed every
    20 s) still holds the lost node when the controller restarts, so it first asks for 2 workers, which
    cannot be placed, and after the wait for 1: 60 s of that fit were this wait. A placement slower than
    the bound costs a try, never the run: the controller tries a group that timed out again without
    counting a failure."""
    return {
        "RAY_worker_register_timeout_seconds": f"{hang_bound(60):.0f}",
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10",
    }


def _child(script: str, folder: Path, timeout: float) -> tuple[int, str]:
    """Run the driver in a session of its own, its output in files (a Ray daemon left behind must not
    hold a pipe open); at the end, every process left in the session is killed. The exit code, stderr."""
    out, err = folder / "stdout.txt", folder / "stderr.txt"
    bound = hang_bound(timeout)
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", f"tests.scripts.{script}", str(folder)], stdout=stdout, stderr=stderr, cwd=REPO,
            env=child_environment(), start_new_session=True,
        )  # fmt: skip
        try:
            code = process.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            _signal_session(process.pid, signal.SIGABRT)  # each Python process prints its stacks
            time.sleep(DUMP_SECONDS)
            code = None
        finally:
            _signal_session(process.pid, signal.SIGKILL)
            process.wait()
    text = err.read_text(errors="replace")
    if code is None:
        raise AssertionError(f"the Ray driver {script} did not end within {bound:.0f} s; its stderr:\n{text[-20000:]}")
    return code, text


def _signal_session(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):  # the session is empty: nothing left to end
        pass


# --------------------------------------------------------------------------- the child (driver) side

Case = Callable[[Any, Path], dict[str, Any]]


def drive(folder: Path, cases: list[tuple[str, Case]]) -> None:
    """Start the cluster, run each case (``case(cluster, folder / name)``) and write the events; a case
    that raises is written with its traceback and the next one runs."""

    def emit(event: dict[str, Any]) -> None:
        with (folder / EVENTS).open("a") as f:
            f.write(json.dumps(event) + "\n")

    import ray

    started = time.monotonic()
    cluster = start_cluster()
    emit({"up": time.monotonic() - started})
    try:
        for name, case in cases:
            emit({"start": name})
            (folder / name).mkdir()
            began = time.monotonic()
            try:
                emit({"case": name, "result": case(cluster, folder / name), "seconds": time.monotonic() - began})
            except Exception:  # the test of this case fails with it; the next case still runs
                emit({"case": name, "error": traceback.format_exc(), "seconds": time.monotonic() - began})
    finally:
        ray.shutdown()
        cluster.shutdown()


def start_cluster() -> Any:
    """A head node and one more node, one CPU each, the driver connected to the head; no dashboard,
    no autoscaler monitor, no log monitor (nothing reads the workers' prints).

    Ray's start has fixed bounds that a machine at load 20 on 2 cores misses: a raylet has 30 s to
    register with the GCS (``ray/_private/node.py``: "The current node timed out during startup").
    So that wait is stretched by the load like every hang bound of the tests (``tests/helpers/load.py``),
    and a raylet that died ends it at once; a start that fails fails the child, and :func:`run_cases`
    starts another.
    """
    import psutil
    from ray._private import services
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": OBJECT_STORE, "include_log_monitor": False}
    original = services.get_node
    services.get_node = _patient(original, hang_bound(30), psutil)
    try:
        cluster = Cluster(
            initialize_head=True, connect=True,
            head_node_args={**node, "include_dashboard": False, "no_monitor": True},
        )  # fmt: skip
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        return cluster
    finally:
        services.get_node = original


def _patient(get_node: Any, bound: float, psutil: Any) -> Any:
    """``get_node`` asked again until the node has registered, for at most ``bound`` seconds, unless a
    raylet this process started has died."""

    def patient_get_node(gcs_address: str, node_id: str) -> Any:
        deadline = time.monotonic() + bound
        while True:
            try:
                return get_node(gcs_address, node_id)
            except RuntimeError:  # not registered yet
                dead = [c for c in psutil.Process().children(recursive=True) if _dead_raylet(c, psutil)]
                if dead or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    return patient_get_node


def _dead_raylet(process: Any, psutil: Any) -> bool:
    try:
        return process.name() == "raylet" and process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
