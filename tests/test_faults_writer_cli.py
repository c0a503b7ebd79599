"""Faults injected for real into ShardWriter runs (SIGKILL, exceptions) and into every CLI sub-command."""

from __future__ import annotations

import glob
import os
import random
import signal
import subprocess
import sys
import time

import fsspec
import pytest

import shardkit
from shardkit.formats.tfrecord import read_tfrecord, verify_tfrecord
from shardkit.shardlist import ShardList

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

# A writer process: run "<tag>" writes <count> records of <size> bytes, 10 per shard; it prints
# "paused" and sleeps before record <pause_at> (<count>: after the last, -1: never) and "closed"
# after the with block.
WRITER = """
import sys, time
from shardkit.writer import ShardWriter
pattern, tag, count, size, pause_at = sys.argv[1], sys.argv[2].encode(), *map(int, sys.argv[3:6])
print("started", flush=True)
with ShardWriter(pattern, max_records=10) as writer:
    for i in range(count + 1):
        if i == pause_at:
            print("paused", flush=True)
            time.sleep(600)
        if i < count:
            writer.write(tag + b":%06d:" % i + b"x" * size)
print("closed", flush=True)
time.sleep(600)
"""


def start_writer(pattern: str, tag: str, count: int, *, size: int = 100, pause_at: int = -1) -> subprocess.Popen:
    args = [sys.executable, "-c", WRITER, pattern, tag, str(count), str(size), str(pause_at)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    assert proc.stdout is not None and proc.stdout.readline() == "started\n", proc.stderr.read()
    return proc


def wait_for(proc: subprocess.Popen, line: str) -> None:
    assert proc.stdout is not None
    got = proc.stdout.readline()
    assert got == line + "\n", f"expected {line!r}, got {got!r}; stderr: {proc.stderr.read() if proc.stderr else ''}"


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def write_run(pattern: str, tag: str, count: int, max_records: int) -> ShardList:
    with shardkit.ShardWriter(pattern, max_records=max_records) as writer:
        for i in range(count):
            writer.write(tag.encode() + b":%06d:" % i + b"x" * 100)
    return writer.shards


def assert_consistent(directory: str) -> str | None:
    """Check what a reader can see after a run was interrupted; return the tag of the
    run the manifest describes, or None when there is no manifest.

    Every file with a final name reads whole with every CRC checked. If there is a
    manifest, every shard it lists holds exactly its count, all from one run, and
    the records numbered 0, 1, 2, ... in shard order.
    """
    for path in glob.glob(os.path.join(directory, "train-*.tfrecord")):
        verify_tfrecord(path)  # raises CorruptRecordError on a partial file
    manifest = os.path.join(directory, "train.manifest.arrow")
    if not os.path.exists(manifest):
        return None
    shards = ShardList.from_manifest(manifest)
    records = []
    for url, count in zip(shards, shards.num_records.tolist()):
        got = list(read_tfrecord(url))
        assert len(got) == count, f"{url} holds {len(got)} records, the manifest says {count}"
        records += got
    tags = {record.split(b":")[0] for record in records}
    assert len(tags) == 1, f"the manifest describes a mix of runs {sorted(tags)}"
    assert [int(record.split(b":")[1]) for record in records] == list(range(len(records)))
    return tags.pop().decode()


def leftovers(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".partial"))


# --------------------------------------------------------------------------- ShardWriter, killed


@pytest.mark.slow
@pytest.mark.parametrize(
    "pause_at, expected",
    [
        (0, "old"),  # killed before the first record: the old run is untouched
        (25, None),  # killed inside the third shard: no manifest at all
        (60, None),  # killed with every record written but not closed
        (-1, "new"),  # killed after close: the new run is complete
    ],
)
def test_killed_writer_never_leaves_a_manifest_describing_a_mix(tmp_path, pause_at, expected):
    pattern = str(tmp_path / "train-%05d.tfrecord")
    write_run(pattern, "old", 35, max_records=7)  # 5 shards of 7
    proc = start_writer(pattern, "new", 60, pause_at=pause_at)
    wait_for(proc, "paused" if pause_at >= 0 else "closed")
    kill(proc)
    assert assert_consistent(str(tmp_path)) == expected
    partial = leftovers(str(tmp_path))
    assert len(partial) == (1 if pause_at > 0 else 0), partial  # the shard in progress, under a temporary name
    assert all(name.startswith("train-0000") and ".tfrecord." in name for name in partial)


