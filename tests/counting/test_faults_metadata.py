"""Fault injection on metadata: counts caches, index files, manifests, resume fingerprints.

Every test damages real files (rewrites a shard, truncates or flips bytes of a
cache or an index, replaces or truncates a manifest under live workers) and
asserts the documented outcome: recounted, refused with an error naming the
file and the fix, or read correctly anyway; never silently wrong.
"""

from __future__ import annotations

import gc
import gzip
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import pytest
from torch.utils.data import ChainDataset, DataLoader

import shardkit
from shardkit import ShardedDataset, ShardList, TFRecordDataset
from shardkit.counting import resolve_counts
from shardkit.formats.offsets import IndexFileError
from shardkit.formats.tfrecord import TFRecordFormat
from shardkit.formats.tfrecord.index import load_index
from shardkit.io.identity import identity
from shardkit.shardlist import DuplicateShardWarning, ShardListError
from shardkit.state import StateError
from tests.helpers.load import hang_bound
from tests.helpers.reading import read_all
from tests.helpers.shards import all_ids, synthetic_read


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
        resolve_counts(ShardList(other), TFRecordFormat().count, why="test", cache_dir=str(tmp_path / "other"))
        [other_name] = os.listdir(tmp_path / "other")
        damaged = open(tmp_path / "other" / other_name, "rb").read()
    with open(cache, "wb") as f:
        f.write(damaged)
    caplog.set_level(logging.INFO, logger="shardkit")
    assert counted(urls) == [4, 3, 5]
    assert "ignoring the" in caplog.text and "counting the records of 3 shards" in caplog.text
    assert open(cache, "rb").read() == data  # rewritten whole
    assert sorted(os.listdir(counts_cache_dir)) == [name]  # no partial file left


def test_an_s3_object_rewritten_with_the_same_size_is_recounted_by_its_etag(s3_server, caplog, counts_cache_dir):
    options = s3_server.storage_options()
    root = f"{s3_server.new_bucket()}/data"
    urls = []
    for shard, records in enumerate([[b"a" * 10] * 4, [b"b" * 10] * 3]):
        url = f"{root}/part-{shard}.tfrecord"
        with shardkit.TFRecordWriter(url, storage_options=options) as out:
            for record in records:
                out.write(record)
        urls.append(url)

    def count():
        dataset = TFRecordDataset(urls, rank=0, world_size=2, storage_options=options)
        return dataset.count_records().shards.num_records.tolist()

    assert count() == [4, 3]
    with shardkit.TFRecordWriter(urls[0], storage_options=options) as out:
        out.write(b"x" * 36)
        out.write(b"y" * 36)  # the same 104 bytes, another ETag
    caplog.set_level(logging.INFO, logger="shardkit")
    assert count() == [2, 3]
    assert "counting the records of 1 shards once" in caplog.text


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


# -- index files ------------------------------------------------------------------------------

RECORDS = [f"record {i:02d}".encode() for i in range(20)]  # 9 data bytes each: 25 framed


def _framed(records: list[bytes], tmp_path) -> bytes:
    scratch = write_tfrecord(str(tmp_path / "scratch.tfrecord"), records)
    data = open(scratch, "rb").read()
    os.unlink(scratch)
    return data


def _set_offsets(index: str, change) -> None:
    raw = bytearray(open(index, "rb").read())
    offsets = np.frombuffer(bytes(raw[24:]), "<u8").copy()
    change(offsets)
    raw[24:] = offsets.tobytes()
    open(index, "wb").write(bytes(raw))


def _grow(url, index, tmp_path):
    with open(url, "ab") as f:
        f.write(_framed([b"appended!"], tmp_path))
    return [*RECORDS, b"appended!"]


def _shrink(url, index, tmp_path):
    with open(url, "r+b") as f:
        f.truncate(15 * 25)  # at a record boundary: the shard itself is sound
    return RECORDS[:15]


