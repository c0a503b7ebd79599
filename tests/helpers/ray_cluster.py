"""A 2-node Ray cluster on this machine for the tests (``ray.cluster_utils.Cluster``: a head and one
more node, each a raylet of its own with one CPU), started patiently on a loaded machine, and one at a
time over the session's xdist workers: two clusters at once on 2 cores is what made Ray's fixed start-up
bounds fail, and ``ray.init()`` without an address would join the other one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.helpers.load import hang_bound
from tests.helpers.once import one_at_a_time

OBJECT_STORE = 80 * 1024 * 1024  # bytes per node (Ray's smallest is 75 MiB): the tests move little through it


@contextmanager
def ray_cluster(factory: pytest.TempPathFactory) -> Iterator[Any]:
    """:func:`start_cluster` while holding the session's ``ray`` lock; shut down after."""
    import ray

    with one_at_a_time(factory, "ray-cluster"):
        started = time.monotonic()
        cluster = start_cluster()
        print(f"\nRay cluster of 2 nodes up in {time.monotonic() - started:.1f} s")
        try:
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


def add_node(cluster: Any) -> None:
    """Add a one-CPU node again (a test removed it), as patiently as :func:`start_cluster` adds one."""
    import psutil
    from ray._private import services

    original = services.get_node
    services.get_node = _patient(original, hang_bound(30), psutil)
    try:
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
        cluster.wait_for_nodes()
    finally:
        services.get_node = original


def start_cluster(tries: int = 3) -> Any:
    """A head node and one more node, one CPU each, the driver connected to the head; no dashboard.

    Ray's start has fixed bounds that a machine at load 20 on 2 cores misses: a raylet has 30 s to
    register with the GCS (``ray/_private/node.py``: "The current node timed out during startup"),
    and a raylet whose metrics agent has not written its port within 15 s aborts (ray-project/ray
    #62883). So the first wait is stretched by the load like every hang bound of the tests
    (``tests/helpers/load.py``), a raylet that died ends it at once, and the start is tried again
    after ending (by pid) the processes the failed one made, ``tries`` times in all.
    """
    import psutil
    from ray._private import services
    from ray.cluster_utils import Cluster

    original = services.get_node
    services.get_node = _patient(original, hang_bound(30), psutil)
    try:
        for attempt in range(1, tries + 1):
            before = {child.pid for child in psutil.Process().children(recursive=True)}
            try:
                cluster = Cluster(
                    initialize_head=True,
                    connect=True,
                    head_node_args={"num_cpus": 1, "object_store_memory": OBJECT_STORE, "include_dashboard": False},
                )
                cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
                cluster.wait_for_nodes()
                return cluster
            except Exception:  # Ray raises a bare Exception for a node that did not come up
                if attempt == tries:
                    raise
                _end_new_children(psutil, before)
    finally:
        services.get_node = original
    raise AssertionError("unreachable")


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


def _end_new_children(psutil: Any, before: set[int]) -> None:
    """SIGKILL this process's children (at any depth) that were not in ``before``, and reap them."""
    import ray

    ray.shutdown()
    new = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
    for child in new:
        child.kill()
    psutil.wait_procs(new, timeout=30)
