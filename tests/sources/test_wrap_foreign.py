"""``wrap`` over the datasets people already have, which split themselves by worker or rank.

Two ranks are simulated by passing ``rank=``/``world_size=`` (what a job's ranks would detect);
each rank's loader runs with 0 or 2 real DataLoader workers, where Hugging Face ``datasets`` and
WebDataset read ``get_worker_info()`` and, before ``wrap`` hid it from them, kept only their
worker's share of what ``wrap`` then split again (9 of 17 items over 2 ranks x 2 workers).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import shardkit
from shardkit.pipeline import Pipeline
from shardkit.sources.errors import DatasetError

datasets = pytest.importorskip("datasets")
distributed = pytest.importorskip("datasets.distributed")
wds = pytest.importorskip("webdataset")

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

ITEMS = 17
SHARD_SIZES = {1: [17], 3: [9, 5, 3], 4: [8, 4, 3, 2]}  # uneven on purpose
WORLD = 2
BATCH = 3


def item_id(item: dict[str, Any]) -> int:
    return int(item["id"])


def _ids(batches: list[Any]) -> list[int]:
    return [int(x) for batch in batches for x in batch]


@pytest.fixture(scope="module")
def json_shards(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[str]]:
    """For every shard count, JSON-lines files holding ids 0..16 in contiguous runs of SHARD_SIZES."""
    root = tmp_path_factory.mktemp("hf-json")
    files: dict[int, list[str]] = {}
    for count, sizes in SHARD_SIZES.items():
        start, files[count] = 0, []
        for shard, size in enumerate(sizes):
            path = root / f"{count}-shards-{shard}.jsonl"
            path.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(start, start + size)))
            files[count].append(str(path))
            start += size
    return files


def hf_dataset(kind: str, shards: int, files: dict[int, list[str]], cache: Path) -> Any:
    """``streaming``: ``load_dataset(json files, streaming=True)``; ``iterable``: an in-memory ``Dataset``'s
    ``to_iterable_dataset(num_shards=shards)``; ``map``: the map-style ``Dataset`` itself."""
    if kind == "streaming":
        ds = datasets.load_dataset(
            "json", data_files=files[shards], split="train", streaming=True, cache_dir=str(cache)
        )
        assert ds.num_shards == shards
        return ds
    table = datasets.Dataset.from_dict({"id": list(range(ITEMS))})
    return table if kind == "map" else table.to_iterable_dataset(num_shards=shards)


def make_loader(kind: str, dataset: Pipeline, workers: int, batch_size: int = BATCH) -> Any:
    if kind == "DataLoader":
        return DataLoader(dataset, batch_size=batch_size, num_workers=workers)
    if kind == "StatefulDataLoader":
        return shardkit.StatefulDataLoader(dataset, batch_size=batch_size, num_workers=workers)
    return shardkit.MixedLoader(dataset, batch_size, num_workers=workers)


def per_rank(make: Callable[[int], Pipeline], loader: str, workers: int) -> list[list[int]]:
    """The ids each of the two ranks reads, through ``loader`` with ``workers`` workers."""
    return [_ids(list(make_loader(loader, make(rank), workers))) for rank in range(WORLD)]


def assert_exactly_once(ranks: list[list[int]], total: int, where: str) -> None:
    seen = sorted(i for rank in ranks for i in rank)
    assert seen == list(range(total)), f"{where}: {len(set(seen))} of {total} items, {len(seen)} reads: {seen}"


def assert_balanced(ranks: list[list[int]], total: int, balance: str, per_rank: int, where: str) -> None:
    """Both ranks read ``per_rank`` items; under ``"pad"`` every item at least once, under ``"drop"`` none twice."""
    assert [len(r) for r in ranks] == [per_rank] * WORLD, f"{where}: {[len(r) for r in ranks]} items per rank"
    seen = [i for rank in ranks for i in rank]
    if balance == "drop":
        assert len(set(seen)) == len(seen), f"{where}: repeats under drop: {sorted(seen)}"
    else:
        assert set(seen) == set(range(total)), f"{where}: {len(set(seen))} of {total} items under pad"


def balanced_count(kind: str, total: int, balance: str, workers: int) -> int:
    """Items per rank: a map-style dataset is planned per rank; an iterable's readers keep every n-th item,
    each of them ``ceil``/``floor`` of ``total / readers``."""
    readers = 1 if kind == "map" else max(workers, 1)
    parts = WORLD * readers
    return readers * (-(-total // parts) if balance == "pad" else total // parts)


LOADERS = ["DataLoader", "StatefulDataLoader", "MixedLoader"]
KINDS = ["streaming", "iterable", "map"]


def exactly_once_cases(workers: int) -> list[tuple[str, int, str]]:
    """(kind, shards, loader): every combination in one process; with workers (processes, ~0.5 s a
    loader), a Latin square: every kind with every loader and every shard count, each loader with
    1 or 3 shards (4 readers keep items) and 4 shards (each reader its own whole shard)."""
    if workers == 0:
        return [(k, n, loader) for k in KINDS for n in SHARD_SIZES for loader in LOADERS if k != "map" or n == 1]
    return [
        *[("streaming", n, loader) for n, loader in zip(SHARD_SIZES, LOADERS)],
        *[("iterable", n, loader) for n, loader in zip(SHARD_SIZES, LOADERS[1:] + LOADERS[:1])],
        ("map", 1, "StatefulDataLoader"),
    ]


def wrapped(ds: Any, balance: str) -> Callable[[int], Pipeline]:
    return lambda rank: shardkit.wrap(ds, rank=rank, world_size=WORLD, balance=balance).map(item_id)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_hf_datasets_are_read_exactly_once_over_ranks_and_workers(
    workers: int, json_shards: dict[int, list[str]], tmp_path: Path
) -> None:
    for kind, shards, loader in exactly_once_cases(workers):
        ds = hf_dataset(kind, shards, json_shards, tmp_path)
        ranks = per_rank(wrapped(ds, "none"), loader, workers)
        assert_exactly_once(ranks, ITEMS, f"{kind}, {shards} shards, {loader}, {workers} workers")


def balance_cases(workers: int) -> list[tuple[str, int, str, str]]:
    """(kind, shards, balance, loader): every kind, shard count and balance in one process, the loaders
    taking turns; with workers, every kind under both balances, each loader twice."""
    if workers == 0:
        combinations = [(k, n, b) for k in KINDS for n in SHARD_SIZES for b in ("pad", "drop") if k != "map" or n == 1]
        return [(k, n, b, LOADERS[i % len(LOADERS)]) for i, (k, n, b) in enumerate(combinations)]
    return [
        ("streaming", 1, "pad", "DataLoader"),
        ("streaming", 4, "drop", "StatefulDataLoader"),
        ("iterable", 3, "pad", "MixedLoader"),
        ("iterable", 1, "drop", "DataLoader"),
        ("map", 1, "pad", "StatefulDataLoader"),
        ("map", 1, "drop", "MixedLoader"),
    ]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_hf_datasets_give_every_rank_the_same_count(
    workers: int, json_shards: dict[int, list[str]], tmp_path: Path
) -> None:
    for kind, shards, balance, loader in balance_cases(workers):
        ds = hf_dataset(kind, shards, json_shards, tmp_path)
        ranks = per_rank(wrapped(ds, balance), loader, workers)
        where = f"{kind}, {shards} shards, {balance}, {loader}, {workers} workers"
        assert_balanced(ranks, ITEMS, balance, balanced_count(kind, ITEMS, balance, workers), where)


READS: list[int] = []


def _counted_shard(ids: list[list[int]]) -> Any:
    for shard in ids:
        for i in shard:
            READS.append(i)
            yield {"id": i}


def test_whole_shards_go_to_each_reader_without_reading_an_item_twice() -> None:
    """4 shards over 2 readers under ``"none"``: every item is generated once in all; 1 shard is
    iterated by every reader, which keeps its items (each generated twice)."""
    for shards, reads in ((4, ITEMS), (1, 2 * ITEMS)):
        sizes, start, ids = SHARD_SIZES[shards], 0, []
        for size in sizes:
            ids.append(list(range(start, start + size)))
            start += size
        ds = datasets.IterableDataset.from_generator(_counted_shard, gen_kwargs={"ids": ids})
        assert ds.num_shards == shards
        READS.clear()
        ranks = [
            [item_id(x) for x in shardkit.wrap(ds, rank=r, world_size=WORLD, balance="none")] for r in range(WORLD)
        ]
        assert_exactly_once(ranks, ITEMS, f"{shards} shards")
        assert len(READS) == reads and sorted(set(READS)) == list(range(ITEMS))


RESUME_CASES = [  # (kind, shards, balance, loader): whole shards per reader, items kept, map-style
    ("streaming", 4, "none", "StatefulDataLoader"),
    ("streaming", 3, "pad", "MixedLoader"),
    ("iterable", 1, "drop", "StatefulDataLoader"),
    ("map", 1, "none", "MixedLoader"),
]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_wrapped_hf_dataset_resumes_exactly_mid_epoch(
    workers: int, json_shards: dict[int, list[str]], tmp_path: Path
) -> None:
    for kind, shards, balance, loader in RESUME_CASES:
        ds = hf_dataset(kind, shards, json_shards, tmp_path)
        check_resume(wrapped(ds, balance), loader, workers, f"{kind}, {shards} shards, {balance}, {loader}")


def check_resume(make: Callable[[int], Pipeline], loader: str, workers: int, where: str) -> None:
    """On rank 0, batches of 2, the state after the 2nd batch (through JSON), loaded into a fresh loader
    over a fresh dataset: the rest of the epoch is exactly the batches not yet delivered, the same
    batches as the uninterrupted run's (the same worker count)."""
    full = [b.tolist() for b in make_loader(loader, make(0), workers, 2)]
    first = make_loader(loader, make(0), workers, 2)
    delivered, batches = [], iter(first)
    for _ in range(2):
        delivered.append(next(batches).tolist())
    state = json.loads(json.dumps(first.state_dict()))
    del batches, first
    resumed = make_loader(loader, make(0), workers, 2)
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    assert len(full) > 3, where
    assert delivered + rest == full, f"{where}: {delivered} + {rest} != {full}"


