"""Resuming mid-epoch: the rest of an epoch is exactly the samples not yet delivered.

Every test runs a loader uninterrupted, saving its state at several points
(first batch, mid-epoch, last batch, between epochs), then restores each
state into a fresh loader and dataset and checks that what was delivered
before the save plus what follows the restore is the uninterrupted epoch:
the same batches when the worker count is the same, the same samples
(exactly once) when it differs.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from shardkit import MixedLoader, ShardedDataset, interleave, wrap
from shardkit.errors import CorruptRecordError
from shardkit.pipeline import Pipeline, Shuffle
from shardkit.state import StateError, merge
from tests.helpers.load import hang_bound
from tests.helpers.processes import last_json_line, run_python
from tests.helpers.reading import CountingStream, run_as_worker
from tests.helpers.shards import synthetic_read, synthetic_shards

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

REPO = Path(__file__).resolve().parents[2]
COUNTS = [7, 13, 5, 20, 9, 31, 4]  # 89 records
EPOCHS = 2
BATCH = 8


def source(**kwargs: Any) -> ShardedDataset:
    return ShardedDataset(synthetic_shards(COUNTS), synthetic_read, shuffle=True, seed=5, **kwargs)


def shuffled() -> Pipeline:
    """Shard order, a shuffle buffer and a filter."""
    return Shuffle(source(), 10).filter(_keep)


def _keep(sample: str) -> bool:
    return not sample.endswith(":3")


def mixed() -> Pipeline:
    """Two sources interleaved until both run out, each shuffled, two passes."""
    items = wrap([f"item:{i}" for i in range(40)], shuffle=True, seed=1)
    mix = interleave([Shuffle(source(), 5), items], weights=[2, 1], seed=9, stop="all_exhausted")
    return mix.repeat(2)


PIPELINES: dict[str, Callable[[], Pipeline]] = {"shuffled": shuffled, "mixed": mixed}

Point = tuple[int, Any]  # (epoch, batches delivered in it) or (epoch, "end")


def save_points(batches_per_epoch: list[int]) -> list[Point]:
    """First batch, mid-epoch and last batch of epoch 0, between epochs 0 and 1, mid epoch 1."""
    n = batches_per_epoch[0]
    return [(0, 1), (0, n // 2), (0, n), (0, "end"), (1, batches_per_epoch[1] // 2)]


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """Through JSON, as a checkpoint would store it."""
    return json.loads(json.dumps(state))


class Run:
    """How one kind of loader is built, its epoch set, and its state read."""

    def __init__(self, kind: str, make: Callable[[], Pipeline], workers: int, **kwargs: Any) -> None:
        self.kind, self.make, self.workers, self.kwargs = kind, make, workers, kwargs

    def loader(self, workers: int | None = None) -> tuple[Any, Pipeline]:
        dataset = self.make()
        workers = self.workers if workers is None else workers
        if self.kind == "stateful":
            return StatefulDataLoader(dataset, batch_size=BATCH, num_workers=workers, **self.kwargs), dataset
        return MixedLoader(dataset, BATCH, num_workers=workers, micro_batch_size=3, **self.kwargs), dataset

    @staticmethod
    def set_epoch(loader: Any, dataset: Pipeline, epoch: int) -> None:
        (loader if isinstance(loader, MixedLoader) else dataset).set_epoch(epoch)

    def uninterrupted(self) -> tuple[list[list[list[str]]], dict[Point, tuple[dict[str, Any], list[str]]]]:
        """Batches of every epoch, and the states at the save points with what was delivered before them."""
        loader, dataset = self.loader()
        epochs: list[list[list[str]]] = []
        for epoch in range(EPOCHS):
            self.set_epoch(loader, dataset, epoch)
            epochs.append([list(batch) for batch in loader])
        points = save_points([len(e) for e in epochs])
        states = {}
        loader, dataset = self.loader()
        for epoch in range(EPOCHS):
            self.set_epoch(loader, dataset, epoch)
            delivered: list[str] = []
            for count, batch in enumerate(loader, 1):
                delivered += batch
                if (epoch, count) in points:
                    states[epoch, count] = roundtrip(loader.state_dict()), list(delivered)
            if (epoch, "end") in points:
                states[epoch, "end"] = roundtrip(loader.state_dict()), list(delivered)
        assert [b for e in epochs for b in e] != [], "nothing read"
        return epochs, states

    def resume(self, state: dict[str, Any], point: Point, workers: int | None = None) -> list[list[str]]:
        """Samples of every epoch from the restore on (epoch ``point[0]`` first)."""
        loader, dataset = self.loader(workers)
        loader.load_state_dict(state)
        out = []
        first = point[0] + (point[1] == "end")
        for epoch in range(first, EPOCHS):
            self.set_epoch(loader, dataset, epoch)
            out.append([sample for batch in loader for sample in batch])
        return out


def check_resume(run: Run, restore_workers: list[int | None]) -> None:
    epochs, states = run.uninterrupted()
    full = [[s for batch in epoch for s in batch] for epoch in epochs]
    assert len(states) == 5
    for point, (state, delivered) in states.items():
        epoch, at = point
        for workers in restore_workers:
            rest = run.resume(state, point, workers)
            where = f"restored at {point} with {workers} workers"
            if at == "end":
                assert delivered == full[epoch], where
                rest = [[]] + rest
            got = delivered + rest[0]
            if workers is None or workers == run.workers:  # the same batches
                assert got == full[epoch], where
                assert rest[1:] == full[epoch + 1 :], where
            else:  # exactly the remaining samples, in another order
                assert sorted(got) == sorted(full[epoch]), where
                assert [sorted(e) for e in rest[1:]] == [sorted(e) for e in full[epoch + 1 :]], where


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_stateful_dataloader_resumes_exactly(pipeline: str, workers: int) -> None:
    check_resume(Run("stateful", PIPELINES[pipeline], workers), [None])


def test_stateful_dataloader_resumes_with_persistent_workers() -> None:
    check_resume(Run("stateful", shuffled, 2, persistent_workers=True), [None])


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_mixed_loader_resumes_with_the_same_or_another_worker_count(pipeline: str) -> None:
    check_resume(Run("mixed", PIPELINES[pipeline], 2), [2, 3, 1])


@pytest.mark.slow
def test_mixed_loader_resumes_with_persistent_workers() -> None:
    check_resume(Run("mixed", shuffled, 2, persistent_workers=True), [2, 3])


def test_mixed_loader_restores_into_the_main_process_carried_samples_included() -> None:
    run = Run("mixed", shuffled, 2)
    epochs, states = run.uninterrupted()
    carried = [(point, state, delivered) for point, (state, delivered) in states.items() if state["carry"]]
    assert carried, "no save point cut a micro-batch; the test does not test the carried samples"
    for point, state, delivered in carried:  # before: "only a MixedLoader with num_workers >= 1 can deliver"
        rest = run.resume(state, point, 0)
        full = [s for batch in epochs[point[0]] for s in batch]
        assert sorted(delivered[len(delivered) - _in_epoch(epochs, point) :] + rest[0]) == sorted(full)
    state, _ = states[0, "end"]
    assert sorted(run.resume(state, (0, "end"), 0)[0]) == sorted(s for b in epochs[1] for s in b)


def _in_epoch(epochs: list[list[list[str]]], point: Any) -> int:
    """Samples delivered in the save point's own epoch."""
    epoch, at = point
    return sum(len(batch) for batch in epochs[epoch][:at])