def _rewrite_same_size(url, index, tmp_path):
    records = [f"{i}".encode().ljust(34) for i in range(10)]  # 10 x 50 bytes: the same 500 bytes
    write_tfrecord(url, records)
    return records


def _offset_past_eof(url, index, tmp_path):
    _set_offsets(index, lambda offsets: offsets.__setitem__(19, 10_000))
    return RECORDS


def _negative_offset(url, index, tmp_path):
    _set_offsets(index, lambda offsets: offsets.__setitem__(7, np.uint64(2**64 - 25)))
    return RECORDS


def _unsorted(url, index, tmp_path):
    _set_offsets(index, lambda offsets: offsets.__setitem__(slice(3, 5), offsets[3:5][::-1].copy()))
    return RECORDS


def _truncated_index(url, index, tmp_path):
    with open(index, "r+b") as f:
        f.truncate(24 + 8 * 12)
    return RECORDS


def _stale_text_index(url, index, tmp_path):
    offsets = np.arange(21) * 25  # the tfrecord package's "offset length" lines
    open(index, "w").write("".join(f"{o} 25\n" for o in offsets[:-1]))
    return _grow(url, index, tmp_path)


def _negative_text_index(url, index, tmp_path):
    open(index, "w").write("0 25\n-25 25\n" + "".join(f"{o} 25\n" for o in range(50, 500, 25)))
    return RECORDS


INDEX_DEFECTS = {
    "shard grew": (_grow, r"it describes 500 bytes but the file has 525 \(it grew\)"),
    "shard shrank": (_shrink, r"it describes 500 bytes but the file has 375 \(it shrank\)"),
    "shard rewritten, same size": (_rewrite_same_size, "no record of the file ends at its end"),
    "offset past the end": (_offset_past_eof, "the last offset 10000 leaves no room for a record before 500"),
    "negative offset": (_negative_offset, "is not a file position"),
    "unsorted offsets": (_unsorted, r"offset 4 \(75\) is not past offset 3 \(100\)"),
    "truncated index": (_truncated_index, "should hold 20 offsets but has 96 bytes"),
    "stale text index": (_stale_text_index, "it describes 500 bytes but the file has 525"),
    "negative text offset": (_negative_text_index, "line 1: record at 0 of length 25 is not followed"),
}


@pytest.fixture(params=list(INDEX_DEFECTS))
def bad_index(request, tmp_path):
    """A shard with an index, then one defect injected: (url, index path, true records, expected problem)."""
    damage, problem = INDEX_DEFECTS[request.param]
    url = write_tfrecord(str(tmp_path / "data.tfrecord"), RECORDS)
    index = shardkit.build_index(url)
    truth = damage(url, index, tmp_path)
    return url, index, truth, problem


def test_counting_with_a_bad_index_warns_and_scans(bad_index):
    url, index, truth, problem = bad_index
    with pytest.warns(UserWarning, match=f"index file {index} does not fit {url}: .*({problem})"):
        counts = TFRecordDataset([url], decode="raw").count_records().shards.num_records.tolist()
    assert counts == [len(truth)]


# Every defect is found by a reader that seeks (rank 1 of 2 starts mid-shard), in this process; that the
# error and the rebuilt index travel through DataLoader workers (worker 1 starts mid-shard) is one path
# whatever the defect, so the workers run two defects, one per kind of index (binary, text), not all nine.
SEEKS = [(defect, 0, 1, 2) for defect in INDEX_DEFECTS] + [
    (defect, 2, 0, 1) for defect in ("shard rewritten, same size", "negative text offset")
]


