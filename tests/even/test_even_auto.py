"""even_batches(every="auto"): one window for every rank, within 1% of a step; and a loader that fails to start.

Ranks run as threads agreeing through the fake side group of
tests/even/test_even_batches.py, each with its own measured round trip, so
ranks that measure differently propose different windows on purpose;
tests/scripts/even_auto_check.py runs it under gloo with one rank's steps slowed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit import EvenBatchesError, even_batches
from shardkit.even import auto
from shardkit.state import StateError
from tests.helpers import even as even_helpers
from tests.helpers.even import Batches, expected, rank_batches
from tests.helpers.examples import examples
from tests.helpers.load import hang_bound
from tests.helpers.processes import last_json_line, run_python


def run_ranks(monkeypatch: pytest.MonkeyPatch, round_trips: list[float], body: Callable[[int], Any]) -> list[Any]:
    """``body(rank)`` in one thread per rank, agreeing through one fake world; rank r measured ``round_trips[r]``."""
    return even_helpers.run_ranks(monkeypatch, len(round_trips), body, round_trips=round_trips)


# -- the choice ------------------------------------------------------------------------------


@given(round_trip=st.floats(0, 1), step=st.floats(1e-6, 10), largest=st.sampled_from([1, 8, 64]))
def test_auto_window_is_the_smallest_power_of_two_whose_share_of_a_step_is_at_most_one_percent(
    round_trip, step, largest
):
    window = auto.auto_window(round_trip, step, largest=largest)
    assert 1 <= window <= largest and window & (window - 1) == 0
    if window < largest:
        assert round_trip / window <= auto.SHARE * step
    if window > 1:
        assert round_trip / (window // 2) > auto.SHARE * step


def test_auto_window_without_a_measured_step_proposes_the_probe_window():
    assert auto.auto_window(0.5, None) == auto.PROBE


def test_auto_window_examples():
    assert auto.auto_window(300e-6, 0.1) == 1  # a 100 ms GPU step: 0.3% at every batch
    assert auto.auto_window(300e-6, 0.01) == 4  # 10 ms: 3% at 1, 0.75% at 4
    assert auto.auto_window(300e-6, 300e-6) == 64  # a step as short as the round trip: the cap


def windows(results: list[Any]) -> set[int | None]:
    return {stats.window for _, stats in results}


def epoch(rank: int, count: int, at_end: str = "stop", step: Callable[[int], None] | None = None) -> tuple[list, Any]:
    wrapped = even_batches(Batches(rank_batches(rank, count)), at_end=at_end, every="auto")
    seen = []
    for batch in wrapped:
        seen.append(batch)
        if step is not None:
            step(rank)
    return seen, wrapped.stats()


def test_ranks_that_propose_different_windows_all_take_the_largest(monkeypatch):
    # rank 0 measured no round trip (proposes 1), rank 2 one of a second (proposes the cap)
    results = run_ranks(monkeypatch, [0.0, 1e-4, 1.0], lambda rank: epoch(rank, 120))
    assert windows(results) == {auto.AUTO_MAX}
    for rank, (seen, stats) in enumerate(results):
        assert seen == rank_batches(rank, 120) and stats.batches == 120


def test_a_rank_with_slower_steps_gets_the_same_window_as_the_others(monkeypatch):
    """Rank 1's steps take 20 ms (it would take 8 at a round trip of 1 ms); rank 0's take
    microseconds (it would take the cap below 3 ms): both take the cap, and stay in step."""

    def step(rank: int) -> None:
        if rank == 1:
            time.sleep(0.02)

    results = run_ranks(monkeypatch, [1e-3, 1e-3], lambda rank: epoch(rank, 40, step=step))
    assert auto.auto_window(1e-3, 0.02) == 8
    assert windows(results) == {auto.AUTO_MAX}


def test_a_slow_round_trip_against_slow_steps_picks_a_window_in_between(monkeypatch):
    def step(rank: int) -> None:
        time.sleep(0.01)

    results = run_ranks(monkeypatch, [4e-4, 4e-4], lambda rank: epoch(rank, 30, step=step))
    # 0.4 ms against 10 ms: 4% at 1, 1% at 4 (a loaded machine sleeps longer: 2 or 1)
    assert len(windows(results)) == 1 and windows(results) <= {1, 2, 4}


@pytest.mark.filterwarnings("ignore:even_batches. epoch")
@settings(max_examples=examples(60), deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=2, max_size=3),
    at_end=st.sampled_from(["stop", "pad"]),
    round_trips=st.lists(st.sampled_from([0.0, 1e-5, 1e-3, 1.0]), min_size=3, max_size=3),
)
def test_every_auto_yields_the_same_batches_as_a_fixed_window_stop_at_min_pad_to_max(counts, at_end, round_trips):
    with pytest.MonkeyPatch.context() as monkeypatch:
        results = run_ranks(monkeypatch, round_trips[: len(counts)], lambda rank: epoch(rank, counts[rank], at_end))
    for rank, result in enumerate(results):
        if at_end == "pad" and 0 in counts and max(counts) > 0:
            assert isinstance(result, EvenBatchesError), result  # a rank has nothing to repeat
            continue
        assert not isinstance(result, BaseException), result
        seen, stats = result
        assert seen == expected(rank, counts, at_end)
        assert stats.batches == len(seen)
    if all(not isinstance(r, BaseException) for r in results):
        assert len(windows(results)) == 1  # decided everywhere or nowhere (an epoch of under 8 batches)


@pytest.mark.filterwarnings("ignore:even_batches. epoch")
@pytest.mark.parametrize("save_after", [0, 2, 3, 7, 8, 11, 30])
@pytest.mark.parametrize("at_end", ["stop", "pad"])
def test_a_resumed_auto_epoch_yields_the_uninterrupted_batches_and_keeps_its_window(monkeypatch, at_end, save_after):
    counts = [45, 52]
    round_trips = [1e-3, 1.0]  # the choice: the cap

    def body(rank: int) -> tuple[list, list, Any, Any]:
        whole = list(even_batches(Batches(rank_batches(rank, counts[rank])), at_end=at_end, every="auto"))
        first = even_batches(Batches(rank_batches(rank, counts[rank])), at_end=at_end, every="auto")
        iterator, seen = iter(first), []
        for _ in range(save_after):
            seen.append(next(iterator))
        state = first.state_dict()
        again = even_batches(Batches(rank_batches(rank, counts[rank])), at_end=at_end, every="auto")
        again.load_state_dict(state)
        seen += list(again)
        return whole, seen, state, again.stats()

    for rank, (whole, resumed, state, stats) in enumerate(run_ranks(monkeypatch, round_trips, body)):
        assert resumed == whole == expected(rank, counts, at_end)
        assert state["every"] == "auto"
        # saved after the proposals' agreement settled (batch 8 on): the choice is in the state
        assert state["auto"] == (auto.AUTO_MAX if save_after >= 8 else 0)
        # resumed before the choice: the steps measured before saving were saved too
        assert stats.window == auto.AUTO_MAX


def test_a_state_of_a_fixed_window_is_refused_by_auto_and_a_tampered_choice_is_named(monkeypatch):
    state = even_batches(Batches(["a", "b"]), every=4).state_dict()
    with pytest.raises(StateError, match=r"saved by even_batches\(at_end='stop', every=4\)"):
        even_batches(Batches([]), every="auto").load_state_dict(state)
    state = {**even_batches(Batches(["a"]), every="auto").state_dict(), "auto": 128}
    with pytest.raises(StateError, match="a window of 128 chosen by every='auto'"):
        even_batches(Batches([]), every="auto").load_state_dict(state)
    state = {**even_batches(Batches(["a"]), every=2).state_dict(), "auto": 2}
    with pytest.raises(StateError, match="a window of 2 chosen by every=2"):
        even_batches(Batches([]), every=2).load_state_dict(state)
    state = {**even_batches(Batches(["a"]), every="auto").state_dict(), "steps": [0.1, -1.0]}
    with pytest.raises(StateError, match=r"step times \[0.1, -1.0\]"):
        even_batches(Batches([]), every="auto").load_state_dict(state)


def test_a_state_saved_before_every_auto_existed_still_loads():
    state = even_batches(Batches(["a", "b"]), every=2).state_dict()
    del state["agreements"], state["auto"]
    again = even_batches(Batches(["a", "b"]), every=2)
    again.load_state_dict(state)
    assert list(again) == ["a", "b"]


@pytest.mark.parametrize("every", ["fast", "Auto", 0, 2.5, None])
def test_a_bad_every_is_named_with_the_fix(every):
    with pytest.raises(EvenBatchesError, match=rf"every must be an int >= 1, got {every!r}.*or every=\"auto\""):
        even_batches([1], every=every)


def test_stats_name_the_window_of_a_fixed_every(monkeypatch):
    def body(rank: int) -> tuple[list, Any]:
        wrapped = even_batches([1, 2, 3], every=3)
        return list(wrapped), wrapped.stats()

    results = run_ranks(monkeypatch, [0.0, 0.0], body)
    assert windows(results) == {3} and [seen for seen, _ in results] == [[1, 2, 3]] * 2


# -- a loader that fails before its first batch -------------------------------------------


class FailsToStart:
    """A loader whose ``iter()`` raises on one rank (a DataLoader that cannot start its workers,
    a dataset that cannot list its shards), or whose ``load_state_dict`` raises."""

    def __init__(self, rank: int, failing: int, where: str) -> None:
        self.rank, self.failing, self.where = rank, failing, where

    def __iter__(self) -> Iterator[int]:
        if self.rank == self.failing and self.where == "iter":
            raise OSError(f"rank {self.rank} cannot start")
        return iter(range(10))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if self.rank == self.failing and self.where == "load":
            raise OSError(f"rank {self.rank} cannot load its state")


@pytest.mark.parametrize("every", [1, 4, "auto"])
@pytest.mark.parametrize("where", ["iter", "load"])
def test_a_loader_that_raises_before_its_first_batch_on_one_rank_stops_every_rank_at_once(monkeypatch, where, every):
    """Before: the error left iter() before the first agreement was posted, and the other
    ranks waited for it until the job's timeout (the fake world reports that as a hang)."""

    def body(rank: int) -> list[int]:
        wrapped = even_batches(FailsToStart(rank, 1, where), every=every)
        if where == "load":
            wrapped.load_state_dict(even_batches(FailsToStart(rank, 1, "nowhere"), every=every).state_dict())
        return list(wrapped)

    started = time.monotonic()
    results = run_ranks(monkeypatch, [0.0, 0.0, 0.0], body)
    assert time.monotonic() - started < hang_bound(30)
    assert isinstance(results[1], OSError) and f"rank 1 cannot {'start' if where == 'iter' else 'load'}" in str(
        results[1]
    )
    for rank in (0, 2):
        assert isinstance(results[rank], EvenBatchesError), results[rank]
        assert "the loader of rank 1 raised" in str(results[rank])


