"""Tests for shardkit.ShardList: construction, globbing, manifests, pickling by
path, DataLoader workers under fork and spawn, and temp-file ownership."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import pickle
import tempfile
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.utils.data

from shardkit import ShardkitError
from shardkit.io.glob import expand_braces as _expand_braces
from shardkit.shardlist import ShardList, ShardListError

URLS = ["s3://bucket/a.tfrecord", "/data/b.tfrecord", "gs://c/d/e.tfrecord"]


@pytest.fixture
def memfs() -> fsspec.AbstractFileSystem:
    fs = fsspec.filesystem("memory")
    root = f"/t-{uuid.uuid4().hex}"
    yield fs, root
    fs.rm(root, recursive=True)


# -- construction -------------------------------------------------------------------


def test_contents_and_accessors() -> None:
    sl = ShardList(URLS, num_records=[10, 20, 30], sizes=np.array([1, 2, 3]))
    assert len(sl) == 3
    assert sl[0] == URLS[0] and sl[-1] == URLS[-1] and sl[-3] == URLS[0]
    assert list(sl) == URLS
    assert sl.urls() == URLS and sl.urls(1) == URLS[1:] and sl.urls(-2, -1) == [URLS[1]]
    assert sl.num_records.dtype == np.int64 and sl.num_records.tolist() == [10, 20, 30]
    assert sl.sizes.tolist() == [1, 2, 3]
    assert sl.total_records == 60
    assert sl.known_counts.tolist() == [True, True, True]
    assert sl.table.column_names == ["url", "num_records", "size"]
    assert "3 urls" in repr(sl) and "total_records=60" in repr(sl)


def test_unknown_counts() -> None:
    sl = ShardList(URLS, num_records=[10, None, 30])
    assert sl.num_records is None and sl.total_records is None and sl.sizes is None
    assert sl.known_counts.tolist() == [True, False, True]
    assert ShardList(URLS).known_counts.tolist() == [False, False, False]


def test_num_records_is_a_read_only_view() -> None:
    counts = ShardList(URLS, num_records=[1, 2, 3]).num_records
    assert not counts.flags.writeable
    with pytest.raises(ValueError):
        counts[0] = 5


def test_index_errors() -> None:
    sl = ShardList(URLS)
    for bad in (3, -4):
        with pytest.raises(IndexError, match="out of range"):
            sl[bad]
    with pytest.raises(IndexError, match=r"indices\[1\]"):
        sl.select([0, 7])


def test_iterates_across_batches() -> None:
    urls = [f"/d/{i:06d}" for i in range(10_000)]  # several 4096-url batches
    assert list(ShardList(urls)) == urls
    assert ShardList(urls).urls(4090, 4100) == urls[4090:4100]


def test_arrow_input_and_iterables() -> None:
    sl = ShardList(pa.array(URLS, pa.large_string()), num_records=pa.array([1, 2, 3], pa.int32()))
    assert list(sl) == URLS and sl.num_records.tolist() == [1, 2, 3]
    assert sl.table.column("url").type == pa.large_string()
    assert sl == ShardList(URLS, [1, 2, 3])  # equal content despite the url type
    assert list(ShardList(u for u in URLS)) == URLS


def test_empty_list() -> None:
    sl = ShardList([])
    assert len(sl) == 0 and list(sl) == [] and sl.total_records == 0
    assert sl.num_records.tolist() == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((["a", ""],), r"urls\[1\] is an empty string"),
        ((["a", "b", None],), r"urls\[2\] is missing"),
        ((["a", 3],), r"urls\[1\] is int, expected str"),
        (("abc",), "single string"),
        ((pa.array([1, 2]),), "string array"),
        ((["a", "b"], [1]), "num_records has 1 entries but there are 2 urls"),
        ((["a", "b"], [1, -1]), r"num_records\[1\] is -1"),
        ((["a", "b"], [1, True]), r"num_records\[1\] is True"),
        ((["a", "b"], [1, "7"]), r"num_records\[1\] is '7'"),
        ((["a", "b"], np.array([1.0, 2.0])), "must hold integers"),
        ((["a", "b"], None, [5, -2]), r"sizes\[1\] is -2"),
    ],
)
def test_validation_names_the_offender(args: tuple, message: str) -> None:
    with pytest.raises(ShardListError, match=message) as info:
        ShardList(*args)
    assert isinstance(info.value, ShardkitError) and isinstance(info.value, ValueError)


def test_with_num_records_select_and_slices() -> None:
    sl = ShardList(URLS, sizes=[5, 6, 7])
    counted = sl.with_num_records(np.array([3, 2, 1]))
    assert counted.num_records.tolist() == [3, 2, 1] and counted.sizes.tolist() == [5, 6, 7]
    assert list(counted) == URLS and sl.num_records is None  # the original is unchanged
    with pytest.raises(ShardListError, match="2 entries but there are 3"):
        sl.with_num_records([1, 2])
    picked = counted.select([2, -3])
    assert list(picked) == [URLS[2], URLS[0]] and picked.num_records.tolist() == [1, 3]
    assert list(counted[::2]) == [URLS[0], URLS[2]] and list(counted[1:]) == URLS[1:]
    assert list(counted.select(np.array([False, True, False]))) == [URLS[1]]


def test_equality() -> None:
    assert ShardList(URLS, [1, 2, 3]) == ShardList(URLS, [1, 2, 3])
    assert ShardList(URLS, [1, 2, 3]) != ShardList(URLS, [1, 2, 4])
    assert ShardList(URLS) != ShardList(URLS[:2])
    assert ShardList(URLS) != URLS


# -- globbing ---------------------------------------------------------------------------


def test_expand_braces() -> None:
    assert _expand_braces("t-{00000..00002}.rec") == ["t-00000.rec", "t-00001.rec", "t-00002.rec"]
    assert _expand_braces("{8..10}") == ["8", "9", "10"]
    assert _expand_braces("{a,b{1..2}}/x") == ["a/x", "b1/x", "b2/x"]
    assert _expand_braces("{a,b}-{0..1}") == ["a-0", "a-1", "b-0", "b-1"]
    assert _expand_braces("keep{this}") == ["keep{this}"]


def test_glob_memory_with_ranges_and_sizes(memfs) -> None:
    fs, root = memfs
    for i in (3, 0, 2, 1):
        fs.pipe(f"{root}/train-{i:05d}.tfrecord", b"x" * (i + 1))
    fs.pipe(f"{root}/val-00000.tfrecord", b"v")
    sl = ShardList.from_glob(f"memory://{root}/train-{{00000..00002}}.tfrecord")
    assert list(sl) == [f"memory://{root}/train-{i:05d}.tfrecord" for i in range(3)]
    assert sl.sizes.tolist() == [1, 2, 3]
    both = ShardList.from_glob(f"memory://{root}/{{train,val}}-*.tfrecord")
    assert len(both) == 5 and list(both) == sorted(both)
    assert both[-1].endswith("val-00000.tfrecord")


def test_glob_errors_name_the_pattern(memfs) -> None:
    fs, root = memfs
    fs.pipe(f"{root}/a-0.rec", b"x")
    with pytest.raises(ShardListError, match="no files match .*nothing"):
        ShardList.from_glob(f"memory://{root}/nothing-*.rec")
    with pytest.raises(ShardListError, match=r"1 file\(s\) named by .* do not exist.*a-1\.rec"):
        ShardList.from_glob(f"memory://{root}/a-{{0..1}}.rec")


def test_glob_local_directory(tmp_path, monkeypatch) -> None:
    (tmp_path / "sub").mkdir()  # a directory that matches must not be listed
    (tmp_path / "shard-sub").mkdir()
    for i in range(12):
        (tmp_path / f"shard-{i:03d}.rec").write_bytes(b"r" * i)
    sl = ShardList.from_glob(str(tmp_path / "shard-{000..009}.rec"))
    assert list(sl) == [str(tmp_path / f"shard-{i:03d}.rec") for i in range(10)]
    assert sl.sizes.tolist() == list(range(10))
    monkeypatch.chdir(tmp_path)
    everything = ShardList.from_glob("file://" + str(tmp_path) + "/shard-*")
    assert len(everything) == 12 and everything[0] == str(tmp_path / "shard-000.rec")


# -- manifests --------------------------------------------------------------------------


def test_ipc_manifest_round_trip_maps_a_private_copy(tmp_path) -> None:
    sl = ShardList(URLS, [1, None, 3], [9, 8, 7])
    path = str(tmp_path / "manifest.arrow")
    sl.to_manifest(path)
    assert os.listdir(tmp_path) == ["manifest.arrow"]  # no partial file left behind
    loaded = ShardList.from_manifest(path)
    copy = loaded.backing_file
    assert loaded == sl and os.path.dirname(copy) == tempfile.gettempdir()  # a snapshot, not the user's file
    with open(copy, "rb") as snapshot, open(path, "rb") as original:
        assert snapshot.read() == original.read()  # copied byte for byte, not rewritten
    assert pickle.loads(pickle.dumps(loaded)) == sl
    del loaded
    gc.collect()
    assert os.path.exists(path) and not os.path.exists(copy)  # a manifest is never deleted; the copy is


def test_compressed_ipc_manifest_is_copied(tmp_path) -> None:
    path = str(tmp_path / "zstd.arrow")
    sl = ShardList(URLS, [1, 2, 3])
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_file(path, sl.table.schema, options=options) as writer:
        writer.write_table(sl.table)
    loaded = ShardList.from_manifest(path)
    assert loaded == sl and loaded.backing_file != path


def test_parquet_manifest_with_relative_urls(tmp_path) -> None:
    (tmp_path / "m").mkdir()
    table = pa.table({"url": ["a.rec", "../b.rec", "s3://x/c.rec"], "num_records": pa.array([1, 2, 3], pa.int32())})
    pq.write_table(table, tmp_path / "m" / "list.parquet")
    sl = ShardList.from_manifest(str(tmp_path / "m" / "list.parquet"))
    assert list(sl) == [str(tmp_path / "m" / "a.rec"), str(tmp_path / "b.rec"), "s3://x/c.rec"]
    assert sl.num_records.tolist() == [1, 2, 3] and sl.sizes is None


def test_jsonl_manifest(tmp_path, memfs) -> None:
    lines = [{"url": "/d/a.rec", "num_records": 4}, {"url": "b.rec", "extra": 1}, {"url": "/d/c.rec", "size": 9}]
    text = "\n".join(json.dumps(line) for line in lines) + "\n"
    (tmp_path / "list.jsonl").write_text(text)
    sl = ShardList.from_manifest(str(tmp_path / "list.jsonl"))
    assert list(sl) == ["/d/a.rec", str(tmp_path / "b.rec"), "/d/c.rec"]
    assert sl.known_counts.tolist() == [True, False, False] and sl.table.column("size").to_pylist() == [None, None, 9]
    fs, root = memfs
    fs.pipe(f"{root}/dir/list.jsonl", text.encode())
    remote = ShardList.from_manifest(f"memory://{root}/dir/list.jsonl")
    assert remote[1] == f"memory://{root}/dir/b.rec"


def test_manifest_to_and_from_fsspec(memfs) -> None:
    fs, root = memfs
    sl = ShardList(URLS, [1, 2, 3])
    sl.to_manifest(f"memory://{root}/m.arrow")
    assert fs.cat(f"{root}/m.arrow")[:6] == b"ARROW1"
    assert ShardList.from_manifest(f"memory://{root}/m.arrow") == sl


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([{"name": "a"}], r"url\[0\] is missing"),
        ([{"url": "a"}, {"url": ""}], r"url\[1\] is an empty string"),
        ([{"url": "/a", "num_records": -3}], r"num_records\[0\] is -3"),
    ],
)
def test_bad_manifests(tmp_path, lines, message) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    with pytest.raises(ShardListError, match=message):
        ShardList.from_manifest(str(path))


def test_manifest_without_url_column(tmp_path) -> None:
    pq.write_table(pa.table({"path": ["a"]}), tmp_path / "x.parquet")
    with pytest.raises(ShardListError, match="no 'url' column"):
        ShardList.from_manifest(str(tmp_path / "x.parquet"))


# -- pickling and workers ------------------------------------------------------------------


def test_pickles_by_path() -> None:
    urls = [f"s3://bucket/train/shard-{i:07d}.tfrecord" for i in range(100_000)]
    sl = ShardList(urls, num_records=np.arange(100_000))
    payload = pickle.dumps(sl)
    assert len(payload) < 1024
    copy = pickle.loads(payload)
    assert copy == sl and copy.urls(99_990) == urls[99_990:]
    assert copy.num_records.tolist() == list(range(100_000))


class _ReadAll(torch.utils.data.IterableDataset):
    """Each worker reads every url, then yields its share with its pid."""

    def __init__(self, shards: ShardList) -> None:
        self.shards = shards

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        everything = list(self.shards)
        for i in range(info.id, len(everything), info.num_workers):
            yield os.getpid(), self.shards.backing_file, everything[i]


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_dataloader_workers_read_every_url(start_method: str) -> None:
    urls = [f"/data/shard-{i:05d}.rec" for i in range(5000)]
    sl = ShardList(urls)
    loader = torch.utils.data.DataLoader(
        _ReadAll(sl), num_workers=2, batch_size=None, multiprocessing_context=start_method
    )
    rows = list(loader)
    assert sorted(url for _, _, url in rows) == urls
    pids = {pid for pid, _, _ in rows}
    assert len(pids) == 2 and os.getpid() not in pids
    assert {path for _, path, _ in rows} == {sl.backing_file}
    assert os.path.exists(sl.backing_file)  # workers never delete the owner's file


# -- the temporary file's owner -----------------------------------------------------------


def test_owner_deletes_its_file_when_collected() -> None:
    sl = ShardList(URLS)
    path = sl.backing_file
    assert os.path.basename(path).startswith("shardkit-") and os.path.dirname(path) == tempfile.gettempdir()
    copy = pickle.loads(pickle.dumps(sl))
    assert len(copy) == 3
    del copy
    gc.collect()
    assert os.path.exists(path)  # an unpickled copy does not own the file
    del sl
    gc.collect()
    assert not os.path.exists(path)


def _finalize_in_child(shards: ShardList) -> None:
    # What garbage collection or interpreter exit would run in the child.
    shards._finalizer()


def test_forked_child_does_not_delete_the_file() -> None:
    sl = ShardList(URLS)
    child = multiprocessing.get_context("fork").Process(target=_finalize_in_child, args=(sl,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert os.path.exists(sl.backing_file) and list(sl) == URLS


def test_file_deleted_at_interpreter_exit(plain_import) -> None:
    path = plain_import["backing file"]  # a ShardList still referenced when its interpreter exited
    assert os.path.basename(path).startswith("shardkit-")
    assert not os.path.exists(path)


def test_missing_backing_file_is_explained() -> None:
    sl = ShardList(URLS)
    payload = pickle.dumps(sl)
    path = sl.backing_file
    del sl
    gc.collect()
    assert not os.path.exists(path)
    with pytest.raises(ShardListError, match="garbage-collected"):
        len(pickle.loads(payload))


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["DataLoader", "MixedLoader"])
def test_a_spawned_worker_reads_its_shards_without_importing_pandas(tmp_path, loader: str) -> None:
    """pyarrow imports pandas (44 MiB, 0.3-0.9 s) on its first ``pa.array``, ``to_numpy`` or Python
    scalar; a worker's plan and reads use buffers and compute kernels instead."""
    from shardkit import MixedLoader, TFRecordDataset, TFRecordWriter
    from tests.helpers.reading import pandas_is_loaded  # not this module: its import builds arrays

    for i in range(4):
        with TFRecordWriter(str(tmp_path / f"s{i}.tfrecord")) as writer:
            for j in range(5):
                writer.write(b"%d-%d" % (i, j))
    dataset = TFRecordDataset(str(tmp_path / "s*.tfrecord"), decode="raw").map(pandas_is_loaded)
    if loader == "DataLoader":
        batches = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    else:
        batches = MixedLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="spawn")
    loaded = [bool(x) for batch in batches for x in (batch if loader == "MixedLoader" else [batch])]
    assert len(loaded) == 20 and not any(loaded)
