"""States saved by an older shardkit still load and resume exactly (issue 23).

The states under ``tests/fixtures/saved_states/states/`` were saved once, by
``tests/fixtures/make_saved_states.py`` on the commit each file names under
``saved_by``, before the modules were restructured. Each file holds the
recipe of the pipeline and loader that saved it, the state as JSON, and what
the uninterrupted run that saved it went on to yield (``expected``). Every
test here rebuilds that pipeline with today's code over the committed shards,
loads the old state and checks the rest of the epoch against ``expected``:
batch for batch where the design promises the same batches (same loader,
same worker count), else every id exactly as often as owed.

A failure here means a state saved by a user's checkpoint would no longer
resume: fix the code, never the fixtures (see the generator's docstring).

The states are bound to the shards' url strings, which are relative
(``shards/ex-00000.tfrecord``): every test copies the shard folders into
``tmp_path`` and runs with the working directory there, and checks that
reading wrote nothing beside them.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.make_saved_states import GLOBAL_FIXTURE, LOADER_FIXTURES, ids, loader, pipeline, set_epoch

pytestmark = pytest.mark.filterwarnings(
    "ignore:This DataLoader will create:UserWarning", "ignore:'set_vital' is deprecated:UserWarning"
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "saved_states"
DATA = ("shards", "text")
MIXED = sorted(name for name in LOADER_FIXTURES if name.startswith("mixed_loader"))
STATEFUL = sorted(name for name in LOADER_FIXTURES if name.startswith("stateful"))


def saved(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / "states" / f"{name}.json").read_text())


def listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def in_shard_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The working directory is a copy of the fixture shards, which stay byte for byte as they were."""
    for folder in DATA:
        shutil.copytree(FIXTURES / folder, tmp_path / folder)
    before = listing(tmp_path)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    assert listing(tmp_path) == before, "reading wrote or changed files beside the shards"


def resume(record: dict[str, Any], workers: int | None = None) -> list[list[int]]:
    """The batches (as ids) a fresh loader of the record's recipe yields after loading its state."""
    loader_, dataset = loader(record["recipe"], workers)
    loader_.load_state_dict(record["state"])
    set_epoch(loader_, dataset, record["recipe"]["epoch"])  # docs/resume.md: the epoch is set again after loading
    return [ids(batch) for batch in loader_]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


@pytest.mark.parametrize("name", MIXED)
def test_a_mixed_loader_state_saved_before_the_restructure_resumes_exactly(name: str, in_shard_copy: Path) -> None:
    record = saved(name)
    assert resume(record) == record["expected"]


@pytest.mark.parametrize("name", MIXED)
def test_a_mixed_loader_state_saved_before_the_restructure_resumes_on_another_worker_count(
    name: str, in_shard_copy: Path
) -> None:
    record = saved(name)
    assert Counter(flat(resume(record, workers=3))) == Counter(flat(record["expected"]))


@pytest.mark.parametrize("name", STATEFUL)
def test_a_stateful_dataloader_state_saved_before_the_restructure_resumes_exactly(
    name: str, in_shard_copy: Path
) -> None:
    record = saved(name)
    assert resume(record) == record["expected"]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_global_state_saved_before_the_restructure_resumes_on_any_world_size_with_exactly_the_owed_ids(
    world_size: int, in_shard_copy: Path
) -> None:
    name, recipe = GLOBAL_FIXTURE
    record = saved(name)
    got: list[int] = []
    for rank in range(world_size):
        dataset = pipeline({**recipe, "rank": rank, "world_size": world_size})
        dataset.load_state_dict(record["state"])
        got += [sample["id"] for sample in dataset]
    assert sorted(got) == record["expected"]  # each owed id once: expected holds each id once


def test_every_fixture_is_a_whole_epoch_split_at_its_save_point() -> None:
    """The fixtures check themselves: what was delivered plus what is expected is the epoch they were cut from."""
    ranks: dict[int, list[int]] = {0: [], 1: []}  # epoch -> the ids both ranks' mixed-loader fixtures cover
    for name, recipe in LOADER_FIXTURES.items():
        record = saved(name)
        assert record["recipe"] == recipe, name
        assert len(record["delivered"]) == recipe["saved_after"] and record["expected"], name
        epoch = flat(record["delivered"]) + flat(record["expected"])
        if recipe["loader"] == "mixed":  # one rank of two under "pad": 62 distinct ids each
            assert len(set(epoch)) == len(epoch) == 62, name
            ranks[recipe["epoch"]] += epoch
        else:
            owned = set(range(123)) | (set(range(1000, 1040)) if recipe["pipeline"] == "interleave" else set())
            assert Counter(epoch) == Counter(owned), name
    for both in ranks.values():  # 123 records, one padded onto rank 1
        assert set(both) == set(range(123)) and len(both) == 124
    record = saved(GLOBAL_FIXTURE[0])
    delivered = flat([i for rank in record["delivered"] for i in rank])
    assert sorted(delivered + record["expected"]) == list(range(123))


def test_the_fixtures_stay_small() -> None:
    assert sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file()) < 300_000


@pytest.mark.parametrize("world", [(1, 0), (2, 0), (3, 0), pytest.param((3, 2), marks=pytest.mark.slow)])
def test_mixed_loader_states_saved_before_the_restructure_gather_and_resume_on_any_world(
    world: tuple[int, int], in_shard_copy: Path
) -> None:
    """Both ranks' epoch-0 states (cut micro-batches, full shuffle buffers, "pad") gathered into one global
    MixedLoader state: every id of the epoch once, bar pad repeats, and equal batch counts on the new world."""
    from shardkit.state import merge_ranks

    records = [saved(f"mixed_loader_rank{rank}_epoch0") for rank in (0, 1)]
    state = merge_ranks([record["state"] for record in records])
    assert state["kind"] == "mixed_loader" and state["carry"] and state["balance"] == "pad"
    before = [i for record in records for i in flat(record["delivered"])]
    per_rank = []
    for rank in range(world[0]):
        recipe = {**records[0]["recipe"], "rank": rank, "world_size": world[0]}
        loader_, dataset = loader(recipe, world[1])
        loader_.load_state_dict(state)
        per_rank.append([ids(batch) for batch in loader_])
    got = Counter(before + [i for batches in per_rank for i in flat(batches)])
    assert set(got) == set(range(123))
    assert sum(got.values()) - 123 < 1 + 2 * world[0]  # the epoch's one pad repeat, and the new world's
    assert len({len(batches) for batches in per_rank}) == 1  # equal batch counts: DDP stays in step
