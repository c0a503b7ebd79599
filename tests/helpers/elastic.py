"""Pipelines whose samples are their ids, for resuming on another world size (tests/state/test_elastic_stages.py
and tests/scripts/elastic_check.py), and the check that a run delivered every id as its balance promises.

Source A's record ``i`` reads as ``i``; source B's as ``OFFSET + i``. Every pipeline holds something of its
own between samples: a ``.shuffle(n)`` buffer, an ``interleave`` of two sources, a ``repeat``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

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
    """Assert ``delivered`` (every phase of an epoch, on worlds of ``worlds`` ranks one after another) holds
    every id exactly once under "none"; under "pad" no id missing and only pad repeats; under "drop" no id
    twice and only dropped ones missing. Each world, in each pass of each source, pads (or drops) fewer than
    its size in positions and as many again in held samples. Returns the missing and repeated counts."""
    got, want = Counter(delivered), expected(kind)
    missing = sum((want - got).values())
    repeated = sum((got - want).values())
    assert set(got) <= set(want), sorted(set(got) - set(want))[:10]
    streams = 2 if kind != "shuffle" else 1  # sources (interleave) or passes (repeat)
    bound = streams * sum(2 * w for w in worlds)
    if balance == "none":
        assert (missing, repeated) == (0, 0)
    elif balance == "pad":
        assert missing == 0 and repeated < bound, (missing, repeated)
    else:
        assert repeated == 0 and missing < bound, (missing, repeated)
    return {"missing": missing, "repeated": repeated}


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
