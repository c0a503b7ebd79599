"""Stall accounting of MixedLoader: wait and compute, the workers' stages, every rank's figures."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import pytest
import torch

import shardkit
from shardkit.loader.stalls import WINDOW, GatheredStats, LoaderStats
from shardkit.loader.timing import WorkerClock, stage_names


def slow_square(x):
    time.sleep(0.002)
    return x * x


def is_even(x):
    return x % 2 == 0


def test_a_map_is_named_by_its_function_and_names_met_twice_are_numbered():
    pipeline = shardkit.wrap(list(range(10))).map(slow_square).filter(is_even).map(slow_square).shuffle(4).batch(2)
    assert stage_names(pipeline) == [
        "batch",
        "shuffle",
        "map(slow_square)",
        "filter(is_even)",
        "map(slow_square)#2",
        "read MapSource",
    ]


def test_wait_and_compute_add_up_to_the_loops_wall_time_and_stages_stay_within_it():
    loader = shardkit.MixedLoader(shardkit.wrap(list(range(192))).map(slow_square), batch_size=16, num_workers=2)
    start = time.perf_counter()
    batches = 0
    for _ in loader:
        batches += 1
        time.sleep(0.003)  # the training step
    wall = time.perf_counter() - start
    stats = loader.stats()
    assert isinstance(stats, LoaderStats) and stats.steps == batches == 12
    looped = stats.wait_seconds + stats.compute_seconds
    assert looped <= wall and looped >= 0.9 * wall, (looped, wall)
    assert stats.compute_seconds >= 0.003 * (batches - 1)
    assert 0 < stats.wait_ratio < 1 and stats.receive_seconds <= stats.wait_seconds
    assert len(stats.workers) == 2 and sum(worker.samples for worker in stats.workers) == 192
    for worker in stats.workers:
        assert sum(worker.stages.values()) <= worker.busy_seconds * 1.001 + 1e-6
        assert worker.busy_seconds + worker.idle_seconds <= worker.elapsed_seconds <= wall
        assert 0 < worker.utilisation <= 1
    assert stats.slowest_stage is not None and stats.slowest_stage[0] == "map(slow_square)"
    # each worker slept 2 ms per sample in the map: the sampled split finds most of it there
    assert stats.stages["map(slow_square)"] >= 0.8 * 192 * 0.002


def test_the_recent_window_holds_the_last_hundred_steps_and_totals_count_every_epoch():
    loader = shardkit.MixedLoader(shardkit.wrap(list(range(120))), batch_size=1, num_workers=1, persistent_workers=True)
    for _ in range(2):
        assert sum(len(batch) for batch in loader) == 120
    stats = loader.stats()
    assert stats.steps == 240 and stats.recent_steps == WINDOW
    assert stats.recent_wait_seconds <= stats.wait_seconds
    assert stats.workers[0].samples == 240, "both epochs' figures of the persistent worker"


def test_a_loader_without_workers_counts_the_loop_only_and_gather_without_a_group_is_this_rank():
    loader = shardkit.MixedLoader(shardkit.wrap(list(range(10))), batch_size=4)
    assert len(list(loader)) == 3
    gathered = loader.stats(gather=True)
    assert isinstance(gathered, GatheredStats) and len(gathered.ranks) == 1
    assert gathered.ranks[0].steps == 3 and gathered.ranks[0].workers == ()
    assert gathered.straggler == 0 and "rank 0 waits most" in gathered.summary()


def test_stats_travel_as_json_and_come_back_equal():
    loader = shardkit.MixedLoader(shardkit.wrap(list(range(40))).map(slow_square), batch_size=8, num_workers=2)
    list(loader)
    stats = loader.stats()
    assert LoaderStats.from_dict(json.loads(json.dumps(stats.to_dict()))) == stats


def rank_one_sleeps(x):
    import torch.distributed as dist

    time.sleep(0.02 if dist.get_rank() == 1 else 0.0)  # 1.3 s over its 2 workers: above start-up noise
    return x


def _train_and_gather(rank: int, world_size: int, out_dir: str) -> None:
    import torch.distributed as dist

    source = shardkit.wrap(list(range(256))).map(rank_one_sleeps)
    loader = shardkit.MixedLoader(source, batch_size=16, num_workers=2, multiprocessing_context="fork")
    for batch in loader:
        dist.all_reduce(torch.zeros(1))  # the gradient all-reduce: the fast rank waits here for the slow one
    gathered = loader.stats(gather=True)
    started = time.monotonic()
    if rank == 0:  # rank 1 skips this gather: rank 0 reports it missing after the timeout instead of hanging
        alone = loader.stats(gather=True, timeout=0.5)
        result = {"missing": alone.missing, "seconds": time.monotonic() - started}
    else:
        result = {}
    dist.barrier()
    straggler = gathered.straggler
    slowest = gathered.ranks[straggler].slowest_stage if straggler is not None else None
    result.update(straggler=straggler, slowest=slowest and slowest[0], summary=gathered.summary())
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_the_straggling_rank_and_its_slowest_stage_are_named_and_a_missing_rank_does_not_hang(tmp_path):
    from tests.helpers.processes import gloo_ranks

    gloo_ranks(_train_and_gather, 2, str(tmp_path), start_method="fork")  # forked: a spawned rank imports torch again
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for result in results:
        assert result["straggler"] == 1, result["summary"]
        assert result["slowest"] == "map(rank_one_sleeps)", result["summary"]
        assert result["summary"].startswith("rank 1 waits most for data")
    assert results[0]["missing"] == [1] and results[0]["seconds"] < 5


def add_one(x):
    return x + 1


def test_a_sampled_micro_batch_times_each_stage_and_leaves_its_attributes_out_of_a_dict():
    """Reading an iterator's ``__dict__`` makes CPython keep its attributes in a dict, which
    slows every attribute read of its ``__next__`` for the rest of the iteration."""
    pipeline = shardkit.wrap(list(range(100))).map(add_one)
    samples = iter(pipeline)
    owner = pipeline._iterator
    if any(type(referent) is dict for referent in gc.get_referents(owner)):
        pytest.skip("this Python keeps every instance's attributes in a dict")
    clock = WorkerClock(pipeline)
    assert clock.take(samples, 8) == list(range(1, 9))  # the first micro-batch is sampled
    assert all(ns > 0 for ns in clock._sampled)  # both the map and its source were timed
    assert not any(type(referent) is dict for referent in gc.get_referents(owner))
    assert next(samples) == 9  # and the proxies are gone