@pytest.mark.slow
def test_several_ranks_resume_their_own_part() -> None:
    per_rank = []
    for rank in range(2):

        def make(rank: int = rank) -> Pipeline:
            return Shuffle(source(rank=rank, world_size=2), 6)

        run = Run("mixed", make, 2)
        epochs, states = run.uninterrupted()
        state, delivered = states[0, 3]
        assert state["workers"][0]["upstream"]["rank"] == rank
        rest = run.resume(state, (0, 3), 3)
        assert sorted(delivered + rest[0]) == sorted(s for batch in epochs[0] for s in batch)
        per_rank.append(delivered + rest[0])
    # balance="pad": every record at least once, the padding the only repeats
    union = [s for part in per_rank for s in part]
    assert len(union) == 2 * -(-sum(COUNTS) // 2)
    assert set(union) == {f"{u}:{i}" for u in synthetic_shards(COUNTS) for i in range(int(u.rsplit("-", 1)[1]))}


def test_state_is_small_plain_versioned_data() -> None:
    block_shuffled = source()
    block_shuffled.shuffle_window = (
        0  # records in block order: the state is one interval (windows: tests/sources/test_shuffle.py)
    )
    dataset = block_shuffled.map(str.upper)
    iterator = iter(dataset)
    for _ in range(10):
        next(iterator)
    state = dataset.state_dict()
    assert roundtrip(state) == state
    buffer = __import__("io").BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer) == state
    text = json.dumps(state)
    assert "mem/shard" not in text and len(text) < 400
    assert state["version"] == 2 and state["upstream"]["version"] == 2
    assert state["upstream"]["remaining"] == [[10, sum(COUNTS)]]


