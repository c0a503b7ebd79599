"""MixedLoader over column batches (``TFRecordDataset(features=..., batch_size=...)``):
batch for batch the same samples as MixedLoader over the decoded records, byte
for byte, with 0, 2 or 3 workers under fork and spawn; exactly once and equal
batch counts over ranks; resume mid-epoch; no shared memory left behind.

Assembly depends only on what each worker yields, never on its micro-batch
sizes, so the decoded path (one sample per record, collated) is the reference
for every batch, not just for the epoch's contents.
"""

from __future__ import annotations

import gc
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

import shardkit
from shardkit import MixedLoader
from shardkit.loader.mixed import LoaderError
from shardkit.loader.slab_columns import as_parts, from_slab, join_columns
from shardkit.loader.slabs import SlabBatch, SlabRing, view
from shardkit.state import StateError, encode
from tests.helpers.shards import COLUMN_FEATURES, column_rows, per_record_rows, write_column_shards
from tests.loader.test_loader_slabs import (
    assert_a_killed_worker_leaves_nothing,
    pause_until_killed_or_released,
    shm_files_of,
    torch_shm_maps,
    worker_pids,
)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def columns_dataset(urls: list[str], micro: int = 16, **kwargs: Any) -> shardkit.TFRecordDataset:
    return shardkit.TFRecordDataset(urls, features=COLUMN_FEATURES, batch_size=micro, **kwargs).count_records()


def as_row(example: dict[str, Any]) -> dict[str, Any]:
    """A decoded record as the sample the decoded path collates."""
    return {"id": int(example["id"][0]), "xy": example["xy"], "blob": example["blob"][0]}


def decoded_batches(urls: list[str], batch_size: int, num_workers: int, **kwargs: Any) -> list[Any]:
    dataset = shardkit.TFRecordDataset(urls, **kwargs).count_records().map(as_row)
    return list(MixedLoader(dataset, batch_size, num_workers=num_workers, micro_batch_size=7))


def check_same_batches(got: list[Any], expected: list[Any]) -> None:
    """Batch for batch: the same ids, xy bits and blob bytes, in the public column form."""
    assert len(got) == len(expected)
    for number, (batch, reference) in enumerate(zip(got, expected)):
        assert isinstance(batch["id"], torch.Tensor) and batch["id"].dtype == torch.int64
        assert isinstance(batch["blob"], pa.LargeBinaryArray), type(batch["blob"])
        assert batch["id"].tolist() == reference["id"].tolist(), f"batch {number}"
        assert batch["xy"].numpy().view(np.uint32).tolist() == reference["xy"].numpy().view(np.uint32).tolist()
        assert batch["blob"].to_pylist() == list(reference["blob"]), f"batch {number}"


def epoch(loader: MixedLoader) -> list[Any]:
    return list(loader)


def test_column_batches_without_workers_are_the_decoded_batches_byte_for_byte(tmp_path: Path) -> None:
    urls = write_column_shards(tmp_path)
    loader = MixedLoader(columns_dataset(urls), 10)
    batches = epoch(loader)
    assert len(loader) == len(batches) == 12
    check_same_batches(batches, decoded_batches(urls, 10, 0))
    assert sorted(column_rows(batches)) == sorted(per_record_rows(urls))


@pytest.mark.slow
@pytest.mark.parametrize(("num_workers", "context"), [(2, "fork"), (3, "fork"), (2, "spawn")])
def test_column_batches_through_workers_are_the_decoded_batches_byte_for_byte(
    tmp_path: Path, num_workers: int, context: str
) -> None:
    urls = write_column_shards(tmp_path, shards=4, records=37)
    loader = MixedLoader(columns_dataset(urls, 16), 10, num_workers=num_workers, multiprocessing_context=context)
    batches = epoch(loader)
    assert len(loader) == len(batches) == math.ceil(148 / 10)
    check_same_batches(batches, decoded_batches(urls, 10, num_workers))
    delivered = column_rows(batches)
    assert sorted(delivered) == sorted(per_record_rows(urls))  # every record once
    if context == "spawn":  # a second epoch would start two more workers as the first did: seconds each
        return
    again = epoch(loader)  # reuses the workers' slabs: the first epoch's batches own their memory
    assert column_rows(batches) == delivered
    assert sorted(column_rows(again)) == sorted(delivered)