@pytest.mark.slow
@pytest.mark.parametrize(("bad_index", "workers", "rank", "world_size"), SEEKS, indirect=["bad_index"])
def test_seeking_with_a_bad_index_raises_naming_both_files_and_the_fix(bad_index, workers, rank, world_size):
    url, index, truth, problem = bad_index
    shards = ShardList([url], num_records=[len(truth)])  # true counts: only the index is wrong
    dataset = TFRecordDataset(shards, decode="raw", rank=rank, world_size=world_size)
    with pytest.raises(IndexFileError) as info:  # rank 1 / worker 1 starts mid-shard, so seeks
        read_all(DataLoader(dataset, batch_size=None, num_workers=workers))
    message = str(info.value)
    assert url in message and index in message and f"shardkit index {url}" in message
    assert re.search(problem, message)

    # Without the index the same reader reads the shard's true records; so does it after a rebuild.
    def read(source):
        return list(DataLoader(source, batch_size=None, num_workers=workers))

    plain = read(TFRecordDataset(shards, decode="raw", rank=rank, world_size=world_size, index=False))
    assert len(plain) == -(-len(truth) // world_size) and set(plain) <= set(truth)
    if world_size == 1:
        assert sorted(plain) == sorted(truth)
    shardkit.build_index(url)
    assert read(dataset) == plain


def test_under_on_error_skip_a_range_behind_a_bad_index_is_skipped_counted_and_named(tmp_path):
    url = write_tfrecord(str(tmp_path / "data.tfrecord"), RECORDS)
    index = shardkit.build_index(url)
    _grow(url, index, tmp_path)
    dataset = TFRecordDataset(ShardList([url], num_records=[21]), decode="raw", rank=1, world_size=2, on_error="skip")
    with pytest.warns(UserWarning, match=f"skipping 10 records of {url} from record 11: index file {index}"):
        # The pad record, read from the start without seeking, also stands in for the 10 skipped
        # records: under balance="pad" the rank still yields its planned 11 samples.
        assert list(dataset) == [RECORDS[0]] * 11
    stats = dataset.stats()
    assert stats.total_skipped == 10 and stats.total_padded == 10 and int(stats.errors.sum()) == 1


def test_a_valid_index_still_seeks_and_counts(tmp_path):
    url = write_tfrecord(str(tmp_path / "data.tfrecord"), RECORDS)
    shardkit.build_index(url)
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".partial")]
    fmt = TFRecordFormat()
    assert fmt.count(url) == 20
    assert list(fmt.read(url, 13, 17)) == RECORDS[13:17]
    assert load_index(url).tolist() == list(range(0, 500, 25))


def test_an_index_beside_a_compressed_shard_is_not_used(tmp_path):
    url = str(tmp_path / "data.tfrecord.gz")
    with shardkit.TFRecordWriter(url, compression="gzip") as out:
        for record in RECORDS:
            out.write(record)
    shardkit.build_index(url)
    assert load_index(url) is None  # cannot be checked against the compressed bytes
    with open(url, "ab") as f:  # a stale one is therefore never trusted either
        f.write(gzip.compress(_framed([b"more"], tmp_path)))
    assert TFRecordFormat().count(url) == 21


# -- manifests --------------------------------------------------------------------------------


def _replace_by_rename(path: str, other: ShardList) -> None:
    other.to_manifest(path)


def _overwrite_in_place(path: str, other: ShardList) -> None:
    with open(path, "r+b") as f:  # the same inode: what a mapped manifest would see
        f.write(open(other.backing_file, "rb").read())
        f.truncate()


@pytest.mark.slow
def test_spawn_workers_read_the_list_the_dataset_was_planned_with(tmp_path):
    """Both ways of replacing a manifest under one loader: its spawned workers (seconds each to start)
    read the two datasets one after the other, each a list of its own shard names."""
    datasets, originals = [], []
    for replace in (_replace_by_rename, _overwrite_in_place):
        path = str(tmp_path / f"{replace.__name__}.arrow")
        original = ShardList([f"/mem/{replace.__name__}{i}-{count}" for i, count in enumerate([3, 5, 2, 4])])
        original.to_manifest(path)
        datasets.append(ShardedDataset(ShardList.from_manifest(path), synthetic_read, balance="none"))
        replace(path, ShardList([f"mem/other{i}-7" for i in range(9)]))
        originals.append(original)
    loader = DataLoader(ChainDataset(datasets), batch_size=None, num_workers=2, multiprocessing_context="spawn")
    assert sorted(loader) == sorted(all_ids(originals[0]) + all_ids(originals[1]))


