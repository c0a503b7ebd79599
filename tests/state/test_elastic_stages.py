"""Resuming on another world size through the stages that hold something of their own: a
``.shuffle(n)`` buffer's samples, an ``interleave``'s inputs, a ``repeat``'s pass, and
MixedLoader's cut micro-batches.

Ranks are simulated in one process (the datasets take ``rank=``/``world_size=``, DataLoader
workers are patched in), so hypothesis can try many save points and worlds; the real thing,
gloo ranks with torchrun's environment, is the slow test at the end. Every sample is its id (tests/helpers/elastic.py).
Before this, ``merge_ranks`` refused all four ("a 'shuffle' stage keeps its position per rank
and cannot be split over another world size"; "... cut out of micro-batches ...") and
MixedLoader refused a gathered state ("the state is of a 'filter' stage but this stage is
'mixed_loader'") and carried samples without workers ("only a MixedLoader with num_workers >= 1
can deliver").
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit import MixedLoader
from shardkit.state import StateError, decode_positions, encode, merge_ranks
from tests.helpers.elastic import (
    KINDS,
    World,
    check_delivered,
    equal_counts,
    flat,
    pipeline,
    resume_world,
    roundtrip,
    save_world,
    torchrun_worlds,
)
from tests.helpers.examples import examples


def save(kind: str, balance: str, world: World, reads: list[int], state: Any = None) -> tuple[list[int], list[Any]]:
    """Every reader of ``world`` (resuming ``state`` if given) reads ``reads[...]`` samples and saves:
    what they delivered, and each rank's list of its workers' states."""
    return save_world(partial(pipeline, kind), balance, world, reads, state)


def resume(kind: str, balance: str, world: World, state: Any) -> list[list[int]]:
    """What each reader of ``world`` delivers to the end of the epoch from the global ``state``, per rank a
    list of its workers' samples."""
    return resume_world(partial(pipeline, kind), balance, world, state)


def check_counts(balance: str, ranks: list[list[list[int]]]) -> None:
    """Under pad/drop every new rank's workers yield the same counts as every other rank's:
    equal samples per rank, and equal batches per rank however each worker batches."""
    if balance != "none":
        assert equal_counts([[len(worker) for worker in rank] for rank in ranks])


def held(state: Any) -> int:
    """Samples held in the shuffle buffers of a state tree."""
    if isinstance(state, list):
        return sum(held(part) for part in state)
    if not isinstance(state, dict):
        return 0
    if "positions" in state:  # held by position (state version 2)
        return len(decode_positions(state["positions"], "held")) + held(state.get("upstream"))
    return len(state.get("samples", ())) + held(state.get("upstream"))


def positions(state: Any) -> list[int]:
    """The positions a shuffle node holds (packed ints)."""
    return decode_positions(state["positions"], "positions").tolist()


WORLDS = [(ranks, workers) for ranks in (1, 2, 3) for workers in (0, 2)]


@settings(max_examples=examples(30), deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    old_workers=st.sampled_from([0, 2]),
    new=st.sampled_from(WORLDS),
    balance=st.sampled_from(["none", "pad", "drop"]),
    reads=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    second_pass=st.booleans(),
)
def test_a_state_gathered_mid_epoch_through_buffers_interleave_and_repeat_resumes_on_any_world(
    kind: str, old_workers: int, new: World, balance: str, reads: list[int], second_pass: bool
) -> None:
    if kind == "repeat" and second_pass:  # every reader past its first pass: the ranks are in the same pass
        per_reader = 1595 // 2 // max(old_workers, 1) + 1
        reads = [per_reader + r for r in reads]
    before, states = save(kind, balance, (2, old_workers), reads)
    state = roundtrip(merge_ranks(states))
    after = resume(kind, balance, new, state)
    check_delivered(kind, balance, [2, new[0]], before + flat(after))
    check_counts(balance, after)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("balance", ["none", "pad", "drop"])
def test_a_state_resumed_on_three_ranks_gathers_again_and_resumes_on_two(kind: str, balance: str) -> None:
    """2x2 -> gathered -> 3x2, saved part-way -> gathered again -> 2x0: the remainder exactly once."""
    before, states = save(kind, balance, (2, 2), [140, 90, 201, 33])
    first = roundtrip(merge_ranks(states))
    assert held(first) > 0, "nothing was held in the shuffle buffers"
    middle, states = save(kind, balance, (3, 2), [50, 77, 12], first)
    second = roundtrip(merge_ranks(states))
    after = resume(kind, balance, (2, 0), second)
    check_delivered(kind, balance, [2, 3, 2], before + middle + flat(after))
    check_counts(balance, after)


