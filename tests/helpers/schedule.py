"""The order in which pytest-xdist hands out the suite's tests: the long ones first, spread over the workers.

``scripts/test.sh`` runs ``--dist worksteal``: the scheduler first gives each of ``n`` workers one
contiguous run of the collection (the first third, the second, the last, for three workers), then an
idle worker steals the back half of the longest queue. In plain collection order the long tests (the
benchmark smoke launch, the type check, the doc blocks, the reads over 2 GiB, the trainer examples)
sit wherever their files sort; one of them starting in the last minute of a run is the suite's tail,
with the other workers idle. :func:`order` moves them to the front of the workers' runs, the longest
first and each to the run with the least long work so far (longest processing time first), so every
worker starts on its long tests and the stealing at the end moves short ones.

A *unit* is a set of node-id prefixes whose tests stay together, in their own order, on one worker:
tests that share one launch (:func:`tests.helpers.once.once`) or one lock must not be split, or a
second worker would sit waiting on the first. Only the ranks of the seconds matter: a figure needs an
update when a test's rank changes, not with every run. A test in no unit keeps its place among the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

SMOKE = "tests/test_benchmarks_smoke.py::test_"

#: (node-id prefixes, seconds): the suite's long units; a prefix that matches nothing is ignored. Seconds from
#: one whole-suite run's ``--durations=60`` (2026-12-07, 3 workers, load 20-30 on 2 cores: 3-4x a quiet run).
LONG_UNITS: tuple[tuple[tuple[str, ...], float], ...] = (
    # One 2-node cluster at a time (the "ray-cluster" lock): both modules on one worker. Not in the run
    # above (then opt-in): -n 0 figures at load 15-27 of their own, 352-530 s together.
    (("tests/test_ray_train.py", "tests/test_ray_write.py"), 700),
    (("tests/formats/test_over_2gib.py",), 650),  # six reads under one lock: one after another on any worker
    ((SMOKE + "formats",), 180),  # a launch each (test_benchmarks_smoke.LAUNCHES)
    (tuple(SMOKE + name for name in ("compare", "shuffle", "packing", "stalls", "autotune", "tokens")), 170),
    (("tests/test_style.py::test_the_package_has_no_basedpyright_errors",), 233),
    (("tests/cli/test_cli_page.py::test_every_command_on_the_cli_page",), 175),
    (("tests/test_trainers.py::test_lightning_ddp_trains_on_every_sample",), 146),
    (("tests/formats/test_formats_lance.py::test_every_row_exactly_once_over_two_ranks_and_workers",), 134),
    (("tests/state/test_resume.py::test_example_runs",), 127),
    (("tests/formats/test_formats_array_record.py::test_a_stateful_dataloader_with_two_workers",), 108),
    (("tests/test_docs.py::test_every_code_block",), 104),
    (("tests/sources/test_faults_reading.py::test_deleting_every_temp_file_mid_iteration",), 100),
    (("tests/test_examples.py::test_pretrain_gpt",), 100),
    (("tests/test_docs.py::test_the_site_builds",), 95),
    (("tests/test_docs.py::test_a_broken_link",), 75),
    (("tests/test_ddp.py",), 62),
    ((SMOKE + "remote",), 40),
)

Item = TypeVar("Item")


def unit_of(nodeid: str) -> int | None:
    """The index in :data:`LONG_UNITS` of the first prefix ``nodeid`` starts with, if any."""
    return next((i for i, (prefixes, _) in enumerate(LONG_UNITS) if nodeid.startswith(prefixes)), None)


def worksteal_runs(count: int, workers: int) -> list[int]:
    """How many tests each worker's first run holds: what ``--dist worksteal`` hands ``workers`` idle workers
    out of ``count`` (each gets the rest divided by the workers still to serve, rounded down)."""
    runs = []
    for served in range(workers):
        runs.append((count - sum(runs)) // (workers - served))
    return runs


def order(items: Sequence[Item], nodeids: Sequence[str], workers: int) -> list[Item]:
    """``items`` (node ids ``nodeids``) reordered so each of ``workers`` worksteal runs begins with long units."""
    if workers < 2:
        return list(items)
    units: dict[int, list[Item]] = {}
    rest: list[Item] = []
    for item, nodeid in zip(items, nodeids, strict=True):
        unit = unit_of(nodeid)
        (rest if unit is None else units.setdefault(unit, [])).append(item)
    runs: list[list[Item]] = [[] for _ in range(workers)]
    seconds = [0.0] * workers
    for unit in sorted(units, key=lambda u: (-LONG_UNITS[u][1], u)):  # ties: in the table's order
        lightest = seconds.index(min(seconds))
        runs[lightest] += units[unit]
        seconds[lightest] += LONG_UNITS[unit][1]
    sizes = worksteal_runs(len(items), workers)
    out: list[Item] = []
    for run, size in zip(runs, sizes, strict=True):
        take = max(0, size - len(run))  # fill the run to its size with the other tests, in their order
        out += run + rest[:take]
        rest = rest[take:]
    return out + rest