@pytest.mark.slow
def test_writer_killed_at_random_moments_leaves_only_whole_files(tmp_path):
    pattern = str(tmp_path / "train-%05d.tfrecord")
    write_run(pattern, "old", 35, max_records=7)
    rng = random.Random(10)
    outcomes = set()
    for attempt in range(6):
        proc = start_writer(pattern, f"run{attempt}", 300, size=20_000)  # 30 shards of 200 kB
        time.sleep(rng.uniform(0, 0.4))
        kill(proc)
        outcomes.add(assert_consistent(str(tmp_path)))
        for name in leftovers(str(tmp_path)):
            os.unlink(tmp_path / name)
    assert None in outcomes  # at least one kill landed mid-run (asserted, so the test exercises it)
    write_run(pattern, "last", 12, max_records=10)
    assert assert_consistent(str(tmp_path)) == "last"


# --------------------------------------------------------------------------- ShardWriter, exceptions


def test_exception_inside_the_with_block_leaves_no_temp_file_and_no_manifest(tmp_path):
    pattern = str(tmp_path / "train-%05d.tfrecord")
    write_run(pattern, "old", 35, max_records=7)
    with pytest.raises(RuntimeError, match="boom"):
        with shardkit.ShardWriter(pattern, max_records=10) as writer:
            for i in range(25):
                writer.write(b"new:%06d:" % i)
            raise RuntimeError("boom")
    assert leftovers(str(tmp_path)) == []
    assert not os.path.exists(tmp_path / "train.manifest.arrow")
    assert writer.shards is None
    # the two completed shards are kept, whole; the third (5 records, in progress) is gone
    assert [len(list(read_tfrecord(pattern % i))) for i in range(2)] == [10, 10]
    assert [r.split(b":")[0] for r in read_tfrecord(pattern % 2)] == [b"old"] * 7
    with pytest.raises(ValueError, match="closed"):
        writer.write(b"more")


def test_exception_before_the_first_record_keeps_the_earlier_run(tmp_path):
    pattern = str(tmp_path / "train-%05d.tfrecord")
    write_run(pattern, "old", 35, max_records=7)
    with pytest.raises(KeyError):
        with shardkit.ShardWriter(pattern, max_records=10):
            raise KeyError("nothing written yet")
    assert assert_consistent(str(tmp_path)) == "old"


def test_a_new_run_removes_the_old_manifest_before_its_first_shard(tmp_path):
    pattern = str(tmp_path / "train-%05d.tfrecord")
    write_run(pattern, "old", 35, max_records=7)
    writer = shardkit.ShardWriter(pattern, max_records=10)
    assert os.path.exists(tmp_path / "train.manifest.arrow")  # constructing the writer changes nothing
    writer.write(b"new:000000:")
    assert not os.path.exists(tmp_path / "train.manifest.arrow")
    assert [r.split(b":")[0] for r in read_tfrecord(pattern % 0)] == [b"old"] * 7  # not replaced until complete
    shards = writer.close()
    assert shards.num_records.tolist() == [1]
    assert assert_consistent(str(tmp_path)) == "new"
    assert leftovers(str(tmp_path)) == []


def test_writer_on_a_remote_filesystem_publishes_by_rename(tmp_path):
    root = f"memory://writer-{os.getpid()}-{random.getrandbits(32)}"
    fs = fsspec.filesystem("memory")
    with pytest.raises(RuntimeError):
        with shardkit.ShardWriter(f"{root}/train-%03d.tfrecord", max_records=4) as writer:
            for i in range(6):
                writer.write(b"%d" % i)
            raise RuntimeError
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root.split("://")[1], detail=False)) == ["train-000.tfrecord"]
    with shardkit.ShardWriter(f"{root}/train-%03d.tfrecord", max_records=4) as writer:
        for i in range(6):
            writer.write(b"%d" % i)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(root.split("://")[1], detail=False))
    assert names == ["train-000.tfrecord", "train-001.tfrecord", "train.manifest.arrow"]
    shards = ShardList.from_manifest(f"{root}/train.manifest.arrow")
    assert [r for url in shards for r in read_tfrecord(url)] == [b"%d" % i for i in range(6)]