def test_loading_a_state_that_does_not_fit_fails_clearly() -> None:
    dataset = source()
    next(iter(dataset))
    state = dataset.state_dict()
    other = ShardedDataset(synthetic_shards([*COUNTS, 3]), synthetic_read, shuffle=True, seed=5)
    with pytest.raises(StateError, match="saved with dataset .*'shards': 7.*'shards': 8"):
        other.load_state_dict(state)
    with pytest.raises(StateError, match="'seed': 5.*'seed': 6"):
        ShardedDataset(synthetic_shards(COUNTS), synthetic_read, shuffle=True, seed=6).load_state_dict(state)
    on_two_ranks = source(rank=0, world_size=2)
    on_two_ranks.load_state_dict(state)
    with pytest.raises(StateError, match="world_size 1, but here it is 2"):
        iter(on_two_ranks)
    with pytest.raises(StateError, match="version 99 is not supported"):
        source().load_state_dict({**state, "version": 99})
    with pytest.raises(StateError, match="'planned' stage but this stage is 'map'"):
        source().map(str.upper).load_state_dict(state)
    later = source()
    later.set_epoch(0)  # an explicit epoch wins over the state's (without it, the next pass reads epoch 4)
    later.load_state_dict({**state, "epoch": 4})
    with pytest.raises(StateError, match=r"call set_epoch\(4\)"):
        iter(later)
    with pytest.raises(StateError, match="has not been iterated"):
        source().state_dict()


def test_worker_states_merge_and_split_over_any_worker_count() -> None:
    """The dataset-level mechanism MixedLoader uses: merge all workers' states, split anew."""
    states, delivered = [], []
    for worker in range(3):
        dataset = Shuffle(source(), 4)

        def read_some(dataset: Pipeline = dataset, worker: int = worker) -> dict[str, Any]:
            iterator = iter(dataset)
            delivered.extend(next(iterator) for _ in range(5 + worker))
            return dataset.state_dict()

        states.append(run_as_worker(worker, 3, read_some))
    with pytest.raises(StateError, match="worker 0's of 3"):
        iter(_loaded(Shuffle(source(), 4), states[0]))
    with pytest.raises(StateError, match="all 3 workers"):
        merge(states[:2])
    rest = list(_loaded(Shuffle(source(), 4), merge(states)))
    assert sorted(delivered + rest) == sorted(source())


def _loaded(dataset: Pipeline, state: dict[str, Any]) -> Pipeline:
    dataset.load_state_dict(state)
    return dataset


@pytest.mark.slow
def test_plain_iterable_resumes_in_the_same_slot_only() -> None:
    def make() -> Pipeline:
        return wrap(CountingStream(50))

    check_resume(Run("stateful", make, 2), [None])
    run = Run("mixed", make, 2)
    _, states = run.uninterrupted()
    with pytest.raises(StateError, match="same reader slot"):
        run.resume(states[0, 1][0], (0, 1), 3)


def corrupt_read(url: str, start: int, stop: int | None) -> Iterator[str]:
    """Record 2 of every shard has bad data (framing intact)."""
    count = int(url.rsplit("-", 1)[1])
    for index in range(start, min(stop, count)):  # type: ignore[type-var]
        if index == 2:
            raise CorruptRecordError(url, index, 0, "bad data CRC", framing_intact=True)
        yield f"{url}:{index}"


