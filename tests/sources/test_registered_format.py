"""A format of your own, registered with ``register_format``, reads through ``FormatDataset`` with
everything the built-in formats get: record-level splits over ranks and workers, counts the files
hold (no scan), ranges that seek to their first record, a bad record skipped alone and counted,
remote reads with the options given, and exact mid-epoch resume. A format with only the
``ShardFormat`` methods (no ``FormatBase``) reads through it too, with the defaults."""

from __future__ import annotations

import collections
import os
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import fsspec
import pytest
import torch.utils.data
from torch.utils.data import DataLoader

import shardkit
from shardkit import CorruptRecordError, FormatDataset
from shardkit.formats.base import FormatBase
from shardkit.formats.registry import format_for, register_format
from shardkit.io.files import open_raw
from shardkit.io.remote import RetryPolicy, remote_stats
from tests.helpers.fault_server import FaultServer

RECORD = struct.Struct("<I12s")  # a CRC-32 of the payload, then 12 bytes of payload
SIZES = [13, 7, 9]  # 29 records in 3 shards: fewer shards than the 4 readers below


class FixedFormat(FormatBase):
    """Fixed-width records with a CRC-32 each: a record's byte offset is arithmetic, so a read seeks
    straight to its first record, and the file's size is its record count."""

    name = "fixed-test"
    suffixes = (".fxd",)

    def __init__(self) -> None:
        self.starts: list[tuple[str, int]] = []  # (url, byte offset) where each read began
        self.bytes_read = 0
        self.stored_counts = 0

    def sniff(self, head: bytes) -> bool:
        return False

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[str]:
        with open_raw(url, "rb", self.storage_options, remote=self.remote) as f:
            f.seek(start * RECORD.size)
            self.starts.append((url, start * RECORD.size))
            index = start
            while stop is None or index < stop:
                data = f.read(RECORD.size)
                self.bytes_read += len(data)
                if len(data) < RECORD.size:
                    return
                crc, payload = RECORD.unpack(data)
                if zlib.crc32(payload) != crc:
                    offset = index * RECORD.size
                    raise CorruptRecordError(url, index, offset, "CRC mismatch", framing_intact=True)
                yield payload.decode()
                index += 1

    def count(self, url: str) -> int:
        raise AssertionError(f"counted {url} by a scan: its size says how many records it holds")

    def stored_count(self, url: str) -> int:
        self.stored_counts += 1
        fs, path = fsspec.core.url_to_fs(url, **(self.storage_options or {}))
        return int(fs.size(path)) // RECORD.size

    def build_index(self, url: str) -> str | None:
        return None


class PlainFormat:
    """The same files through the ``ShardFormat`` methods only: no ``FormatBase``, no stored counts."""

    name = "plain-fixed-test"
    suffixes = (".pfxd",)

    def __init__(self) -> None:
        self.counted: list[str] = []

    def sniff(self, head: bytes) -> bool:
        return False

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[str]:
        return FixedFormat().read(url, start, stop)

    def count(self, url: str) -> int:
        self.counted.append(url)
        return os.path.getsize(url) // RECORD.size

    def build_index(self, url: str) -> str | None:
        return None


def record(shard: int, index: int) -> str:
    return f"s{shard}r{index:09d}"[:12]


def write_shards(
    root: str, sizes: list[int] = SIZES, bad: tuple[int, int] | None = None, suffix: str = ".fxd"
) -> list[str]:
    """Shards of ``record(shard, index)`` payloads; ``bad`` = (shard, index) gets a wrong CRC."""
    urls = []
    for shard, size in enumerate(sizes):
        url = os.path.join(root, f"part-{shard}{suffix}")
        with open(url, "wb") as f:
            for index in range(size):
                payload = record(shard, index).encode()
                crc = zlib.crc32(payload) ^ (1 if (shard, index) == bad else 0)
                f.write(RECORD.pack(crc, payload))
        urls.append(url)
    return urls


def every_record(sizes: list[int] = SIZES) -> list[str]:
    return [record(shard, index) for shard, size in enumerate(sizes) for index in range(size)]


@contextmanager
def as_worker(worker: int, workers: int) -> Iterator[None]:
    info = SimpleNamespace(id=worker, num_workers=workers)
    with mock.patch.object(torch.utils.data, "get_worker_info", lambda: info):
        yield


@pytest.fixture
def fmt() -> FixedFormat:
    return register_format(FixedFormat())  # type: ignore[return-value]


def test_a_registered_format_is_found_by_its_suffix(fmt, tmp_path) -> None:
    (url,) = write_shards(str(tmp_path), [3])
    assert format_for(url) is fmt


def test_two_ranks_of_two_workers_split_at_record_level_and_read_every_record_exactly_once(fmt, tmp_path) -> None:
    urls = write_shards(str(tmp_path))
    readers = {}
    for rank in range(2):
        dataset = FormatDataset(urls, fmt, balance="none", rank=rank, world_size=2)
        for worker in range(2):
            with as_worker(worker, 2):
                readers[rank, worker] = list(dataset)
    assert sorted(s for samples in readers.values() for s in samples) == sorted(every_record())
    assert all(readers.values())  # 3 shards, 4 readers: only a split inside shards feeds all four


