"""even_batches(every="auto"): one window for every rank, within 1% of a step; and a loader that fails to start.

Ranks run as threads agreeing through the fake side group of
tests/even/test_even_batches.py, each with its own measured round trip, so
ranks that measure differently propose different windows on purpose;
tests/scripts/even_auto_check.py runs it under gloo with one rank's steps slowed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit import EvenBatchesError, even_batches
from shardkit.even import auto
from shardkit.even import wrapper as wrapper_module
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

steps = st.floats(1e-6, 10)
budgets = {
    "round_trip": st.floats(0, 1),
    "agreements": st.integers(1, 50),
    "batches": st.integers(0, 10_000),
    "largest": st.sampled_from([1, 4, 64, auto.AUTO_MAX]),
}


@settings(max_examples=examples(300))
@given(step=steps, **budgets)
def test_auto_window_is_the_smallest_power_of_two_that_keeps_the_epochs_agreements_within_the_share(
    round_trip, step, agreements, batches, largest
):
    window = auto.auto_window(round_trip, step, agreements=agreements, batches=batches, largest=largest)
    assert 1 <= window <= largest and window & (window - 1) == 0
    if window < largest:  # within budget: the agreements so far cost at most SHARE of the steps to the window's end
        assert agreements * round_trip <= auto.SHARE * step * (batches + window)
    if window > 1:  # and the smallest: half of it would not be
        assert agreements * round_trip > auto.SHARE * step * (batches + window // 2)


@settings(max_examples=examples(300))
@given(step=steps, longer=steps, **budgets)
def test_a_longer_step_never_gets_a_larger_window(round_trip, step, longer, agreements, batches, largest):
    step, longer = sorted([step, longer])
    window = auto.auto_window(round_trip, step, agreements=agreements, batches=batches, largest=largest)
    assert auto.auto_window(round_trip, longer, agreements=agreements, batches=batches, largest=largest) <= window


@given(round_trip=st.floats(0, 1), gaps=st.lists(steps, max_size=auto.MEASURED), current=st.sampled_from([1, 4, 16]))
def test_a_proposal_is_none_until_a_step_is_measured_and_grows_at_most_sixteen_fold(round_trip, gaps, current):
    proposed = auto.proposal(round_trip, gaps, agreements=3, batches=5, current=current)
    if not gaps:
        assert proposed == 0
    else:
        assert 1 <= proposed <= min(auto.AUTO_MAX, current * auto.GROWTH)


def test_windows_grow_eightfold_from_two_until_a_rank_measured_then_take_the_agreed_proposal():
    assert auto.FIRST_WINDOW == 2
    assert [auto.next_window(w, 0, 0) for w in (2, 16, 128, 256)] == [16, 128, 256, 256]
    assert auto.next_window(16, 2, 0) == 2  # shrinks at once to what the ranks measured
    assert [auto.next_window(w, 0, 8) for w in (1, 2, 4, 8)] == [2, 4, 8, 8]  # a fixed every doubles to it


def test_auto_window_examples():
    assert auto.auto_window(300e-6, 0.1) == 1  # a 100 ms GPU step: 0.3% at every batch
    assert auto.auto_window(300e-6, 0.01) == 8  # 10 ms: 0.6% at 4, 0.375% at 8
    assert auto.auto_window(300e-6, 300e-6) == auto.AUTO_MAX  # a step as short as the round trip: the cap
    # the 4th agreement of an epoch that yielded 5 batches and fetched 16 more: pays back the first three
    assert auto.auto_window(600e-6, 1.3e-3, agreements=4, batches=21) == 256


class SteadyClock:
    """``time.perf_counter`` for the wrapper: each thread's clock moves ``step`` seconds a call,
    so every step a rank measures (hand-over to the next ask) lasts exactly ``step``."""

    def __init__(self, step: float) -> None:
        self.step, self.local = step, threading.local()

    def perf_counter(self) -> float:
        self.local.now = getattr(self.local, "now", 0.0) + self.step
        return self.local.now


@pytest.mark.parametrize(
    ("step", "agreements", "window"),
    [
        (1.1e-3, 3, 256),  # windows 2, 16, then 256 for the rest (cut at 182)
        (1.3e-3, 3, 256),
        (2.6e-3, 4, 128),  # a longer step: 2, 16, 128, then the rest
        (0.1, 167, 2),  # a 100 ms step: 2, 16, then windows of 1 and 2 (one agreement is 0.6% of a step)
    ],
)
def test_an_epoch_of_200_steps_posts_few_agreements_and_stays_within_its_share(monkeypatch, step, agreements, window):
    """Before: windows 1, 2, 4, 4, then doubling to a cap of 64: 10 agreements for the short steps,
    1.2% of the steps at 0.6 ms a round trip; then windows 1, 4, 16 and 256: 4 agreements (0.9%)."""
    monkeypatch.setattr(wrapper_module, "time", SteadyClock(step))
    posted: list[int] = [0, 0]

    def body(rank: int) -> Any:
        seen, stats = epoch(rank, 200)
        posted[rank] = wrapper_module._side_group(None).seq
        return seen, stats

    results = run_ranks(monkeypatch, [600e-6, 600e-6], body)
    assert [stats.batches for _, stats in results] == [200, 200]
    assert posted == [agreements] * 2 and windows(results) == {window}
    if step == 0.1:  # no window capped: the agreements within the share of the steps up to the last window's end
        assert agreements * 600e-6 <= auto.SHARE * step * (200 + window)


def test_the_second_agreement_of_an_auto_epoch_carries_a_measured_step(monkeypatch):
    """Windows 2 and 16 before any measurement, then the ranks' proposal from the one step measured
    when the second agreement was posted (a 100 ms step: a window of 1), not a blind 128."""
    monkeypatch.setattr(wrapper_module, "time", SteadyClock(0.1))
    sizes: list[list[int]] = [[], []]
    real = wrapper_module.next_window

    def recorded(current: int, agreed: int, every: int) -> int:
        window = real(current, agreed, every)
        sizes[wrapper_module._side_group(None).rank].append(window)
        return window

    monkeypatch.setattr(wrapper_module, "next_window", recorded)
    results = run_ranks(monkeypatch, [600e-6, 600e-6], lambda rank: epoch(rank, 30))
    assert [stats.batches for _, stats in results] == [30, 30]
    assert sizes[0] == sizes[1] and sizes[0][:2] == [16, 1]


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
    """Rank 1's steps take 20 ms (it would take 16 at a round trip of 1 ms); rank 0's take
    microseconds (it would take the cap below 3 ms): both take the cap, and stay in step."""

    def step(rank: int) -> None:
        if rank == 1:
            time.sleep(0.02)

    results = run_ranks(monkeypatch, [1e-3, 1e-3], lambda rank: epoch(rank, 40, step=step))
    assert auto.proposal(1e-3, [0.02], agreements=2, batches=2, current=16) == 16
    assert windows(results) == {auto.AUTO_MAX}


def test_a_slow_round_trip_against_slow_steps_picks_a_window_in_between(monkeypatch):
    def step(rank: int) -> None:
        time.sleep(0.01)

    results = run_ranks(monkeypatch, [4e-4, 4e-4], lambda rank: epoch(rank, 30, step=step))
    # 0.4 ms against 10 ms, 3 agreements over 18 batches and the next window's: 8 (a loaded machine
    # sleeps longer: 4 or less); the second window (16) is blind
    assert auto.proposal(4e-4, [0.01], agreements=2, batches=2, current=16) == 8
    assert len(windows(results)) == 1 and windows(results) <= {1, 2, 4, 8, 16}


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
@pytest.mark.parametrize("save_after", [0, 1, 2, 3, 7, 17, 18, 19, 30])
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
        # saved after the first agreement with proposals settled (the second, at the third batch): the
        # choice is in the state; saved after two batches, that agreement is in flight and posted again
        assert state["auto"] == (auto.AUTO_MAX if save_after >= 3 else 0)
        # resumed before the choice: the steps measured before saving were saved too
        assert stats.window == auto.AUTO_MAX


def test_a_state_of_a_fixed_window_is_refused_by_auto_and_a_tampered_choice_is_named(monkeypatch):
    state = even_batches(Batches(["a", "b"]), every=4).state_dict()
    with pytest.raises(StateError, match=r"saved by even_batches\(at_end='stop', every=4\)"):
        even_batches(Batches([]), every="auto").load_state_dict(state)
    state = {**even_batches(Batches(["a"]), every="auto").state_dict(), "auto": 512}
    with pytest.raises(StateError, match="a window of 512 chosen by every='auto'"):
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
def test_gloo_ranks_with_a_rank_dependent_filter_and_one_slowed_yield_equal_batches_in_few_agreements_and_resume():
    ranks = last_json_line(run_python(str(CHECK), timeout=240).stdout)
    assert [r["error"] for r in ranks] == [None, None]
    assert ranks[0]["window"] == ranks[1]["window"] is not None
    assert ranks[0]["round_trip"] > 0 and ranks[1]["round_trip"] > 0
    # each rank's proposal from its own steps; the slowed rank's is no larger, and the ranks take the largest
    assert ranks[0]["window"] >= max(r["proposal"] for r in ranks) > 0
    assert ranks[1]["proposal"] <= ranks[0]["proposal"]
    # the same agreements on both ranks, and few: windows 2, 16, then at least 16 (a 2 ms step against a
    # round trip of at least ~0.1 ms: 4 agreements for 350 batches on a quiet machine)
    assert ranks[0]["agreements"] == ranks[1]["agreements"] <= 2 + -(-(350 - 18) // 16) + 1
    counts = [len(r["natural"]) for r in ranks]
    assert counts == [400, 350]  # the filter: rank 1's count is known only when it runs out
    for rank in ranks:
        natural = rank["natural"]
        assert rank["batches"] == natural[:350] and rank["stats"][:2] == [350, 0]
        # no len(): dropped is exact once the rank ran out, else the batches fetched ahead (a lower bound)
        dropped, exact = rank["stats"][2:]
        assert dropped == len(natural) - 350 if exact else dropped < len(natural) - 350
        # resumed inside the first windows and inside the large one: the uninterrupted batches, the same window
        assert rank["resumed"] == [rank["batches"]] * 2
        assert rank["resumed_window"][0] == rank["resumed_window"][1] is not None
    assert ranks[0]["resumed_window"] == ranks[1]["resumed_window"]


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


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(0, 2**34), budget=st.integers(1, 2**32))
def test_a_window_of_large_batches_holds_at_most_its_byte_budget_ahead(nbytes: int, budget: int) -> None:
    window = auto.held_limit(nbytes, budget)
    assert 1 <= window <= auto.AUTO_MAX and window & (window - 1) == 0
    if nbytes == 0:
        assert window == auto.AUTO_MAX
    elif window > 1:
        assert (2 * window - 1) * nbytes <= budget
        assert window == auto.AUTO_MAX or (4 * window - 1) * nbytes > budget  # the largest that fits


def test_a_proposal_for_image_batches_is_bounded_by_the_bytes_they_hold() -> None:
    images = {"image": torch.zeros(32, 3, 224, 224, dtype=torch.uint8), "label": torch.zeros(32, dtype=torch.int64)}
    nbytes = auto.batch_bytes(images)
    assert nbytes == 32 * 3 * 224 * 224 + 32 * 8
    # A slow round trip against short steps asks for the largest window; the bytes held cut it to 16.
    free = auto.proposal(0.01, [0.001] * 32, agreements=3, batches=21, current=16)
    bounded = auto.proposal(0.01, [0.001] * 32, agreements=3, batches=21, current=16, nbytes=nbytes)
    assert free == auto.AUTO_MAX and bounded == 16
    assert auto.batch_bytes([b"abc", "de", np.zeros(3, dtype=np.int32), {"n": 5}]) == 3 + 2 + 12


def test_every_auto_holds_no_more_batches_than_the_byte_budget_allows(monkeypatch) -> None:
    """Batches of 100 bytes under a 1,000-byte budget: windows of at most 4 where the steps alone would take 256."""
    monkeypatch.setattr(auto, "HELD_BYTES", 1000)
    monkeypatch.setattr(wrapper_module, "time", SteadyClock(1e-4))

    def body(rank: int) -> Any:
        wrapped = even_batches([np.full(100, rank * 100 + i % 100, dtype=np.uint8) for i in range(120)], every="auto")
        return [int(batch[0]) for batch in wrapped], wrapped.stats()

    results = run_ranks(monkeypatch, [0.01, 0.01], body)
    for rank, (seen, stats) in enumerate(results):
        assert seen == [rank * 100 + i % 100 for i in range(120)] and stats.batches == 120
    assert windows(results) == {4}