def test_pad_repeats_of_held_samples_are_marked_and_owed_to_no_later_gather() -> None:
    """A pool of 30 held samples over 4 ranks under "pad": 8 each, the last rank's 2 last ones repeats.
    Saved before anything is drawn, every rank's state gathers back into the same remainder."""
    _, states = save("shuffle", "pad", (2, 1), [17])
    first = roundtrip(merge_ranks(states))
    assert held(first) == 30 and "repeats" not in first
    saved = []
    for rank in range(4):
        dataset = pipeline("shuffle", rank, 4, "pad")
        dataset.load_state_dict(first)
        iter(dataset)
        saved.append(roundtrip(dataset.state_dict()))
    assert [held(s) - held(s["upstream"]) for s in saved] == [8, 8, 8, 8]
    assert [s.get("repeats", []) for s in saved] == [[], [], [], [6, 7]]
    again = merge_ranks(saved)
    assert sorted(positions(again)) == sorted(positions(first))
    assert again["upstream"]["upstream"]["remaining"] == first["upstream"]["upstream"]["remaining"]


def test_ranks_in_different_repeat_passes_are_refused_naming_the_passes() -> None:
    _, states = save("repeat", "none", (2, 1), [10, 900])
    with pytest.raises(StateError, match=r"different repeat\(\) passes \[0, 1\]"):
        merge_ranks(states)


def test_a_gathered_global_state_is_not_gathered_twice() -> None:
    _, states = save("shuffle", "none", (2, 1), [10])
    with pytest.raises(StateError, match="not a global state gathered already"):
        merge_ranks([merge_ranks(states)])


# -- MixedLoader: gathered states, carried micro-batches -----------------------------

BATCH, MICRO = 8, 3  # micro_batch_size not dividing batch_size: every save cuts micro-batches


def mixed_loader(
    kind: str, rank: int, world_size: int, balance: str, workers: int, restart: bool = False
) -> MixedLoader:
    """Without ``restart`` its workers keep no restart points (shardkit.loader.restart): a save carries
    the undelivered samples of cut micro-batches, as these tests need."""
    loader = MixedLoader(pipeline(kind, rank, world_size, balance), BATCH, num_workers=workers, micro_batch_size=MICRO)
    if loader._micro_batches is not None:
        loader._micro_batches.restart = restart
    return loader


def save_loaders(
    kind: str, balance: str, world: World, batches: list[int], state: Any = None, restart: bool = False
) -> tuple[list, list]:
    """Every rank's MixedLoader (resuming ``state`` if given) takes ``batches[rank]`` batches and saves."""
    delivered, states = [], []
    for rank in range(world[0]):
        loader = mixed_loader(kind, rank, world[0], balance, world[1], restart)
        if state is not None:
            loader.load_state_dict(state)
        iterator = iter(loader)
        for _ in range(batches[rank % len(batches)]):
            delivered += next(iterator).tolist()
        states.append(roundtrip(loader.state_dict()))
        del iterator, loader
    return delivered, states


def resume_loaders(kind: str, balance: str, world: World, state: Any) -> list[list[list[int]]]:
    """Every new rank's batches to the end of the epoch after loading the global ``state``."""
    out = []
    for rank in range(world[0]):
        loader = mixed_loader(kind, rank, world[0], balance, world[1])
        loader.load_state_dict(state)
        out.append([batch.tolist() for batch in loader])
    return out


@pytest.fixture(scope="module")
def gathered_loaders() -> dict[str, tuple[list[int], Any]]:
    """Two ranks of two workers save mid-epoch with micro-batches cut, per balance; their states gathered."""
    out = {}
    for balance in ("none", "pad", "drop"):
        delivered, states = save_loaders("interleave", balance, (2, 2), [20, 19])
        assert all(s["carry"] for s in states), "every rank must hold cut micro-batches"
        out[balance] = delivered, roundtrip(merge_ranks(states))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("balance", ["none", "pad", "drop"])
def test_a_gathered_mixed_loader_state_resumes_on_any_world_and_workers_carried_samples_once(
    gathered_loaders: dict[str, tuple[list[int], Any]], balance: str
) -> None:
    before, state = gathered_loaders[balance]
    assert state["kind"] == "mixed_loader" and state["carry"] and state["balance"] == balance
    for world in [(1, 0), (2, 2), (3, 0), (3, 2)]:
        after = resume_loaders("interleave", balance, world, state)
        check_delivered("interleave", balance, [2, world[0]], before + [s for r in after for b in r for s in b])
        if balance != "none":
            assert equal_counts([len(batches) for batches in after]), world  # equal batch counts: no DDP hang
            assert equal_counts([sum(map(len, batches)) for batches in after]), world


@pytest.mark.slow
@pytest.mark.parametrize("balance", ["none", "pad", "drop"])
def test_states_made_at_the_delivered_point_gather_and_resume_on_any_world_exactly_once(balance: str) -> None:
    """An interleave cannot read its records again: its workers answer a save with their state at the
    delivered point, made again from a restart point (shardkit.loader.restart), so nothing is carried
    and the states merge over workers and ranks like any other."""
    before, states = save_loaders("interleave", balance, (2, 2), [20, 19], restart=True)
    assert not any(s["carry"] for s in states), "nothing carried: each worker's state is at the delivered point"
    state = roundtrip(merge_ranks(states))
    for world in [(1, 0), (2, 2), (3, 2)]:
        after = resume_loaders("interleave", balance, world, state)
        check_delivered("interleave", balance, [2, world[0]], before + [s for r in after for b in r for s in b])
        if balance != "none":
            assert equal_counts([len(batches) for batches in after]), world


