"""The local cache of remote shards: a second epoch fetches nothing, a changed object is fetched again,
LRU eviction under a limit, concurrent fillers share one entry, a killed writer leaves nothing read as whole."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from shardkit.formats.tfrecord import read_tfrecord
from shardkit.io.cache import Cache
from shardkit.io.remote import RemoteOptions, RetryPolicy, remote_stats
from tests.helpers.fault_server import FaultServer
from tests.helpers.load import hang_bound
from tests.io.test_remote_reads import write_shard

FAST_RETRY = RetryPolicy(attempts=6, max_seconds=5.0, backoff=0.001, max_backoff=0.01)


@pytest.fixture
def server(tmp_path) -> Iterator[FaultServer]:
    os.makedirs(tmp_path / "data")
    with FaultServer(str(tmp_path / "data")) as running:
        yield running


def cached(cache_dir: str, limit: int | None = None) -> RemoteOptions:
    return RemoteOptions(
        block_size=16 << 10, readahead_bytes=64 << 10, retry=FAST_RETRY, cache_dir=cache_dir, cache_limit_bytes=limit
    )


def test_the_second_epoch_reads_from_the_cache_and_fetches_nothing(server: FaultServer, tmp_path) -> None:
    data = tmp_path / "data"
    expected = {i: write_shard(str(data / f"s{i}.tfrecord"), seed=i) for i in range(3)}
    options = cached(str(tmp_path / "cache"))
    remote_stats(reset=True)
    for epoch in range(2):
        for i in range(3):
            assert list(read_tfrecord(f"{server.url}/s{i}.tfrecord", remote=options)) == expected[i]
        if epoch == 0:
            fetched = sum(r.length for r in server.gets())
            assert fetched == sum(os.path.getsize(data / f"s{i}.tfrecord") for i in range(3))
            gets = len(server.gets())
    assert len(server.gets()) == gets  # epoch 2: not one GET, only a HEAD per shard to check its identity
    stats = remote_stats()
    assert (stats["cache_misses"], stats["cache_hits"]) == (3, 3)
    assert len(Cache(str(tmp_path / "cache")).entries()) == 3


def test_a_changed_object_is_fetched_again_not_read_stale(server: FaultServer, tmp_path) -> None:
    path = str(tmp_path / "data" / "a.tfrecord")
    write_shard(path)
    url = f"{server.url}/a.tfrecord"
    options = cached(str(tmp_path / "cache"))
    list(read_tfrecord(url, remote=options))
    new = write_shard(path + ".new", seed=42)
    os.replace(path + ".new", path)
    before = len(server.gets())
    assert list(read_tfrecord(url, remote=options)) == new
    assert len(server.gets()) > before


def test_least_recently_used_entries_are_evicted_under_the_limit(server: FaultServer, tmp_path) -> None:
    data = tmp_path / "data"
    for i in range(4):
        write_shard(str(data / f"s{i}.tfrecord"), seed=i)
    size = os.path.getsize(data / "s0.tfrecord")
    cache = Cache(str(tmp_path / "cache"), 2 * size + 100)
    options = cached(cache.root, cache.limit)
    read = lambda i: list(read_tfrecord(f"{server.url}/s{i}.tfrecord", remote=options))  # noqa: E731
    read(0)
    read(1)
    time.sleep(0.01)  # mtimes must differ for the order to be seen
    read(0)  # used again: now s1 is the least recently used
    time.sleep(0.01)
    read(2)
    assert len(cache.entries()) == 2
    assert sum(size for _, size, _ in cache.entries()) <= cache.limit
    gets = len(server.gets())
    read(0)
    assert len(server.gets()) == gets  # kept
    read(1)
    assert len(server.gets()) > gets  # evicted, fetched again


def test_an_object_bigger_than_the_whole_cache_is_streamed_not_cached(server: FaultServer, tmp_path) -> None:
    records = write_shard(str(tmp_path / "data" / "a.tfrecord"))
    options = cached(str(tmp_path / "cache"), limit=1000)
    assert list(read_tfrecord(f"{server.url}/a.tfrecord", remote=options)) == records
    assert Cache(str(tmp_path / "cache")).entries() == []


def _read_cached(url: str, cache_dir: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put(list(read_tfrecord(url, remote=cached(cache_dir))))


@pytest.mark.slow
def test_concurrent_workers_filling_one_entry_fetch_it_once_and_agree(server: FaultServer, tmp_path) -> None:
    records = write_shard(str(tmp_path / "data" / "a.tfrecord"), count=600)
    server.latency = 0.02  # the first filler is still fetching when the others arrive
    # fork: what is tested is processes sharing one cache folder, not how they start (a spawned one
    # imports torch again, seconds each; forked ones also start together, so they meet mid-fill)
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    workers = [
        context.Process(target=_read_cached, args=(f"{server.url}/a.tfrecord", str(tmp_path / "cache"), out))
        for _ in range(3)
    ]
    for worker in workers:
        worker.start()
    results = [out.get(timeout=hang_bound(60)) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
    assert results == [records] * 3
    assert sum(r.length for r in server.gets()) == os.path.getsize(tmp_path / "data" / "a.tfrecord")
    assert len(Cache(str(tmp_path / "cache")).entries()) == 1


_FILLER = """
import sys
from shardkit.formats.tfrecord import read_tfrecord
from shardkit.io.remote import RemoteOptions
print("started", flush=True)
list(read_tfrecord(sys.argv[1], remote=RemoteOptions(block_size=16 << 10, readahead_bytes=0, cache_dir=sys.argv[2])))
"""


@pytest.mark.slow
def test_a_killed_writer_leaves_no_entry_that_is_read_as_whole(server: FaultServer, tmp_path) -> None:
    records = write_shard(str(tmp_path / "data" / "a.tfrecord"), count=600)
    server.latency = 0.05  # about 30 blocks: 1.5 s to fill
    root = str(tmp_path / "cache")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    filler = subprocess.Popen(
        [sys.executable, "-c", _FILLER, f"{server.url}/a.tfrecord", root], env=env, stdout=subprocess.PIPE
    )
    assert filler.stdout is not None and filler.stdout.readline().strip() == b"started"
    deadline = time.monotonic() + hang_bound(30)
    while len(server.gets()) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    filler.send_signal(signal.SIGKILL)
    filler.wait(timeout=10)
    names = os.listdir(root)
    assert any(".tmp." in name for name in names) and Cache(root).entries() == []  # half a file, never an entry
    server.latency = 0.0
    assert list(read_tfrecord(f"{server.url}/a.tfrecord", remote=cached(root))) == records  # lock broken, refilled
    assert len(Cache(root).entries()) == 1
    assert not any(".tmp." in name or name.endswith(".lock") for name in os.listdir(root))


# --------------------------------------------------------------------------- planted symlinks and permissions


def _entry_of(server: FaultServer, root: str, name: str) -> str:
    """The path where ``name`` on ``server`` is cached under ``root`` (the object's identity read by a HEAD)."""
    import fsspec

    url = f"{server.url}/{name}"
    fs, path = fsspec.core.url_to_fs(url)
    return Cache(root).entry_path(url, fs.info(path))


def test_a_symlink_planted_at_the_temp_path_is_not_followed(server: FaultServer, tmp_path) -> None:
    records = write_shard(str(tmp_path / "data" / "a.tfrecord"))
    root = str(tmp_path / "cache")
    os.makedirs(root, mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    entry = _entry_of(server, root, "a.tfrecord")
    os.symlink(victim, f"{entry}.tmp.{os.getpid()}")  # the temp name this process's writer used to take
    assert list(read_tfrecord(f"{server.url}/a.tfrecord", remote=cached(root))) == records
    assert victim.read_bytes() == b"precious"
    assert os.path.isfile(entry) and not os.path.islink(entry)


def test_an_entry_planted_as_a_symlink_is_refused_and_fetched_again(server: FaultServer, tmp_path) -> None:
    path = str(tmp_path / "data" / "a.tfrecord")
    records = write_shard(path)
    root = str(tmp_path / "cache")
    os.makedirs(root, mode=0o700)
    fake = tmp_path / "fake"
    fake.write_bytes(b"\0" * os.path.getsize(path))  # same size: the size check alone would take it
    entry = _entry_of(server, root, "a.tfrecord")
    os.symlink(fake, entry)
    assert list(read_tfrecord(f"{server.url}/a.tfrecord", remote=cached(root))) == records
    assert sum(r.length for r in server.gets()) == os.path.getsize(path)  # fetched again
    assert not os.path.islink(entry) and fake.read_bytes() == b"\0" * os.path.getsize(path)


def test_an_entry_owned_by_another_user_is_refused_and_fetched_again(server: FaultServer, tmp_path) -> None:
    if os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    path = str(tmp_path / "data" / "a.tfrecord")
    records = write_shard(path)
    root = str(tmp_path / "cache")
    os.makedirs(root, mode=0o700)
    entry = _entry_of(server, root, "a.tfrecord")
    with open(entry, "wb") as planted:
        planted.write(b"\0" * os.path.getsize(path))
    os.chown(entry, 12345, 12345)
    assert list(read_tfrecord(f"{server.url}/a.tfrecord", remote=cached(root))) == records
    assert os.stat(entry).st_uid == os.getuid()


def test_the_cache_dir_is_private_and_its_entries_are_readable_by_their_owner_only(
    server: FaultServer, tmp_path
) -> None:
    write_shard(str(tmp_path / "data" / "a.tfrecord"))
    root = str(tmp_path / "cache")
    old = os.umask(0o022)
    try:
        list(read_tfrecord(f"{server.url}/a.tfrecord", remote=cached(root)))
    finally:
        os.umask(old)
    assert os.stat(root).st_mode & 0o777 == 0o700
    ((_, _, entry),) = Cache(root).entries()
    assert os.stat(entry).st_mode & 0o777 == 0o600


def test_a_cache_dir_writable_by_others_is_warned_about(server: FaultServer, tmp_path) -> None:
    records = write_shard(str(tmp_path / "data" / "a.tfrecord"))
    root = str(tmp_path / "cache")
    os.makedirs(root)
    os.chmod(root, 0o777)
    with pytest.warns(UserWarning, match="writable by other users"):
        assert list(read_tfrecord(f"{server.url}/a.tfrecord", remote=cached(root))) == records


# --------------------------------------------------------------------------- eviction racing a read


def test_an_entry_evicted_between_its_open_and_its_touch_is_still_read_whole(
    server: FaultServer, tmp_path, monkeypatch
) -> None:
    records = write_shard(str(tmp_path / "data" / "a.tfrecord"))
    url = f"{server.url}/a.tfrecord"
    root = str(tmp_path / "cache")
    list(read_tfrecord(url, remote=cached(root)))  # the entry is there
    real_fstat, removed = os.fstat, []

    def evicted_meanwhile(fd: int) -> os.stat_result:
        """What another process's eviction does right after this one opened the entry: os.remove it."""
        result = real_fstat(fd)
        path = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        if path.startswith(root) and ".tmp." not in path and not removed:
            os.remove(path)
            removed.append(path)
        return result

    monkeypatch.setattr(os, "fstat", evicted_meanwhile)
    assert list(read_tfrecord(url, remote=cached(root))) == records
    assert removed


def _read_all_cached(urls: list[str], cache_dir: str, limit: int, rounds: int, seed: int, out) -> None:  # type: ignore[no-untyped-def]
    import random

    rng = random.Random(seed)
    try:
        for _ in range(rounds):
            for url in rng.sample(urls, len(urls)):
                out.put((url, len(list(read_tfrecord(url, remote=cached(cache_dir, limit))))))
        out.put(("done", 0))
    except BaseException as error:  # noqa: BLE001 - reported to the test
        out.put(("error", repr(error)))


@pytest.mark.slow
def test_four_processes_evicting_each_others_entries_all_read_every_shard_whole(server: FaultServer, tmp_path) -> None:
    data = tmp_path / "data"
    urls = []
    for i in range(6):
        write_shard(str(data / f"s{i}.tfrecord"), count=60, seed=i)
        urls.append(f"{server.url}/s{i}.tfrecord")
    limit = os.path.getsize(data / "s0.tfrecord") + 100  # one entry: every fill evicts the others
    context = multiprocessing.get_context("fork")  # as above: processes sharing a cache, however started
    out = context.Queue()
    workers = [
        context.Process(target=_read_all_cached, args=(urls, str(tmp_path / "cache"), limit, 6, seed, out))
        for seed in range(4)
    ]
    for worker in workers:
        worker.start()
    results, done = [], 0
    while done < len(workers):
        result = out.get(timeout=hang_bound(120))
        assert result[0] != "error", result[1]
        done += result[0] == "done"
        results.append(result)
    for worker in workers:
        worker.join(timeout=30)
    assert sorted(count for url, count in results if url != "done") == [60] * 4 * 6 * 6