@pytest.mark.slow
@pytest.mark.parametrize(("records", "padded"), [(40, 0), (41, 1)])
def test_ranks_get_every_record_once_and_equal_batch_counts(tmp_path: Path, records: int, padded: int) -> None:
    urls = write_column_shards(tmp_path, shards=3, records=records)
    counts, samples, seen = [], [], []
    for rank in range(2):
        batches = epoch(MixedLoader(columns_dataset(urls, 8, rank=rank, world_size=2), 6, num_workers=2))
        counts.append(len(batches))
        samples.append(sum(len(batch["id"]) for batch in batches))
        seen += [row[0] for row in column_rows(batches)]
    assert set(seen) == set(range(3 * records)) and len(seen) == 3 * records + padded  # balance="pad"'s repeat
    assert samples[0] == samples[1] and counts[0] == counts[1] == math.ceil(samples[0] / 6)


def resumed(urls: list[str], state: Any, num_workers: int) -> list[Any]:
    loader = MixedLoader(columns_dataset(urls), 10, num_workers=num_workers)
    loader.load_state_dict(state)
    return epoch(loader)


def interrupted(urls: list[str], num_workers: int, stop: int) -> tuple[list[Any], list[Any], Any]:
    """The uninterrupted epoch, and the first ``stop`` batches of another run with its state."""
    everything = epoch(MixedLoader(columns_dataset(urls), 10, num_workers=num_workers))
    loader = MixedLoader(columns_dataset(urls), 10, num_workers=num_workers)
    iterator = iter(loader)
    first = [next(iterator) for _ in range(stop)]
    state = loader.state_dict()
    del iterator
    return everything, first, state


@pytest.mark.parametrize("stop", [1, 5, 11])
def test_resuming_without_workers_gives_the_remaining_batches(tmp_path: Path, stop: int) -> None:
    urls = write_column_shards(tmp_path)
    everything, first, state = interrupted(urls, 0, stop)
    assert column_rows(first) == column_rows(everything[:stop])
    assert column_rows(resumed(urls, state, 0)) == column_rows(everything[stop:])


@pytest.mark.slow
@pytest.mark.parametrize("stop", [3, 7])
def test_resuming_with_workers_gives_the_uninterrupted_runs_remaining_batches(tmp_path: Path, stop: int) -> None:
    urls = write_column_shards(tmp_path)
    everything, first, state = interrupted(urls, 2, stop)
    assert state["carry"], "a micro-batch of 16 cut into batches of 10 leaves a tail to save"
    assert column_rows(first) == column_rows(everything[:stop])
    assert column_rows(resumed(urls, state, 2)) == column_rows(everything[stop:])
    rest = column_rows(resumed(urls, state, 3))  # another worker count: the same records, once
    assert sorted(column_rows(first) + rest) == sorted(per_record_rows(urls))


def test_a_carried_tail_of_another_form_is_refused(tmp_path: Path) -> None:
    urls = write_column_shards(tmp_path)
    _, _, state = interrupted(urls, 0, 1)
    state["carry"][0]["payload"] = encode({"id": np.arange(3)})
    with pytest.raises(StateError, match="a column batch of 6"):
        MixedLoader(columns_dataset(urls), 10).load_state_dict(state)


def test_a_full_ring_sends_the_columns_themselves_and_they_join_with_slab_ones() -> None:
    ring = SlabRing(1)
    batch = {"id": np.arange(5), "blob": pa.array([b"a", b"", b"ccc", b"dd", b"e"], pa.large_binary())}
    in_slab = ring.put(as_parts(batch))
    assert isinstance(in_slab, SlabBatch)
    assert isinstance(ring.put(as_parts(batch)), dict)  # no free slot: as it is
    assert in_slab.slab is not None
    slab = in_slab.slab
    parts = [(from_slab(in_slab.skeleton, lambda place: view(slab, place)), 1, 4), (as_parts(batch), 3, 5)]
    joined = join_columns(parts)
    assert joined["id"].tolist() == [1, 2, 3, 3, 4]
    assert joined["blob"].to_pylist() == [b"", b"ccc", b"dd", b"dd", b"e"]


