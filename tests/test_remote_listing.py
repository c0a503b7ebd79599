"""A glob is listed once per job: rank 0 lists, the other ranks receive its listing through gloo."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from shardkit.listing import list_shards
from tests.helpers import free_port

pytestmark = pytest.mark.slow  # gloo ranks in subprocesses


def _rank(rank: int, port: int, pattern: str, out_dir: str) -> None:
    import fsspec

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 0:  # memory:// is per process: only rank 0 can see these files
            fs = fsspec.filesystem("memory")
            for i in range(5):
                fs.pipe(f"/listing/shard-{i}.tfrecord", b"x" * (i + 1))
        try:
            shards = list_shards(pattern)
            result = {"urls": shards.urls(), "sizes": shards.sizes.tolist()}
        except Exception as error:
            result = {"error": f"{type(error).__name__}: {error}"}
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _run(pattern: str, tmp_path) -> list[dict]:
    mp.start_processes(_rank, args=(free_port(), pattern, str(tmp_path)), nprocs=2, start_method="spawn")
    return [json.load(open(tmp_path / f"{rank}.json")) for rank in range(2)]


def test_rank_1_gets_rank_0s_listing_without_listing_itself(tmp_path) -> None:
    results = _run("memory://listing/shard-*.tfrecord", tmp_path)
    assert results[0]["urls"] == [f"memory:///listing/shard-{i}.tfrecord" for i in range(5)]
    assert results[1] == results[0]  # rank 1 could not have listed these: they are in rank 0's memory
    assert results[0]["sizes"] == [1, 2, 3, 4, 5]


def test_a_listing_that_fails_on_rank_0_fails_on_every_rank(tmp_path) -> None:
    results = _run("memory://nothing-here/shard-*.tfrecord", tmp_path)
    assert results[0]["error"].startswith("ShardListError: no files match")
    assert results[1]["error"].startswith("ShardListError: rank 0 could not list 'memory://nothing-here/")


def _rank_zero_builds_alone(rank: int, port: int, root: str, out_dir: str) -> None:
    from datetime import timedelta

    import shardkit

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=20)
    )
    try:
        result: dict = {}
        if rank == 0:  # e.g. evaluation on rank 0 only: a glob dataset must not wait for rank 1
            dataset = shardkit.TFRecordDataset(f"{root}/*.tfrecord", decode="raw", rank=0, world_size=1)
            result = {"records": len(list(dataset))}
        dist.barrier()  # both ranks meet here only after rank 0 built and read its dataset
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_a_glob_dataset_built_on_rank_0_only_does_not_wait_for_the_other_ranks(tmp_path) -> None:
    import shardkit

    data = tmp_path / "data"
    data.mkdir()
    for shard in range(3):
        with shardkit.TFRecordWriter(str(data / f"s{shard}.tfrecord")) as writer:
            for i in range(4):
                writer.write(b"%d" % i)
    args = (free_port(), str(data), str(tmp_path))
    mp.start_processes(_rank_zero_builds_alone, args=args, nprocs=2, start_method="spawn")
    assert json.load(open(tmp_path / "0.json")) == {"records": 12}
