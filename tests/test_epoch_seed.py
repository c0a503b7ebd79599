"""SharedEpoch across DataLoader workers, per-reader seeds, and the seed user code reads."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

import shardkit
from shardkit import seeding
from shardkit.epoch import SharedEpoch, call_with_epoch_offset, epoch_offset
from shardkit.seeding import SeedError, current_seed, seed_everything, worker_seed
from shardkit.topology import Topology
from tests.helpers.shards import synthetic_read, synthetic_shards
from tests.pipeline.test_pipeline import EpochTagged, RangeSource


def probe(item: tuple[int, int]) -> dict[str, float]:
    """What an augmentation running in a worker sees: epoch, process, seed and draws."""
    epoch, i = item
    info = get_worker_info()
    return {
        "epoch": epoch,
        "i": i,
        "pid": os.getpid(),
        "worker": -1 if info is None else info.id,
        "seed": current_seed(),
        "random": random.random(),
        "numpy": float(np.random.random()),
        "torch": float(torch.rand(())),
    }


def draws(seed: int) -> tuple[float, float, float]:
    seed_everything(seed)
    return random.random(), float(np.random.random()), float(torch.rand(()))


def loader(pipeline, context: str = "fork", **kwargs) -> DataLoader:
    return DataLoader(pipeline, batch_size=None, num_workers=2, multiprocessing_context=context, **kwargs)


# -- SharedEpoch --------------------------------------------------------------


def test_shared_epoch_get_set_and_validation():
    shared = SharedEpoch()
    assert shared.get() == 0
    shared.set(3)
    assert shared.get() == 3 and repr(shared) == "SharedEpoch(3)"
    assert SharedEpoch(7).get() == 7
    with pytest.raises(ValueError, match="epoch must be an int >= 0 and <= 9223372036854775807, got -2"):
        shared.set(-2)
    with pytest.raises(ValueError, match="epoch must be an int >= 0 and <= 9223372036854775807, got '1' \\(str\\)"):
        SharedEpoch("1")


def test_effective_epoch_adds_the_repeat_offset_only_inside_the_call():
    shared = SharedEpoch(2)
    assert shared.effective() == 2 and epoch_offset() == 0
    assert call_with_epoch_offset(3, shared.effective) == 5
    assert shared.effective() == 2 and shared.get() == 2


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_set_epoch_reaches_persistent_workers(context):
    pipeline = EpochTagged(8).map(probe)
    workers = loader(pipeline, context, persistent_workers=True)
    first = list(workers)
    pipeline.set_epoch(1)
    second = list(workers)
    assert {r["epoch"] for r in first} == {0}
    assert {r["epoch"] for r in second} == {1}
    assert sorted(r["i"] for r in second) == list(range(8))
    # The same worker processes served both epochs, with fresh seeds.
    assert {r["pid"] for r in first} == {r["pid"] for r in second}
    assert len({r["pid"] for r in first}) == 2
    for epoch, records in ((0, first), (1, second)):
        for r in records:
            assert r["seed"] == worker_seed(0, epoch, 0, r["worker"])


def test_set_epoch_reaches_fresh_workers_too():
    source = EpochTagged(4)
    workers = loader(source.map(probe))
    source.set_epoch(6)
    assert {r["epoch"] for r in workers} == {6}


# -- seeds ----------------------------------------------------------------------


def test_worker_seed_is_deterministic_64_bit_and_distinct_per_argument():
    grid = [(s, e, r, w) for s in range(4) for e in range(4) for r in range(4) for w in range(4)]
    seeds = [worker_seed(*args) for args in grid]
    assert len(set(seeds)) == len(grid)
    assert all(0 <= s < 2**64 for s in seeds)
    assert seeds == [worker_seed(*args) for args in grid]
    # Pinned: a saved run must replay on another machine or numpy version.
    assert worker_seed(42, 3, 1, 2) == 6443980785065200287
    assert shardkit.worker_seed is worker_seed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1, 0, 0, 0), "seed must be an int >= 0, got -1"),
        ((0, -1, 0, 0), "epoch must be an int >= 0"),
        ((0, 0, 1.0, 0), "rank must be an int >= 0, got 1.0"),
        ((0, 0, 0, True), "worker must be an int"),
    ],
)
def test_worker_seed_rejects_bad_arguments(args, message):
    with pytest.raises(SeedError, match=message):
        worker_seed(*args)


def test_a_numpy_int_seed_is_taken_as_that_int_and_a_negative_one_names_the_fix():
    import numpy as np

    from shardkit.seeding import check_seed

    assert check_seed(np.int64(7)) == 7 and type(check_seed(np.uint32(7))) is int
    assert worker_seed(np.int64(7), 0, 0, 0) == worker_seed(7, 0, 0, 0)
    with pytest.raises(SeedError, match=r"seed must be an int >= 0, got -3 \(int\); use abs\(\) or a hash"):
        check_seed(np.int64(-3))


def test_seed_everything_seeds_random_numpy_and_torch():
    assert draws(5) == draws(5)
    assert draws(5) != draws(6)
    assert draws(2**64 - 1) == draws(2**64 - 1)
    assert draws(2**32 + 5) != draws(5)  # numpy gets the high bits too
    with pytest.raises(SeedError, match="must be < 2\\*\\*64"):
        seed_everything(2**64)


def test_streams_from_one_reader_are_independent():
    topology = Topology()
    shuffle = seeding.generator(0, 0, topology, seeding.SHUFFLE_STREAM).random(4)
    mix = seeding.generator(0, 0, topology, seeding.INTERLEAVE_STREAM).random(4)
    assert not np.allclose(shuffle, mix)


def run(rank: int, epoch: int, context: str = "fork") -> list[dict[str, float]]:
    source = EpochTagged(8, rank=rank, world_size=2)
    source.set_epoch(epoch)
    return [{k: v for k, v in r.items() if k != "pid"} for r in loader(source.map(probe), context)]


def test_workers_and_ranks_draw_differently_and_repeat_across_runs():
    torch.manual_seed(1)
    epoch0 = [run(rank, 0) for rank in range(2)]
    torch.manual_seed(2)  # the DataLoader's own base seed must not matter
    assert [run(rank, 0) for rank in range(2)] == epoch0

    first_draws = {}
    for rank, records in enumerate(epoch0):
        for r in records:
            assert r["seed"] == worker_seed(0, 0, rank, r["worker"])
            first_draws.setdefault((rank, r["worker"]), r)
    assert len(first_draws) == 4
    # Each reader's first augmentation is the first draw after seed_everything(its seed).
    for r in first_draws.values():
        assert (r["random"], r["numpy"], r["torch"]) == draws(r["seed"])
    for key in ("seed", "random", "numpy", "torch"):
        assert len({r[key] for r in first_draws.values()}) == 4

    epoch1 = [run(rank, 1) for rank in range(2)]
    assert {r["seed"] for rs in epoch1 for r in rs}.isdisjoint({r["seed"] for rs in epoch0 for r in rs})


def test_repeat_reseeds_every_pass_inside_a_persistent_worker():
    workers = loader(EpochTagged(4).repeat(3).map(probe), persistent_workers=True)
    records = list(workers)
    assert len(records) == 12
    for worker in (0, 1):
        mine = [r for r in records if r["worker"] == worker]
        assert [r["epoch"] for r in mine] == [0, 0, 1, 1, 2, 2]
        assert [r["seed"] for r in mine[::2]] == [worker_seed(0, k, 0, worker) for k in range(3)]


def test_main_process_rng_is_left_to_the_user(monkeypatch):
    monkeypatch.setattr(seeding, "_current_seed", None)
    with pytest.raises(SeedError, match="no shardkit iteration has started in this process"):
        current_seed()
    torch.manual_seed(5)
    expected = (torch.rand(2), random.getstate())
    torch.manual_seed(5)
    assert list(RangeSource(4, rank=1, world_size=2)) == [1, 3]
    assert torch.equal(torch.rand(2), expected[0]) and random.getstate() == expected[1]
    assert current_seed() == worker_seed(0, 0, 1, 0)


@pytest.mark.parametrize("epoch", [2**63, 2**64 + 5])
def test_set_epoch_past_int64_is_an_epoch_error_naming_the_bound(epoch):
    source = shardkit.ShardedDataset(synthetic_shards([4]), read_fn=synthetic_read)
    with pytest.raises(shardkit.ShardkitError, match=r"epoch must be an int >= 0 and <= 9223372036854775807"):
        source.set_epoch(epoch)
