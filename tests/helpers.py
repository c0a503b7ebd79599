"""Shared test helpers: module level, so that DataLoader workers and ranks started with spawn can unpickle them."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

import shardkit

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def synthetic_read(url: str, start: int, stop: int | None) -> Iterator[str]:
    """Records of a synthetic shard named ``<name>-<count>``: ``"<url>:<index>"``.

    Like slicing, a ``stop`` past ``count`` yields the records that exist.
    """
    count = int(url.rsplit("-", 1)[1])
    for index in range(start, count if stop is None else min(stop, count)):
        yield f"{url}:{index}"


def synthetic_shards(counts: list[int], *, known: bool = True) -> shardkit.ShardList:
    urls = [f"mem/shard{i:03d}-{count}" for i, count in enumerate(counts)]
    return shardkit.ShardList(urls, num_records=counts if known else None)


def all_ids(shards: shardkit.ShardList) -> list[str]:
    return [record for url in shards for record in synthetic_read(url, 0, None)]


def tag_worker(sample: object) -> tuple[int, object]:
    info = get_worker_info()
    return (-1 if info is None else info.id), sample


class CountingStream(torch.utils.data.IterableDataset):
    """A plain IterableDataset yielding 0..n-1 (no __len__, no __getitem__)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def assert_same(got: Any, expected: Any, where: str = "batch") -> None:
    """Equal types, dtypes, shapes and bytes, all the way down."""
    assert type(got) is type(expected), f"{where}: {type(got).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        assert got.view(-1).view(torch.uint8).tolist() == expected.view(-1).view(torch.uint8).tolist(), where
    elif isinstance(expected, dict):
        assert list(got) == list(expected), where
        for key in expected:
            assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{where}[{i}]")
    else:
        assert got == expected, where


def record_offsets(url: str) -> list[int]:
    """The byte offset of every record of a TFRecord file, walking its length fields by hand."""
    import struct

    offsets, offset = [], 0
    with open(url, "rb") as file:
        while header := file.read(8):
            offsets.append(offset)
            (length,) = struct.unpack("<Q", header)
            offset += 16 + length
            file.seek(offset)
    return offsets


# --------------------------------------------------------------------------- shard formats


def sample_id(sample: object) -> str:
    """The identity of a sample of any built-in format: a tar sample's key, a row's or line's ``id``."""
    if isinstance(sample, dict) and "__key__" in sample:
        return str(sample["__key__"])
    if isinstance(sample, dict):
        return str(sample["id"])
    raise TypeError(f"no id in {sample!r}")


def ids_per_rank(make, *, world_size: int, num_workers: int, batch_size: int = 4, env: bool = False, monkeypatch=None):
    """Sample ids each rank's DataLoader yields, as lists of batches; ``make(rank, world)`` builds a rank's dataset
    (``rank``/``world`` are None with ``env``: then RANK/WORLD_SIZE are set for each rank)."""
    from torch.utils.data import DataLoader

    ranks = []
    for rank in range(world_size):
        if env:
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WORLD_SIZE", str(world_size))
            dataset = make(None, None)
        else:
            dataset = make(rank, world_size)
        kwargs = {"multiprocessing_context": "fork"} if num_workers else {}
        loader = DataLoader(dataset.map(sample_id), batch_size=batch_size, num_workers=num_workers, **kwargs)
        ranks.append([list(batch) for batch in loader])
    return ranks


