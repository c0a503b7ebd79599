"""Fault injection on metadata: counts caches, index files, manifests, resume fingerprints.

Every test damages real files (rewrites a shard, truncates or flips bytes of a
cache or an index, replaces or truncates a manifest under live workers) and
asserts the documented outcome: recounted, refused with an error naming the
file and the fix, or read correctly anyway; never silently wrong.
"""

from __future__ import annotations

import logging
import os

import pytest
from torch.utils.data import DataLoader

import shardkit
from shardkit import ShardList, TFRecordDataset
from shardkit.counting import identity, resolve_counts
from shardkit.dataset import TFRecordReader
from shardkit.state import StateError


def write_tfrecord(path: str, records: list[bytes]) -> str:
    with shardkit.TFRecordWriter(path) as out:
        for record in records:
            out.write(record)
    return path


def write_shards(root, counts: list[int], record_size: int = 10) -> list[str]:
    """Shards of raw records ``b"<shard>:<index>"`` padded to ``record_size`` bytes."""
    return [
        write_tfrecord(str(root / f"part-{s}.tfrecord"), [f"{s}:{i}".encode().ljust(record_size) for i in range(n)])
        for s, n in enumerate(counts)
    ]


def bump_mtime(path: str, seconds: float = 10.0) -> None:
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + int(seconds * 1e9)))


def counted(urls: list[str]) -> list[int]:
    return TFRecordDataset(urls, rank=0, world_size=2).count_records().shards.num_records.tolist()


# -- counts cache ---------------------------------------------------------------------------


def test_a_shard_rewritten_with_the_same_size_and_another_count_is_recounted_alone(tmp_path, caplog, counts_cache_dir):
    urls = write_shards(tmp_path, [4, 3, 5])  # 26 bytes a record
    assert counted(urls) == [4, 3, 5]
    size = os.path.getsize(urls[0])
    write_tfrecord(urls[0], [b"x" * 36, b"y" * 36])  # 2 records of 52 bytes: the same 104 bytes
    assert os.path.getsize(urls[0]) == size
    bump_mtime(urls[0])  # a rewrite within the same clock tick is what the inode/ctime keys catch
    caplog.set_level(logging.INFO, logger="shardkit")
    assert counted(urls) == [2, 3, 5]
    assert "counting the records of 1 shards once" in caplog.text
    assert "record counts of 2 shards from" in caplog.text
    caplog.clear()
    assert counted(urls) == [2, 3, 5]  # and the new count is cached
    assert "counting the records" not in caplog.text


def test_a_shard_replaced_by_rename_is_recounted_even_with_the_same_size_and_mtime(tmp_path, counts_cache_dir):
    urls = write_shards(tmp_path, [4, 3])
    assert counted(urls) == [4, 3]
    stat = os.stat(urls[0])
    replacement = write_tfrecord(str(tmp_path / "new.tmp"), [b"x" * 36, b"y" * 36])
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime: only the inode differs
    os.replace(replacement, urls[0])
    assert counted(urls) == [2, 3]


