"""Lightning resumes a shardkit loader from its own checkpoints, exactly (issue 24).

2 gloo ranks (forked by the rank server with torchrun's environment: see
tests/helpers/trainer_runs.py; tests/test_trainers.py runs the example under
Lightning's own launcher), 300 records in 4 TFRecord shards,
``TFRecordDataset(shuffle=True, balance="pad").map(...).shuffle(64)``, batch 8, 2
persistent workers, ``ModelCheckpoint(every_n_train_steps=8, save_on_train_epoch_end=False)``:
one run checkpoints at steps 8, 16 (epoch 0) and 24 (epoch 1, its 5th batch) and is
killed with SIGKILL at step 30 (epoch 1, its 11th batch); its own records up to the
kill are the uninterrupted reference. A fresh launch resumes from step 8 and one from
step 24 with ``trainer.fit(ckpt_path=...)`` and nothing else. For each rank: the
batches after the checkpoint are the reference's, the epoch holds every sample of
the rank once (0 missing, 0 repeated; over both ranks every record once), and the
pipeline of the resumed run makes no sample that was trained on before the
checkpoint (0 re-read). For ``MixedLoader`` and ``StatefulDataLoader``.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.once import once
from tests.helpers.processes import EXAMPLES
from tests.helpers.trainer_runs import launch_ranks, write_example_data

RECORDS, EVERY, KILL_AT = 300, 8, 30
PER_RANK = 150  # samples per rank and epoch
# Batches per rank and epoch: MixedLoader cuts 150 samples into 19; under a StatefulDataLoader
# each of the 2 workers batches its own 75 into 10, the last of 3 samples.
PER_EPOCH = {"mixed": 19, "stateful": 20}
CHECKPOINTS = {8: 0, 24: 1}  # global step -> the epoch it is in (with 19 or 20 batches an epoch)


def launch(*args: str) -> subprocess.CompletedProcess[str]:
    return launch_ranks([str(EXAMPLES / "lightning_train.py"), "--records", str(RECORDS), *args], timeout=300)


@pytest.fixture(scope="module", params=["mixed", "stateful"])
def runs(request, tmp_path_factory) -> tuple[str, Path]:
    """The killed run and one resumed run per checkpoint, for one loader: their record folders."""
    loader = request.param

    def make() -> str:  # once for every xdist worker that runs one of the tests (tests.helpers.once)
        root = tmp_path_factory.mktemp(loader)
        make_runs(loader, root)
        return str(root)

    return loader, Path(once(tmp_path_factory, f"lightning-resume-{loader}", make))


def make_runs(loader: str, root: Path) -> None:
    data, checkpoints = root / "data", root / "checkpoints"
    write_example_data(EXAMPLES / "lightning_train.py", data, RECORDS)
    (root / "killed").mkdir()
    killed = launch(
        *("--loader", loader, "--data", str(data), "--record", str(root / "killed")),
        *("--checkpoint-every", str(EVERY), "--checkpoints", str(checkpoints), "--kill-at", str(KILL_AT)),
    )
    assert killed.returncode != 0 and (root / "killed" / "rank1-epoch1.json").exists(), killed.stderr[-3000:]
    for step in CHECKPOINTS:
        (root / f"resumed{step}").mkdir()
        resumed = launch(
            *("--loader", loader, "--data", str(data), "--record", str(root / f"resumed{step}")),
            *("--resume", str(checkpoints / f"step={step}.ckpt")),
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]


def batches(folder: Path, rank: int, epoch: int) -> list[tuple[int, list[int]]]:
    """``(global step, ids)`` of every batch a rank trained on in an epoch."""
    record = json.loads((folder / f"rank{rank}-epoch{epoch}.json").read_text())
    out, start = [], 0
    for step, size in zip(record["steps"], record["sizes"], strict=True):
        out.append((step, record["ids"][start : start + size]))
        start += size
    assert start == len(record["ids"])
    return out


def made(folder: Path, rank: int, epoch: int) -> list[int]:
    """The ids the pipeline of a run made for a rank in an epoch (every worker)."""
    lines = [line.split() for path in folder.glob(f"made-rank{rank}-*.txt") for line in path.read_text().splitlines()]
    return [int(sample) for made_epoch, sample in lines if int(made_epoch) == epoch]


def ids(trained: list[tuple[int, list[int]]]) -> list[int]:
    return [sample for _, batch in trained for sample in batch]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_lightning_resumes_the_batches_of_an_uninterrupted_run_with_nothing_missing_repeated_or_reread(
    runs, checkpoint
):
    loader, root = runs
    epoch = CHECKPOINTS[checkpoint]
    whole_epoch = []
    for rank in range(2):
        reference = batches(root / "killed", rank, epoch)  # uninterrupted up to the kill
        before = [(s, b) for s, b in reference if s <= checkpoint]
        resumed = batches(root / f"resumed{checkpoint}", rank, epoch)
        assert resumed[0][0] == checkpoint + 1, f"{loader}: rank {rank} resumed at step {resumed[0][0]}"
        assert [b for s, b in resumed if s <= KILL_AT] == [b for s, b in reference if s > checkpoint], (
            f"{loader}, rank {rank}: the batches after step {checkpoint} differ from the uninterrupted run's"
        )
        epoch_ids = ids(before) + ids(resumed)
        assert len(before) + len(resumed) == PER_EPOCH[loader] and len(epoch_ids) == PER_RANK
        assert not [i for i, n in Counter(epoch_ids).items() if n > 1], f"{loader}, rank {rank}: repeated"
        reread = set(made(root / f"resumed{checkpoint}", rank, epoch)) & set(ids(before))
        assert not reread, f"{loader}, rank {rank}: {len(reread)} samples trained before the checkpoint made again"
        whole_epoch += epoch_ids
    assert sorted(whole_epoch) == list(range(RECORDS)), f"{loader}: missing {set(range(RECORDS)) - set(whole_epoch)}"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_after_a_resume_in_epoch_0_epoch_1_is_the_uninterrupted_runs(runs):
    loader, root = runs
    whole = []
    for rank in range(2):
        reference = batches(root / "killed", rank, 1)
        resumed = batches(root / "resumed8", rank, 1)
        assert [b for s, b in resumed if s <= KILL_AT] == [b for _, b in reference], f"{loader}, rank {rank}"
        assert len(resumed) == PER_EPOCH[loader]
        whole += ids(resumed)
    assert sorted(whole) == list(range(RECORDS)), f"{loader}: epoch 1 after the resume is not every record once"


# -- a checkpoint saved after fit() ended, and torchdata's own loader (issue 36) ------------------------

SMALL = 64  # records: 32 per rank, 4 batches of 8 a rank and epoch under either loader


def small_run(root: Path, name: str, loader: str, *args: str) -> subprocess.CompletedProcess[str]:
    """One launch of the example over ``root/data`` (``SMALL`` records), recording in ``root/name``."""
    if not (root / "data").exists():
        write_example_data(EXAMPLES / "lightning_train.py", root / "data", SMALL)
    (root / name).mkdir()
    common = ["--loader", loader, "--data", str(root / "data"), "--records", str(SMALL)]
    script = str(EXAMPLES / "lightning_train.py")
    return launch_ranks([script, *common, "--record", str(root / name), *args], timeout=300)


def trained(folder: Path, rank: int) -> list[tuple[int, list[int]]]:
    """``(global step, ids)`` of every batch a rank trained on in a run, in every epoch file."""
    epochs = sorted(int(path.stem.rsplit("epoch", 1)[1]) for path in folder.glob(f"rank{rank}-epoch*.json"))
    return [batch for epoch in epochs for batch in batches(folder, rank, epoch)]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("loader", ["mixed", "stateful"])
def test_a_checkpoint_saved_after_fit_ended_at_max_steps_resumes_after_its_last_batch(tmp_path, loader):
    # fit(max_steps=2) ends, Lightning's teardown drops the loader's iterator, then
    # trainer.save_checkpoint(...): the resumed fit must go on with the epoch's batch 3.
    checkpoint = str(tmp_path / "after-fit.ckpt")
    first = small_run(tmp_path, "first", loader, "--epochs", "-1", "--max-steps", "2", "--save", checkpoint)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = small_run(tmp_path, "resumed", loader, "--epochs", "-1", "--max-steps", "4", "--resume", checkpoint)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = []
    for rank in range(2):
        before, after = trained(tmp_path / "first", rank), trained(tmp_path / "resumed", rank)
        assert [step for step, _ in before] == [1, 2] and [step for step, _ in after] == [3, 4], f"rank {rank}"
        epoch_ids = ids(before) + ids(after)
        assert len(epoch_ids) == len(set(epoch_ids)) == SMALL // 2, f"{loader}, rank {rank}: repeated or missing"
        whole += epoch_ids
    assert sorted(whole) == list(range(SMALL))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchdatas_own_loader_under_lightning_is_refused_on_rank_1_saying_why_and_naming_the_fix(tmp_path):
    # torchdata's StatefulDataLoader saves the calling rank's state; Lightning writes rank 0's checkpoint.
    checkpoints = tmp_path / "checkpoints"
    saving = ("--epochs", "1", "--checkpoint-every", "2", "--checkpoints", str(checkpoints), "--max-steps", "3")
    first = small_run(tmp_path, "first", "torchdata", *saving)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = small_run(tmp_path, "resumed", "torchdata", "--epochs", "1", "--resume", str(checkpoints / "step=2.ckpt"))
    assert resumed.returncode != 0
    why = (
        "the state was saved with rank 0, but here it is 1: it holds rank 0's position, not this rank's. Trainers "
        "save rank 0's checkpoint only (Lightning's save_checkpoint"
    )
    fix = "Fix: build the loader with shardkit.StatefulDataLoader (import it instead of torchdata's"
    assert why in resumed.stderr and fix in resumed.stderr and "or shardkit.MixedLoader" in resumed.stderr, (
        resumed.stderr[-3000:]
    )
