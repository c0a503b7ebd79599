"""Remote reads against a fault-injecting HTTP server on 127.0.0.1: the same records as a local read, or the
documented error; retries counted; readahead bounded and carried across shards."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import wait

import fsspec
import pytest

import shardkit
from shardkit.formats.tfrecord import TFRecordWriter, read_tfrecord
from shardkit.io.remote import (
    ObjectChangedError,
    RemoteOptions,
    RemoteReadError,
    RetryPolicy,
    open_remote,
    prefetch,
    remote_stats,
)
from tests.helpers.fault_server import FaultServer
from tests.helpers.load import hang_bound

FAST_RETRY = RetryPolicy(attempts=6, max_seconds=5.0, backoff=0.001, max_backoff=0.01)
SMALL = RemoteOptions(block_size=16 << 10, readahead_bytes=64 << 10, retry=FAST_RETRY)


def write_shard(path: str, count: int = 300, size: int = 700, seed: int = 0) -> list[bytes]:
    records = [bytes([(seed + i) % 256]) * (size + i % 7) for i in range(count)]
    with TFRecordWriter(path) as writer:
        for record in records:
            writer.write(record)
    return records


@pytest.fixture
def server(tmp_path) -> Iterator[FaultServer]:
    with FaultServer(str(tmp_path)) as running:
        yield running


@pytest.mark.parametrize(
    "faults",
    [["503"], ["500", "503", "429"], ["429"] * 4, ["reset"], ["reset", "503", "reset"]],
)
@pytest.mark.parametrize("compression", [None, "gzip"])
def test_transient_faults_give_exactly_the_records_of_a_local_read(
    server: FaultServer, tmp_path, faults: list[str], compression: str | None
) -> None:
    path = os.path.join(tmp_path, "a.tfrecord")
    write_shard(path)
    if compression:
        with TFRecordWriter(path + ".gz", compression="gzip") as writer:
            for record in read_tfrecord(path):
                writer.write(record)
        path += ".gz"
    name = os.path.basename(path)
    server.inject(name, *faults)
    remote_stats(reset=True)
    got = list(read_tfrecord(f"{server.url}/{name}", remote=SMALL))
    assert got == list(read_tfrecord(path))
    assert remote_stats()["retries"] == len(faults)
    assert server.take_fault("/" + name) is None  # every fault was met


def test_connections_dropped_before_any_answer_lose_nothing(server: FaultServer, tmp_path) -> None:
    """(aiohttp itself retries such a request once, so not every drop reaches our retry count.)"""
    records = write_shard(os.path.join(tmp_path, "a.tfrecord"))
    server.inject("a.tfrecord", "drop", "drop", "drop")
    assert list(read_tfrecord(f"{server.url}/a.tfrecord", remote=SMALL)) == records
    assert [r.status for r in server.gets("a.tfrecord")].count(0) == 3


def test_a_failure_that_does_not_pass_raises_after_the_bounded_tries(server: FaultServer, tmp_path) -> None:
    write_shard(os.path.join(tmp_path, "a.tfrecord"))
    server.inject("a.tfrecord", *["503"] * 50)
    options = RemoteOptions(retry=RetryPolicy(attempts=3, max_seconds=5.0, backoff=0.001), readahead_bytes=0)
    remote_stats(reset=True)
    began = time.monotonic()
    with pytest.raises(RemoteReadError, match=r"a\.tfrecord bytes 0-.*after 3 tries"):
        list(read_tfrecord(f"{server.url}/a.tfrecord", remote=options))
    assert time.monotonic() - began < hang_bound(5)
    assert remote_stats()["retries"] == 2
    assert len(server.gets("a.tfrecord")) == 3


def test_retry_time_is_bounded_even_with_tries_left(server: FaultServer, tmp_path) -> None:
    write_shard(os.path.join(tmp_path, "a.tfrecord"))
    server.inject("a.tfrecord", *["503"] * 50)
    options = RemoteOptions(retry=RetryPolicy(attempts=1000, max_seconds=0.3, backoff=0.05, max_backoff=0.1))
    remote_stats(reset=True)
    began = time.monotonic()
    with pytest.raises(RemoteReadError, match="still failing"):
        list(read_tfrecord(f"{server.url}/a.tfrecord", remote=options))
    assert time.monotonic() - began < hang_bound(2)
    stats = remote_stats()
    assert stats["retries"] >= 1 and 0 < stats["retry_wait_seconds"] <= 0.3


def test_a_missing_object_is_not_retried(server: FaultServer) -> None:
    remote_stats(reset=True)
    with pytest.raises(FileNotFoundError):
        list(read_tfrecord(f"{server.url}/nope.tfrecord", remote=SMALL))
    assert remote_stats()["retries"] == 0


def test_an_object_replaced_mid_read_is_an_error_naming_it(server: FaultServer, tmp_path) -> None:
    path = os.path.join(tmp_path, "a.tfrecord")
    write_shard(path, count=7000)  # more than the 4 MiB the record reader asks for at once
    records = read_tfrecord(f"{server.url}/a.tfrecord", remote=RemoteOptions(block_size=1 << 20, readahead_bytes=0))
    first = [next(records) for _ in range(5)]
    assert first == list(read_tfrecord(path, stop=5))
    write_shard(path + ".new", count=7000, seed=99)
    os.replace(path + ".new", path)  # same size: only the ETag (mtime) tells the versions apart
    with pytest.raises(ObjectChangedError, match=r"a\.tfrecord: the object changed while it was being read"):
        list(records)


def test_a_replaced_object_found_on_a_retry_is_an_error(server: FaultServer, tmp_path) -> None:
    """The identity is checked again before each retry (what catches a change where the store has no ETag)."""
    path = os.path.join(tmp_path, "a.tfrecord")
    write_shard(path, count=7000)
    options = RemoteOptions(block_size=1 << 20, readahead_bytes=0, retry=FAST_RETRY)
    records = read_tfrecord(f"{server.url}/a.tfrecord", remote=options)
    next(records)
    write_shard(path + ".new", count=7001, seed=5)
    os.replace(path + ".new", path)
    server.inject("a.tfrecord", "503")
    with pytest.raises(ObjectChangedError, match=r"opened as ETag=.*,size=5033000, now ETag=.*,size=5033716"):
        list(records)


def test_readahead_is_bounded_in_bytes(server: FaultServer, tmp_path) -> None:
    write_shard(os.path.join(tmp_path, "a.tfrecord"), count=17_000)  # about 12 MB
    options = RemoteOptions(block_size=1 << 20, readahead_bytes=2 << 20)
    records = read_tfrecord(f"{server.url}/a.tfrecord", remote=options)
    next(records)  # the record reader asked for its first 4 MiB
    time.sleep(0.5)  # let the readahead run as far as it may
    fetched = sum(r.length for r in server.gets("a.tfrecord"))
    assert fetched == (4 << 20) + (2 << 20)
    del records


def test_prefetch_opens_the_next_shard_before_it_is_read(server: FaultServer, tmp_path) -> None:
    records = write_shard(os.path.join(tmp_path, "b.tfrecord"))
    url = f"{server.url}/b.tfrecord"
    remote_stats(reset=True)
    prefetch(url, None, SMALL)
    deadline = time.monotonic() + hang_bound(5)
    while not server.gets("b.tfrecord") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.gets("b.tfrecord"), "prefetch did not start fetching"
    heads = sum(r.method == "HEAD" for r in server.log)
    assert list(read_tfrecord(url, remote=SMALL)) == records
    assert sum(r.method == "HEAD" for r in server.log) == heads  # the read took the prefetched open over
    assert remote_stats()["prefetched"] == 1


def test_a_dataset_reads_remote_shards_exactly_once_across_workers_with_prefetch(server: FaultServer, tmp_path) -> None:
    from shardkit import TFRecordDataset

    expected = []
    for i in range(5):
        expected += write_shard(os.path.join(tmp_path, f"s{i}.tfrecord"), count=50 + i, seed=i)
    urls = [f"{server.url}/s{i}.tfrecord" for i in range(5)]
    for i in range(5):
        server.inject(f"s{i}.tfrecord", "reset")
    dataset = TFRecordDataset(urls, decode="raw", readahead_bytes=64 << 10, retry=FAST_RETRY)
    assert sorted(dataset) == sorted(expected)
    # list() asks len(), which looks for index files beside the shards (the first is missing: one probe).
    assert not [r for r in server.log if r.method == "HEAD" and not r.path.endswith(".idx")]  # opened by a ranged GET
    assert sorted({r.path for r in server.gets() if not r.path.endswith(".idx")}) == sorted(
        f"/s{i}.tfrecord" for i in range(5)
    )


@pytest.mark.slow
def test_dataloader_workers_read_remote_shards_through_faults_exactly_once(server: FaultServer, tmp_path) -> None:
    from torch.utils.data import DataLoader

    from shardkit import TFRecordDataset

    expected = []
    for i in range(6):
        expected += write_shard(os.path.join(tmp_path, f"s{i}.tfrecord"), count=40 + i, seed=i)
    for i in range(6):
        server.inject(f"s{i}.tfrecord", "503", "reset")
    server.latency = 0.01
    urls = [f"{server.url}/s{i}.tfrecord" for i in range(6)]
    dataset = TFRecordDataset(urls, decode="raw", readahead_bytes=64 << 10, retry=FAST_RETRY)
    # fork: exactly once through faults does not depend on how the workers start (spawned ones import
    # torch again, seconds each); spawned workers read through faults in ..._summed_into_stats[spawn]
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert sorted(loader) == sorted(expected)
    assert all(server.take_fault(f"/s{i}.tfrecord") is None for i in range(6))


def write_faulty_shards(server: FaultServer, tmp_path, count: int, faults: list[str]) -> tuple[list[str], list[bytes]]:
    """``count`` shards served by ``server``, each with ``faults`` queued; their urls and all their records."""
    expected: list[bytes] = []
    for i in range(count):
        expected += write_shard(os.path.join(tmp_path, f"s{i}.tfrecord"), count=40 + i, seed=i)
        server.inject(f"s{i}.tfrecord", *faults)
    return [f"{server.url}/s{i}.tfrecord" for i in range(count)], expected


def test_retries_and_their_waits_are_counted_in_a_datasets_stats(server: FaultServer, tmp_path) -> None:
    from shardkit import TFRecordDataset

    urls, expected = write_faulty_shards(server, tmp_path, 3, ["503", "429"])
    dataset = TFRecordDataset(urls, decode="raw", readahead_bytes=64 << 10, retry=FAST_RETRY)
    assert dataset.stats().retries == 0
    assert sorted(dataset) == sorted(expected)
    stats = dataset.stats()
    assert stats.retries == 6
    assert 0 < stats.retry_wait_seconds <= 6 * FAST_RETRY.max_backoff
    dataset._stats.reset()
    assert dataset.stats().retries == 0 and dataset.stats().retry_wait_seconds == 0


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_retries_in_dataloader_workers_are_summed_into_stats(server: FaultServer, tmp_path, context: str) -> None:
    from torch.utils.data import DataLoader

    from shardkit import TFRecordDataset

    os.makedirs(tmp_path / "before")
    write_shard(os.path.join(tmp_path, "before", "a.tfrecord"))
    server.inject("before/a.tfrecord", "503", "503", "503")
    list(read_tfrecord(f"{server.url}/before/a.tfrecord", remote=SMALL))  # the parent's own retries, before
    parent = remote_stats()["retries"]
    assert parent >= 3
    urls, expected = write_faulty_shards(server, tmp_path, 4, ["503", "503"])
    dataset = TFRecordDataset(urls, decode="raw", readahead_bytes=64 << 10, retry=FAST_RETRY)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=context)
    assert sorted(loader) == sorted(expected)
    assert all(server.take_fault(f"/s{i}.tfrecord") is None for i in range(4))
    stats = dataset.stats()
    assert stats.retries == 8  # the workers' retries, and none the forked workers inherited from the parent
    assert stats.retry_wait_seconds > 0
    assert remote_stats()["retries"] == parent  # the parent read nothing more


def requests_of(server: FaultServer, name: str) -> tuple[int, int]:
    """(HEAD, GET) requests the server answered for ``/name``."""
    log = [r for r in server.log if r.path == "/" + name]
    return sum(r.method == "HEAD" for r in log), sum(r.method == "GET" for r in log)


def test_plain_http_shards_are_opened_by_their_first_ranged_get_without_a_head(server: FaultServer, tmp_path) -> None:
    records = write_shard(os.path.join(tmp_path, "a.tfrecord"), count=200)  # about 140 KB: 9 blocks of 16 KiB
    url = f"{server.url}/a.tfrecord"
    through_fsspec = {"headers": {"X-Any": "1"}}  # options the fast path does not carry: fsspec reads it
    assert list(read_tfrecord(url, storage_options=through_fsspec, remote=SMALL)) == records
    before = requests_of(server, "a.tfrecord")
    server.log.clear()
    assert list(read_tfrecord(url, remote=SMALL)) == records
    after = requests_of(server, "a.tfrecord")
    assert before == (1, 9) and after == (0, 9)


@pytest.mark.parametrize("honour_if_match", [True, False])
def test_an_object_replaced_after_a_head_free_open_is_caught_by_its_etag(
    server: FaultServer, tmp_path, honour_if_match: bool
) -> None:
    """Opened with no HEAD, the version is pinned by the first GET's ETag: If-Match makes the store refuse
    another version (412), and a store that ignores If-Match still names its version in the ETag it answers."""
    path = os.path.join(tmp_path, "a.tfrecord")
    write_shard(path, count=7000)
    server.honour_if_match = honour_if_match
    records = read_tfrecord(f"{server.url}/a.tfrecord", remote=RemoteOptions(block_size=1 << 20, readahead_bytes=0))
    assert [next(records) for _ in range(5)] == list(read_tfrecord(path, stop=5))
    write_shard(path + ".new", count=7000, seed=99)
    os.replace(path + ".new", path)  # same size: only the ETag (mtime) tells the versions apart
    with pytest.raises(ObjectChangedError, match=r"a\.tfrecord: the object changed while it was being read"):
        list(records)
    assert requests_of(server, "a.tfrecord")[0] == 0
    assert [r.status for r in server.gets("a.tfrecord")][-1] == (412 if honour_if_match else 206)


@pytest.mark.parametrize("leave", ["close", "seek past"])
def test_readahead_nobody_waits_for_is_neither_retried_nor_counted_in_the_next_datasets_stats(
    server: FaultServer, tmp_path, leave: str
) -> None:
    write_shard(os.path.join(tmp_path, "a.tfrecord"))  # about 210 KB: 13 blocks of 16 KiB
    url = f"{server.url}/a.tfrecord"
    fs, path = fsspec.core.url_to_fs(url)
    options = RemoteOptions(block_size=16 << 10, readahead_bytes=0, retry=FAST_RETRY)
    remote = open_remote(fs, path, url, options)
    server.inject("a.tfrecord", "stall", "stall", "stall", "stall")
    remote.start(4 * (16 << 10), readahead=3 * (16 << 10))  # blocks 4-7, each fetched by a pool thread
    fetches = list(remote._blocks.values())  # to wait for the threads, which close() cannot stop
    deadline = time.monotonic() + hang_bound(10)
    while len([r for r in server.gets("a.tfrecord") if r.status == 0]) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    retries, gets = remote_stats()["retries"], len(server.gets("a.tfrecord"))
    if leave == "close":
        remote.close()
    else:
        remote.seek(12 * (16 << 10))  # drops blocks 4-7 behind the reads
    server.released.set()  # each stalled GET now ends without an answer: a transient error
    wait(fetches, timeout=hang_bound(10))
    assert all(future.done() for future in fetches)
    assert remote_stats()["retries"] == retries  # before: 4, added to the next dataset that swept them
    assert len(server.gets("a.tfrecord")) == gets  # and 4 GETs more of a file nobody reads


def test_a_keep_alive_connection_the_server_closed_is_replaced_without_a_retry(server: FaultServer, tmp_path) -> None:
    records = write_shard(os.path.join(tmp_path, "a.tfrecord"))
    url = f"{server.url}/a.tfrecord"
    assert list(read_tfrecord(url, remote=SMALL)) == records  # leaves kept-alive connections behind
    server.inject("a.tfrecord", "drop")  # the next GET finds its connection closed before any answer
    remote_stats(reset=True)
    assert list(read_tfrecord(url, remote=SMALL)) == records
    assert server.take_fault("/a.tfrecord") is None
    assert remote_stats()["retries"] == 0  # the first GET went out on the kept-alive connection of the last read


def test_a_server_that_ignores_ranges_is_an_error_not_a_misread(server: FaultServer, tmp_path) -> None:
    write_shard(os.path.join(tmp_path, "a.tfrecord"))  # about 210 KB: more than one 16 KiB block
    server.honour_range = False
    with pytest.raises(RemoteReadError, match="the server ignores HTTP Range requests"):
        list(read_tfrecord(f"{server.url}/a.tfrecord", remote=SMALL))


def test_an_object_smaller_than_a_block_is_read_whole_even_without_ranges(server: FaultServer, tmp_path) -> None:
    records = write_shard(os.path.join(tmp_path, "a.tfrecord"), count=10)  # 7 KB, under a 16 KiB block
    server.honour_range = False
    assert list(read_tfrecord(f"{server.url}/a.tfrecord", remote=SMALL)) == records
    assert requests_of(server, "a.tfrecord") == (0, 1)


def test_an_empty_object_opened_by_a_ranged_get_reads_as_no_records(server: FaultServer, tmp_path) -> None:
    open(os.path.join(tmp_path, "empty.tfrecord"), "wb").close()
    assert list(read_tfrecord(f"{server.url}/empty.tfrecord", remote=SMALL)) == []


def test_a_server_the_fast_path_cannot_read_is_read_through_fsspec(server: FaultServer, tmp_path) -> None:
    records = write_shard(os.path.join(tmp_path, "a.tfrecord"))
    server.send_length = False
    url = f"{server.url}/a.tfrecord"
    assert list(read_tfrecord(url, remote=SMALL)) == records
    heads, gets = requests_of(server, "a.tfrecord")
    assert heads == 1  # fell back to fsspec, which opens with a HEAD
    assert list(read_tfrecord(url, remote=SMALL)) == records
    assert requests_of(server, "a.tfrecord") == (2, 2 * gets - 1)  # no fast-path GET tried again


@pytest.mark.parametrize("name", ["a b.tfrecord", "naïve 100%.tfrecord", "plain.tfrecord"])
def test_urls_are_quoted_as_fsspec_quotes_them(server: FaultServer, tmp_path, name: str) -> None:
    records = write_shard(os.path.join(tmp_path, name))
    url = f"{server.url}/{name}"
    assert list(read_tfrecord(url, storage_options={"headers": {"X-Any": "1"}}, remote=SMALL)) == records  # fsspec
    through_fsspec = {r.path for r in server.gets()}
    server.log.clear()
    assert list(read_tfrecord(url, remote=SMALL)) == records  # the fast path
    assert {r.path for r in server.gets()} == through_fsspec


def put_shard(s3_server, tmp_path, records: int, seed: int = 0) -> tuple[str, dict, list[bytes]]:
    """A TFRecord shard copied to a new bucket of the moto server: its url, storage options and records."""
    import fsspec

    options = s3_server.storage_options()
    url = f"{s3_server.new_bucket()}/a.tfrecord"
    local = os.path.join(tmp_path, f"put-{seed}.tfrecord")
    data = write_shard(local, count=records, seed=seed)
    fsspec.filesystem("s3", **options).put_file(local, url)
    return url, options, data


def test_s3_objects_are_opened_by_their_first_ranged_get_without_a_head(s3_server, tmp_path) -> None:
    import fsspec

    from shardkit.io.remote import _open_now

    url, options, records = put_shard(s3_server, tmp_path, 300)  # about 215 KB: 14 blocks of 16 KiB
    fs, path = fsspec.core.url_to_fs(url, **options)
    blocks = -(-fs.size(path) // SMALL.block_size)
    remote_stats(reset=True)
    assert list(read_tfrecord(url, storage_options=options, remote=SMALL)) == records
    assert remote_stats()["requests"] == blocks  # one GET per block, no HEAD
    opened = _open_now(fs, path, url, SMALL, offset=None)
    opened.check_identity()  # the identity from the GET is the one a HEAD gives: no false "changed"
    assert "ETag=" in opened.identity and "size=" in opened.identity


def test_an_s3_object_replaced_between_blocks_is_an_error_naming_it(s3_server, tmp_path) -> None:
    """On a bucket without versioning, every block is asked for with If-Match: the store refuses a new version."""
    import fsspec

    url, options, records = put_shard(s3_server, tmp_path, 7000)  # about 5 MB: several 1 MiB blocks
    stream = read_tfrecord(
        url, storage_options=options, remote=RemoteOptions(block_size=1 << 20, readahead_bytes=0, retry=FAST_RETRY)
    )
    assert [next(stream) for _ in range(5)] == records[:5]
    local = os.path.join(tmp_path, "other.tfrecord")
    write_shard(local, count=7000, seed=99)  # the same size, other bytes
    fsspec.filesystem("s3", **options).put_file(local, url)
    with pytest.raises(ObjectChangedError, match=r"a\.tfrecord: the object changed while it was being read"):
        list(stream)


def test_an_s3_compatible_store_that_refuses_if_match_is_read_through_s3fs(s3_server, tmp_path, monkeypatch) -> None:
    import s3fs
    from botocore.exceptions import ClientError

    url, options, records = put_shard(s3_server, tmp_path, 300)
    original = s3fs.S3FileSystem._call_s3
    refused = []

    async def no_conditional_reads(self, method, *args, **kwargs):
        if method == "get_object" and "IfMatch" in kwargs:
            refused.append(kwargs["Range"])
            raise ClientError({"Error": {"Code": "NotImplemented", "Message": "If-Match"}}, "GetObject")
        return await original(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", no_conditional_reads)
    assert list(read_tfrecord(url, storage_options=options, remote=SMALL)) == records
    assert len(refused) >= 1  # the store refused once, and the rest was read through s3fs's cat_file


def test_a_shard_opened_ahead_without_a_start_costs_a_one_byte_probe_not_a_block(server: FaultServer, tmp_path) -> None:
    """A plan whose next range starts inside a shard hints it with no offset: its identity, not its first block."""
    records = write_shard(os.path.join(tmp_path, "c.tfrecord"))
    url = f"{server.url}/c.tfrecord"
    prefetch(url, None, SMALL, offset=None)
    deadline = time.monotonic() + hang_bound(5)
    while not server.gets("c.tfrecord") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(r.start, r.length) for r in server.gets("c.tfrecord")] == [(0, 1)]
    assert list(read_tfrecord(url, remote=SMALL)) == records
    assert requests_of(server, "c.tfrecord")[0] == 0


def _shard_gets(server: FaultServer, expected: int) -> list[str]:
    """The shard GETs logged, once ``expected`` of them are (the hinted ones finish in the background)."""
    deadline = time.monotonic() + hang_bound(10)
    while True:
        gets = [r.path for r in server.gets() if r.path.endswith(".tfrecord")]
        if len(gets) >= expected or time.monotonic() > deadline:
            return gets
        time.sleep(0.01)


def test_each_epoch_starts_on_shards_opened_while_the_last_one_ended(server: FaultServer, tmp_path) -> None:
    """The next epoch's first three shards (in its own shuffled order) are opened as an epoch ends, so a
    pass starts without a round trip; every shard is still fetched exactly once per epoch."""
    from shardkit import TFRecordDataset

    for i in range(6):
        with TFRecordWriter(os.path.join(tmp_path, f"s{i}.tfrecord")) as writer:
            for n in range(20):
                writer.write(b"%d %d " % (i, n) * 100)  # one 4 MiB block: one GET per open
    urls = [f"{server.url}/s{i}.tfrecord" for i in range(6)]
    paths = [f"/s{i}.tfrecord" for i in range(6)]
    dataset = TFRecordDataset(urls, decode="raw", shuffle=True, seed=3, readahead_bytes=64 << 10, retry=FAST_RETRY)
    dataset.shuffle_window = 0  # whole shards in a seeded order per epoch: the order is the shards'
    orders = []
    for epoch in range(3):
        before = _shard_gets(server, 6 * epoch + 3 * (epoch > 0))
        records = list(iter(dataset))
        assert sorted(records) == sorted(b"%d %d " % (i, n) * 100 for i in range(6) for n in range(20))
        order = [f"/s{int(record.split()[0])}.tfrecord" for record in records[::20]]
        if epoch > 0:  # every shard once per epoch before, and this epoch's first three, opened ahead
            assert Counter(before) - Counter(paths * epoch) == Counter(order[:3])
        orders.append(order)
    assert len(set(map(tuple, orders))) > 1  # the order does change from epoch to epoch
    assert len(_shard_gets(server, 6 * 3 + 3)) == 6 * 3 + 3  # nothing fetched twice: 3 epochs and 3 hints


def test_https_shards_are_opened_by_their_first_ranged_get_without_a_head(tmp_path, monkeypatch) -> None:
    """Over TLS too (a loopback server with a certificate made here, trusted through SSL_CERT_FILE as the
    default context trusts a CA file): one GET per block, no HEAD, the records of a local read."""
    from shardkit.io import http as httpranges
    from tests.helpers.servers import self_signed_cert

    cert, key = self_signed_cert(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", cert)
    monkeypatch.setattr(httpranges, "_clients", {})  # a client made now reads the CA file named above
    data = tmp_path / "data"
    data.mkdir()
    records = write_shard(str(data / "a.tfrecord"), count=200)  # about 140 KB: 9 blocks of 16 KiB
    with FaultServer(str(data), tls=(cert, key)) as server:
        assert server.url.startswith("https://")
        assert list(read_tfrecord(f"{server.url}/a.tfrecord", remote=SMALL)) == records
        assert requests_of(server, "a.tfrecord") == (0, 9)
        server.inject("a.tfrecord", "reset", "503", "drop", "reset")  # faults over TLS are retried alike
        remote_stats(reset=True)
        assert list(read_tfrecord(f"{server.url}/a.tfrecord", remote=SMALL)) == records
        assert server.take_fault("/a.tfrecord") is None
        assert remote_stats()["retries"] >= 3  # (a drop on a kept-alive connection is replaced, not retried)


def test_an_https_server_with_a_certificate_nobody_trusts_is_refused(tmp_path, monkeypatch) -> None:
    from shardkit.io import http as httpranges
    from tests.helpers.servers import self_signed_cert

    cert, key = self_signed_cert(tmp_path)
    monkeypatch.setattr(httpranges, "_clients", {})
    write_shard(str(tmp_path / "a.tfrecord"), count=20)
    with FaultServer(str(tmp_path), tls=(cert, key)) as server:
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
            list(read_tfrecord(f"{server.url}/a.tfrecord", remote=SMALL))
        assert not server.gets("a.tfrecord")  # not one byte of the object went to an unverified peer


PRESIGNED = "?X-Amz-Signature=SIG&X-Amz-Expires=60"


@pytest.mark.parametrize("fmt", ["tfrecord", "tar", "jsonl"])
def test_a_url_with_a_query_string_is_read_once_without_asking_for_an_index_file(server, tmp_path, fmt) -> None:
    from tests.helpers.shards import write_jsonl_shards, write_tar_shards

    if fmt == "tfrecord":
        path = str(tmp_path / "a.tfrecord")
        written = write_shard(path, count=20)
        records = list(shardkit.TFRecordDataset([f"{server.url}/a.tfrecord{PRESIGNED}"], decode="raw"))
        assert records == written
    else:
        (path,) = (write_tar_shards if fmt == "tar" else write_jsonl_shards)(str(tmp_path), [20])
        dataset = shardkit.TarDataset if fmt == "tar" else shardkit.JsonlDataset
        records = list(dataset([f"{server.url}/{os.path.basename(path)}{PRESIGNED}"]))
        assert len(records) == 20
    assert [r.path for r in server.log if ".idx" in r.path] == []


def test_a_url_with_a_query_string_has_no_index_file_beside_it() -> None:
    from shardkit.errors import ShardkitError
    from shardkit.formats.offsets import index_path_for
    from shardkit.formats.tfrecord.index import load_index

    url = f"https://h/a.tfrecord{PRESIGNED}"
    with pytest.raises(ShardkitError, match="query string"):
        index_path_for(url)
    assert load_index(url) is None
    assert index_path_for("https://h/a.tfrecord") == "https://h/a.tfrecord.idx"
    assert index_path_for("/data/what?.tfrecord") == "/data/what?.tfrecord.idx"  # a local name may hold a "?"


def test_a_hint_for_a_local_shard_costs_no_filesystem_lookup(tmp_path, monkeypatch) -> None:
    """A plan of many short ranges (a resumed shuffle window) hints three ranges per range opened: for a local
    file each hint did an fsspec lookup (about 0.15 ms) for nothing, a tenth of a worker's start after a resume."""
    from shardkit.formats.tfrecord import TFRecordFormat

    looked = []

    def url_to_fs(url: str, **options: object) -> object:
        looked.append(url)
        raise OSError("not looked up in this test")

    monkeypatch.setattr(fsspec.core, "url_to_fs", url_to_fs)
    tfrecord = TFRecordFormat()
    for url in (str(tmp_path / "a.tfrecord"), f"file://{tmp_path}/a.tfrecord"):
        tfrecord.prefetch(url, 10, 20)
    assert looked == []
    tfrecord.prefetch("http://127.0.0.1:9/a.tfrecord", 0, None)  # remote: looked up (and refused here)
    assert len(looked) == 1