def test_counting_writes_nothing_beside_the_data(tmp_path, counts_cache_dir):
    urls = write_shards(tmp_path, [4, 3])
    shardkit.build_index(urls[0])
    before = sorted(os.listdir(tmp_path))
    assert counted(urls) == [4, 3]
    glob = TFRecordDataset(f"{tmp_path}/part-*.tfrecord", rank=0, world_size=2).count_records()
    assert glob.shards.num_records.tolist() == [4, 3]
    assert sorted(os.listdir(tmp_path)) == before
    assert all(name.startswith("counts-") and name.endswith(".arrow") for name in os.listdir(counts_cache_dir))


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "other list"])
def test_a_damaged_counts_cache_is_ignored_and_rewritten(tmp_path, caplog, counts_cache_dir, damage):
    urls = write_shards(tmp_path, [4, 3, 5])
    assert counted(urls) == [4, 3, 5]
    [name] = os.listdir(counts_cache_dir)
    cache = os.path.join(counts_cache_dir, name)
    data = open(cache, "rb").read()
    if damage == "truncate":
        damaged = data[: len(data) // 2]
    elif damage == "flip":
        damaged = data[:8] + bytes(b ^ 0xFF for b in data[8:-8]) + data[-8:]
    elif damage == "empty":
        damaged = b""
    else:  # a valid cache of another list under this list's name
        (tmp_path / "elsewhere").mkdir()
        other = write_shards(tmp_path / "elsewhere", [1])
        resolve_counts(ShardList(other), TFRecordReader().count, why="test", cache_dir=str(tmp_path / "other"))
        [other_name] = os.listdir(tmp_path / "other")
        damaged = open(tmp_path / "other" / other_name, "rb").read()
    with open(cache, "wb") as f:
        f.write(damaged)
    caplog.set_level(logging.INFO, logger="shardkit")
    assert counted(urls) == [4, 3, 5]
    assert "ignoring the" in caplog.text and "counting the records of 3 shards" in caplog.text
    assert open(cache, "rb").read() == data  # rewritten whole
    assert sorted(os.listdir(counts_cache_dir)) == [name]  # no partial file left


def test_an_empty_cache_dir_setting_turns_the_cache_off(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SHARDKIT_CACHE_DIR", "")
    urls = write_shards(tmp_path, [2, 3])
    caplog.set_level(logging.INFO, logger="shardkit")
    assert counted(urls) == [2, 3] and counted(urls) == [2, 3]
    assert caplog.text.count("counting the records of 2 shards") == 2


def test_the_default_cache_dir_follows_xdg(tmp_path, monkeypatch):
    from shardkit.counting import cache_dir

    monkeypatch.delenv("SHARDKIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == str(tmp_path / "xdg" / "shardkit")
    assert cache_dir(str(tmp_path / "explicit")) == str(tmp_path / "explicit")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "shardkit")


def test_identity_uses_what_the_filesystem_reports_and_refuses_a_bare_size():
    local = {"name": "/d/a", "size": 5, "type": "file", "mtime": 1.5, "ino": 7, "created": 1.5}
    assert identity(local) == "size=5;mtime=1.5;ino=7;created=1.5"
    s3 = {"name": "b/a", "size": 5, "ETag": '"abc"', "LastModified": "2026-01-01"}
    assert identity(s3) == 'size=5;ETag="abc";LastModified=2026-01-01'
    assert identity({**s3, "ETag": '"abd"'}) != identity(s3)
    assert identity({"name": "x", "size": 5, "type": "file"}) is None  # a size alone is not an identity


def test_counts_of_files_without_an_identity_are_never_served_from_the_cache(tmp_path, caplog):
    urls = [str(tmp_path / f"missing-{n}") for n in (3, 4)]  # never stat-able: counted every time
    calls = []

    def count(url):
        calls.append(url)
        return int(url.rsplit("-", 1)[1])

    for _ in range(2):
        assert resolve_counts(ShardList(urls), count, why="test").num_records.tolist() == [3, 4]
    assert len(calls) == 4


# -- resume fingerprints -----------------------------------------------------------------------


def test_a_state_of_other_files_with_the_same_counts_is_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = write_shards(tmp_path / "a", [4, 3]), write_shards(tmp_path / "b", [4, 3])
    counts = [4, 3]
    first = TFRecordDataset(ShardList(a, num_records=counts), decode="raw")
    next(iter(first))
    state = first.state_dict()
    with pytest.raises(StateError, match=r"saved with dataset .*'urls': '[0-9a-f]{16}'.*but here it is .*'urls'"):
        TFRecordDataset(ShardList(b, num_records=counts), decode="raw").load_state_dict(state)
    with pytest.raises(StateError, match="'urls'"):  # the same files in another order
        TFRecordDataset(ShardList(a[::-1], num_records=counts[::-1]), decode="raw").load_state_dict(state)
    with pytest.raises(StateError, match="'counts'"):  # the same files and total, other counts
        TFRecordDataset(ShardList(a, num_records=[3, 4]), decode="raw").load_state_dict(state)
    same = TFRecordDataset(ShardList(list(a), num_records=counts), decode="raw")
    same.load_state_dict(state)  # an equal list elsewhere in memory is the same dataset
    assert len(list(same)) == sum(counts) - 1


def test_the_url_digest_is_stable_across_chunking_and_string_types():
    import pyarrow as pa

    urls = [f"s3://b/shard-{i:05d}" for i in range(1000)]
    chunked = pa.chunked_array([pa.array(urls[:300], pa.large_string()), pa.array(urls[300:], pa.large_string())])
    assert ShardList(urls).url_digest() == ShardList(chunked).url_digest() == ShardList(urls)[0:1000].url_digest()
    assert ShardList(urls).url_digest() != ShardList(urls[:999] + ["s3://b/shard-x"]).url_digest()
    # Moving one byte between neighbouring urls changes the lengths, so the digest.
    assert ShardList(["/ab", "/c"]).url_digest() != ShardList(["/a", "/bc"]).url_digest()


def _loader_ids(dataset, workers: int) -> list[bytes]:
    loader = DataLoader(dataset, batch_size=None, num_workers=workers)
    return list(loader)
