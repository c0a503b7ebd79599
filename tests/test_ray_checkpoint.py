"""shardkit.integrations.ray: a loader's state in a Ray Train checkpoint folder, saved and loaded.

Without a Ray cluster: the functions work on a checkpoint's folder (what ``ray.train.Checkpoint``
holds); ``tests/test_ray_train.py`` runs them inside Ray Train. The gloo tests join real ranks.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray (the dev extra's ray[data,train]) does not install on this platform")

import shardkit  # noqa: E402
from shardkit.integrations.ray import STATE_FILE, SavedLoader, load_loader_state, save_loader_state  # noqa: E402
from shardkit.state import StateError  # noqa: E402
from tests.helpers.processes import gloo_ranks, run_python  # noqa: E402

SIZE, BATCH = 40, 4


class Numbers:
    """A map-style dataset of its indices."""

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> int:
        return index


def loader() -> shardkit.MixedLoader:
    return shardkit.MixedLoader(shardkit.wrap(Numbers(), shuffle=True, seed=3), batch_size=BATCH, seed=3)


def take(batches, count: int) -> list[int]:
    taken = []
    for _, batch in zip(range(count), batches):
        taken += batch.tolist()
    return taken


def saved_at(folder: Path, steps: int, *, run: str = "run-a") -> tuple[list[int], str | None]:
    """A fresh loader, ``steps`` batches delivered, then saved into ``folder``: the ids delivered, the file."""
    first = loader()
    first.set_epoch(0)
    delivered = take(iter(first), steps)
    return delivered, save_loader_state(first, folder, step=steps, run=run)


def test_a_loader_saved_mid_epoch_resumes_from_the_folder_with_exactly_the_samples_not_yet_delivered(tmp_path):
    delivered, path = saved_at(tmp_path, 3)
    assert path == str(tmp_path / STATE_FILE)
    resumed = loader()
    resumed.set_epoch(0)
    saved = load_loader_state(resumed, tmp_path, step=3, run="run-a")
    assert saved == SavedLoader(run="run-a", step=3, world_size=1, save=saved.save)
    rest = [i for batch in resumed for i in batch.tolist()]
    assert len(delivered) == 12 and sorted(delivered + rest) == list(range(SIZE))
    resumed.set_epoch(1)
    assert sorted(i for batch in resumed for i in batch.tolist()) == list(range(SIZE))


def test_the_file_is_plain_json_naming_the_run_step_world_size_and_save_and_nothing_else_is_written(tmp_path):
    saved_at(tmp_path, 2, run="my-run")
    assert os.listdir(tmp_path) == [STATE_FILE]
    record = json.loads((tmp_path / STATE_FILE).read_text())
    assert {k: record[k] for k in ("format", "version", "run", "step", "world_size")} == {
        "format": "shardkit.integrations.ray.loader_state", "version": 1, "run": "my-run", "step": 2, "world_size": 1,
    }  # fmt: skip
    assert len(record["save"]) == 32 and record["state"]["kind"] == "mixed_loader"


def test_a_rank_given_no_folder_writes_nothing(tmp_path):
    first = loader()
    take(iter(first), 1)
    assert save_loader_state(first, None, step=1) is None
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # a new Python process
def test_a_process_killed_while_saving_leaves_the_last_checkpoints_file_whole(tmp_path):
    """The child saves step 2, then is SIGKILLed inside the save of step 4 just before the rename: the
    file is step 2's, whole; the new state is only under its temporary ``.partial`` name, which no load
    reads (a SIGKILL runs no clean-up)."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from tests.test_ray_checkpoint import loader, take
        from shardkit.integrations.ray import save_loader_state
        first = loader()
        batches = iter(first)
        take(batches, 2)
        save_loader_state(first, {str(tmp_path)!r}, step=2, run="r")
        take(batches, 2)
        os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
        save_loader_state(first, {str(tmp_path)!r}, step=4, run="r")
    """)
    done = run_python("-c", script, check=False)
    assert done.returncode == -9, done.stderr[-2000:]
    left = sorted(os.listdir(tmp_path))
    assert left[0] == STATE_FILE and len(left) == 2 and left[1].startswith(STATE_FILE) and left[1].endswith(".partial")
    assert json.loads((tmp_path / STATE_FILE).read_text())["step"] == 2
    resumed = loader()
    assert load_loader_state(resumed, tmp_path).step == 2


def _damage(path: Path, how: str) -> None:
    record = json.loads(path.read_text())
    if how == "truncated":
        path.write_text(path.read_text()[:-40])
    elif how == "other format":
        path.write_text(json.dumps({**record, "format": "something.else"}))
    elif how == "version 2":
        path.write_text(json.dumps({**record, "version": 2}))
    elif how == "world size lies":
        path.write_text(json.dumps({**record, "world_size": 2}))
    elif how == "step not a number":
        path.write_text(json.dumps({**record, "step": "3"}))
    elif how == "missing":
        path.unlink()


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("truncated", "is not a loader state written by save_loader_state()"),
        ("other format", "no 'shardkit.integrations.ray.loader_state' record"),
        ("version 2", "has version 2; this shardkit reads version 1"),
        ("world size lies", "says world size 2 but holds the states of 1 ranks"),
        ("step not a number", "field 'step' must be an int >= 0, got '3'"),
        ("missing", "is missing: the checkpoint holds no loader state"),
    ],
)
def test_a_damaged_or_missing_file_is_a_state_error_naming_it_and_the_loader_is_left_as_it_was(tmp_path, how, message):
    saved_at(tmp_path, 3)
    _damage(tmp_path / STATE_FILE, how)
    resumed = loader()
    with pytest.raises(StateError, match=message) as caught:
        load_loader_state(resumed, tmp_path)
    assert str(tmp_path / STATE_FILE) in str(caught.value)
    assert sorted(i for batch in resumed for i in batch.tolist()) == list(range(SIZE))  # a fresh epoch


@pytest.mark.parametrize(
    ("asked", "message"),
    [({"step": 6}, "loader state of step 3, but step 6 is resumed"), ({"run": "b"}, "run 'run-a', but run 'b'")],
)
def test_a_file_of_another_step_or_run_than_asked_is_refused(tmp_path, asked, message):
    saved_at(tmp_path, 3)
    with pytest.raises(StateError, match=message):
        load_loader_state(loader(), tmp_path, **asked)


def test_a_state_that_is_not_plain_data_is_refused_and_nothing_is_written(tmp_path):
    class Odd:
        def state_dict(self):
            return {"kind": "mixed_loader", "tail": object()}

    with pytest.raises(StateError, match="is not plain JSON data"):
        save_loader_state(Odd(), tmp_path, step=1, run="r")
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- real ranks (gloo)
#
# The ranks are forked from the test's process, which has imported torch, Ray and this module: spawned,
# each of the six calls' two ranks imported them again (about 50 s of CPU for the three tests, load 8 on
# 2 cores). What the tests check, the files the ranks save and load and the errors they raise, is the same.


def _save_on_two_ranks(rank: int, world_size: int, folder: str, delivered: str) -> None:
    ranked = loader()
    ranked.set_epoch(0)
    ids = take(iter(ranked), 2)
    Path(delivered, f"rank{rank}.json").write_text(json.dumps(ids))
    save_loader_state(ranked, folder if rank == 0 else None, step=2, run="two")


def _load_own_folder(rank: int, world_size: int, folders: list[str], errors: str) -> None:
    try:
        load_loader_state(loader(), folders[rank])
    except StateError as error:
        Path(errors, f"rank{rank}.txt").write_text(str(error))


@pytest.mark.slow  # two gloo ranks, forked
def test_ranks_given_checkpoints_of_two_saves_each_raise_naming_both(tmp_path):
    folders = [str(tmp_path / "a"), str(tmp_path / "b")]
    (tmp_path / "ids").mkdir()
    for folder in folders:  # the same run and step, saved twice: only the save differs
        gloo_ranks(_save_on_two_ranks, 2, folder, str(tmp_path / "ids"), start_method="fork")
    (tmp_path / "errors").mkdir()
    gloo_ranks(_load_own_folder, 2, folders, str(tmp_path / "errors"), start_method="fork")
    saves = [json.loads(Path(folder, STATE_FILE).read_text())["save"] for folder in folders]
    for rank in (0, 1):
        message = (tmp_path / "errors" / f"rank{rank}.txt").read_text()
        assert "the ranks loaded different checkpoints" in message
        assert f"rank 0: run 'two' step 2 (save {saves[0]})" in message
        assert f"rank 1: run 'two' step 2 (save {saves[1]})" in message


@pytest.mark.slow  # two gloo ranks, forked
def test_every_ranks_state_saved_by_two_ranks_resumes_one_process_with_every_sample_once(tmp_path):
    (tmp_path / "ids").mkdir()
    gloo_ranks(_save_on_two_ranks, 2, str(tmp_path / "ck"), str(tmp_path / "ids"), start_method="fork")
    assert os.listdir(tmp_path / "ck") == [STATE_FILE]  # rank 0 alone wrote
    delivered = [i for rank in (0, 1) for i in json.loads((tmp_path / "ids" / f"rank{rank}.json").read_text())]
    alone = loader()
    saved = load_loader_state(alone, tmp_path / "ck")
    assert (saved.world_size, saved.step, saved.run) == (2, 2, "two")
    rest = [i for batch in alone for i in batch.tolist()]
    assert len(delivered) == 16 and sorted(delivered + rest) == list(range(SIZE))


def test_outside_ray_train_a_save_without_a_run_name_asks_for_one(tmp_path):
    first = loader()
    take(iter(first), 1)
    with pytest.raises(TypeError, match="not a Ray Train worker .*Pass run='...' to name it"):
        save_loader_state(first, tmp_path, step=1)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # two gloo ranks, forked
def test_a_damaged_file_on_one_rank_raises_on_every_rank_at_once_rather_than_at_the_jobs_timeout(tmp_path):
    (tmp_path / "ids").mkdir()
    gloo_ranks(_save_on_two_ranks, 2, str(tmp_path / "good"), str(tmp_path / "ids"), start_method="fork")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / STATE_FILE).write_text((tmp_path / "good" / STATE_FILE).read_text()[:-40])
    (tmp_path / "errors").mkdir()
    gloo_ranks(
        _load_own_folder, 2, [str(tmp_path / "good"), str(damaged)], str(tmp_path / "errors"),
        collective_timeout=600, start_method="fork",
    )  # fmt: skip
    for rank in (0, 1):
        message = (tmp_path / "errors" / f"rank{rank}.txt").read_text()
        assert f"{damaged / STATE_FILE} is not a loader state written by save_loader_state()" in message
