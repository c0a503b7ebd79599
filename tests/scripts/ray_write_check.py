"""The Ray driver of tests/test_ray_write.py, run in a child process of the test (``tests/helpers/ray_cluster.py``):
one 2-node cluster, then each case on it, faults injected for real: a write task that raises on its first
attempt, a worker SIGKILLed mid-shard, ``shardkit convert --ray`` against the cluster, and last the added
node removed mid-write. Each case writes under its own folder and returns plain data (counts, markers,
exit codes, modification times taken before a refused run); the test asserts on those and on the files.

    python -m tests.scripts.ray_write_check DIR
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray

from shardkit.ray import ShardSink, write_shards
from tests.helpers.load import hang_bound
from tests.helpers.processes import run_python
from tests.helpers.ray_cluster import drive
from tests.helpers.ray_faults import FaultAt, rows, tfrecord_sources

FORMATS = ("tar", "parquet", "jsonl", "megatron")


def dataset(blocks: int = 6) -> Any:
    return ray.data.from_items(rows(), override_num_blocks=blocks)


def plain(cluster: Any, folder: Path) -> dict[str, Any]:
    shards = write_shards(dataset(), str(folder / "out"), max_records=40)
    return {"num_records": [int(n) for n in shards.num_records]}


def raises_once(cluster: Any, folder: Path) -> dict[str, Any]:
    fault = FaultAt(str(folder / "raised"), at=130, fault="raise")
    write_shards(dataset(), str(folder / "out"), to_records=fault, max_records=40,
                 ray_remote_args={"retry_exceptions": [ConnectionError]})  # fmt: skip
    return {}


def killed(cluster: Any, folder: Path) -> dict[str, Any]:
    write_shards(
        dataset(), str(folder / "out"), to_records=FaultAt(str(folder / "killed"), 170, "kill"), max_records=40
    )
    return {}


def same_bytes(cluster: Any, folder: Path) -> dict[str, Any]:
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    try:
        write_shards(ray.data.from_items(rows(), override_num_blocks=1), str(folder / "ray"), max_records=70)
        raw = [{"record": r["payload"]} for r in rows()]
        write_shards(ray.data.from_items(raw, override_num_blocks=3), str(folder / "raw"), column="record",
                     max_records=1000)  # fmt: skip
    finally:
        context.execution_options.preserve_order = False
    return {}


def every_format(cluster: Any, folder: Path) -> dict[str, Any]:
    counts = {}
    for name in FORMATS:
        data = [{"__key__": f"{i:05d}", "txt": f"row {i}"} for i in range(50)] if name == "tar" else (
            [{"input_ids": list(range(i % 7 + 1))} for i in range(50)] if name == "megatron"
            else [{"id": i, "text": f"row {i}"} for i in range(50)]
        )  # fmt: skip
        shards = write_shards(ray.data.from_items(data, override_num_blocks=3), str(folder / name), format=name,
                              max_records=20)  # fmt: skip
        counts[name] = [int(n) for n in shards.num_records]
    return counts


def second_run(cluster: Any, folder: Path) -> dict[str, Any]:
    out = str(folder / "out")
    write_shards(dataset(blocks=2), out, max_records=100)
    before = mtimes(out)
    refused = []
    for write in (lambda: write_shards(dataset(blocks=2), out, max_records=100),
                  lambda: dataset(blocks=2).write_datasink(ShardSink(out, max_records=100))):  # fmt: skip
        try:
            write()
            refused.append(None)
        except Exception as error:  # noqa: BLE001 - the test asserts on which error and its message
            refused.append({"type": type(error).__name__, "message": str(error)})
    return {"before": before, "refused": refused}


def convert(cluster: Any, folder: Path) -> dict[str, Any]:
    sources = tfrecord_sources(folder)
    target = str(folder / "ray" / "rows-%05d.parquet")
    first = run_convert(sources, target, "--format", "parquet", "--max-records", "60", "--ray", cluster.address)
    before = mtimes(str(folder / "ray"))
    again = run_convert(sources, target, "--format", "parquet", "--ray", cluster.address)
    return {"first": first, "again": again, "before": before}


def convert_corrupt(cluster: Any, folder: Path) -> dict[str, Any]:
    tfrecord_sources(folder)
    damaged = folder / "src" / "train-00001.tfrecord"
    data = bytearray(damaged.read_bytes())
    data[2000] ^= 0xFF  # inside a record's payload: its CRC no longer matches
    damaged.write_bytes(bytes(data))
    target = str(folder / "ray" / "rows-%05d.tfrecord")
    return run_convert(
        str(folder / "src" / "train-*.tfrecord"), target, "--format", "tfrecord", "--ray", cluster.address
    )


def node_removed(cluster: Any, folder: Path) -> dict[str, Any]:
    """Last: the tests before it share the cluster's added node."""
    marker = folder / "stalled"
    added = next(n for n in cluster.list_all_nodes() if n is not cluster.head_node)
    errors: list[str] = []

    def write() -> None:
        try:
            stall = FaultAt(str(marker), at=3, fault="stall", node_id=added.node_id)  # mid-shard: 3 of 25 rows
            write_shards(dataset(blocks=8), str(folder / "out"), to_records=stall, max_records=25)
        except BaseException as error:  # noqa: BLE001 - reported to the test
            errors.append(repr(error))

    thread = threading.Thread(target=write, daemon=True)  # one still stuck must not keep the driver
    thread.start()
    deadline = time.monotonic() + hang_bound(120)
    while not marker.exists() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    stalled = marker.exists()
    if stalled:
        cluster.remove_node(added)
    thread.join(hang_bound(240))
    return {"stalled": stalled, "finished": not thread.is_alive(), "errors": errors}


def run_convert(*argv: str) -> dict[str, Any]:
    done = run_python("-m", "shardkit", "convert", *argv, check=False, timeout=240)
    return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr[-5000:]}


def mtimes(folder: str) -> dict[str, int]:
    return {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in sorted(os.listdir(folder))}


CASES = [
    ("plain", plain), ("raises_once", raises_once), ("killed", killed), ("same_bytes", same_bytes),
    ("every_format", every_format), ("second_run", second_run), ("convert", convert),
    ("convert_corrupt", convert_corrupt), ("node_removed", node_removed),
]  # fmt: skip


if __name__ == "__main__":
    ray.data.DataContext.get_current().enable_progress_bars = False
    drive(Path(sys.argv[1]), CASES)