@pytest.mark.slow
def test_a_shuffled_hf_dataset_is_read_exactly_once_in_a_new_order_every_epoch(
    json_shards: dict[int, list[str]], tmp_path: Path
) -> None:
    """HF's ``shuffle(seed=...)`` over 4 shards (each reader its own) and 3 (every reader the same
    sequence): shardkit's epoch reaches it, and resuming replays the epoch's order."""
    for shards in (4, 3):
        ds = hf_dataset("streaming", shards, json_shards, tmp_path).shuffle(seed=3, buffer_size=4)
        epochs = []
        for epoch in (0, 1):
            ranks = []
            for rank in range(WORLD):
                pipeline = wrapped(ds, "none")(rank)
                pipeline.set_epoch(epoch)
                ranks.append(_ids(list(make_loader("DataLoader", pipeline, 2))))
            assert_exactly_once(ranks, ITEMS, f"shuffled, {shards} shards, epoch {epoch}")
            epochs.append(ranks)
        assert epochs[0] != epochs[1], f"{shards} shards: the same order in epochs 0 and 1"
    check_resume(wrapped(ds, "none"), "StatefulDataLoader", 2, "shuffled, 3 shards")


# WebDataset: tar shards, a pipeline with its own split_by_worker (WebDataset's default workersplitter).

