"""Remote requests have a bound of our own: a server that never answers costs seconds, not aiohttp's 5 minutes.

Each fault is real, on loopback (``tests/helpers/fault_server.py``): the server
reads the request and keeps the connection open without a word, answers half a
body and goes quiet, or answers 503 first. The bound is set small here
(``RetryPolicy(timeout=...)``); the default is 30 s per try and 60 s in all.
"""

from __future__ import annotations

import re
import time

import pytest

from shardkit.formats.tfrecord import TFRecordWriter, read_tfrecord
from shardkit.io.remote import RemoteOptions, RemoteReadError, RetryPolicy, remote_stats
from shardkit.shardlist import ShardList
from tests.helpers.fault_server import FaultServer
from tests.helpers.load import hang_bound

TIMEOUT = 0.5
BOUNDED = RetryPolicy(attempts=3, max_seconds=2.0, backoff=0.01, max_backoff=0.02, timeout=TIMEOUT)
# A try is not cut short by the budget, only not started; a plain-HTTP body that goes quiet mid-way
# is noticed after up to twice the timeout (the kernel returns what came, then waits once more).
WORST = BOUNDED.max_seconds + 2 * TIMEOUT
MARGIN = 3.0  # scheduling and fsspec's loop hand-off on a quiet machine; stretched by load where used
# Where every try stalls, no answer has to fit in the timeout: a shorter one shows the bound as well, sooner.
NEVER = RetryPolicy(attempts=3, max_seconds=2.0, backoff=0.01, max_backoff=0.02, timeout=0.2)
NEVER_WORST = NEVER.attempts * NEVER.timeout + NEVER.timeout  # a quiet body is noticed after up to two timeouts


@pytest.fixture
def server(tmp_path) -> FaultServer:
    with FaultServer(str(tmp_path)) as fault_server:
        yield fault_server


def _shards(server: FaultServer, tmp_path, count: int = 3, records: int = 50) -> list[list[bytes]]:
    (tmp_path / "data").mkdir()
    written = []
    for shard in range(count):
        data = [f"shard {shard} record {i} ".encode() * 20 for i in range(records)]
        with TFRecordWriter(str(tmp_path / "data" / f"part-{shard}.tfrecord")) as writer:
            for record in data:
                writer.write(record)
        written.append(data)
    return written


def _timed(call) -> tuple[float, BaseException | None]:
    began = time.monotonic()
    try:
        call()
    except Exception as error:
        return time.monotonic() - began, error
    return time.monotonic() - began, None


# --------------------------------------------------------------------------- listing


def test_a_listing_the_server_never_answers_fails_within_the_bound_naming_url_time_and_fix(server, tmp_path) -> None:
    _shards(server, tmp_path)
    server.inject("data/", *["stall"] * 10)
    pattern = f"{server.url}/data/*.tfrecord"
    waited, error = _timed(lambda: ShardList.from_glob(pattern, retry=NEVER))
    assert isinstance(error, RemoteReadError), error
    message = str(error)
    assert f"listing {server.url}/data" in message
    assert re.search(r"still failing after 3 tries in \d\.\d s", message) and "no answer in 0.2 s" in message
    assert "RetryPolicy(timeout=" in message and "ShardList.from_glob(pattern, retry=" in message
    assert waited < NEVER_WORST + hang_bound(MARGIN)


def test_a_listing_answered_503_then_200_lists_every_shard(server, tmp_path) -> None:
    _shards(server, tmp_path)
    server.inject("data/", "503", "drop")
    listed = ShardList.from_glob(f"{server.url}/data/*.tfrecord", retry=BOUNDED)
    assert listed.urls() == [f"{server.url}/data/part-{i}.tfrecord" for i in range(3)]
    assert [r.status for r in server.log if r.path == "/data/"][:2] == [503, 0]


def test_a_listing_stalled_once_is_tried_again_and_lists_every_shard(server, tmp_path) -> None:
    _shards(server, tmp_path)
    server.inject("data/", "stall")
    waited, error = _timed(lambda: ShardList.from_glob(f"{server.url}/data/*.tfrecord", retry=BOUNDED))
    assert error is None
    assert waited < TIMEOUT + hang_bound(MARGIN)


