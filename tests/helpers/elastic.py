"""Pipelines whose samples are their ids, for resuming on another world size (tests/state/test_elastic_stages.py
and tests/scripts/elastic_check.py), and the check that a run delivered every id as its balance promises.

Source A's record ``i`` reads as ``i``; source B's as ``OFFSET + i``. Every pipeline holds something of its
own between samples: a ``.shuffle(n)`` buffer, an ``interleave`` of two sources, a ``repeat``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch

from shardkit import ShardedDataset, interleave
from shardkit.pipeline import Pipeline
from tests.helpers.once import once
from tests.helpers.processes import REPO, run_python
from tests.helpers.shards import positional_read, positional_shards

COUNTS_A = [230, 410, 170, 388, 302, 95]  # 1,595 records: no world size below 5 divides it
COUNTS_B = [120, 77, 301]  # 498
OFFSET = 100_000
KINDS = ("shuffle", "interleave", "repeat")


def source(counts: list[int], seed: int, rank: int | None, world_size: int | None, balance: str) -> ShardedDataset:
    dataset = ShardedDataset(
        positional_shards(counts),
        positional_read,
        shuffle=True,
        seed=seed,
        balance=balance,
        rank=rank,
        world_size=world_size,
    )
    dataset.shuffle_block, dataset.shuffle_window = 32, 200
    return dataset


def offset(sample: int) -> int:
    """Source B's ids (module level: workers started with spawn unpickle it)."""
    return OFFSET + sample


def same(sample: int) -> int:
    return sample


def pipeline(kind: str, rank: int | None, world_size: int | None, balance: str) -> Pipeline:
    """``kind``'s pipeline as rank ``rank`` of ``world_size`` reads it (None: detected, under torchrun)."""
    a = source(COUNTS_A, 9, rank, world_size, balance)
    if kind == "shuffle":  # the README's: a source, a map, a shuffle buffer
        return a.map(same).shuffle(16)
    if kind == "interleave":
        b = source(COUNTS_B, 3, rank, world_size, balance).map(offset)
        return interleave([a.shuffle(8), b], weights=[2, 1], seed=4, stop="all_exhausted").shuffle(16)
    if kind == "repeat":
        return a.shuffle(8).repeat(2)
    raise ValueError(kind)


def expected(kind: str) -> Counter[int]:
    """Every id and how many times one uninterrupted epoch delivers it under balance="none"."""
    ids = Counter(range(sum(COUNTS_A)))
    if kind == "interleave":
        ids.update(OFFSET + i for i in range(sum(COUNTS_B)))
    if kind == "repeat":
        ids.update(range(sum(COUNTS_A)))
    return ids


def check_delivered(kind: str, balance: str, worlds: Iterable[int], delivered: Iterable[int]) -> dict[str, int]:
    """:func:`check_ids` for ``kind``'s pipeline: two streams (sources or passes) but for "shuffle"."""
    return check_ids(expected(kind), balance, worlds, delivered, streams=2 if kind != "shuffle" else 1)


def check_ids(
    want: Counter[Any], balance: str, worlds: Iterable[int], delivered: Iterable[Any], streams: int = 1
) -> dict[str, int]:
    """Assert ``delivered`` (every phase of an epoch, on worlds of ``worlds`` ranks one after another) holds
    every id of ``want`` exactly once under "none"; under "pad" no id missing and only pad repeats; under "drop"
    no id twice and only dropped ones missing. Each world, in each pass of each of ``streams`` sources, pads (or
    drops) fewer than its size in positions and as many again in held samples. Returns the missing and repeated
    counts."""
    got = Counter(delivered)
    missing = sum((want - got).values())
    repeated = sum((got - want).values())
    assert set(got) <= set(want), sorted(set(got) - set(want))[:10]
    bound = streams * sum(2 * w for w in worlds)
    if balance == "none":
        assert (missing, repeated) == (0, 0)
    elif balance == "pad":
        assert missing == 0 and repeated < bound, (missing, repeated)
    else:
        assert repeated == 0 and missing < bound, (missing, repeated)
    return {"missing": missing, "repeated": repeated}


World = tuple[int, int]  # (ranks, DataLoader workers per rank; 0 is the main process)
Make = Callable[[int, int, str], Any]  # (rank, world_size, balance) -> a dataset whose samples are their ids


@contextmanager
def as_worker(worker: int, workers: int) -> Iterator[None]:
    """Run as DataLoader worker ``worker`` of ``workers`` (0: the main process), in this process."""
    info = None if workers == 0 else SimpleNamespace(id=worker, num_workers=workers)
    with mock.patch.object(torch.utils.data, "get_worker_info", lambda: info):
        yield


def roundtrip(state: Any) -> Any:
    """Through JSON, as a checkpoint stores it."""
    return json.loads(json.dumps(state))