WDS_SIZES = [6, 4, 5, 2]  # 17 samples in 4 tar shards


@pytest.fixture(scope="module")
def tar_shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root, urls, start = tmp_path_factory.mktemp("wds"), [], 0
    for shard, size in enumerate(WDS_SIZES):
        url = str(root / f"shard-{shard}.tar")
        with wds.TarWriter(url) as sink:
            for i in range(start, start + size):
                sink.write({"__key__": f"{i:04d}", "txt": str(i)})
        urls.append(url)
        start += size
    return urls


def sample_id(sample: dict[str, Any]) -> int:
    return int(sample["txt"])


def webdataset_pipeline(urls: list[str], style: str) -> Any:
    """``WebDataset(urls)`` (its default workersplitter is split_by_worker), or the same as a DataPipeline."""
    if style == "WebDataset":
        return wds.WebDataset(urls, shardshuffle=False, nodesplitter=None).decode()
    return wds.DataPipeline(wds.SimpleShardList(urls), wds.split_by_worker, wds.tarfile_to_samples(), wds.decode())


WDS_CASES = [
    ("WebDataset", "none", "DataLoader"),
    ("WebDataset", "pad", "MixedLoader"),
    ("DataPipeline", "none", "StatefulDataLoader"),
]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_webdataset_that_splits_by_worker_is_read_exactly_once(workers: int, tar_shards: list[str]) -> None:
    total = sum(WDS_SIZES)
    for style, balance, loader in WDS_CASES:

        def make(rank: int, style: str = style, balance: str = balance) -> Pipeline:
            pipeline = webdataset_pipeline(tar_shards, style)
            return shardkit.wrap(pipeline, rank=rank, world_size=WORLD, balance=balance).map(sample_id)

        ranks = per_rank(make, loader, workers)
        where = f"{style}, {balance}, {loader}, {workers} workers"
        if balance == "none":
            assert_exactly_once(ranks, total, where)
        else:
            assert_balanced(ranks, total, balance, balanced_count(style, total, balance, workers), where)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_wrapped_webdataset_resumes_exactly_mid_epoch(workers: int, tar_shards: list[str]) -> None:
    def make(rank: int) -> Pipeline:
        return shardkit.wrap(webdataset_pipeline(tar_shards, "WebDataset"), rank=rank, world_size=WORLD).map(sample_id)

    for loader in ("StatefulDataLoader", "MixedLoader"):
        check_resume(make, loader, workers, f"WebDataset, {loader}")


