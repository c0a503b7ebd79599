"""A glob is listed once per job: rank 0 lists, the other ranks receive its listing through gloo."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from shardkit.listing import list_shards
from tests.helpers.processes import free_port

pytestmark = pytest.mark.slow  # gloo ranks in subprocesses

# The ranks are forked from the test's process (a spawned rank imports torch again: seconds each). They
# inherit its memory:// files too, but the test process writes none under the paths the ranks list.


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
    mp.start_processes(_rank, args=(free_port(), pattern, str(tmp_path)), nprocs=2, start_method="fork")
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
    mp.start_processes(_rank_zero_builds_alone, args=args, nprocs=2, start_method="fork")
    assert json.load(open(tmp_path / "0.json")) == {"records": 12}


def _read_glob_with_workers(rank: int, world_size: int, pattern: str, out_dir: str) -> None:
    from torch.utils.data import DataLoader

    import shardkit

    dataset = shardkit.TFRecordDataset(pattern, decode="raw")  # built in the main process: listed here, once
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork")  # as by default
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump([record.decode() for record in loader], f)


def _write_shards(root, shards: int = 6, records: int = 5) -> list[str]:
    import shardkit

    root.mkdir()
    for shard in range(shards):
        with shardkit.TFRecordWriter(str(root / f"s{shard}.tfrecord")) as writer:
            for i in range(records):
                writer.write(b"%d-%d" % (shard, i))
    return [f"{shard}-{i}" for shard in range(shards) for i in range(records)]


@pytest.mark.parametrize("counts_cache", [True, False])
def test_a_remote_glob_is_listed_once_per_job_by_default_with_two_ranks_of_two_workers(
    tmp_path, monkeypatch, counts_cache: bool
) -> None:
    """Counting the records (two ranks need counts) checks the counts cache against the identities the
    listing gave, not a listing of its own per worker."""
    from shardkit.shardlist import ShardList
    from tests.helpers.fault_server import FaultServer
    from tests.helpers.processes import gloo_ranks

    if not counts_cache:
        monkeypatch.setenv("SHARDKIT_CACHE_DIR", "")  # inherited by the ranks and their workers
    everything = _write_shards(tmp_path / "data")
    with FaultServer(str(tmp_path)) as server:
        pattern = f"{server.url}/data/s*.tfrecord"
        gloo_ranks(_read_glob_with_workers, 2, pattern, str(tmp_path), start_method="fork")
        job_listings = [r for r in server.log if r.method == "LIST"]
        server.log.clear()
        # What one listing costs (fsspec's HTTP glob asks for the page more than once); listed after the
        # ranks ran, so that the forked ranks inherited nothing this process learnt from listing it.
        ShardList.from_glob(pattern)
        one_listing = [r for r in server.log if r.method == "LIST"]
        assert one_listing and job_listings == one_listing
    ranks = [json.load(open(tmp_path / f"{rank}.json")) for rank in range(2)]
    assert sorted(ranks[0] + ranks[1]) == sorted(everything)  # every record once over the job
    assert len(ranks[0]) == len(ranks[1])


def _build_twice(rank: int, world_size: int, pattern: str, out_dir: str) -> None:
    import shardkit

    first = shardkit.TFRecordDataset(pattern, decode="raw")
    dist.barrier()
    if rank == 0:  # a shard added between two builds: the second build lists again, once for both ranks
        import shutil

        shutil.copy(first.shards[0], first.shards[0].replace("s0.", "s9."))
    dist.barrier()
    second = shardkit.TFRecordDataset(pattern, decode="raw")
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump([len(first.shards), len(second.shards)], f)


def test_each_rebuild_of_a_glob_dataset_lists_again_once_for_all_ranks(tmp_path) -> None:
    from tests.helpers.processes import gloo_ranks

    _write_shards(tmp_path / "data", shards=3)
    gloo_ranks(_build_twice, 2, str(tmp_path / "data" / "s*.tfrecord"), str(tmp_path), start_method="fork")
    assert [json.load(open(tmp_path / f"{rank}.json")) for rank in range(2)] == [[3, 4], [3, 4]]


def _rank_fails_to_list(rank: int, world_size: int, pattern: str, out_dir: str) -> None:
    import shardkit

    try:
        shardkit.TFRecordDataset(pattern, decode="raw")
        result = "built"
    except Exception as error:
        result = f"{type(error).__name__}: {error}"
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # rank 0 holds the store: it stays up until every rank has read from it


def test_a_shared_listing_that_fails_fails_on_every_rank_instead_of_hanging(tmp_path) -> None:
    from tests.helpers.processes import gloo_ranks

    gloo_ranks(_rank_fails_to_list, 2, str(tmp_path / "nothing" / "*.tfrecord"), str(tmp_path), start_method="fork")
    results = sorted(json.load(open(tmp_path / f"{rank}.json")) for rank in range(2))
    assert results[0].startswith("ShardListError: another rank listed")  # the rank that waited ...
    assert results[1].startswith("ShardListError: no files match")  # ... learns the lister's error
    assert "no files match" in results[0]


def test_the_identities_a_glob_remembers_are_those_a_directory_listing_gives() -> None:
    """So counts cached against either still match: the counts cache skips its own listing only when it
    would have found the same identities."""
    import fsspec

    from shardkit.io.identity import identity, listed_identities
    from shardkit.shardlist import ShardList

    fs = fsspec.filesystem("memory")
    for i in range(3):
        fs.pipe(f"/remembered/part-{i}.tfrecord", b"x" * (i + 1))
    shards = ShardList.from_glob("memory://remembered/part-*.tfrecord")
    seen, remembered = listed_identities([*shards.urls(), "memory:///remembered/never-listed"])
    assert seen.tolist() == [True, True, True, False]
    remembered = remembered[:3]
    listing = {fs.unstrip_protocol(info["name"]): identity(info) for info in fs.ls("/remembered", detail=True)}
    assert remembered == [listing[url] for url in shards.urls()]
    assert all(remembered)  # memory:// reports a creation time: these identities can key the cache
