"""Resume through the trainers' own checkpoints (issue 24): Accelerate's
``save_state``/``load_state`` with ``register_for_checkpointing(loader)``, and
the Hugging Face Trainer's ``train(resume_from_checkpoint=...)`` with
:class:`shardkit.integrations.hf.ResumeCallback`.

Slow tests: one run per trainer (2 gloo ranks with torchrun's environment, forked
by the rank server of tests/helpers/trainer_runs.py, 300 records in 4
TFRecord shards, ``TFRecordDataset(shuffle=True, balance="pad").map(...).shuffle(64)``,
batch 8, 2 persistent workers: 19 steps per epoch) checkpoints every 8 steps
(steps 8 and 16 in epoch 0, 24 and 32 in epoch 1) and SIGKILLs itself after
step 35; what it trained up to the kill is the uninterrupted reference. One
fresh torchrun per checkpoint resumes from it and trains to the end. Fast
tests: the callback's files and their checks, in process.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import shardkit
from shardkit.errors import StateError
from shardkit.trainers import TrainerError
from tests.helpers.once import once
from tests.helpers.processes import EXAMPLES
from tests.helpers.shards import synthetic_read, synthetic_shards
from tests.helpers.trainer_runs import launch_ranks, recorded_reads, recorded_steps

RECORDS, STEPS_PER_EPOCH, EPOCHS, KILL_AT = 300, 19, 2, 35
CHECKPOINTS = {0: 8, 1: 24}  # epoch: a checkpoint in it
TRAINERS = ["accelerate_train.py", "hf_trainer.py"]
RUN = "run-a"  # the run identity the in-process tests save under


# -- ResumeCallback's files, in process ------------------------------------------------


def small_loader() -> shardkit.MixedLoader:
    dataset = shardkit.ShardedDataset(synthetic_shards([20, 20]), synthetic_read, shuffle=True).shuffle(8)
    return shardkit.MixedLoader(dataset, batch_size=4, collate_fn=list)


def test_a_rank_state_file_is_plain_json_written_whole_and_loads_back_into_a_fresh_loader(tmp_path):
    from shardkit.integrations.hf import read_loader_state, write_loader_state

    loader, fresh = small_loader(), small_loader()
    batches = iter(loader)
    head = [next(batches) for _ in range(3)]
    path = write_loader_state(str(tmp_path / "checkpoint-3"), loader.state_dict(), 3, rank=0, world_size=1, run=RUN)
    assert os.listdir(tmp_path / "checkpoint-3") == [Path(path).name] == ["shardkit_loader_rank0.json"]
    record = json.loads(Path(path).read_text())  # plain JSON: no pickle anywhere
    assert (record["global_step"], record["rank"], record["world_size"]) == (3, 0, 1)
    fresh.load_state_dict(read_loader_state(str(tmp_path / "checkpoint-3"), 3, rank=0, world_size=1))
    rest = list(fresh)
    assert rest == list(batches) and sorted(s for b in head + rest for s in b) == sorted(small_loader().dataset)


def test_a_missing_or_foreign_rank_file_is_an_error_naming_the_file_not_a_silent_restart(tmp_path):
    from shardkit.integrations.hf import read_loader_state, write_loader_state

    folder = str(tmp_path / "checkpoint-8")
    with pytest.raises(StateError, match=r"shardkit_loader_rank1\.json is missing.*ResumeCallback"):
        read_loader_state(folder, 8, rank=1, world_size=2)
    write_loader_state(folder, {"x": 1}, 16, rank=1, world_size=2, run=RUN)  # copied from checkpoint-16
    with pytest.raises(StateError, match=r"global step 16, rank 1 of 2, but the Trainer resumes global step 8"):
        read_loader_state(folder, 8, rank=1, world_size=2)
    write_loader_state(folder, {"x": 1}, 8, rank=0, world_size=2, run=RUN)
    os.replace(f"{folder}/shardkit_loader_rank0.json", f"{folder}/shardkit_loader_rank1.json")  # rank 0's, renamed
    with pytest.raises(StateError, match=r"rank 0 of 2.*must be rank 1's"):
        read_loader_state(folder, 8, rank=1, world_size=2)
    Path(folder, "shardkit_loader_rank1.json").write_text("{not json")
    with pytest.raises(StateError, match="is not a loader state written by ResumeCallback"):
        read_loader_state(folder, 8, rank=1, world_size=2)


def test_on_another_world_size_every_rank_file_is_read_into_one_ranks_node(tmp_path):
    from shardkit.integrations.hf import read_loader_state, write_loader_state

    folder = str(tmp_path / "checkpoint-8")
    for rank in range(2):
        write_loader_state(folder, {"rank": rank}, 8, rank=rank, world_size=2, run=RUN)
    node = read_loader_state(folder, 8, rank=0, world_size=1)
    assert node["kind"] == "ranks" and node["states"] == [{"rank": 0}, {"rank": 1}]
    os.remove(f"{folder}/shardkit_loader_rank1.json")
    with pytest.raises(StateError, match=r"rank1\.json is missing"):
        read_loader_state(folder, 8, rank=0, world_size=3)


def test_files_of_two_runs_read_as_one_ranks_node_are_a_state_error_naming_both_runs(tmp_path):
    from shardkit.integrations.hf import read_loader_state, write_loader_state

    folder = str(tmp_path / "checkpoint-8")
    for rank in range(2):  # run-a saves on 2 ranks; run-b's rank 0 saves into the same folder, its rank 1 is killed
        write_loader_state(folder, {"rank": rank}, 8, rank=rank, world_size=2, run=RUN)
    write_loader_state(folder, {"rank": 0}, 8, rank=0, world_size=2, run="run-b")
    with pytest.raises(StateError, match=r"holds the loader states of 2 saves") as info:
        read_loader_state(folder, 8, rank=0, world_size=1)
    message = str(info.value)
    assert "shardkit_loader_rank0.json of run run-b, 2 ranks, step 8" in message
    assert "shardkit_loader_rank1.json of run run-a, 2 ranks, step 8" in message and "twice" in message


def older_file(folder: Path, rank: int, world_size: int, step: int = 8) -> None:
    """A loader state as shardkit wrote it before the run was saved (version 1)."""
    record = {"format": "shardkit.integrations.hf.loader_state", "version": 1, "global_step": step, "rank": rank,
              "world_size": world_size, "state": {"rank": rank}}  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"shardkit_loader_rank{rank}.json").write_text(json.dumps(record))


def test_older_files_without_a_run_load_when_they_agree_and_beside_a_newer_file_are_refused(tmp_path):
    from shardkit.integrations.hf import read_loader_state, write_loader_state

    folder = tmp_path / "checkpoint-8"
    for rank in range(2):
        older_file(folder, rank, world_size=2)
    assert read_loader_state(str(folder), 8, rank=1, world_size=2) == {"rank": 1}
    assert read_loader_state(str(folder), 8, rank=0, world_size=1)["states"] == [{"rank": 0}, {"rank": 1}]
    write_loader_state(str(folder), {"rank": 1}, 8, rank=1, world_size=2, run=RUN)
    with pytest.raises(StateError, match=r"rank0\.json of an older shardkit's run \(version 1, no run saved\)"):
        read_loader_state(str(folder), 8, rank=0, world_size=1)
    newer = folder / "shardkit_loader_rank1.json"
    newer.write_text(json.dumps({**json.loads(newer.read_text()), "run": 5}))
    with pytest.raises(StateError, match=r"field 'run' must be a non-empty str"):
        read_loader_state(str(folder), 8, rank=1, world_size=2)


def test_a_state_that_is_not_plain_data_is_refused_and_leaves_no_file(tmp_path):
    from shardkit.integrations.hf import write_loader_state

    with pytest.raises(StateError, match="not plain JSON data.*never pickle"):
        write_loader_state(str(tmp_path), {"x": object()}, 1, rank=0, world_size=1, run=RUN)
    assert os.listdir(tmp_path) == []


def test_the_callback_sets_ignore_data_skip_and_refuses_a_resume_that_would_skip(tmp_path):
    from transformers.trainer_callback import TrainerControl, TrainerState
    from transformers.training_args import TrainingArguments

    from shardkit.integrations.hf import ResumeCallback

    # Without __post_init__, which imports transformers' whole modeling stack (torch._dynamo,
    # DTensor: 3 s of CPU) for its reporting integrations; the field's default is the class's.
    args = TrainingArguments.__new__(TrainingArguments)
    callback = ResumeCallback(small_loader())
    assert args.ignore_data_skip is False
    callback.on_init_end(args, TrainerState(), TrainerControl())
    assert args.ignore_data_skip is True
    args.ignore_data_skip = False  # e.g. the callback was added after the Trainer was built
    with pytest.raises(TrainerError, match=r"ignore_data_skip=False.*Trainer\(callbacks=\[ResumeCallback"):
        callback.on_train_begin(args, TrainerState(global_step=8), TrainerControl())
    callback.on_train_begin(args, TrainerState(global_step=0), TrainerControl())  # a fresh run loads nothing
    with pytest.raises(TypeError, match="state_dict"):
        ResumeCallback(object())


def test_import_shardkit_needs_no_transformers(plain_import):
    assert plain_import["transformers imported"] is False  # a new interpreter, after shardkit.MixedLoader


# -- 2 ranks, killed after a checkpoint, resumed in a fresh torchrun ---------------------------


def run(trainer: str, folder: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    (folder / "record").mkdir(parents=True, exist_ok=True)
    args = ["--records", str(RECORDS), "--data", str(folder.parent / "data"), "--record", str(folder / "record")]
    return launch_ranks([str(EXAMPLES / trainer), *args, *extra], timeout=300)


@pytest.fixture(scope="module", params=TRAINERS)
def killed(request, tmp_path_factory) -> tuple[str, Path]:
    """One run of ``request.param`` that checkpoints every 8 steps and is SIGKILLed after step 35."""
    trainer = request.param

    def make() -> str:  # once for every xdist worker that runs one of the tests (tests.helpers.once)
        folder = tmp_path_factory.mktemp(trainer.removesuffix(".py")) / "killed"
        done = run(trainer, folder, "--checkpoints", str(folder / "checkpoints"), "--checkpoint-every", "8",
                   "--kill-at", str(KILL_AT))  # fmt: skip
        assert done.returncode != 0 and "SIGKILL" in done.stderr, done.stderr[-3000:]
        for rank in range(2):
            assert sorted(recorded_steps(folder / "record", rank)) == list(range(1, KILL_AT + 1))
        return str(folder)

    return trainer, Path(once(tmp_path_factory, f"killed-{trainer}", make))


@pytest.mark.slow
@pytest.mark.parametrize("epoch", sorted(CHECKPOINTS))
def test_a_killed_run_resumed_from_its_checkpoint_trains_exactly_what_it_would_have_with_nothing_read_twice(
    killed, epoch
):
    trainer, folder = killed
    checkpoint = CHECKPOINTS[epoch]
    resumed = folder.parent / f"resumed-{checkpoint}"
    done = run(trainer, resumed, "--checkpoints", str(resumed / "checkpoints"),
               "--resume", str(folder / "checkpoints" / f"checkpoint-{checkpoint}"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    trained_before, epoch_ids = [], []
    for rank in range(2):
        before, after = recorded_steps(folder / "record", rank), recorded_steps(resumed / "record", rank)
        assert sorted(after) == list(range(checkpoint + 1, EPOCHS * STEPS_PER_EPOCH + 1)), f"rank {rank}"
        for step in range(checkpoint + 1, KILL_AT + 1):  # the same batches, in the same order, as without the kill
            assert after[step] == before[step], f"rank {rank}, step {step}"
        ids = [i for s in range(1, checkpoint + 1) if before[s]["epoch"] == epoch for i in before[s]["ids"]]
        rest = [i for s in after.values() if s["epoch"] == epoch for i in s["ids"]]
        assert len(ids + rest) == len(set(ids + rest)) == RECORDS // 2, f"rank {rank}: repeated ids in epoch {epoch}"
        trained_before += ids
        epoch_ids += ids + rest
    assert sorted(epoch_ids) == list(range(RECORDS)), f"epoch {epoch}: {set(range(RECORDS)) ^ set(epoch_ids)}"
    reads = recorded_reads(resumed / "record")  # what the resumed pipelines read, over both ranks
    later_epochs = EPOCHS - 1 - epoch  # each of which reads every id once
    assert {i: reads[i] for i in trained_before} == dict.fromkeys(trained_before, later_epochs), "re-read"
    saved = folder / "checkpoints" / f"checkpoint-{checkpoint}"
    if trainer == "hf_trainer.py":  # a plain JSON file per rank
        assert sorted(p.name for p in saved.glob("shardkit_*")) == [f"shardkit_loader_rank{r}.json" for r in (0, 1)]
    else:  # Accelerate pickles what state_dict() returns; shardkit's part is plain data, every rank's
        state = torch.load(saved / "custom_checkpoint_0.pkl", weights_only=True)
        assert state["kind"] == "ranks" and state["world_size"] == 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_checkpoint_folder_two_runs_saved_into_is_refused_on_every_rank_not_loaded_half_from_each(tmp_path):
    # A 4-rank run saves checkpoint-2, then a 2-rank run saves its checkpoint-2 into the same folder: the
    # folder holds rank 0-1 files of the second run and rank 2-3 files of the first. Loaded as they were,
    # ranks 0-1 resumed from the 2-rank run's position and ranks 2-3 from the 4-rank run's: records twice.
    folder = tmp_path / "checkpoints" / "checkpoint-2"
    common = [str(EXAMPLES / "hf_trainer.py"), "--records", "40", "--epochs", "1", "--data", str(tmp_path / "data"),
              "--checkpoints", str(tmp_path / "checkpoints"), "--checkpoint-every", "2"]  # fmt: skip
    for ranks in (4, 2):
        done = launch_ranks([*common, "--kill-at", "2"], timeout=300, ranks=ranks)
        assert done.returncode != 0 and "SIGKILL" in done.stderr, done.stderr[-3000:]
    saved = [json.loads((folder / f"shardkit_loader_rank{r}.json").read_text()) for r in range(4)]
    assert [s["world_size"] for s in saved] == [2, 2, 4, 4] and saved[0]["run"] == saved[1]["run"] != saved[2]["run"]
    resumed = launch_ranks([*common, "--resume", str(folder)], timeout=300, ranks=4)
    assert resumed.returncode != 0, resumed.stdout[-3000:]
    refusal = f"checkpoint {folder} holds the loader states of 2 saves"
    assert resumed.stderr.count(refusal) >= 4, resumed.stderr[-3000:]  # every rank refuses; none trains
    for ranks, run, world in (("0, 1", saved[0]["run"], 2), ("2, 3", saved[2]["run"], 4)):
        files = ", ".join(f"shardkit_loader_rank{r}.json" for r in ranks.split(", "))
        assert f"{files} (loaded by rank {ranks}) of run {run}, {world} ranks, step 2" in resumed.stderr