def test_a_webdataset_that_splits_by_node_is_refused_at_the_first_item(tar_shards: list[str]) -> None:
    splitting = [
        wds.WebDataset(tar_shards, shardshuffle=False, nodesplitter=wds.split_by_node),
        wds.DataPipeline(wds.SimpleShardList(tar_shards), functools.partial(wds.split_by_node, group=None)),
    ]
    for pipeline in splitting:
        wrapped = shardkit.wrap(pipeline, rank=0, world_size=WORLD)
        with pytest.raises(DatasetError, match=r"WebDataset .*split_by_node.*nodesplitter=None"):
            next(iter(wrapped))
    one_rank = shardkit.wrap(splitting[0], rank=0, world_size=1)  # nothing is split twice
    assert sorted(sample_id(s) for s in one_rank) == list(range(sum(WDS_SIZES)))


@pytest.mark.slow  # imports accelerate
def test_iterables_known_to_split_by_rank_are_refused_naming_the_library() -> None:
    from accelerate.data_loader import IterableDatasetShard

    class StreamingDataset(torch.utils.data.IterableDataset):  # stands in for LitData's, by its module
        __module__ = "litdata.streaming.dataset"

        def __iter__(self) -> Any:
            return iter(range(4))

    table = datasets.Dataset.from_dict({"id": list(range(8))}).to_iterable_dataset(num_shards=2)
    refused = {
        "LitData's StreamingDataset": StreamingDataset(),
        "IterableDatasetShard already keeps one process's share": IterableDatasetShard(
            list(range(8)), num_processes=2, process_index=0
        ),
        "split_dataset_by_node": distributed.split_dataset_by_node(table, rank=0, world_size=2),
    }
    for message, iterable in refused.items():
        with pytest.raises(DatasetError, match=message):
            next(iter(shardkit.wrap(iterable, rank=0, world_size=WORLD)))


class SplitsItselfByWorker(torch.utils.data.IterableDataset):
    """The PyTorch documentation's example: each worker keeps its own part of range(n)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))


@pytest.mark.slow
def test_a_torch_iterable_that_splits_itself_by_worker_is_read_exactly_once() -> None:
    ranks = per_rank(
        lambda r: shardkit.wrap(SplitsItselfByWorker(ITEMS), rank=r, world_size=WORLD, balance="none"), "DataLoader", 2
    )
    assert_exactly_once(ranks, ITEMS, "torch IterableDataset with its own worker split")
