"""Metadata requests outside the reader have a bound of their own too: a size, an identity, a listing.

A format's record bound (the file's size), its index check (the data file's size and both files'
identities), a Megatron pair's ``.idx`` size, the counts cache's directory listing and the CLI's
index lookups each ask the store one question outside :mod:`shardkit.io`'s reader. Each is
asked through :func:`~shardkit.io.retry.retried_call`: a server that never answers costs the
format's ``retry`` (or the default policy) and fails naming the url; one that stalls once is
asked again. A dataset given a glob lists it under its own ``retry=``.

Each fault is real, on loopback (``tests/helpers/fault_server.py``): the server reads the HEAD
or GET and keeps the connection open without a word.
"""

from __future__ import annotations

import json
import time

import pytest

import shardkit
from shardkit.formats.jsonl import JsonlFormat
from shardkit.formats.megatron import MegatronFormat
from shardkit.formats.tfrecord import TFRecordFormat, TFRecordWriter
from shardkit.formats.tfrecord.index import build_index, load_index
from shardkit.io.remote import RemoteOptions, RemoteReadError, RetryPolicy
from shardkit.shardlist import ShardList
from tests.helpers.fault_server import FaultServer
from tests.helpers.load import hang_bound
from tests.helpers.tokens import DOCS, write_pair

TIMEOUT = 0.5
BOUNDED = RetryPolicy(attempts=2, max_seconds=1.0, backoff=0.01, max_backoff=0.02, timeout=TIMEOUT)
REMOTE = RemoteOptions(retry=BOUNDED)
WORST = BOUNDED.max_seconds + 2 * TIMEOUT  # the last try is started within the budget and runs its timeout
MARGIN = 3.0  # scheduling and fsspec's loop hand-off on a quiet machine; stretched by load where used
STALLS = ["stall"] * 10
# Where every try stalls, no answer has to fit in the timeout: a shorter one shows the bound as well, sooner.
NEVER = RetryPolicy(attempts=2, max_seconds=1.0, backoff=0.01, max_backoff=0.02, timeout=0.2)
NEVER_WORST = NEVER.max_seconds + 2 * NEVER.timeout


@pytest.fixture
def server(tmp_path) -> FaultServer:
    (tmp_path / "data").mkdir()
    with FaultServer(str(tmp_path)) as fault_server:
        yield fault_server


@pytest.fixture
def small_defaults(monkeypatch) -> None:
    """The default RetryPolicy (30 s a try, 60 s in all) made BOUNDED's, for call sites with no policy at hand
    (also the one a default RemoteOptions holds)."""
    fields = ("attempts", "max_seconds", "backoff", "max_backoff", "timeout")
    monkeypatch.setattr(RetryPolicy.__init__, "__defaults__", tuple(getattr(BOUNDED, f) for f in fields))
    defaults = tuple(BOUNDED if isinstance(d, RetryPolicy) else d for d in RemoteOptions.__init__.__defaults__)
    monkeypatch.setattr(RemoteOptions.__init__, "__defaults__", defaults)


def _elapsed(call) -> tuple[float, object]:
    began = time.monotonic()
    try:
        result = call()
    except Exception as error:
        result = error
    return time.monotonic() - began, result


def _tfrecord(tmp_path, name: str = "part-0.tfrecord", indexed: bool = False) -> str:
    with TFRecordWriter(str(tmp_path / "data" / name)) as writer:
        for i in range(20):
            writer.write(f"record {i} ".encode() * 10)
    if indexed:
        build_index(str(tmp_path / "data" / name))
    return f"data/{name}"


def _jsonl(tmp_path) -> str:
    path = tmp_path / "data" / "part.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(20)))
    JsonlFormat().build_index(str(path))
    return "data/part.jsonl"


def _pair(tmp_path) -> str:
    if not (tmp_path / "data" / "x.bin").exists():
        write_pair(tmp_path / "data")
    return "data/x"


