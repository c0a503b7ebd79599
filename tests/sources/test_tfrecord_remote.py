"""TFRecord over remote storage: S3 (moto server on 127.0.0.1) and HTTP (a local server)."""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Iterator
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

import shardkit
from shardkit.cli import main as cli_main
from shardkit.formats.offsets import index_path_for
from shardkit.formats.tfrecord import TFRecordWriter, read_tfrecord, scan_count
from shardkit.formats.tfrecord.index import build_index, read_index
from shardkit.io.files import BLOCK_SIZE

pytestmark = pytest.mark.slow  # subprocesses, servers or DDP ranks: the inner loop skips them

RECORDS = [os.urandom(n) for n in (0, 1, 1000, 70_000, 5)] * 20


def write(url: str, records: list[bytes], compression: str | None = None, storage_options: dict | None = None) -> str:
    with TFRecordWriter(url, compression=compression, storage_options=storage_options) as writer:
        for record in records:
            writer.write(record)
    return url


# --------------------------------------------------------------------------- S3


@pytest.mark.parametrize("compression", [None, "gzip", "zlib"])
def test_s3_round_trip(s3_server, compression: str | None) -> None:
    options = s3_server.storage_options()
    url = write(f"{s3_server.new_bucket()}/data/a.tfrecord", RECORDS, compression, options)
    assert list(read_tfrecord(url, storage_options=options)) == RECORDS
    assert scan_count(url, storage_options=options) == len(RECORDS)


def test_s3_index_and_seek(s3_server) -> None:
    options = s3_server.storage_options()
    url = write(f"{s3_server.new_bucket()}/a.tfrecord", RECORDS, storage_options=options)
    index = build_index(url, storage_options=options)
    assert index == index_path_for(url)
    assert len(read_index(index, options)) == len(RECORDS)
    got = list(read_tfrecord(url, start=37, stop=60, index=index, storage_options=options))
    assert got == RECORDS[37:60]


def test_s3_shard_writer_manifest(s3_server) -> None:
    from shardkit.shardlist import ShardList

    options = s3_server.storage_options()
    root = s3_server.new_bucket()
    with shardkit.ShardWriter(f"{root}/train-%03d.tfrecord", max_records=30, storage_options=options) as writer:
        for record in RECORDS:
            writer.write(record)
    shards = ShardList.from_manifest(f"{root}/train.manifest.arrow", storage_options=options)
    assert shards.num_records.tolist() == [30, 30, 30, 10]
    assert [r for url in shards for r in read_tfrecord(url, storage_options=options)] == RECORDS


# --------------------------------------------------------------------------- HTTP


class _RangeHandler(SimpleHTTPRequestHandler):
    """Static files with single-range GET support; logs the byte ranges served."""

    disable_nagle_algorithm = True  # TCP_NODELAY: else 40 ms a response (delayed ACK of the headers)
    served: list[tuple[str, int]]

    def send_head(self):  # type: ignore[no-untyped-def]
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        path = self.translate_path(self.path)
        if not match or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        start = int(match.group(1))
        stop = min(size, int(match.group(2)) + 1) if match.group(2) else size
        if start >= size:
            self.send_error(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
            return None
        f = open(path, "rb")
        f.seek(start)
        self.send_response(HTTPStatus.PARTIAL_CONTENT)
        self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        self.send_header("Content-Length", str(stop - start))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.served.append((self.path, stop - start))
        self._remaining = stop - start
        return f

    def copyfile(self, source, outputfile):  # type: ignore[no-untyped-def]
        remaining = getattr(self, "_remaining", None)
        if remaining is None:
            return super().copyfile(source, outputfile)
        while remaining > 0:
            chunk = source.read(min(remaining, 1 << 16))
            if not chunk:
                break
            outputfile.write(chunk)
            remaining -= len(chunk)

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass


@pytest.fixture
def http_root(tmp_path) -> Iterator[tuple[str, str, list[tuple[str, int]]]]:
    """(local dir, base URL, log of (path, bytes) ranges served) for a server on 127.0.0.1."""
    served: list[tuple[str, int]] = []
    handler = type("Handler", (_RangeHandler,), {"served": served})
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)  # quick shutdown
    thread.start()
    try:
        yield str(tmp_path), f"http://127.0.0.1:{server.server_address[1]}", served
    finally:
        server.shutdown()
        thread.join()


def test_http_streams_in_blocks(http_root) -> None:
    root, base, served = http_root
    records = [os.urandom(100_000) for _ in range(120)]  # about 12 MB: several blocks
    write(os.path.join(root, "a.tfrecord"), records)
    assert list(read_tfrecord(f"{base}/a.tfrecord")) == records
    reads = [n for path, n in served if path == "/a.tfrecord"]
    size = os.path.getsize(os.path.join(root, "a.tfrecord"))
    assert len(reads) > 2 and max(reads) <= BLOCK_SIZE  # fetched block by block, never whole
    assert sum(reads) < 1.5 * size


def test_http_gzip_index_and_inspect(http_root, capsys: pytest.CaptureFixture[str]) -> None:
    root, base, _ = http_root
    write(os.path.join(root, "a.tfrecord.gz"), RECORDS, "gzip")
    write(os.path.join(root, "b.tfrecord"), RECORDS)
    build_index(os.path.join(root, "b.tfrecord"))
    assert list(read_tfrecord(f"{base}/a.tfrecord.gz")) == RECORDS
    index = f"{base}/b.tfrecord.idx"
    assert list(read_tfrecord(f"{base}/b.tfrecord", start=95, index=index)) == RECORDS[95:]
    assert cli_main(["verify", f"{base}/b.tfrecord", f"{base}/a.tfrecord.gz"]) == 0
    assert f"{len(RECORDS)} records" in capsys.readouterr().out