def save_world(make: Make, balance: str, world: World, reads: list[int], state: Any = None) -> tuple[list, list]:
    """Every reader of ``world`` (ranks simulated in this process; resuming ``state`` if given) reads
    ``reads[...]`` samples and saves: what they delivered, and each rank's list of its workers' states."""
    delivered, states = [], []
    ranks, workers = world
    for rank in range(ranks):
        worker_states = []
        for worker in range(max(workers, 1)):
            dataset = make(rank, ranks, balance)
            if state is not None:
                dataset.load_state_dict(state)
            with as_worker(worker, workers):
                iterator = iter(dataset)
                for _ in range(reads[(rank * max(workers, 1) + worker) % len(reads)]):
                    sample = next(iterator, None)
                    if sample is not None:
                        delivered.append(sample)
                worker_states.append(roundtrip(dataset.state_dict()))
        states.append(worker_states)
    return delivered, states


def resume_world(make: Make, balance: str, world: World, state: Any) -> list[list[list[Any]]]:
    """What each reader of ``world`` delivers to the end of the epoch from the global ``state``, per rank a
    list of its workers' samples."""
    ranks, workers = world
    out = []
    for rank in range(ranks):
        per_worker = []
        for worker in range(max(workers, 1)):
            dataset = make(rank, ranks, balance)
            dataset.load_state_dict(state)
            with as_worker(worker, workers):
                per_worker.append(list(dataset))
        out.append(per_worker)
    return out


def flat(ranks: list[list[list[Any]]]) -> list[Any]:
    return [sample for rank in ranks for worker in rank for sample in worker]


def check_elastic(
    make: Make, want: Iterable[Any], balance: str, old_workers: int, new: World, reads: list[int]
) -> None:
    """Saved part-way on 2 ranks of ``old_workers`` workers, gathered (``merge_ranks``) through JSON and
    resumed on ``new``: every id of ``want`` as ``balance`` promises, and equal counts per new rank
    under pad/drop."""
    from shardkit.state import merge_ranks

    before, states = save_world(make, balance, (2, old_workers), reads)
    after = resume_world(make, balance, new, roundtrip(merge_ranks(states)))
    check_ids(Counter(want), balance, [2, new[0]], before + flat(after))
    if balance != "none":
        assert equal_counts([[len(worker) for worker in rank] for rank in after])


def equal_counts(counts: list[Any]) -> bool:
    """Whether every rank's count (or list of its workers' counts) is the same."""
    return all(c == counts[0] for c in counts)


#: (mode, ranks, MixedLoader/DataLoader workers of test_elastic.py's case) of each torchrun.
WORLDS = (("save", 2, 2), ("load", 3, 1), ("load", 1, 3))
_torchruns: dict[str, Any] = {}


def torchrun_worlds(factory: pytest.TempPathFactory) -> dict[tuple[str, int], Any]:
    """tests/scripts/elastic_check.py's worlds of :data:`WORLDS`, each world's JSON line by (mode, ranks).
    The script forks each world's gloo ranks with torchrun's environment from one interpreter that
    imported torch once. Run once per session, for every xdist worker (:func:`tests.helpers.once.once`),
    and shared by tests/state/test_elastic.py and test_elastic_stages.py."""
    if "results" not in _torchruns:

        def launch() -> dict[str, Any]:
            root = factory.mktemp("elastic")
            script = REPO / "tests" / "scripts" / "elastic_check.py"
            env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
            done = run_python(str(script), "worlds", str(root), timeout=400, env=env)
            return {"root": str(root), "lines": json.loads(done.stdout.strip().splitlines()[-1])}

        shared = once(factory, "elastic-worlds", launch)
        lines = shared["lines"]
        _torchruns["results"] = {(mode, ranks): lines[f"{mode} {ranks}"] for mode, ranks, _ in WORLDS}
        _torchruns["root"] = Path(shared["root"])
    return _torchruns["results"]


def torchrun_root() -> Path:
    """The folder :func:`torchrun_worlds` wrote into (files of every rank's run)."""
    return _torchruns["root"]


NEW_WORLDS: tuple[World, ...] = ((1, 0), (1, 2), (3, 0), (3, 2))


def elastic_property(make: Make, want: list[Any], count: int = 12) -> None:
    """:func:`check_elastic` over what hypothesis draws: the balance, the old world's workers (0 or 2),
    the new world (1 or 3 ranks, 0 or 2 workers) and how far each old reader got (0 to past its share)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tests.helpers.examples import examples

    share = len(want) // 2 + 2

    @settings(max_examples=examples(count), deadline=None)
    @given(
        balance=st.sampled_from(["none", "pad", "drop"]),
        old_workers=st.sampled_from([0, 2]),
        new=st.sampled_from(NEW_WORLDS),
        reads=st.lists(st.integers(0, share), min_size=1, max_size=4),
    )
    def check(balance: str, old_workers: int, new: World, reads: list[int]) -> None:
        check_elastic(make, want, balance, old_workers, new, reads)

    check()