def test_collate_fn_and_micro_batch_size_do_not_apply_to_column_batches(tmp_path: Path) -> None:
    dataset = columns_dataset(write_column_shards(tmp_path, shards=1, records=4))
    with pytest.raises(LoaderError, match="collate_fn=None"):
        MixedLoader(dataset, 4, collate_fn=list)
    with pytest.raises(LoaderError, match="dataset's batch_size"):
        MixedLoader(dataset, 4, micro_batch_size=2)


class ColumnStream(IterableDataset):
    """Column batches of 5 rows, ``counts[w]`` rows for worker ``w``; at row ``pause_after``
    a worker creates ``<pause_file>.<worker>`` and sleeps."""

    column_batches = True

    def __init__(self, counts: list[int], *, pause_after: int = -1, pause_file: str = "") -> None:
        self.counts = counts
        self.pause_after = pause_after
        self.pause_file = pause_file

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        for start in range(0, self.counts[worker], 5):
            if start == self.pause_after:
                Path(f"{self.pause_file}.{worker}").touch()
                pause_until_killed_or_released()
            ids = np.arange(start, min(start + 5, self.counts[worker])) + 1000 * worker
            yield {"id": ids, "blob": pa.array([b"x" * (i % 9) for i in ids.tolist()], pa.large_binary())}


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
def test_no_shared_memory_stays_after_an_epoch_or_del_loader(persistent: bool) -> None:
    gc.collect()  # loaders of earlier tests that wait for a collection
    before = torch_shm_maps()
    loader = MixedLoader(ColumnStream([30, 30]), 8, num_workers=2, persistent_workers=persistent, resumable=False)
    iterator = iter(loader)
    next(iterator)
    pids = worker_pids(loader)
    assert len(torch_shm_maps()) > len(before)  # the rings are mapped mid-epoch
    for _ in iterator:
        pass
    assert torch_shm_maps() == before, "an epoch's slabs are still mapped after it ended"
    assert shm_files_of([os.getpid(), *pids]) == []
    iterator = iter(loader)
    next(iterator)
    pids += worker_pids(loader)
    del iterator, loader
    gc.collect()
    assert torch_shm_maps() == before, "slabs are still mapped after del loader"
    assert shm_files_of([os.getpid(), *pids]) == []


@pytest.mark.slow
def test_no_shared_memory_stays_after_a_worker_is_killed(tmp_path: Path) -> None:
    # fork only: a killed spawned worker is tests/loader/test_loader_slabs.py's case (the same script);
    # column batches from spawned workers are test_column_batches_through_workers_...[2-spawn]'s
    context = "fork"
    pause = str(tmp_path / "paused")
    dataset = f"ColumnStream([40, 40], pause_after=10, pause_file={pause!r})"
    imports = "from tests.loader.test_loader_columns import ColumnStream"
    assert_a_killed_worker_leaves_nothing(tmp_path, context, dataset, imports, pause=pause)


def test_bytes_features_of_several_values_per_record_come_as_fixed_size_lists(tmp_path: Path) -> None:
    url = str(tmp_path / "pairs.tfrecord")
    with shardkit.TFRecordWriter(url) as writer:
        for i in range(23):
            writer.write(shardkit.encode_example({"id": i, "pair": [b"a" * (i % 4), b"b%d" % i]}))
    features = {"id": ("int64", ()), "pair": ("bytes", (2,))}
    dataset = shardkit.TFRecordDataset([url], features=features, batch_size=7).count_records()
    batches = epoch(MixedLoader(dataset, 5))
    assert all(isinstance(batch["pair"], pa.FixedSizeListArray) for batch in batches)
    assert [pair for batch in batches for pair in batch["pair"].to_pylist()] == [
        [b"a" * (i % 4), b"b%d" % i] for i in range(23)
    ]
    iterator = iter(loader := MixedLoader(dataset, 5))
    next(iterator), next(iterator)
    state = loader.state_dict()  # 10 rows out: the second micro-batch of 7 cut after 3, 4 carried
    assert [tail["count"] for tail in state["carry"]] == [4]
    resumed_loader = MixedLoader(dataset, 5)
    resumed_loader.load_state_dict(state)
    assert [pair for batch in epoch(resumed_loader) for pair in batch["pair"].to_pylist()][0] == [b"aa", b"b10"]