@pytest.mark.filterwarnings("ignore:skipping record")
def test_skipped_records_count_as_read() -> None:
    def make() -> ShardedDataset:
        # balance="none": nothing is made up (tests/sources/test_faults_reading.py resumes the made-up samples of "pad")
        return ShardedDataset(synthetic_shards(COUNTS), corrupt_read, on_error="skip", balance="none")

    full = list(make())
    assert len(full) == sum(COUNTS) - len(COUNTS)
    for cut in (1, 2, 10, len(full) - 1):
        dataset = make()
        iterator = iter(dataset)
        before = [next(iterator) for _ in range(cut)]
        assert before + list(_loaded(make(), roundtrip(dataset.state_dict()))) == full


KILL_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, traceback
    sys.path.insert(0, {repo!r})
    from tests.helpers.processes import exit_as_a_script
    from shardkit import MixedLoader
    from shardkit.pipeline import Shuffle
    from tests.state.test_resume import source

    out = sys.argv[1]

    def record_pid(worker_id):
        with open(f"{{out}}/worker{{worker_id}}.pid", "w") as file:
            file.write(str(os.getpid()))

    def train():
        # Micro-batches of one sample: the worker killed at batch 7 still has micro-batches to send (a
        # state_dict() receives a worker's micro-batches up to its next state, at most 16 of them).
        loader = MixedLoader(Shuffle(source(), 6), 4, num_workers=2, micro_batch_size=1, worker_init_fn=record_pid)
        if os.path.exists(out + "/state.json"):  # resume
            with open(out + "/state.json") as file:
                loader.load_state_dict(json.load(file)["state"])
            with open(out + "/resumed.json", "w") as file:
                json.dump([s for batch in loader for s in batch], file)
            return
        delivered = []
        for count, batch in enumerate(loader, 1):
            delivered += batch
            if count % 3 == 0:  # checkpoint: model and loader state together
                with open(out + "/tmp.json", "w") as file:
                    json.dump({{"state": loader.state_dict(), "delivered": delivered}}, file)
                os.replace(out + "/tmp.json", out + "/state.json")
            if count == 7:  # preemption: a worker dies mid-epoch
                with open(out + "/worker0.pid") as file:
                    os.kill(int(file.read()), signal.SIGKILL)

    def job(name):
        # Each run a process of its own, as a preempted and a restarted job are: forked from this one,
        # which imported torch and shardkit once and ran nothing (not two interpreters importing torch).
        # Its exit status; its stderr in OUT/NAME.stderr.
        pid = os.fork()
        if pid == 0:
            os.dup2(os.open(f"{{out}}/{{name}}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
            code = 0
            try:
                train()
            except BaseException:
                traceback.print_exc()
                code = 1
            exit_as_a_script(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    print(json.dumps([job("crashed"), job("resumed")]), flush=True)
    """
)


@pytest.mark.slow
def test_killed_worker_resumes_from_the_last_saved_state(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(KILL_SCRIPT.format(repo=str(REPO)))
    crashed, resumed = last_json_line(run_python(str(script), str(tmp_path), timeout=240).stdout)
    stderr = (tmp_path / "crashed.stderr").read_text()
    assert crashed != 0 and "killed by signal" in stderr, stderr[-2000:]
    saved = json.loads((tmp_path / "state.json").read_text())
    # The last checkpoint: some multiple of 3 batches, from before the crash surfaced.
    assert len(saved["delivered"]) % 12 == 0 and 0 < len(saved["delivered"]) < sum(COUNTS)
    assert resumed == 0, (tmp_path / "resumed.stderr").read_text()[-2000:]
    rest = json.loads((tmp_path / "resumed.json").read_text())
    assert sorted(saved["delivered"] + rest) == sorted(source())


@pytest.mark.slow
def test_example_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "resume.py")],
        capture_output=True,
        text=True,
        timeout=hang_bound(120),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "exactly once" in result.stdout


def test_mixed_loader_says_why_it_cannot_save() -> None:
    loader = MixedLoader(CountingStream(20), 4, num_workers=1)
    with pytest.raises(StateError, match="nothing has been iterated"):
        loader.state_dict()
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(StateError, match="CountingStream has no state_dict"):
        loader.state_dict()
    loader = MixedLoader(shuffled(), 4, num_workers=1, resumable=False)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(StateError, match="resumable=False"):
        loader.state_dict()


def test_tfrecord_dataset_resumes_mid_shard(tmp_path: Path) -> None:
    import shardkit

    urls = []
    for shard, size in enumerate([12, 7, 20]):
        urls.append(f"{tmp_path}/part-{shard}.tfrecord")
        with shardkit.TFRecordWriter(urls[-1]) as out:
            for index in range(size):
                out.write(f"{shard}:{index}".encode())
    shardkit.build_index(urls[2])  # one shard seeks by index, the others scan to the start

    def make() -> Pipeline:
        shards = shardkit.ShardList(urls, num_records=[12, 7, 20])
        return shardkit.TFRecordDataset(shards, decode="raw", shuffle=True, seed=2)

    full = list(make())
    for cut in (1, 5, 17, 38):
        dataset = make()
        iterator = iter(dataset)
        before = [next(iterator) for _ in range(cut)]
        assert before + list(_loaded(make(), roundtrip(dataset.state_dict()))) == full


def test_merge_refuses_what_cannot_be_split_anew() -> None:
    def repeat(passes: int, upstream: Any) -> dict[str, Any]:
        return {"version": 1, "kind": "repeat", "epoch": 0, "pass": passes, "yielded": True, "upstream": upstream}

    planned = {"version": 1, "kind": "planned", "epoch": 0, "world_size": 1, "rank": 0, "fingerprint": {}}
    workers = [{**planned, "remaining": [[w * 10, w * 10 + 5]], "share": [w, 2]} for w in range(2)]
    assert merge(workers)["remaining"] == [[0, 5], [10, 15]]
    with pytest.raises(StateError, match="different repeat\\(\\) passes \\[0, 1\\]"):
        merge([repeat(0, workers[0]), repeat(1, workers[1])])
    with pytest.raises(StateError, match="different epoch"):
        merge([workers[0], {**workers[1], "epoch": 1}])
    mix = {"version": 1, "kind": "interleave", "epoch": 0, "upstream": [workers[0]], "live": [0], "rng": None}
    stopped = [{**mix, "stopped": w == 0, "share": [w, 2], "upstream": [workers[w]]} for w in range(2)]
    with pytest.raises(StateError, match="first_exhausted"):
        merge(stopped)


@pytest.mark.parametrize("trial", range(60))
def test_random_worker_states_merge_into_exactly_the_rest(trial: int) -> None:
    """Workers stop anywhere; their merged state, split over another worker count, reads exactly the rest."""
    import random

    rng = random.Random(trial)
    counts = [rng.randint(0, 15) for _ in range(rng.randint(1, 6))]
    kind = ["source", "shuffled", "interleaved"][trial % 3]

    def make() -> Pipeline:
        base = ShardedDataset(synthetic_shards(counts), synthetic_read, shuffle=True, seed=trial, balance="none")
        if kind == "source":
            return base
        if kind == "shuffled":
            return Shuffle(base, 7).filter(_keep)
        items = wrap([f"item:{i}" for i in range(23)], shuffle=True, balance="none")
        return interleave([Shuffle(base, 3), items], weights=[3, 1], stop="all_exhausted")

    before, after = rng.randint(1, 4), rng.randint(1, 4)
    full = sorted(s for w in range(before) for s in run_as_worker(w, before, lambda: list(make())))
    delivered: list[str] = []
    states = []
    for worker in range(before):
        dataset = make()

        def read_some(dataset: Pipeline = dataset) -> dict[str, Any]:
            iterator = iter(dataset)
            delivered.extend(itertools.islice(iterator, rng.randint(0, 20)))
            return roundtrip(dataset.state_dict())

        states.append(run_as_worker(worker, before, read_some))
    merged = merge(states)
    rest = [s for w in range(after) for s in run_as_worker(w, after, lambda: list(_loaded(make(), merged)))]
    assert sorted(delivered + rest) == full


@pytest.mark.slow
def test_a_state_loaded_after_a_trainer_calls_iter_resumes_exactly_with_persistent_workers() -> None:
    # Lightning calls iter() on the loader before it loads the checkpoint's state: with persistent
    # workers the state must still load, and resume the epoch exactly.
    run = Run("mixed", shuffled, 2, persistent_workers=True)
    epochs, states = run.uninterrupted()
    state, delivered = states[0, len(epochs[0]) // 2]
    loader, _ = run.loader()
    iter(loader)
    loader.load_state_dict(state)
    rest = [sample for batch in loader for sample in batch]
    assert delivered + rest == [sample for batch in epochs[0] for sample in batch]
