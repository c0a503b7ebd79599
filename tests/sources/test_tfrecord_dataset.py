"""TFRecordDataset end to end: local, memory:// and S3 shards, decoding, counting, corrupt data."""

from __future__ import annotations

import collections
import logging
import os
import struct

import fsspec
import numpy as np
import pytest
from torch.utils.data import DataLoader

import shardkit
from shardkit import CorruptRecordError, TFRecordDataset
from shardkit.formats.tfrecord import TFRecordFormat

SIZES = [40, 7, 0, 23, 31]


def write_shards(root: str, sizes=SIZES, storage_options=None) -> list[str]:
    """Shards of tf.Examples whose "id" feature numbers every record of the dataset."""
    urls, next_id = [], 0
    for shard, size in enumerate(sizes):
        url = f"{root}/part-{shard:03d}.tfrecord"
        with shardkit.TFRecordWriter(url, storage_options=storage_options) as out:
            for _ in range(size):
                out.write(shardkit.encode_example({"id": [next_id], "name": [f"r{next_id}".encode()]}))
                next_id += 1
        urls.append(url)
    return urls


def example_id(example) -> int:
    return int(example["id"][0])


def ids_of(dataset, num_workers=2, batch_size=6) -> list[int]:
    loader = DataLoader(dataset.map(example_id), batch_size=batch_size, num_workers=num_workers)
    return [int(i) for batch in loader for i in batch]


def test_every_record_once_over_workers_and_ranks(tmp_path):
    urls = write_shards(str(tmp_path))
    shards = shardkit.ShardList(urls, num_records=SIZES)
    seen = []
    for rank in range(3):
        seen += ids_of(TFRecordDataset(shards, shuffle=True, balance="none", rank=rank, world_size=3))
    assert sorted(seen) == list(range(sum(SIZES)))


def test_decode_options(tmp_path):
    urls = write_shards(str(tmp_path), sizes=[3])
    raw = list(TFRecordDataset(urls, decode="raw"))
    assert raw == list(shardkit.read_tfrecord(urls[0]))
    examples = list(TFRecordDataset(urls))
    assert [e["name"] for e in examples] == [[b"r0"], [b"r1"], [b"r2"]]
    assert examples[2]["id"].dtype == np.int64
    assert list(TFRecordDataset(urls, decode=len)) == [len(r) for r in raw]
    with pytest.raises(ValueError, match="decode must be one of"):
        TFRecordDataset(urls, decode="json")
    with pytest.raises(ValueError, match="compression must be None, 'gzip', 'zlib' or 'auto'"):
        TFRecordDataset(urls, compression="bz2")


def test_unknown_counts_over_ranks_come_from_index_files_or_one_scan(tmp_path, caplog, counts_cache_dir):
    urls = write_shards(str(tmp_path))
    for url in urls[:2]:
        shardkit.build_index(url)  # two shards indexed, the rest scanned
    caplog.set_level(logging.INFO, logger="shardkit")
    first = TFRecordDataset(f"{tmp_path}/part-*.tfrecord", rank=0, world_size=2).count_records()
    assert "counting the records of 5 shards once" in caplog.text
    assert first.shards.num_records.tolist() == SIZES
    for name in os.listdir(counts_cache_dir):  # now let each rank's workers count on first use
        os.unlink(os.path.join(counts_cache_dir, name))
    ranks = [ids_of(TFRecordDataset(f"{tmp_path}/part-*.tfrecord", rank=r, world_size=2)) for r in range(2)]
    total = sum(SIZES)
    assert [len(r) for r in ranks] == [-(-total // 2)] * 2
    assert set(ranks[0]) | set(ranks[1]) == set(range(total))
    # The counts were cached (in the cache directory): the next dataset does not count.
    caplog.clear()
    dataset = TFRecordDataset(f"{tmp_path}/part-*.tfrecord", rank=0, world_size=2).count_records()
    assert dataset.shards.num_records.tolist() == SIZES
    assert "counting the records" not in caplog.text


def test_index_files_let_a_range_start_mid_shard(tmp_path):
    urls = write_shards(str(tmp_path), sizes=[50])
    shardkit.build_index(urls[0])
    fmt = TFRecordFormat()
    assert fmt.count(urls[0]) == 50
    assert list(fmt.read(urls[0], 45, None)) == list(shardkit.read_tfrecord(urls[0]))[45:]


def test_memory_filesystem_shards_with_forked_workers():
    root = "memory://shardkit-dataset-test"
    urls = write_shards(root)
    dataset = TFRecordDataset(shardkit.ShardList(urls, num_records=SIZES), balance="none")
    loader = DataLoader(dataset.map(example_id), batch_size=5, num_workers=2, multiprocessing_context="fork")
    assert sorted(int(i) for batch in loader for i in batch) == list(range(sum(SIZES)))
    fsspec.filesystem("memory").rm(root, recursive=True)


@pytest.mark.slow
def test_s3_shards_over_two_ranks(s3_server):
    bucket = s3_server.new_bucket()
    options = s3_server.storage_options()
    write_shards(bucket, storage_options=options)
    seen = collections.Counter()
    for rank in range(2):
        dataset = TFRecordDataset(
            f"{bucket}/part-*.tfrecord", storage_options=options, balance="pad", shuffle=True, rank=rank, world_size=2
        )
        seen.update(ids_of(dataset))
    total = sum(SIZES)
    assert set(seen) == set(range(total))
    assert sum(seen.values()) == 2 * -(-total // 2)


def corrupt_data_byte(url: str, record: int) -> None:
    """Flip a data byte of one record (its data CRC no longer matches)."""
    with open(url, "r+b") as f:
        offset = 0
        for _ in range(record):
            f.seek(offset)
            (length,) = struct.unpack("<Q", f.read(8))
            offset += 12 + length + 4
        f.seek(offset + 12)
        byte = f.read(1)
        f.seek(offset + 12)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_corrupt_record_raises_with_its_location_or_is_skipped_and_counted(tmp_path):
    urls = write_shards(str(tmp_path), sizes=[10, 10])
    corrupt_data_byte(urls[0], 4)
    strict = TFRecordDataset(urls, balance="none")
    with pytest.raises(CorruptRecordError, match=r"part-000.tfrecord: record 4 at byte offset \d+"):
        list(strict)
    lenient = TFRecordDataset(urls, balance="none", on_error="skip")
    with pytest.warns(UserWarning, match="skipping record 4 of .*part-000.tfrecord"):
        ids = [example_id(e) for e in lenient]
    assert ids == [i for i in range(20) if i != 4]  # only the bad record is lost
    stats = lenient.stats()
    assert stats.read.tolist() == [9, 10]
    assert stats.skipped.tolist() == [1, 0]
    assert stats.total_read + stats.total_skipped == 20


def test_a_truncated_shard_loses_only_its_tail_when_skipping(tmp_path):
    urls = write_shards(str(tmp_path), sizes=[10, 10])
    with open(urls[1], "r+b") as f:
        f.truncate(f.seek(0, 2) - 3)  # the last record's footer is cut
    lenient = TFRecordDataset(shardkit.ShardList(urls, num_records=[10, 10]), balance="none", on_error="skip")
    with pytest.warns(UserWarning, match=r"skipping 1 records of .*part-001.tfrecord from record 9"):
        ids = [example_id(e) for e in lenient]
    assert ids == list(range(19))
    assert lenient.stats().skipped.tolist() == [0, 1]
