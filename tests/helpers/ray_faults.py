"""Faults injected into real Ray write tasks, through ``ShardSink``'s ``to_records`` hook (it runs inside the
write task, row by row, while a shard is being written). A marker file tells the first attempt from a retry:
Ray gives a retried task the same rows, so the fault fires once, at the same row, and the retry runs clean.
Module-level classes, so Ray's workers import them by name (tests/ is on the driver's sys.path, which Ray
hands to its workers)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardkit.ray import record_of
from shardkit.writer import ShardWriter

ROWS = 300
"""Rows of the test dataset: ids 0..299, each with a payload of its own."""


def rows() -> list[dict[str, Any]]:
    return [{"id": i, "payload": bytes([i % 251]) * (50 + i % 37)} for i in range(ROWS)]


class FaultAt:
    """``to_records`` that yields each row's tf.Example and, the first time row ``at`` comes, does ``fault``:
    ``"raise"`` (a ConnectionError, which the test's ``retry_exceptions`` retries), ``"kill"`` (SIGKILL of the
    worker process), or ``"stall"``: at the ``at``-th row of any task on node ``node_id``, touch the marker and
    wait to be killed with the node (a retry elsewhere runs clean)."""

    def __init__(self, marker: str, at: int, fault: str, node_id: str | None = None) -> None:
        self.marker, self.at, self.fault, self.node_id = marker, at, fault, node_id
        self.seen = 0  # rows this task has seen (each task unpickles its own copy)

    def __call__(self, row: dict[str, Any]) -> Iterator[bytes]:
        self.seen += 1
        if self.fault == "stall" and self.seen == self.at:
            self._stall()
        elif row["id"] == self.at and self._first():
            if self.fault == "raise":
                raise ConnectionError(f"injected: the store hung up at row {self.at}")
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        yield record_of(row, "tfrecord")

    def _first(self) -> bool:
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def _stall(self) -> None:
        import ray

        if ray.get_runtime_context().get_node_id() == self.node_id:
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)  # the driver removes this node now; the driver's own bound ends a run where it does not


def tfrecord_sources(folder: Path) -> str:
    """The test rows as tf.Examples in 3 TFRecord files under ``folder/src`` (for ``convert --ray``); their glob."""
    with ShardWriter(str(folder / "src" / "train-%05d.tfrecord"), max_records=100) as writer:
        for row in rows():
            writer.write(record_of(row, "tfrecord"))
    return str(folder / "src" / "train-*.tfrecord")
