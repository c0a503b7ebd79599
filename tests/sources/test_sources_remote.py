"""Remote options reach every format: a tar, JSON-lines, Parquet or TFRecord shard served over HTTP
with a connection reset mid-body yields exactly the local samples (retried), the retry policy given
is the one used, and with ``cache_dir`` a second epoch fetches nothing."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import shardkit
from shardkit.io.remote import RemoteReadError, RetryPolicy, remote_stats
from tests.helpers.fault_server import FaultServer

pytest.importorskip("aiohttp")  # fsspec's http filesystem

FAST_RETRY = RetryPolicy(attempts=6, max_seconds=5.0, backoff=0.001, max_backoff=0.01)
SIZES = [7, 5]


def _tar(root: str) -> list[str]:
    from tests.formats.test_formats_tar import write_shards

    return write_shards(root, sizes=SIZES)


def _jsonl(root: str) -> list[str]:
    from tests.formats.test_formats_jsonl import write_shards

    return write_shards(root, sizes=SIZES)


def _parquet(root: str) -> list[str]:
    from tests.formats.test_formats_parquet import write_shards

    return write_shards(root, sizes=SIZES)


def _tfrecord(root: str) -> list[str]:
    urls = []
    for i, size in enumerate(SIZES):
        url = f"{root}/part-{i:03d}.tfrecord"
        with shardkit.TFRecordWriter(url) as writer:
            for n in range(size):
                writer.write(b"record %d of shard %d " % (n, i) * 40)
        urls.append(url)
    return urls


FORMATS: dict[str, tuple[Callable[[str], list[str]], Callable[..., Any]]] = {
    "tar": (_tar, shardkit.TarDataset),
    "jsonl": (_jsonl, shardkit.JsonlDataset),
    "parquet": (_parquet, shardkit.ParquetDataset),
    "tfrecord": (_tfrecord, lambda shards, **kw: shardkit.TFRecordDataset(shards, decode="raw", **kw)),
}


def _plain(sample: Any) -> Any:
    """A sample comparable across local and remote reads (a tar sample names its url)."""
    if isinstance(sample, dict):
        return {k: _plain(v) for k, v in sample.items() if k != "__url__"}
    if isinstance(sample, np.ndarray):
        return sample.tolist()
    return sample


def _shard_gets(server: FaultServer, urls: list[str]) -> int:
    return sum(len(server.gets(os.path.basename(url))) for url in urls)


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[FaultServer, str]]:
    root = tmp_path / "data"
    os.makedirs(root)
    with FaultServer(str(root)) as server:
        yield server, str(root)


@pytest.fixture(params=list(FORMATS))
def shards(request, served) -> tuple[FaultServer, Callable[..., Any], list[str], list[Any]]:
    """(server, dataset class, remote urls, the samples read locally)."""
    server, root = served
    write, dataset = FORMATS[request.param]
    local = write(root)
    expected = [_plain(s) for s in dataset(local)]
    assert len(expected) == sum(SIZES)
    return server, dataset, [f"{server.url}/{os.path.basename(url)}" for url in local], expected


def test_a_reset_mid_body_is_retried_and_every_sample_arrives_once(shards) -> None:
    server, dataset, urls, expected = shards
    for url in urls:
        server.inject(os.path.basename(url), "reset")
    remote_stats(reset=True)
    got = [_plain(s) for s in dataset(urls, retry=FAST_RETRY, readahead_bytes=0)]
    assert got == expected
    assert remote_stats()["retries"] >= len(urls)  # the resets happened and were retried, not dodged


def test_the_retry_policy_given_is_the_one_used(shards) -> None:
    server, dataset, urls, _ = shards
    server.inject(os.path.basename(urls[0]), *["reset"] * 8)
    with pytest.raises(RemoteReadError, match="still failing after 2 tries"):
        list(dataset(urls, retry=RetryPolicy(attempts=2, backoff=0.001, max_backoff=0.001), readahead_bytes=0))


def test_with_a_cache_dir_the_second_epoch_fetches_nothing(shards, tmp_path) -> None:
    server, dataset, urls, expected = shards
    source = dataset(urls, retry=FAST_RETRY, cache_dir=str(tmp_path / "cache"))
    assert [_plain(s) for s in source] == expected
    fetched = _shard_gets(server, urls)
    assert fetched > 0
    assert [_plain(s) for s in source] == expected
    # Not one GET of a shard: only HEADs, to check each object is still the cached version (and the
    # probes for index files beside the shards, answered 404 here).
    assert _shard_gets(server, urls) == fetched
    assert len(os.listdir(tmp_path / "cache")) >= len(urls)
