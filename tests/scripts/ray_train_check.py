"""The Ray driver of tests/test_ray_train.py, run in a child process of the test (``tests/helpers/ray_cluster.py``):
one 2-node cluster, then ``examples/ray_train.py``'s ``TorchTrainer`` on it three times: uninterrupted
(the control), with rank 1 SIGKILLed mid-epoch, and elastic with the second node removed mid-epoch.
Each run writes each rank's ids per step under its case's folder (``record/rank{r}.jsonl``) and returns
whether it failed and whether its fault happened; the test compares the records.

    python -m tests.scripts.ray_train_check DIR
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.helpers.load import hang_bound
from tests.helpers.ray_cluster import drive
from tests.helpers.ray_train import EVERY, KILL_AT, LOSE_AT, LoseNodeOnce, load_example, remove_node_when_asked

example = load_example()


def fit(folder: Path, **options: Any) -> dict[str, Any]:
    """One ``TorchTrainer.fit()`` over the case's record folder; its error (None) and how long it took."""
    (folder / "record").mkdir()
    started = time.monotonic()
    result = example.run(
        str(folder.parent / "data" / example.MANIFEST), str(folder / "storage"), record=str(folder / "record"),
        every=EVERY, name=folder.name, **options,
    )  # fmt: skip
    seconds = time.monotonic() - started
    print(f"{folder.name}: TorchTrainer.fit() took {seconds:.1f} s", flush=True)
    return {"error": None if result.error is None else repr(result.error), "fit_seconds": seconds}


def control(cluster: Any, folder: Path) -> dict[str, Any]:
    return fit(folder)


def killed(cluster: Any, folder: Path) -> dict[str, Any]:
    """Rank 1 SIGKILLs itself after step ``KILL_AT``, on the first attempt."""
    return fit(folder, hook=example.KillOnce(KILL_AT, 1, str(folder / "killed")))


def elastic(cluster: Any, folder: Path) -> dict[str, Any]:
    """``num_workers=(1, 2)``; after step ``LOSE_AT`` the second node is removed with its worker. Last: the
    cluster has one node after it."""
    marker = folder / "lost-node"
    hook = LoseNodeOnce(LOSE_AT, cluster.head_node.node_id, str(marker), wait=hang_bound(300))
    stop = threading.Event()
    watcher = remove_node_when_asked(cluster, marker, stop)
    try:
        return fit(folder, workers=(1, 2), hook=hook)
    finally:
        stop.set()
        watcher.join()


if __name__ == "__main__":
    data = Path(sys.argv[1]) / "data"
    data.mkdir()
    example.write_dataset(str(data))
    drive(Path(sys.argv[1]), [("control", control), ("killed", killed), ("elastic", elastic)])