# Each case: (write the files and return (path the stall is queued on, the call's url), the call (url, remote
# options), its answer).
CASES = {
    "record bound (size)": (
        lambda tmp: (_tfrecord(tmp),) * 2,
        lambda url, remote: TFRecordFormat(remote=remote).record_bound(url).size,
        lambda tmp: (tmp / "data" / "part-0.tfrecord").stat().st_size,
    ),
    "tar/jsonl index (data size)": (
        lambda tmp: (_jsonl(tmp),) * 2,
        lambda url, remote: JsonlFormat(remote=remote).index_offsets(url).tolist(),
        lambda tmp: [len("".join(json.dumps({"i": i}) + "\n" for i in range(k))) for k in range(20)],
    ),
    "tfrecord index (identity)": (
        lambda tmp: (_tfrecord(tmp, indexed=True) + ".idx", _tfrecord(tmp, indexed=True)),
        lambda url, remote: len(load_index(url, remote=remote)),
        lambda tmp: 20,
    ),
    "megatron .idx (size)": (
        lambda tmp: (_pair(tmp) + ".idx", _pair(tmp) + ".bin"),
        lambda url, remote: MegatronFormat(remote=remote).stored_count(url),
        lambda tmp: len(DOCS),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_size_or_identity_the_server_never_answers_fails_within_the_formats_bound_naming_the_url(
    server, tmp_path, case
) -> None:
    write, call, _ = CASES[case]
    stalled, path = write(tmp_path)
    server.inject(stalled, *STALLS, method="HEAD")
    waited, error = _elapsed(lambda: call(f"{server.url}/{path}", RemoteOptions(retry=NEVER)))
    assert isinstance(error, RemoteReadError), error
    assert f"looking up {server.url}/{stalled}: still failing after 2 tries" in str(error)
    assert "no answer in 0.2 s" in str(error) and "RetryPolicy(timeout=" in str(error)
    assert waited < NEVER_WORST + hang_bound(MARGIN)


@pytest.mark.parametrize("case", list(CASES))
def test_a_size_or_identity_stalled_once_is_asked_again_and_answered(server, tmp_path, case) -> None:
    write, call, expected = CASES[case]
    stalled, path = write(tmp_path)
    server.inject(stalled, "stall", method="HEAD")
    waited, answer = _elapsed(lambda: call(f"{server.url}/{path}", REMOTE))
    assert answer == expected(tmp_path)
    assert [r.status for r in server.log if r.method == "HEAD" and r.path == "/" + stalled][:2] == [0, 200]
    assert waited < TIMEOUT + hang_bound(MARGIN)


# --------------------------------------------------------------------------- a dataset's listing


DATASETS = {
    "TFRecordDataset(retry=)": lambda pattern: shardkit.TFRecordDataset(pattern, retry=NEVER),
    "FormatDataset(fmt with remote=)": lambda pattern: shardkit.FormatDataset(
        pattern, TFRecordFormat(remote=RemoteOptions(retry=NEVER))
    ),
}


@pytest.mark.parametrize("dataset", list(DATASETS))
def test_a_dataset_whose_retry_has_a_small_timeout_fails_its_stalled_listing_in_seconds_naming_the_url(
    server, tmp_path, dataset
) -> None:
    _tfrecord(tmp_path)
    server.inject("data/", *STALLS)
    waited, error = _elapsed(lambda: DATASETS[dataset](f"{server.url}/data/*.tfrecord"))
    assert isinstance(error, RemoteReadError), error
    message = str(error)
    assert f"listing {server.url}/data" in message and "still failing after 2 tries" in message
    assert "no answer in 0.2 s" in message and "a dataset lists its glob under its own retry=" in message
    assert waited < NEVER_WORST + hang_bound(MARGIN)


def test_a_dataset_listing_stalled_once_is_tried_again_and_holds_every_shard(server, tmp_path) -> None:
    for shard in range(3):
        _tfrecord(tmp_path, f"part-{shard}.tfrecord")
    server.inject("data/", "stall")
    waited, dataset = _elapsed(lambda: shardkit.TFRecordDataset(f"{server.url}/data/*.tfrecord", retry=BOUNDED))
    assert dataset.shards.urls() == [f"{server.url}/data/part-{i}.tfrecord" for i in range(3)]
    assert [r.status for r in server.log if r.path == "/data/"][:2] == [0, 200]
    assert waited < TIMEOUT + hang_bound(MARGIN)


# --------------------------------------------------------------------------- no policy at hand: the default's bound


def test_the_counts_cache_gives_up_a_stalled_directory_listing_within_the_default_bound(
    server, tmp_path, small_defaults
) -> None:
    from shardkit.counting.cache import Cached

    urls = [f"{server.url}/{_tfrecord(tmp_path, f'part-{i}.tfrecord')}" for i in range(2)]
    server.inject("data", *["stall"] * BOUNDED.attempts)  # the cache lists the shards' directory as their urls name it
    waited, cached = _elapsed(lambda: Cached.read(ShardList(urls), None, str(tmp_path / "cache")))
    assert cached.identities == [None, None]  # not cached, counted: as for a store that cannot list
    assert [r.status for r in server.log if r.path == "/data"] == [0, 0]  # two tries, each given up
    assert waited < WORST + hang_bound(MARGIN)
    server.inject("data", "stall")
    Cached.read(ShardList(urls), None, str(tmp_path / "cache"))
    assert [(r.method, r.status) for r in server.log if r.path == "/data"][2:] == [("GET", 0), ("LIST", 200)]


def test_the_cli_index_counts_fall_back_from_a_stalled_listing_and_fail_a_stalled_lookup_naming_it(
    server, tmp_path, small_defaults
) -> None:
    from shardkit.cli.files import index_counts

    url = f"{server.url}/{_tfrecord(tmp_path, indexed=True)}"
    server.inject("data/", *STALLS)
    waited, counts = _elapsed(lambda: index_counts([url]))
    assert counts == [20]  # asked per file, as a store that cannot list is
    assert waited < WORST + hang_bound(MARGIN)
    server.inject("data/", *STALLS)
    server.inject("data/part-0.tfrecord.idx", *STALLS, method="HEAD")
    waited, error = _elapsed(lambda: index_counts([url]))
    assert isinstance(error, RemoteReadError) and f"looking up {url}.idx" in str(error)
    assert waited < 2 * WORST + hang_bound(MARGIN)


def test_a_remote_manifest_is_read_as_shards_are_bounded_and_retried(server, tmp_path, small_defaults) -> None:
    urls = [f"{server.url}/data/part-{i}.tfrecord" for i in range(3)]
    ShardList(urls).to_manifest(str(tmp_path / "data" / "list.arrow"))
    manifest = f"{server.url}/data/list.arrow"
    server.inject("data/list.arrow", *["stall"] * BOUNDED.attempts)
    waited, error = _elapsed(lambda: ShardList.from_manifest(manifest))
    assert isinstance(error, RemoteReadError) and f"{manifest} bytes 0-" in str(error), error
    assert "still failing after 2 tries" in str(error) and "each try waits 0.5 s" in str(error)
    assert waited < WORST + hang_bound(MARGIN)
    server.inject("data/list.arrow", "stall")
    assert ShardList.from_manifest(manifest).urls() == urls
    assert [r.status for r in server.gets("data/list.arrow")][2:4] == [0, 206]