@pytest.mark.slow
def test_column_batches_sent_without_a_free_slot_mix_with_slab_ones_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put = SlabRing.put
    calls = []

    def every_other_slot(ring: SlabRing, parts: dict[str, Any]) -> Any:  # as if the ring were full
        calls.append(1)
        return parts if len(calls) % 2 else put(ring, parts)

    monkeypatch.setattr(SlabRing, "put", every_other_slot)  # the forked workers inherit it
    urls = write_column_shards(tmp_path)
    batches = epoch(MixedLoader(columns_dataset(urls), 10, num_workers=2, multiprocessing_context="fork"))
    check_same_batches(batches, decoded_batches(urls, 10, 2))


# -- Parquet batches (ParquetDataset(batch_size=...)) ------------------------------------

PARQUET_SIZES = [13, 7, 20]  # 40 rows, row groups of 4: batches cross row groups and end short per file


def parquet_rows(batches: list[Any]) -> list[tuple[Any, ...]]:
    """(id, n, x bits, tags, blob) per row over Parquet column batches."""
    return [
        (i, n, x, list(tags), blob)
        for batch in batches
        for i, n, x, tags, blob in zip(
            list(batch["id"]),
            np.asarray(batch["n"]).tolist(),
            np.asarray(batch["x"]).view(np.uint64).tolist(),
            batch["tags"],
            list(batch["blob"]),
        )
    ]


def parquet_per_record_rows(urls: list[str]) -> list[tuple[Any, ...]]:
    """parquet_rows of the rows read one by one."""
    return [
        (r["id"], r["n"], int(np.float64(r["x"]).view(np.uint64)), r["tags"], r["blob"])
        for r in shardkit.ParquetDataset(urls)
    ]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_parquet_column_batches_go_through_mixed_loader_exactly_once_byte_for_byte(
    tmp_path: Path, num_workers: int
) -> None:
    """Before: MixedLoader collated each Parquet batch as one sample ("stack expects each tensor to be equal size")."""
    from tests.helpers.shards import write_parquet_shards

    urls = write_parquet_shards(str(tmp_path), PARQUET_SIZES)
    dataset = shardkit.ParquetDataset(urls, batch_size=5)
    assert dataset.column_batches
    loader = MixedLoader(dataset, 8, num_workers=num_workers)
    batches = list(loader)
    assert [len(batch["id"]) for batch in batches] == [8] * 5
    assert isinstance(batches[0]["n"], torch.Tensor) and isinstance(batches[0]["x"], torch.Tensor)
    got, expected = parquet_rows(batches), parquet_per_record_rows(urls)
    assert sorted(got) == sorted(expected)
    if num_workers == 0:
        assert got == expected  # one reader: the file order


@pytest.mark.parametrize("num_workers", [0, 2])
def test_parquet_column_batches_resume_mid_epoch_exactly_once(tmp_path: Path, num_workers: int) -> None:
    """A micro-batch of 5 rows cut by batches of 8: the saved carry holds strings, bytes and lists."""
    from tests.helpers.shards import write_parquet_shards

    urls = write_parquet_shards(str(tmp_path), PARQUET_SIZES)
    loader = MixedLoader(shardkit.ParquetDataset(urls, batch_size=5).count_records(), 8, num_workers=num_workers)
    iterator = iter(loader)
    before = [next(iterator) for _ in range(2)]
    state = loader.state_dict()
    assert state["carry"] and any(len(tail["payload"]) for tail in state["carry"])
    state = json.loads(json.dumps(state))
    del iterator
    again = MixedLoader(shardkit.ParquetDataset(urls, batch_size=5).count_records(), 8, num_workers=num_workers)
    again.load_state_dict(state)
    after = list(again)
    assert sorted(parquet_rows(before + after)) == sorted(parquet_per_record_rows(urls))


def test_len_of_a_mixed_loader_over_column_batches_without_a_sample_count_is_refused(tmp_path: Path) -> None:
    """len(ParquetDataset(batch_size=5)) counts batches, not rows: it must not be taken for samples."""
    from tests.helpers.shards import write_parquet_shards

    dataset = shardkit.ParquetDataset(write_parquet_shards(str(tmp_path), PARQUET_SIZES), batch_size=5)
    with pytest.raises(TypeError, match="num_samples"):
        len(MixedLoader(dataset, 8))
