"""Shards for tests: synthetic read functions, and real TFRecord, tar, Parquet and JSON lines files.

Module level, so that DataLoader workers and ranks started with spawn can unpickle them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import shardkit


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