# -- real gloo ranks (tests/scripts/even_auto_check.py) ------------------------------------

CHECK = Path(__file__).resolve().parents[1] / "scripts" / "even_auto_check.py"


@pytest.mark.slow
def test_gloo_ranks_with_one_slowed_choose_one_window_yield_equal_batches_and_resume_exactly():
    ranks = last_json_line(run_python(str(CHECK), timeout=240).stdout)
    assert [r["error"] for r in ranks] == [None, None]
    assert ranks[0]["window"] == ranks[1]["window"] is not None
    assert ranks[0]["round_trip"] > 0 and ranks[1]["round_trip"] > 0
    # each rank's proposal from its own steps; the slowed rank would have taken a smaller window
    assert ranks[0]["window"] == max(r["proposal"] for r in ranks)
    assert ranks[1]["proposal"] <= ranks[0]["proposal"]
    for rank in ranks:
        natural = rank["natural"]
        target = min(len(r["natural"]) for r in ranks)
        assert rank["batches"] == natural[:target] and rank["stats"][:3] == [target, 0, len(natural) - target]
        assert rank["resumed"] == rank["batches"]


class RaisesAtThird:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self) -> Iterator[int]:
        for i in range(10):
            if self.rank == 0 and i == 3:
                raise OSError("corrupt record")
            yield i


def test_the_wrapper_lets_go_of_a_loader_error_it_raised(monkeypatch):
    """Before: the wrapper kept the error, whose traceback holds the wrapper (a cycle) and the failed
    loader's frames (a DataLoader iterator and its worker processes) until the cyclic GC ran."""

    def body(rank: int) -> tuple[str, Any]:
        wrapped = even_batches(RaisesAtThird(rank))
        try:
            list(wrapped)
        except Exception as error:  # noqa: BLE001 - what a script that logs and goes on does
            return type(error).__name__, wrapped._iterator
        return "no error", None

    results = run_ranks(monkeypatch, [0.0, 0.0], body)
    assert [name for name, _ in results] == ["OSError", "EvenBatchesError"]
    assert [(iterator._error, iterator._inner, iterator.done) for _, iterator in results] == [(None, None, True)] * 2
