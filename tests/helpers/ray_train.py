"""Ray Train runs for the tests: the example loaded, faults, records.

The runs happen in tests/scripts/ray_train_check.py, a child process of the test, on a 2-node cluster
(:mod:`tests.helpers.ray_cluster`): a head node and a second node, each a raylet of its own with one CPU,
so Ray Train's two workers sit one on each node and the second node can be lost for real
(``remove_node`` stops its raylet and every process on it). The hooks run inside Ray Train's workers
after each step; this module and the example are pickled by value, so the workers need not import
``tests``. The test reads the records the runs wrote.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tests.helpers.load import hang_bound
from tests.helpers.processes import EXAMPLES

RECORDS, BATCH_SIZE, EPOCHS = 128, 8, 2
"""The runs' data (``examples/ray_train.py``'s), its batches per rank and its epochs."""
STEPS_PER_EPOCH = RECORDS // (2 * BATCH_SIZE)
"""Steps of an epoch on 2 ranks."""
EVERY = 3
"""A checkpoint every this many steps."""
KILL_AT = 11
"""Rank 1 SIGKILLs itself after this step (epoch 1), on the first attempt."""
LOSE_AT = 7
"""The second node is lost after this step (epoch 0), on the first attempt."""


def load_example() -> Any:
    """``examples/ray_train.py`` as a module whose functions Ray ships to its workers by value."""
    import ray.cloudpickle

    spec = importlib.util.spec_from_file_location("shardkit_example_ray_train", EXAMPLES / "ray_train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return module


def read_record(folder: Path) -> dict[int, list[dict[str, Any]]]:
    """Each rank's record lines (``examples/ray_train.py --record``), in the order written."""
    lines: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        lines[rank] = [json.loads(line) for line in path.read_text().splitlines()]
    return lines


def steps_of(lines: list[dict[str, Any]], resumed_from: int | None) -> dict[int, list[int]]:
    """The ids trained at each step by the attempt that resumed from ``resumed_from`` (None: the first)."""
    return {line["step"]: line["ids"] for line in lines if line["resumed_from"] == resumed_from}


def ids_per_epoch(kept: list[dict[str, Any]]) -> dict[int, Counter[int]]:
    """How often each id was trained, per epoch, over the record lines ``kept``."""
    counts: dict[int, Counter[int]] = {}
    for line in kept:
        counts.setdefault(line["epoch"], Counter()).update(line["ids"])
    return counts


class LoseNodeOnce:
    """After step ``step``, the worker that is not on the head node writes its node's id to ``marker``
    and waits: the test removes that node (:func:`remove_node_when_asked`), which ends the worker with
    it. On the first attempt only (the marker exists after)."""

    def __init__(self, step: int, head_node: str, marker: str, wait: float) -> None:
        self.step, self.head_node, self.marker, self.wait = step, head_node, marker, wait

    def __call__(self, step: int, rank: int) -> None:
        import ray

        node = ray.get_runtime_context().get_node_id()
        if step != self.step or node == self.head_node or os.path.exists(self.marker):
            return
        partial = f"{self.marker}.partial"
        Path(partial).write_text(node)
        os.replace(partial, self.marker)
        time.sleep(self.wait)  # the node is removed long before: this process ends with it
        raise RuntimeError(f"node {node} was not removed within {self.wait:.0f} s")


def remove_node_when_asked(cluster: Any, marker: Path, stop: threading.Event, bound: float = 300) -> threading.Thread:
    """A thread that waits for ``marker`` (a node id, written by :class:`LoseNodeOnce`) and removes that node."""

    def watch() -> None:
        deadline = time.monotonic() + hang_bound(bound)
        while not stop.is_set() and time.monotonic() < deadline:
            if marker.exists():
                node_id = marker.read_text()
                node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
                cluster.remove_node(node)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, name="remove-node", daemon=True)
    thread.start()
    return thread