TRUNCATE_SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r})
from torch.utils.data import DataLoader
from shardkit import ShardList, ShardedDataset
from tests.helpers.shards import synthetic_read

if __name__ == "__main__":
    path = sys.argv[1]
    shards = ShardList.from_manifest(path)
    os.truncate(path, 0 if sys.argv[2] == "empty" else os.path.getsize(path) // 2)
    dataset = ShardedDataset(shards, synthetic_read, balance="none")
    # one spawned worker maps the manifest anew (it pickles by path); a second would only import torch again
    loader = DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    print(len(list(shards)), len(list(loader)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("cut", ["empty", "half"])
def test_a_manifest_truncated_after_loading_cannot_kill_the_process(tmp_path, cut):
    path = str(tmp_path / "train.arrow")
    # A manifest several pages long (4 KiB each), of absolute urls: the layout that used to be mapped in
    # place. Not longer: the workers read every record (2000 shards took 20 s; a truncated page is a page).
    counts = [3] * 600
    ShardList([f"/mem/shard{i:04d}-3" for i in range(600)], num_records=counts).to_manifest(path)
    assert os.path.getsize(path) > 3 * 4096
    script = tmp_path / "run.py"
    script.write_text(
        TRUNCATE_SCRIPT.format(repo=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    )
    result = subprocess.run(
        [sys.executable, str(script), path, cut], capture_output=True, text=True, timeout=hang_bound(300)
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])  # -7 was SIGBUS
    assert result.stdout.split() == ["600", str(sum(counts))]


def test_a_manifest_truncated_before_loading_is_a_clear_error_and_leaves_no_copy(tmp_path, monkeypatch):
    path = str(tmp_path / "train.arrow")
    ShardList(["/mem/a-3", "/mem/b-4"]).to_manifest(path)
    os.truncate(path, os.path.getsize(path) // 2)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    with pytest.raises(ShardListError, match="cannot read manifest .*train.arrow.* as Arrow IPC"):
        ShardList.from_manifest(path)
    gc.collect()
    assert os.listdir(tmp_path / "tmp") == []


def test_duplicate_urls_warn_naming_the_url_and_its_positions(tmp_path):
    with pytest.warns(DuplicateShardWarning, match=r"urls: '/d/b' is listed 3 times \(at positions \[1, 3, 4\]\)"):
        ShardList(["/d/a", "/d/b", "/d/c", "/d/b", "/d/b", "/d/c"])
    path = tmp_path / "list.jsonl"
    path.write_text("".join(json.dumps({"url": url}) + "\n" for url in ["/d/x", "/d/y", "/d/x"]))
    with pytest.warns(
        DuplicateShardWarning, match=r"manifest .*list.jsonl.*'/d/x' is listed 2 times \(at positions \[0, 2\]\)"
    ):
        ShardList.from_manifest(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardList([f"/d/{i}" for i in reversed(range(100))])  # distinct, unsorted: no warning
        ShardList(["/d/a", "/d/b"]).select([0, 0, 1])  # repeating on purpose: no warning
        for name in "ab":
            open(tmp_path / f"{name}.rec", "wb").close()
        ShardList.from_glob(f"{tmp_path}/{{a,b,a}}.rec")  # a glob lists a file once


DDP_COUNT_SCRIPT = """
import json, os, sys
sys.path.insert(0, {repo!r})
import torch.distributed as dist
import torch.multiprocessing as mp
from shardkit import ShardList
from shardkit.counting import resolve_counts

def count(url):
    with open(url + ".calls", "a") as log:
        log.write("x")
    return os.path.getsize(url)

def run(rank, root, port):
    os.environ["SHARDKIT_CACHE_DIR"] = os.path.join(root, f"cache-node{{rank}}")  # one cache per node
    shards = ShardList([os.path.join(root, f"part-{{i}}") for i in range(4)])
    if rank == 0:
        resolve_counts(shards, count, why="warm node 0")  # only node 0 has counted before
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2)
    counts = resolve_counts(shards, count, why="training").num_records.tolist()
    gathered = [None, None]
    dist.all_gather_object(gathered, counts)
    if rank == 0:
        print(json.dumps(gathered), flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    root, port = sys.argv[1], int(sys.argv[2])
    mp.start_processes(run, args=(root, port), nprocs=2, start_method="fork")
"""


@pytest.mark.slow
def test_ranks_with_different_node_caches_count_together_without_hanging(tmp_path):
    import socket

    for i, size in enumerate([3, 1, 4, 1]):
        (tmp_path / f"part-{i}").write_bytes(b"x" * size)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "ddp_count.py"
    script.write_text(
        DDP_COUNT_SCRIPT.format(repo=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    )
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(port)], capture_output=True, text=True, timeout=hang_bound(120)
    )  # before: rank 1's counting all-gather met rank 0's next collective: a crash or a hang
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[3, 1, 4, 1], [3, 1, 4, 1]]
    # Node 0 counted each file once before; then the two ranks shared the four counts out.
    assert [(tmp_path / f"part-{i}.calls").read_text() for i in range(4)] == ["xx"] * 4


# -- counts from index files, without count_records() -------------------------------------------


def _indexed_shards(tmp_path, kind: str) -> tuple[list[str], object, list]:
    """Two shards of ``kind`` with index files beside them: (urls, a dataset factory, every sample id)."""
    from tests.formats.test_formats_jsonl import write_shards as write_jsonl
    from tests.formats.test_formats_tar import write_shards as write_tars

    if kind == "tfrecord":
        urls = [write_tfrecord(str(tmp_path / f"part-{i}.tfrecord"), RECORDS[i::2]) for i in range(2)]
        factory, ids = (lambda shards, **kw: TFRecordDataset(shards, decode="raw", **kw)), (lambda s: s)
    elif kind == "tar":
        urls, factory, ids = write_tars(str(tmp_path), sizes=[9, 12]), shardkit.TarDataset, (lambda s: s["__key__"])
    else:
        urls, factory, ids = write_jsonl(str(tmp_path), sizes=[9, 12]), shardkit.JsonlDataset, (lambda s: s["id"])
    for url in urls:
        factory([url]).format.build_index(url)
    return urls, (lambda **kw: factory(ShardList(urls), **kw)), ids


@pytest.fixture(params=["tfrecord", "tar", "jsonl"])
def indexed(request, tmp_path, monkeypatch):
    """Shards with index files, and every way of counting them by a scan made to fail the test."""
    urls, make, ids = _indexed_shards(tmp_path, request.param)
    everything = sorted(ids(s) for s in make(balance="none"))

    def no_counting(*args, **kwargs):
        raise AssertionError("counted by count_fn / count_records(), not from the index files")

    monkeypatch.setattr(ShardedDataset, "count_records", no_counting)
    monkeypatch.setattr("shardkit.counting.resolve.resolve_counts", no_counting)
    return urls, make, ids, everything


def test_len_and_resume_take_counts_from_index_files_without_count_records(indexed):
    urls, make, ids, everything = indexed
    dataset = make()
    assert len(dataset) == len(everything)
    iterator = iter(dataset)
    first = [ids(next(iterator)) for _ in range(5)]
    state = dataset.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert sorted(first + [ids(s) for s in resumed]) == everything


def test_two_balanced_ranks_plan_from_index_files_without_count_records(indexed):
    urls, make, ids, everything = indexed
    ranks = [[ids(s) for s in make(rank=r, world_size=2, balance="drop")] for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(everything) // 2
    assert not set(ranks[0]) & set(ranks[1]) and set(ranks[0]) | set(ranks[1]) <= set(everything)


def test_a_stale_index_is_refused_not_trusted_for_counts(indexed, tmp_path):
    urls, make, ids, everything = indexed
    with open(urls[1], "ab") as f:  # the shard grew after it was indexed
        f.write(b"\0" * 1024)
    with pytest.raises(IndexFileError, match=f"does not fit {re.escape(urls[1])}.*shardkit index"):
        len(make())
    with pytest.raises(IndexFileError, match=re.escape(urls[1])):
        list(make(rank=0, world_size=2))


# -- the in-process index cache --------------------------------------------------------------------


def test_a_checked_index_is_read_once_per_process_for_many_ranges(tmp_path, monkeypatch):
    import shardkit.formats.tfrecord.index as index_module

    url = write_tfrecord(str(tmp_path / "data.tfrecord"), RECORDS)
    shardkit.build_index(url)
    reads = []
    real = index_module._load_checked
    monkeypatch.setattr(index_module, "_load_checked", lambda *a: reads.append(a) or real(*a))
    fmt = TFRecordFormat()
    for start in range(1, 19, 3):  # the ranges a sample-level shuffle reads
        assert list(fmt.read(url, start, start + 2)) == RECORDS[start : start + 2]
    assert len(reads) == 1
    assert not load_index(url).flags.writeable  # shared by every caller: nobody can change it for the others


@pytest.mark.parametrize("damage", ["grow", "rewrite index"])
def test_a_cached_index_is_checked_again_when_either_file_changes(tmp_path, damage):
    url = write_tfrecord(str(tmp_path / "data.tfrecord"), RECORDS)
    index = shardkit.build_index(url)
    fmt = TFRecordFormat()
    assert list(fmt.read(url, 13, 15)) == RECORDS[13:15]  # cached now
    if damage == "grow":
        _grow(url, index, tmp_path)
        with pytest.raises(IndexFileError, match="it grew"):
            list(fmt.read(url, 13, 15))
    else:  # an index of other records with the same size: only its identity tells it changed
        other = write_tfrecord(str(tmp_path / "other.tfrecord"), [b"%034d" % i for i in range(10)])  # 500 bytes
        os.replace(shardkit.build_index(other), index)
        with pytest.raises(IndexFileError, match="no record of the file ends at its end"):
            list(fmt.read(url, 13, 15))


def test_counts_taken_from_index_files_are_cached_for_the_next_dataset(indexed, monkeypatch):
    urls, make, ids, everything = indexed
    assert len(make()) == len(everything)
    fmt_class = type(make().format)

    def read_again(self, url):
        raise AssertionError(f"the index of {url} was read again")

    monkeypatch.setattr(fmt_class, "index_offsets", read_again)
    assert len(make()) == len(everything)  # from the counts cache, bound to each shard's identity
    os.utime(urls[0], ns=(1, 1))  # a shard that may have changed: its index is read (and checked) again
    with pytest.raises(AssertionError, match=f"the index of {re.escape(urls[0])} was read again"):
        len(make())


@pytest.mark.slow
def test_dataloader_workers_of_two_ranks_plan_from_index_files_without_count_records(indexed):
    urls, make, ids, everything = indexed
    ranks = []
    for rank in range(2):
        loader = DataLoader(make(rank=rank, world_size=2, balance="pad"), batch_size=None, num_workers=2)
        ranks.append([ids(s) for s in loader])
    assert len(ranks[0]) == len(ranks[1]) == -(-len(everything) // 2)
    assert set(ranks[0]) | set(ranks[1]) == set(everything)
    assert len(ranks[0]) + len(ranks[1]) - len(everything) == len(everything) % 2  # "pad" repeats one at most
