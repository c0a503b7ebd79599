"""The suite's own schedule (tests/helpers/schedule.py): long units first in each worksteal run, none split."""

from __future__ import annotations

from tests.helpers.schedule import LONG_UNITS, order, worksteal_runs

LONG = [prefixes[0] + "::x" if prefixes[0].endswith(".py") else prefixes[0] + "_x" for prefixes, _ in LONG_UNITS]


def test_worksteal_runs_split_the_tests_as_xdist_hands_them_to_idle_workers():
    assert worksteal_runs(10, 3) == [3, 3, 4]
    assert worksteal_runs(2639, 3) == [879, 880, 880]


def test_every_long_unit_starts_a_run_or_follows_long_units_and_nothing_is_lost_or_repeated():
    short = [f"tests/test_short_{i}.py::t" for i in range(300)]
    ids = short[:100] + LONG[::-1] + short[100:]
    ordered = order(ids, ids, 3)
    assert sorted(ordered) == sorted(ids)
    sizes = worksteal_runs(len(ids), 3)
    starts = [0, sizes[0], sizes[0] + sizes[1]]  # where xdist's worksteal begins each worker's run
    for start, size in zip(starts, sizes):  # each run: its long units, then only short tests
        run = [nodeid in LONG for nodeid in ordered[start : start + size]]
        assert run == sorted(run, reverse=True) and any(run)
    assert [nodeid for nodeid in ordered if nodeid not in LONG] == short  # the rest keep their order
    longest = sorted(range(len(LONG)), key=lambda u: -LONG_UNITS[u][1])[:3]
    assert {ordered[start] for start in starts} == {LONG[u] for u in longest}  # the three longest open the runs


def test_the_tests_of_one_unit_stay_together_in_their_order():
    smoke = [prefix + "_x" for prefix in max(LONG_UNITS, key=lambda unit: len(unit[0]))[0]][:3]
    ids = [smoke[2], "tests/a.py::t", smoke[0], "tests/b.py::t", smoke[1]] + [f"tests/c.py::t{i}" for i in range(20)]
    ordered = order(ids, ids, 3)
    at = ordered.index(smoke[2])
    assert ordered[at : at + 3] == [smoke[2], smoke[0], smoke[1]]


def test_without_workers_the_order_is_the_collection_order():
    ids = ["tests/a.py::t", LONG[0], "tests/b.py::t"]
    assert order(ids, ids, 0) == ids and order(ids, ids, 1) == ids
