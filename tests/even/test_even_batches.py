"""even_batches: equal batch counts on every rank, whatever each rank's loader yields.

The agreement protocol is checked in one process with ranks as threads and a
fake side group (fast, property-based); tests/scripts/even_check.py runs it for real
under gloo with DataLoader workers, MixedLoader, filters, corrupt records and
unequal counts (marked slow).
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit
from shardkit import EvenBatchesError, even_batches
from shardkit.even import saved as even_saved
from shardkit.even import wrapper as even_module
from shardkit.ranks import ranks_node
from shardkit.state import StateError
from tests.helpers.even import Batches, expected, rank_batches, run_ranks
from tests.helpers.examples import examples
from tests.helpers.once import once
from tests.helpers.processes import EXAMPLES, REPO, free_port, last_json_line, run_python
from tests.sources.test_tfrecord_dataset import corrupt_data_byte, write_shards

# -- ranks as threads, agreeing through a fake side group (tests/helpers/even.py) ---


@pytest.mark.filterwarnings("ignore:even_batches. epoch")
@settings(max_examples=examples(150), deadline=None)
@given(
    counts=st.lists(st.integers(0, 12), min_size=2, max_size=4),
    at_end=st.sampled_from(["stop", "pad"]),
    every=st.integers(1, 5),
    sized=st.booleans(),
)
def test_every_rank_yields_the_same_batches_stop_at_min_pad_to_max(counts, at_end, every, sized):
    with pytest.MonkeyPatch.context() as monkeypatch:

        def body(rank: int) -> tuple[list[str], shardkit.EvenStats]:
            wrapped = even_batches(Batches(rank_batches(rank, counts[rank]), sized=sized), at_end=at_end, every=every)
            return list(wrapped), wrapped.stats()

        results = run_ranks(monkeypatch, len(counts), body)
    if at_end == "pad" and min(counts) == 0 < max(counts):
        assert all(isinstance(r, EvenBatchesError) for r in results), results
        empty = max(rank for rank, count in enumerate(counts) if count == 0)
        assert all(f"rank {empty} has no batch this epoch" in str(r) for r in results)
        return
    for rank, (got, stats) in enumerate(results):
        assert got == expected(rank, counts, at_end)
        assert stats.batches == len(got)
        if at_end == "pad":
            assert (stats.padded, stats.dropped) == (max(counts) - counts[rank], 0)
        else:
            lost = counts[rank] - min(counts)
            assert stats.padded == 0
            if sized or stats.dropped_exact:
                assert stats.dropped == lost and stats.dropped_exact == (sized or lost == stats.dropped)
            else:
                assert stats.dropped <= lost


def test_a_loader_error_on_one_rank_stops_every_rank_at_the_same_step(monkeypatch):
    def failing(rank: int) -> Iterator[str]:
        yield from rank_batches(rank, 3)
        if rank == 1:
            raise OSError("disk gone")
        yield from rank_batches(rank, 5)[3:]

    def body(rank: int) -> list[str]:
        seen: list[str] = []
        try:
            for batch in even_batches(failing(rank)):
                seen.append(batch)
        except Exception as error:  # noqa: BLE001
            return [*seen, repr(error)]
        return seen

    results = run_ranks(monkeypatch, 3, body)
    assert [r[:-1] for r in results] == [rank_batches(rank, 3) for rank in range(3)]
    assert results[1][-1] == "OSError('disk gone')"
    assert all("EvenBatchesError" in r[-1] and "the loader of rank 1 raised" in r[-1] for r in (results[0], results[2]))


def test_warns_when_a_rank_drops_more_than_a_few_batches(monkeypatch):
    counts = [2, 10, 5]
    with warnings.catch_warnings(record=True) as caught:  # set here: the filters are global, not per thread
        warnings.simplefilter("always")
        results = run_ranks(monkeypatch, 3, lambda rank: list(even_batches(Batches(rank_batches(rank, counts[rank])))))
    assert results == [rank_batches(rank, 2) for rank in range(3)]
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 1 and "this rank dropped 8 of its batches so that every rank yields 2" in messages[0]


@pytest.mark.parametrize("at_end", ["stop", "pad"])
@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.filterwarnings("ignore:even_batches. epoch")
@pytest.mark.parametrize("save_after", [0, 1, 2, 4, 6])
def test_a_resumed_epoch_yields_what_the_uninterrupted_one_would_and_ends_together(
    monkeypatch, at_end, every, save_after
):
    counts = [4, 7, 5]

    def body(rank: int) -> tuple[list[str], list[str], list[str]]:
        whole = list(even_batches(Batches(rank_batches(rank, counts[rank])), at_end=at_end, every=every))
        first = even_batches(Batches(rank_batches(rank, counts[rank])), at_end=at_end, every=every)
        first.set_epoch(2)
        before: list[str] = []
        iterator = iter(first)
        for _ in range(save_after):
            before.append(next(iterator, None))
        state = first.state_dict()
        # Batches fetched ahead are already counted by the loader's own state; they travel in ours.
        held = len(state["window"]) + len(state["next"]) + state["dropped_ahead"]
        yielded = sum(b is not None for b in before)
        assert state["inner"]["position"] == min(counts[rank], yielded + held)
        second = even_batches(Batches(rank_batches(rank, counts[rank])), at_end=at_end, every=every)
        second.load_state_dict(state)
        assert second.epoch == 2 and second.loader.epochs == [2]
        after = list(second)
        return whole, [b for b in before if b is not None], after

    results = run_ranks(monkeypatch, 3, body)
    for whole, before, after in results:
        assert before + after == whole
    assert len({len(whole) for whole, _, _ in results}) == 1


@pytest.mark.parametrize("at_end", ["stop", "pad"])
@pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")
def test_torchdatas_stateful_dataloader_resumes_through_even_batches(monkeypatch, at_end):
    from torchdata.stateful_dataloader import StatefulDataLoader

    sizes = [9, 14]

    def loader(rank: int) -> StatefulDataLoader:
        return StatefulDataLoader([f"r{rank}s{i}" for i in range(sizes[rank])], batch_size=2)

    def body(rank: int) -> tuple[list[list[str]], list[list[str]]]:
        whole = list(even_batches(loader(rank), at_end=at_end, every=2))
        first = even_batches(loader(rank), at_end=at_end, every=2)
        iterator = iter(first)
        before = [next(iterator) for _ in range(3)]
        again = even_batches(loader(rank), at_end=at_end, every=2)
        again.load_state_dict(first.state_dict())
        return whole, before + list(again)

    results = run_ranks(monkeypatch, 2, body)
    assert [len(whole) for whole, _ in results] == ([5, 5] if at_end == "stop" else [7, 7])
    for whole, resumed in results:
        assert resumed == whole


def test_a_state_from_an_earlier_epoch_is_ignored(monkeypatch):
    def body(rank: int) -> list[str]:
        wrapped = even_batches(Batches(rank_batches(rank, 3)))
        iterator = iter(wrapped)
        next(iterator)
        state = wrapped.state_dict()
        again = even_batches(Batches(rank_batches(rank, 3)))
        again.load_state_dict(state)
        again.set_epoch(1)
        return list(again)

    assert run_ranks(monkeypatch, 2, body) == [rank_batches(0, 3), rank_batches(1, 3)]


def test_a_state_of_two_ranks_saved_at_an_epochs_end_loads_on_one_with_the_loaders_states_merged(monkeypatch):
    def body(rank: int) -> dict[str, Any]:
        wrapped = even_batches(Batches(rank_batches(rank, 3 + rank)), at_end="stop")
        assert list(wrapped) == rank_batches(rank, 3)
        return wrapped.state_dict(gather=False)

    entries = run_ranks(monkeypatch, 2, body)
    monkeypatch.undo()  # this process has no process group again
    assert [(e["window"], e["next"], e["finished"]) for e in entries] == [([], [], True)] * 2

    class Recording(Batches):
        def load_state_dict(self, state: Any) -> None:
            self.received = state

    loader = Recording([])
    wrapped = even_batches(loader, at_end="stop")
    wrapped.load_state_dict(ranks_node(entries))
    assert wrapped.state_dict()["inner"] == ranks_node([{"position": 3}, {"position": 4}])  # not loaded yet
    list(wrapped)
    assert loader.received == ranks_node([{"position": 3}, {"position": 4}])  # the loader merges its own


# -- one process: a pass-through ------------------------------------------------


def test_without_a_process_group_iteration_is_the_loaders_own_iterator():
    class Loader:
        def __init__(self) -> None:
            self.iterator = iter([1, 2, 3])

        def __iter__(self) -> Iterator[int]:
            return self.iterator

    loader = Loader()
    wrapped = even_batches(loader, at_end="pad")
    assert iter(wrapped) is loader.iterator
    assert list(loader.iterator) == [1, 2, 3]
    assert wrapped.stats() == shardkit.EvenStats(epoch=0, batches=None)


def test_len_and_set_epoch_pass_through():
    loader = Batches(["a", "b"])
    wrapped = even_batches(loader)
    assert len(wrapped) == 2
    wrapped.set_epoch(3)
    assert loader.epochs == [3] and wrapped.epoch == 3
    with pytest.raises(TypeError, match="unsized"):
        len(even_batches(Batches([], sized=False)))


def test_set_epoch_reaches_a_dataloaders_dataset_and_sampler():
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    data = list(range(10))
    sampler = DistributedSampler(data, num_replicas=2, rank=0)
    wrapped = even_batches(DataLoader(data, sampler=sampler, batch_size=2))
    wrapped.set_epoch(5)
    assert sampler.epoch == 5
    dataset = shardkit.wrap(data)
    even_batches(DataLoader(dataset, batch_size=2)).set_epoch(4)
    assert dataset.epoch == 4


def test_a_pass_through_resumes_the_loader_and_its_held_batches():
    loader = Batches(["a", "b", "c", "d"])
    state = even_saved.state_of(even_batches(loader), inner={"position": 3}, window=[], next=[even_module.encode("c")])
    wrapped = even_batches(Batches(["a", "b", "c", "d"]))
    wrapped.load_state_dict(state)
    assert list(wrapped) == ["c", "d"]


def test_state_dict_of_a_loader_without_one_names_the_fix():
    with pytest.raises(StateError, match="generator has no state_dict"):
        even_batches(x for x in range(3)).state_dict()


def saved_state(**fields: Any) -> dict[str, Any]:
    """A well-formed state of an even_batches(at_end="pad", every=2) over Batches, 3 batches in."""
    wrapped = even_batches(Batches(["a", "b", "c", "d", "e"]), at_end="pad", every=2)
    base = dict(
        inner={"position": 5},
        window=[even_module.encode("d")],
        next=[even_module.encode("e")],
        quota=1,
        target=2,
        pad=[even_module.encode("a")],
        batches=3,
        from_inner=3,
    )
    return even_saved.state_of(wrapped, **{**base, **fields})


def test_a_well_formed_state_resumes_its_held_batches_first():
    wrapped = even_batches(Batches(["a", "b", "c", "d", "e"]), at_end="pad", every=2)
    wrapped.load_state_dict(saved_state())
    assert wrapped.state_dict() == saved_state()  # before iterating: the state as loaded
    assert list(wrapped) == ["d", "e"]  # no process group: the held batches, then the loader's rest


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda s: s.pop("quota"), "has no 'quota'"),
        (lambda s: s.update(batches="3"), r"state\['batches'\] must be int, got str"),
        (lambda s: s.update(padded=-1), r"state\['padded'\] must be >= 0"),
        (lambda s: s.update(finished=1), r"state\['finished'\] must be bool"),
        (lambda s: s.update(window=[["tensor", "no such encoding"]]), "cannot be read"),
        (lambda s: s.update(quota=0), "1 batches held for a window of 0"),
        (lambda s: s.update(next=["x", "y", "z"]), "3 batches fetched for a window of 2"),
        (lambda s: s.update(target=3), "fetched for a window of 3"),
        (lambda s: s.update(padded=2), "more batches padded or read than yielded"),
        (lambda s: s.update(pad=["a", "b"]), "2 batches to repeat"),
        (lambda s: s.update(finished=True), "a finished epoch holding batches"),
        (lambda s: s.pop("inner"), "has no 'inner'"),
        (lambda s: s.update(every=3), r"saved by even_batches\(at_end='pad', every=3\)"),
        (lambda s: s.update(kind="mixed_loader"), "this stage is 'even_batches'"),
    ],
)
def test_a_tampered_state_is_refused_at_load_naming_what_is_wrong(tamper, message):
    state = saved_state()
    tamper(state)
    with pytest.raises(StateError, match=message):
        even_batches(Batches([]), at_end="pad", every=2).load_state_dict(state)


def test_a_batch_a_state_cannot_hold_is_named_when_saving(monkeypatch):
    class Custom:
        pass

    def body(rank: int) -> str:
        wrapped = even_batches(Batches([Custom(), Custom(), Custom()]))
        next(iter(wrapped))
        with pytest.raises(StateError, match="Custom"):
            wrapped.state_dict()
        return "refused"

    assert run_ranks(monkeypatch, 2, body) == ["refused", "refused"]


def test_a_state_saved_with_other_settings_is_refused():
    state = even_batches(Batches(["a"]), at_end="pad").state_dict()
    with pytest.raises(StateError, match="at_end='pad'"):
        even_batches(Batches(["a"]), at_end="stop").load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"at_end": "drop"}, "at_end must be one of"),
        ({"every": 0}, "every must be an int >= 1"),
        ({"every": True}, "every must be an int >= 1"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(EvenBatchesError, match=message):
        even_batches([1], **kwargs)


def test_a_group_without_torch_distributed_is_an_error():
    with pytest.raises(EvenBatchesError, match="not initialised"):
        iter(even_batches([1], group=object()))


# -- real gloo runs (tests/scripts/even_check.py) -----------------------------------------

CHECK = Path(__file__).resolve().parents[1] / "scripts" / "even_check.py"


# A run takes about 3 s on a quiet 2-core machine; the bound only turns a hang into a failure, and
# must not fail a slow but correct run on a loaded one (60 s did).
RUN_TIMEOUT = 240


def check_ranks(*args: str) -> list[dict[str, Any]]:
    return last_json_line(run_python(str(CHECK), *args, timeout=RUN_TIMEOUT).stdout)


# Several cases share one launch (one interpreter per rank, one rendezvous): each launch costs
# seconds of start-up, the cases only milliseconds. The raised error runs last: its ranks stop early.
TWO_RANKS = (
    "filter/stop/1",
    "mixed/pad/1",
    "sized/stop/1",
    "skip/pad/3",
    "resume/pad/1",
    "resume/stop/2",
    "trainer/pad/1",
    "trainer/stop/2",
    "raise/stop/1",
)
THREE_RANKS = ("filter/pad/1", "mixed/stop/1", "subgroup/pad/1")


# Each launch runs once per session (tests.helpers.once), however worksteal splits this module's tests.
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    def launch() -> dict[str, list[dict[str, Any]]]:
        urls = corrupt_shards(tmp_path_factory.mktemp("corrupt"))
        return check_ranks("--world-size", "2", "--runs", *TWO_RANKS, "--", *urls)

    return once(tmp_path_factory, "even-two-ranks", launch)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    return once(tmp_path_factory, "even-three-ranks", lambda: check_ranks("--world-size", "3", "--runs", *THREE_RANKS))


def corrupt_shards(root: Path) -> list[str]:
    """Two shards of 40 records; 12 records of the first (read by one rank) have a flipped data byte."""
    urls = write_shards(str(root), sizes=[40, 40])
    for record in range(0, 24, 2):
        corrupt_data_byte(urls[0], record)
    return urls


def assert_even(ranks: list[dict[str, Any]], at_end: str) -> list[int]:
    """Every rank yielded the same number of batches: its own natural batches
    cut at the shortest rank ("stop") or padded with its first batch to the longest ("pad")."""
    natural = [len(r["natural"]) for r in ranks]
    assert len(set(natural)) > 1, f"the case must give ranks unequal counts, got {natural}"
    target = min(natural) if at_end == "stop" else max(natural)
    for rank in ranks:
        assert "error" not in rank, rank.get("error")
        own = rank["natural"]
        assert rank["batches"] == (own[:target] if at_end == "stop" else own + own[:1] * (target - len(own)))
        batches, padded, dropped, exact = rank["stats"]
        assert batches == target
        if at_end == "pad":
            assert (padded, dropped) == (target - len(own), 0)
        else:
            assert padded == 0 and (dropped == len(own) - target if exact else dropped <= len(own) - target)
    return natural


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "case", "at_end"),
    [(2, "filter", "stop"), (3, "filter", "pad"), (3, "mixed", "stop"), (2, "mixed", "pad"), (2, "sized", "stop")],
)
def test_gloo_ranks_with_run_time_uneven_counts_yield_equal_batches(request, world_size, case, at_end):
    launch = request.getfixturevalue("two_ranks" if world_size == 2 else "three_ranks")
    ranks = launch[f"{case}/{at_end}/1"]
    assert len(ranks) == world_size
    assert_even(ranks, at_end)
    if case == "sized":  # the loader has len(): what was dropped is counted exactly
        assert sorted(rank["stats"][2:] for rank in ranks) == [[0, True], [1, True]]


@pytest.mark.slow
def test_gloo_ranks_with_records_skipped_as_corrupt_on_one_rank_yield_equal_batches(two_ranks):
    ranks = two_ranks["skip/pad/3"]
    assert_even(ranks, "pad")
    assert sorted(sum(map(len, r["natural"])) for r in ranks) == [28, 40]  # 12 records skipped on one rank
    assert [len(r["warnings"]) for r in ranks] == [0, 0]  # 2 repeated batches: not yet worth a warning


@pytest.mark.slow
def test_a_corrupt_record_raised_on_one_gloo_rank_stops_every_rank_without_a_hang(two_ranks):
    ranks = two_ranks["raise/stop/1"]
    failed = [r for r in ranks if isinstance(r["natural"], str)]
    assert len(failed) == 1
    assert failed[0]["error"].startswith("CorruptRecordError: ") and "record 0 at byte offset 0" in failed[0]["error"]
    other = next(r for r in ranks if r is not failed[0])
    assert other["error"].startswith("EvenBatchesError: ")
    assert f"the loader of rank {ranks.index(failed[0])} raised" in other["error"]


@pytest.mark.slow
@pytest.mark.parametrize(("at_end", "every"), [("pad", 1), ("stop", 2)])
def test_a_gloo_epoch_resumed_from_state_dict_yields_the_uninterrupted_batches(two_ranks, at_end, every):
    ranks = two_ranks[f"resume/{at_end}/{every}"]
    for rank in ranks:
        assert "error" not in rank, rank.get("error")
        assert rank["resumed"] == rank["batches"]
    assert len({len(rank["batches"]) for rank in ranks}) == 1


@pytest.mark.slow
@pytest.mark.parametrize(("at_end", "every"), [("pad", 1), ("stop", 2)])
def test_every_rank_resumed_from_rank_0s_copy_of_the_state_yields_its_own_uninterrupted_batches(
    two_ranks, at_end, every
):
    """Trainers write rank 0's state only. Before: rank 1 took up rank 0's batches fetched ahead
    (one of rank 0's batches twice, one of its own never)."""
    ranks = two_ranks[f"trainer/{at_end}/{every}"]
    for rank in ranks:
        assert "error" not in rank, rank.get("error")
        assert rank["resumed"] == rank["batches"]
    state = ranks[0]["state"]
    assert state["kind"] == "ranks" and [entry["kind"] for entry in state["states"]] == ["even_batches"] * 2
    held = [entry["window"] + entry["next"] for entry in state["states"]]
    assert all(held) and held[0] != held[1]  # each rank held batches of its own


@pytest.mark.slow
def test_a_state_of_two_ranks_holding_batches_is_refused_on_one(two_ranks):
    state = two_ranks["trainer/pad/1"][0]["state"]
    loader = even_batches([], at_end="pad")
    with pytest.raises(StateError, match=r"saved on 2 ranks and rank\(s\) \[0, 1\] held batches .* same world size"):
        loader.load_state_dict(state)


@pytest.mark.slow
def test_ranks_of_a_subgroup_agree_among_themselves_and_a_rank_outside_is_told(three_ranks):
    ranks = three_ranks["subgroup/pad/1"]
    outside = ranks.pop()
    assert "rank 2 is not in the given group (ranks [0, 1])" in outside["error"]
    assert_even(ranks, "pad")


# The control's collective timeout: every step's all-reduce of the plain loop is bounded by it. Short, as
# the run hangs at the first rank's end anyway; 2 s still far exceeds a step of a few ms, even at load 10.
HANG_TIMEOUT = 2


@pytest.mark.slow
def test_control_without_even_batches_the_same_run_hangs_until_the_collective_timeout():
    start = time.monotonic()
    args = ("--case", "filter", "--wrap", "none", "--collective-timeout", str(HANG_TIMEOUT))
    done = run_python(str(CHECK), *args, check=False, timeout=RUN_TIMEOUT)
    assert done.returncode != 0 and not done.stdout.strip()
    # It waited out the timeout (a hang), then gloo gave up on one rank and the other lost its peer.
    assert time.monotonic() - start > HANG_TIMEOUT
    assert re.search(r"[Tt]ime(d )?out|Connection closed by peer", done.stderr), done.stderr[-3000:]


# -- the examples ---------------------------------------------------------------


def eval_results(out: str) -> tuple[str, float]:
    accuracy = re.search(r"^accuracy .*$", out, re.MULTILINE)
    loss = re.search(r"^mean log-loss ([\d.]+)$", out, re.MULTILINE)
    assert accuracy and loss, out
    return accuracy.group(0), float(loss.group(1))


@pytest.mark.slow
def test_ddp_eval_example_counts_every_sample_once_and_matches_one_process():
    alone = run_python(str(EXAMPLES / "ddp_eval.py"), timeout=RUN_TIMEOUT).stdout
    assert "world size 1: 1001 samples counted of 1001; each once (id checksums): True" in alone
    spread = run_python(
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=3",
        f"--master_port={free_port()}",
        str(EXAMPLES / "ddp_eval.py"),
        timeout=RUN_TIMEOUT,
    ).stdout
    assert "world size 3: 1001 samples counted of 1001; each once (id checksums): True" in spread
    assert sorted(re.findall(r"rank \d: (\d+) samples", spread)) == ["333", "334", "334"]
    (accuracy, loss), (accuracy_alone, loss_alone) = eval_results(spread), eval_results(alone)
    assert accuracy == accuracy_alone == "accuracy 881/1001 = 0.880120"
    assert abs(loss - loss_alone) < 1e-11  # float64 sums, added in another order
    assert "padding would count 1002 samples (1 of them twice)" in spread


@pytest.mark.slow
def test_the_benchmark_runs_and_prints_its_tables():
    done = run_python(str(REPO / "benchmarks" / "even_batches.py"), "--quick", timeout=RUN_TIMEOUT)
    # every=1 in the two step tables and in the wrapper's own Python per batch
    assert done.stdout.count("even_batches(every=1)") == 3 and "one side-group round trip" in done.stdout


# -- a rank that stalls or dies ---------------------------------------------------------

FAULTS = Path(__file__).resolve().parents[1] / "scripts" / "even_faults_check.py"
JOB_TIMEOUT = 3.0  # the agreement's wait a stalled rank makes the others wait (5 s before: 2 s more per test)
MARGIN = 5.0  # gloo noticing, the other ranks' marks in the store, process scheduling on a loaded machine


def fault_reports(fault: str, out: Path) -> list[dict[str, Any] | None]:
    done = run_python(
        str(FAULTS), "--fault", fault, "--timeout", str(JOB_TIMEOUT), "--out", str(out), timeout=RUN_TIMEOUT
    )
    return last_json_line(done.stdout)


@pytest.mark.slow
def test_a_rank_that_stops_iterating_makes_the_others_raise_naming_it_within_the_jobs_timeout(tmp_path):
    """Before: the side group had gloo's default timeout (30 min), so the other rank waited that long."""
    waiting, stalled = fault_reports("stall", tmp_path)
    # rank 1 had posted the agreement on batch 3 before it handed over batch 2
    assert waiting is not None and waiting["batches"] == 3, waiting
    assert waiting["error"].startswith("EvenBatchesError: "), waiting["error"]
    assert "rank 1 stalled or died" in waiting["error"]
    assert waiting["seconds"] <= JOB_TIMEOUT + MARGIN
    assert stalled is not None and stalled["error"].startswith("EvenBatchesError: "), stalled  # when it goes on


@pytest.mark.slow
def test_a_rank_that_dies_makes_the_others_raise_naming_it(tmp_path):
    """Before: a raw gloo RuntimeError ("Connection closed by peer") naming no rank."""
    waiting, dead = fault_reports("die", tmp_path)
    assert dead is None
    # the agreement on batch 3, posted before rank 1 handed over batch 2, may complete before it exits
    assert waiting is not None and waiting["batches"] in (2, 3), waiting
    assert waiting["error"].startswith("EvenBatchesError: "), waiting["error"]
    assert "rank 1 stalled or died" in waiting["error"]
    assert waiting["seconds"] <= JOB_TIMEOUT + MARGIN
