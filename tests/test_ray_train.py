"""Training under Ray Train: a worker lost mid-epoch, Ray restarts the group, the loader resumes exactly.

``examples/ray_train.py``'s ``TorchTrainer`` runs three times on one Ray cluster (a head node and a second
node on this machine): 2 CPU workers, a ``MixedLoader`` over 128 records in 4 TFRecord shards, batches of
8, 2 epochs, a checkpoint every few steps with every rank's loader state (``shardkit.integrations.ray``),
``FailureConfig(max_failures=1)``. The Ray driver is a child process (tests/scripts/ray_train_check.py,
through ``tests/helpers/ray_cluster.py``): a raylet that dies takes its driver down, and that must not be
the pytest worker. Each run writes each rank's ids per step; the tests compare them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray (the dev extra's ray[data,train]) does not install on this platform")

from tests.helpers.ray_cluster import case_result, run_cases  # noqa: E402
from tests.helpers.ray_train import (  # noqa: E402
    BATCH_SIZE,
    EPOCHS,
    EVERY,
    KILL_AT,
    LOSE_AT,
    RECORDS,
    STEPS_PER_EPOCH,
    ids_per_epoch,
    read_record,
    steps_of,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # one child process: a cluster and three fits

STEPS = EPOCHS * STEPS_PER_EPOCH
EVERY_EPOCH_ONCE = {epoch: Counter(range(RECORDS)) for epoch in range(EPOCHS)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The driver's run: every case's result, and the folder each case wrote under."""
    return run_cases(tmp_path_factory, "ray_train_check", timeout=900)


def _fit(run, name: str) -> Path:
    """Case ``name``'s folder, after checking that its fit ended without error."""
    result = case_result(run, name)
    assert result["error"] is None, result["error"]
    return Path(run["folder"]) / name


@pytest.fixture(scope="module")
def control(run):
    """The uninterrupted run's record: each rank's ids per step."""
    return read_record(_fit(run, "control") / "record")


def _checkpoints_before(step: int) -> set[int]:
    return set(range(EVERY, step + 1, EVERY))


def test_the_uninterrupted_run_trains_every_record_once_per_epoch_with_the_ranks_ray_train_gives(control):
    assert sorted(control) == [0, 1]
    for rank, lines in control.items():
        assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
        assert {line["world_size"] for line in lines} == {2} and {line["resumed_from"] for line in lines} == {None}
    assert ids_per_epoch(control[0] + control[1]) == EVERY_EPOCH_ONCE


def test_a_worker_killed_mid_epoch_is_restarted_by_ray_and_resumes_with_exactly_the_control_runs_batches(run, control):
    """Rank 1 SIGKILLs itself after step 11 (epoch 1) on the first attempt; Ray starts the group again
    from the last checkpoint it holds (step 9, or an earlier one: Ray can lose a report the controller had
    not polled when the worker died). From that step on every rank's batches are the control's, id for
    id, and the checkpointed steps plus the resumed ones train every record once per epoch."""
    folder = _fit(run, "killed")
    assert (folder / "killed").exists()  # the fault happened
    record = read_record(folder / "record")
    resumed_from = {line["resumed_from"] for rank in (0, 1) for line in record[rank]} - {None}
    assert len(resumed_from) == 1 and resumed_from <= _checkpoints_before(KILL_AT), resumed_from  # one restart
    (checkpoint,) = resumed_from
    print(f"\nrank 1 killed after step {KILL_AT}; Ray restarted from the checkpoint of step {checkpoint}")
    for rank in (0, 1):
        first, resumed = steps_of(record[rank], None), steps_of(record[rank], checkpoint)
        assert sorted(resumed) == list(range(checkpoint + 1, STEPS + 1))
        assert resumed == {step: control[rank][step - 1]["ids"] for step in resumed}
        assert {s: first[s] for s in range(1, checkpoint + 1)} == {
            s: control[rank][s - 1]["ids"] for s in range(1, checkpoint + 1)
        }
    kept = [
        line
        for rank in (0, 1)
        for line in record[rank]
        if (line["resumed_from"] is None) == (line["step"] <= checkpoint)
    ]
    assert ids_per_epoch(kept) == EVERY_EPOCH_ONCE


def test_a_node_lost_mid_epoch_resumes_elastically_on_the_one_worker_left_with_every_record_once(run):
    """``ScalingConfig(num_workers=(1, 2))``: after step 7 (epoch 0) the second node is removed with its
    worker; Ray starts again on the one node left, from the last checkpoint it holds (step 6 or 3), saved
    by 2 ranks. The rank states merge: the rest of epoch 0 and all of epoch 1 come on 1 worker, every
    record once."""
    folder = _fit(run, "elastic")
    assert (folder / "lost-node").exists()  # the node was lost
    record = read_record(folder / "record")
    resumed = [line for line in record[0] if line["resumed_from"] is not None]
    restarts = {(line["resumed_from"], line["world_size"]) for line in resumed}
    assert restarts in [{(c, 1)} for c in sorted(_checkpoints_before(LOSE_AT))], restarts  # at a checkpoint, 1 worker
    ((checkpoint, _),) = restarts
    print(f"\nnode lost after step {LOSE_AT}; Ray restarted on 1 worker from the checkpoint of step {checkpoint}")
    assert 1 not in record or all(line["resumed_from"] is None for line in record[1])
    lines = [line for rank in record for line in record[rank]]
    first = [line for line in lines if line["resumed_from"] is None and line["step"] <= checkpoint]
    assert {line["world_size"] for line in first} == {2}
    assert ids_per_epoch(first + resumed) == EVERY_EPOCH_ONCE
    # checkpoint steps of 2 batches, then on 1 worker the rest of epoch 0 and 2 x STEPS_PER_EPOCH in epoch 1.
    rest = (RECORDS - 2 * BATCH_SIZE * checkpoint) // BATCH_SIZE
    assert [line["step"] for line in resumed] == list(
        range(checkpoint + 1, checkpoint + 1 + rest + 2 * STEPS_PER_EPOCH)
    )