def test_real_dataloader_workers_on_two_ranks_read_every_record_exactly_once(fmt, tmp_path) -> None:
    urls = write_shards(str(tmp_path))
    seen: collections.Counter[str] = collections.Counter()
    for rank in range(2):
        dataset = FormatDataset(urls, fmt, balance="none", rank=rank, world_size=2)
        loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork")
        seen.update(loader)
    assert sorted(seen.elements()) == sorted(every_record())


def test_record_counts_come_from_the_format_stored_count_without_a_scan(fmt, tmp_path) -> None:
    urls = write_shards(str(tmp_path))
    dataset = FormatDataset(urls, fmt, balance="pad", rank=0, world_size=2)
    assert len(dataset) == -(-sum(SIZES) // 2)  # FixedFormat.count raises: no scan was needed
    assert dataset.shards.num_records.tolist() == SIZES
    assert fmt.stored_counts == len(SIZES)


def test_a_range_read_seeks_to_its_first_record_and_reads_only_its_records(fmt, tmp_path) -> None:
    (url,) = write_shards(str(tmp_path), [20])
    dataset = FormatDataset([url], fmt, rank=1, world_size=2)
    assert list(dataset) == [record(0, i) for i in range(10, 20)]
    assert fmt.starts == [(url, 10 * RECORD.size)]  # one read, from record 10's bytes
    assert fmt.bytes_read == 10 * RECORD.size  # and nothing before it


def test_a_record_with_a_bad_checksum_costs_that_record_alone_under_skip_and_is_counted(fmt, tmp_path) -> None:
    urls = write_shards(str(tmp_path), bad=(1, 4))
    dataset = FormatDataset(urls, fmt, balance="none", on_error="skip")
    with pytest.warns(UserWarning, match=r"skipping record 4 of .*part-1\.fxd: .*CRC mismatch"):
        samples = list(dataset)
    assert samples == [s for s in every_record() if s != record(1, 4)]
    stats = dataset.stats()
    assert stats.skipped.tolist() == [0, 1, 0] and stats.errors.tolist() == [0, 1, 0]
    assert stats.read.tolist() == [13, 6, 9]


def test_under_raise_a_bad_checksum_names_the_url_the_record_index_and_the_byte_offset(fmt, tmp_path) -> None:
    urls = write_shards(str(tmp_path), bad=(1, 4))
    with pytest.raises(CorruptRecordError, match=r"part-1\.fxd: record 4 at byte offset 64: CRC mismatch") as caught:
        list(FormatDataset(urls, fmt, balance="none"))
    assert (caught.value.url, caught.value.record_index, caught.value.offset) == (urls[1], 4, 4 * RECORD.size)


def test_remote_shards_arrive_exactly_once_read_with_the_remote_options_given(fmt, tmp_path) -> None:
    pytest.importorskip("aiohttp")  # fsspec's http filesystem
    root = str(tmp_path / "data")
    os.makedirs(root)
    local = write_shards(root)
    retry = RetryPolicy(attempts=6, max_seconds=5.0, backoff=0.001, max_backoff=0.01)
    with FaultServer(root) as server:
        urls = [f"{server.url}/{os.path.basename(url)}" for url in local]
        for url in local:
            server.inject(os.path.basename(url), "reset")
        remote_stats(reset=True)
        dataset = FormatDataset(urls, fmt, rank=1, world_size=2, retry=retry, readahead_bytes=0)
        assert dataset.format.remote is not None and dataset.format.remote.retry == retry
        assert fmt.remote is None  # the format given keeps its own options
        remote = list(dataset)
        assert remote_stats()["retries"] >= 1  # a reset happened and was retried
    assert remote == list(FormatDataset(local, FixedFormat(), rank=1, world_size=2))


def test_a_state_saved_mid_epoch_resumes_into_a_fresh_dataset_with_exactly_the_rest(fmt, tmp_path) -> None:
    urls = write_shards(str(tmp_path))

    def dataset() -> FormatDataset:
        return FormatDataset(urls, fmt, shuffle=True, seed=4, balance="none")

    whole = list(dataset())
    interrupted = dataset()
    iterator = iter(interrupted)
    delivered = [next(iterator) for _ in range(11)]
    state = interrupted.state_dict()
    fresh = dataset()
    fresh.load_state_dict(state)
    assert delivered + list(fresh) == whole  # the same order, every record exactly once
    assert sorted(whole) == sorted(every_record())


def test_a_format_with_only_the_shard_format_methods_reads_with_the_defaults(tmp_path) -> None:
    plain = register_format(PlainFormat())
    assert not isinstance(plain, FormatBase)
    urls = write_shards(str(tmp_path), bad=(0, 2), suffix=".pfxd")
    # shuffle=True shuffles records, which needs their counts: the default way to them is count()
    options = {"shuffle": True, "balance": "none", "on_error": "skip", "world_size": 2}
    ranks = [FormatDataset(urls, plain, rank=rank, **options) for rank in range(2)]
    with pytest.warns(UserWarning, match=r"skipping record 2 of .*part-0\.pfxd"):
        samples = [s for dataset in ranks for s in dataset]
    assert sorted(samples) == sorted(s for s in every_record() if s != record(0, 2))
    assert sum(dataset.stats().skipped.sum() for dataset in ranks) == 1
    assert sorted(set(plain.counted)) == sorted(urls)  # no stored counts: counted with count()
    assert format_for(urls[0]) is plain and isinstance(shardkit.FormatDataset(urls, plain).format, FormatBase)