@pytest.mark.slow
def test_a_mixed_loader_resumed_on_three_ranks_gathers_again_and_resumes_on_two(
    gathered_loaders: dict[str, tuple[list[int], Any]],
) -> None:
    before, state = gathered_loaders["pad"]
    middle, states = save_loaders("interleave", "pad", (3, 0), [5, 9, 2], state)
    assert any(s["carry"] for s in states)
    again = roundtrip(merge_ranks(states))
    after = resume_loaders("interleave", "pad", (2, 2), again)
    check_delivered("interleave", "pad", [2, 3, 2], before + middle + [s for r in after for b in r for s in b])
    assert equal_counts([len(batches) for batches in after])


def loader_states(kind: str, balance: str, reads: list[int], cut: int) -> tuple[list[int], list[Any]]:
    """MixedLoader states of two ranks without workers, as if the last ``cut`` samples each rank read were
    the undelivered tail of a micro-batch: what was delivered, and the states."""
    delivered, states = save(kind, balance, (2, 0), reads)
    fields = {"epoch": 0, "num_workers": 0, "batch_size": BATCH, "batch_index": 3, "finished": False}
    taken, out = [], []
    for rank, (dataset_state,) in enumerate(states):
        mine = delivered[sum(reads[:rank]) : sum(reads[: rank + 1])]
        taken += mine[:-cut]
        tail = {"worker": 0, "count": cut, "payload": encode(torch.tensor(mine[-cut:]))}
        out.append({"version": 1, "kind": "mixed_loader", **fields, "workers": [dataset_state], "carry": [tail]})
    return taken, out


@pytest.mark.parametrize("balance", ["none", "pad", "drop"])
def test_carried_micro_batches_of_a_gathered_state_resume_without_workers_on_any_world(balance: str) -> None:
    before, states = loader_states("shuffle", balance, [30, 41], 5)
    state = roundtrip(merge_ranks(states))
    assert [t["count"] for t in state["carry"]] == [5, 5] and state["balance"] == balance
    for ranks in (1, 3):
        after = resume_loaders("shuffle", balance, (ranks, 0), state)
        check_delivered("shuffle", balance, [2, ranks], before + [s for r in after for b in r for s in b])
        if balance != "none":
            assert equal_counts([len(batches) for batches in after])
            assert equal_counts([sum(map(len, batches)) for batches in after])
    middle, again = save_loaders("shuffle", balance, (3, 0), [1, 3, 2], state)
    assert any(s["carry"] for s in again), "the main process's loaders hold carried samples still"
    after = resume_loaders("shuffle", balance, (2, 0), roundtrip(merge_ranks(again)))
    check_delivered("shuffle", balance, [2, 3, 2], before + middle + [s for r in after for b in r for s in b])


def test_a_global_mixed_loader_state_is_checked_naming_the_field() -> None:
    _, states = loader_states("shuffle", "pad", [30, 41], 5)
    state = roundtrip(merge_ranks(states))
    loader = mixed_loader("shuffle", 0, 3, "pad", 0)
    with pytest.raises(StateError, match=r"state\['balance'\] must be one of"):
        loader.load_state_dict({**state, "balance": "even"})
    with pytest.raises(StateError, match="a global state"):
        loader.load_state_dict({**state, "carry": [{**state["carry"][0], "worker": 0}]})
    with pytest.raises(StateError, match=r"state\['repeat'\] must be bool"):
        loader.load_state_dict({**state, "carry": [{**state["carry"][0], "repeat": "yes"}]})


# -- real ranks: gloo, forked with torchrun's environment (tests/helpers/elastic.py) -----------


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test to ask waits for the three worlds (tests/helpers/elastic.py)
def test_two_gloo_ranks_gathered_through_shuffle_and_interleave_resume_on_one_and_three(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Saved through gather on 2 gloo ranks (MixedLoader of 2 workers, micro-batches cut), resumed in
    fresh worlds of 1 and 3 ranks: the epoch's ids exactly once ("pad": only pad repeats)."""
    results = torchrun_worlds(tmp_path_factory)
    saved = results["save", 2]
    assert all(saved["carried"]), "every rank must save with cut micro-batches"
    for ranks in (1, 3):
        loaded = results["load", ranks]
        for balance in ("none", "pad", "drop"):
            before = [s for part in saved["delivered"][balance] for s in part]
            after = [s for part in loaded["delivered"][balance] for s in part]
            check_delivered("interleave", balance, [2, ranks], before + after)
            if balance != "none":
                assert equal_counts(loaded["batches"][balance]), loaded["batches"]