def assert_split(ranks: list, everything: list[str], balance: str) -> None:
    """Exactly once over the ranks with ``"none"``; equal batch and sample counts with ``"pad"``/``"drop"``
    (``"pad"`` repeats, ``"drop"`` leaves out, fewer samples than there are ranks)."""
    import collections

    seen = collections.Counter(s for batches in ranks for batch in batches for s in batch)
    total, world = len(everything), len(ranks)
    assert set(seen) <= set(everything)
    if balance == "none":
        assert sorted(seen.elements()) == sorted(everything)
        return
    assert len({len(batches) for batches in ranks}) == 1, "ranks yield different numbers of batches"
    per_rank = -(-total // world) if balance == "pad" else total // world
    assert {sum(len(b) for b in batches) for batches in ranks} == {per_rank}
    if balance == "pad":
        assert set(seen) == set(everything)
        assert sum(seen.values()) == per_rank * world
    else:
        assert max(seen.values()) == 1 and len(set(everything) - set(seen)) == total % world


def positional_read(url: str, start: int, stop: int | None) -> Iterator[int]:
    """Records of a shard named ``pos/<shard>/<first>-<count>``: their global storage positions ``first + index``."""
    first, count = map(int, url.rsplit("/", 1)[1].split("-"))
    for index in range(start, count if stop is None else min(stop, count)):
        yield first + index


def positional_shards(counts: list[int]) -> shardkit.ShardList:
    """Shards for :func:`positional_read`: record ``i`` of the whole dataset (shard after shard) reads as ``i``."""
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    return shardkit.ShardList(
        [f"pos/{i}/{first}-{count}" for i, (first, count) in enumerate(zip(firsts, counts))], num_records=counts
    )


def holey_positional_read(url: str, start: int, stop: int | None) -> Iterator[int]:
    """:func:`positional_read` where every global position ``p`` with ``p % 97 == 5`` is a bad record
    (a :class:`~shardkit.CorruptRecordError` with its framing intact: only that record is lost)."""
    from shardkit.errors import CorruptRecordError

    first = int(url.rsplit("/", 1)[1].split("-")[0])
    for position in positional_read(url, start, stop):
        if position % 97 == 5:
            raise CorruptRecordError(url, position - first, -1, "a planted bad record", framing_intact=True)
        yield position


def rank_factory(dataset_class, urls, **kwargs):
    """``make(rank, world_size)`` building ``dataset_class(urls, rank=..., world_size=..., **kwargs)`` (for ids_per_rank)."""

    def make(rank, world):
        return dataset_class(urls, rank=rank, world_size=world, **kwargs)

    return make


# --------------------------------------------------------------------------- TLS


def self_signed_cert(directory: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and localhost signed by its own key, written to ``directory``:
    ``(cert.pem, key.pem)``. The cert is its own CA: trust it with ``SSL_CERT_FILE``. Skips the
    test when ``cryptography`` is not installed."""
    import pytest

    pytest.importorskip("cryptography", reason="generating a self-signed certificate needs cryptography")
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shardkit test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(*args: str, timeout: float = 300, check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess:
    """``python *args`` in a new process, its output captured as text; with ``check``, it must exit 0
    (the end of its stderr is the failure message). The timeout bounds any hang."""
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def last_json_line(stdout: str) -> Any:
    """The JSON a check script prints as its last line."""
    return json.loads(stdout.strip().splitlines()[-1])


def gloo_ranks(
    fn: Callable[..., None],
    world_size: int,
    *args: Any,
    start_method: str = "spawn",
    collective_timeout: float | None = None,
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes joined in a gloo
    process group over localhost (destroyed when ``fn`` returns or raises); waits for all,
    and raises if one fails.

    The ranks meet through a file store in a fresh folder, not a TCP port picked in
    advance: a port found free can be taken by another process before rank 0 binds it.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="shardkit-gloo-") as folder:
        setup = (fn, world_size, os.path.join(folder, "store"), collective_timeout, args)
        mp.start_processes(_gloo_rank, args=setup, nprocs=world_size, join=True, start_method=start_method)


def _gloo_rank(
    rank: int, fn: Callable[..., None], world_size: int, store: str, timeout: float | None, args: tuple
) -> None:
    import torch.distributed as dist

    options = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, **options)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- one writer per shard format
# (the format tests and tests/test_formats_matrix.py; ids count up across the shards of one call)


def tar_sample(n: int) -> dict:
    return {"__key__": f"s{n:05d}", "txt": f"text {n}", "cls": str(n % 10), "bin": bytes([n % 256]) * (n * 13 % 700)}


def write_tar_shards(root: str, sizes: list[int], storage_options=None) -> list[str]:
    """Tars written by webdataset.TarWriter (shardkit's TarWriter on remote storage), samples ``s00000``..."""
    import webdataset as wds

    from shardkit.formats.tar import TarWriter

    urls, n = [], 0
    for i, size in enumerate(sizes):
        url = f"{root}/part-{i:03d}.tar"
        with wds.TarWriter(url) if storage_options is None else TarWriter(url, storage_options=storage_options) as w:
            for _ in range(size):
                w.write(tar_sample(n))
                n += 1
        urls.append(url)
    return urls


def parquet_row(n: int) -> dict:
    return {"id": f"r{n:05d}", "n": n, "x": n / 7, "tags": [n % 3] * (n % 4), "blob": bytes([n % 256]) * (n % 9)}


def write_parquet_shards(root: str, sizes: list[int], row_group_size: int = 4, storage_options=None) -> list[str]:
    """Files written by pyarrow.parquet with page checksums, several row groups each; rows ``r00000``..."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("id", pa.string()),
            ("n", pa.int64()),
            ("x", pa.float64()),
            ("tags", pa.list_(pa.int64())),
            ("blob", pa.binary()),
        ]
    )
    urls, n = [], 0
    for i, size in enumerate(sizes):
        url = f"{root}/part-{i:03d}.parquet"
        table = pa.Table.from_pylist([parquet_row(k) for k in range(n, n + size)], schema=schema)
        filesystem = None
        if storage_options is not None:
            import fsspec

            filesystem = fsspec.filesystem("s3", **storage_options)
            url = url.removeprefix("s3://")
        pq.write_table(table, url, row_group_size=row_group_size, filesystem=filesystem, write_page_checksum=True)
        urls.append(url if storage_options is None else f"s3://{url}")
        n += size
    return urls


def jsonl_row(n: int) -> dict:
    return {
        "id": f"r{n:05d}",
        "text": 'é\u2028 "quoted"\\' * (n % 4),
        "values": [n, n / 3, None, True],
        "nested": {"n": n},
    }


def write_jsonl_shards(root: str, sizes: list[int], suffix: str = ".jsonl", storage_options=None) -> list[str]:
    """Shards written with json.dumps, one value a line (gzip for .gz); lines ``r00000``..."""
    import gzip
    import json

    import fsspec

    urls, n = [], 0
    for i, size in enumerate(sizes):
        url = f"{root}/part-{i:03d}{suffix}"
        text = "".join(json.dumps(jsonl_row(k)) + "\n" for k in range(n, n + size))
        n += size
        data = gzip.compress(text.encode()) if suffix.endswith(".gz") else text.encode()
        with fsspec.open(url, "wb", **(storage_options or {})) as f:
            f.write(data)
        urls.append(url)
    return urls


def format_ids(name: str, sizes: list[int]) -> list[str]:
    """The sample ids (:func:`sample_id`) the writer of format ``name`` gives ``sizes``."""
    prefix = "s" if name == "tar" else "r"
    return [f"{prefix}{n:05d}" for n in range(sum(sizes))]


def read_all(loader: Iterable[Any]) -> list[Any]:
    """``list(loader)``, but a DataLoader worker's error shuts the workers down before it propagates.

    DataLoader re-raises a worker's error with a traceback that holds its
    iterator. Kept by ``pytest.raises``, the iterator is freed by the cycle
    collector, which finalizes its queues first: the workers never get their
    exit message and DataLoader waits 5 s per worker before terminating them.
    (MixedLoader shuts its own workers down; a plain DataLoader needs this.)
    """
    iterator = iter(loader)
    try:
        return list(iterator)
    except BaseException:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        raise


# --------------------------------------------------------------------------- column batches

COLUMN_FEATURES = {"id": ("int64", ()), "xy": ("float32", (2,)), "blob": ("bytes", ())}


def write_column_shards(
    folder: Path, shards: int = 3, records: int = 40, odd: int | None = None, misfits: dict[int, str] | None = None
) -> list[str]:
    """TFRecord shards of records numbered by "id" with COLUMN_FEATURES (and an extra "n").

    Record ``odd`` has three xy values instead of two; ``misfits`` maps record ids to how
    they do not fit: ``"shape"`` (three xy values), ``"missing"`` (no xy), ``"type"`` (xy as bytes).
    """
    misfits = {**(misfits or {}), **({} if odd is None else {odd: "shape"})}
    urls = []
    for shard in range(shards):
        url = str(folder / f"part-{shard}.tfrecord")
        with shardkit.TFRecordWriter(url) as writer:
            for i in range(shard * records, (shard + 1) * records):
                features: dict[str, Any] = {"id": i, "xy": np.array([i / 4, -i], np.float32), "blob": b"b%d" % i}
                misfit = misfits.get(i)
                if misfit == "shape":
                    features["xy"] = np.array([i / 4, -i, 0.0], np.float32)
                elif misfit == "missing":
                    del features["xy"]
                elif misfit == "type":
                    features["xy"] = [b"x", b"y"]
                writer.write(shardkit.encode_example({**features, "n": [1, 2]}))
        urls.append(url)
    return urls


def column_rows(batches: list[Any]) -> list[tuple[int, list[int], bytes]]:
    """(id, xy bits, blob) per record over column batches."""
    return [
        (i, xy.view(np.uint32).tolist(), blob)
        for batch in batches
        for i, xy, blob in zip(np.asarray(batch["id"]).tolist(), np.asarray(batch["xy"]), batch["blob"].to_pylist())
    ]


def per_record_rows(urls: list[str]) -> list[tuple[int, list[int], bytes]]:
    """column_rows of the records decoded one by one (decode_example)."""
    return [(int(r["id"][0]), r["xy"].view(np.uint32).tolist(), r["blob"][0]) for r in shardkit.TFRecordDataset(urls)]