def test_the_shared_listing_of_a_dataset_takes_the_bound_too(server, tmp_path) -> None:
    from shardkit.listing import shared_listing

    _shards(server, tmp_path)
    server.inject("data/", *["stall"] * 10)
    waited, error = _timed(lambda: shared_listing(f"{server.url}/data/*.tfrecord", retry=NEVER))
    assert isinstance(error, RemoteReadError) and f"{server.url}/data" in str(error)
    assert waited < NEVER_WORST + hang_bound(MARGIN)


# --------------------------------------------------------------------------- ranged reads


def _read(
    url: str, storage_options: dict | None = None, readahead: int = 0, retry: RetryPolicy = BOUNDED
) -> list[bytes]:
    options = RemoteOptions(retry=retry, readahead_bytes=readahead, block_size=4096)
    return list(read_tfrecord(url, storage_options=storage_options, remote=options))


# Plain HTTP goes through the fast path (shardkit.io.http); with a header, fsspec reads it (HEAD, then GETs).
PATHS = [pytest.param(None, id="fast-path"), pytest.param({"headers": {"X-Test": "1"}}, id="fsspec")]


@pytest.mark.parametrize("storage_options", PATHS)
def test_a_range_the_server_never_answers_fails_within_the_bound_naming_the_url(
    server, tmp_path, storage_options
) -> None:
    _shards(server, tmp_path)
    server.inject("data/part-1.tfrecord", *["stall"] * 10)
    url = f"{server.url}/data/part-1.tfrecord"
    waited, error = _timed(lambda: _read(url, storage_options, retry=NEVER))
    assert isinstance(error, RemoteReadError), error
    assert f"{url} bytes 0-" in str(error) and "still failing after" in str(error)
    assert "RetryPolicy(timeout=" in str(error)
    assert waited < NEVER_WORST + hang_bound(MARGIN)


@pytest.mark.parametrize("fault", ["stall", "stall-body", "reset", "503"])
@pytest.mark.parametrize("storage_options", PATHS)
def test_a_range_that_fails_once_is_retried_and_every_record_read_once(
    server, tmp_path, storage_options, fault
) -> None:
    written = _shards(server, tmp_path)
    server.inject("data/part-2.tfrecord", fault, "ok", fault)  # the opening GET, then a later block's
    before = remote_stats()["retries"]
    waited, error = _timed(lambda: written.append(_read(f"{server.url}/data/part-2.tfrecord", storage_options)))
    assert error is None, error
    assert written[-1] == written[2]
    assert remote_stats()["retries"] > before
    assert waited < 4 * TIMEOUT + hang_bound(MARGIN)


def test_a_stalled_range_fetched_ahead_is_bounded_too(server, tmp_path) -> None:
    written = _shards(server, tmp_path)
    server.inject("data/part-0.tfrecord", "ok", "stall")  # the second block, fetched ahead by the pool
    waited, error = _timed(lambda: written.append(_read(f"{server.url}/data/part-0.tfrecord", readahead=16384)))
    assert error is None, error
    assert written[-1] == written[0]
    assert waited < TIMEOUT + hang_bound(MARGIN)


def test_a_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout > 0"):
        RetryPolicy(timeout=0)


# --------------------------------------------------------------------------- S3 (s3fs's client, the fault server as its endpoint)


def _s3_options(server: FaultServer) -> dict:
    pytest.importorskip("s3fs")
    # The fault server answers a path-style GetObject as a ranged GET: enough for s3fs's client to read through it.
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": server.url, "region_name": "us-east-1"},
    }


def test_an_s3_range_the_store_never_answers_fails_within_the_bound_naming_the_url(server, tmp_path) -> None:
    _shards(server, tmp_path)
    server.inject("data/part-1.tfrecord", *["stall"] * 10)
    waited, error = _timed(lambda: _read("s3://data/part-1.tfrecord", _s3_options(server), retry=NEVER))
    assert isinstance(error, RemoteReadError), error
    assert "s3://data/part-1.tfrecord bytes 0-" in str(error) and "no answer in 0.2 s" in str(error)
    assert waited < NEVER_WORST + hang_bound(MARGIN)
