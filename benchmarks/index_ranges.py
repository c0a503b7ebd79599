"""What a small range of an indexed TFRecord shard costs: the per-range price of sample-level shuffling.

A shuffled epoch reads every shard in blocks of at most 512 records, each
block a range that seeks with the shard's index. This measures, in one
process: ``load_index`` alone, a 1-record and a 512-record range read through
``TFRecordFormat.read_marked`` (what the sources call), the same from a copy
in ``memory://`` (the streamed path remote shards take; the bytes framed per
range are printed too), and one shuffled epoch of ``TFRecordDataset`` over 4
shards. Run it on two checkouts to compare::

    PYTHONPATH=. python benchmarks/index_ranges.py [--records 200000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections.abc import Callable

import fsspec

import shardkit
from shardkit.formats.tfrecord import TFRecordFormat
from shardkit.formats.tfrecord import framing as tfrecord
from shardkit.formats.tfrecord.index import load_index


def write_shard(url: str, records: int) -> str:
    if not os.path.exists(url + ".idx"):
        with shardkit.TFRecordWriter(url) as writer:
            for n in range(records):
                writer.write(b"%06d" % n + b"x" * 94)
        shardkit.build_index(url)
    return url


def per_call_us(fn: Callable[[int], object], starts: list[int], repeats: int = 3) -> float:
    fn(0)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for start in starts:
            fn(start)
        best = min(best, time.perf_counter() - began)
    return best / len(starts) * 1e6


def copy_to_memory(url: str) -> str:
    """A copy of the shard and its index in ``memory://``: read through the streamed (remote) path."""
    fs = fsspec.filesystem("memory")
    target = "memory://index-ranges/" + os.path.basename(url)
    for suffix in ("", ".idx"):
        with open(url + suffix, "rb") as f:
            fs.pipe(target + suffix, f.read())
    return target


def framed_bytes(fmt: TFRecordFormat, url: str, n: int) -> int:
    """Bytes the reader frames for one ``n``-record range from record 1000."""
    seen: list[int] = []
    frame = tfrecord._frame
    tfrecord._frame = lambda buf, pos, end, last: seen.append(end - pos) or frame(buf, pos, end, last)
    try:
        sum(1 for _ in fmt.read_marked(url, 1000, 1000 + n))
    finally:
        tfrecord._frame = frame
    return sum(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000, help="records in the measured shard")
    parser.add_argument("--dir", default=None, help="where to write the shards (default: a temporary directory)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="shardkit-index-ranges-")
    os.makedirs(root, exist_ok=True)
    url = write_shard(os.path.join(root, "one.tfrecord"), args.records)
    fmt = TFRecordFormat()
    starts = [random.Random(n).randrange(0, args.records - 512) for n in range(400)]
    print(f"| measured ({args.records} records, 100 B each) | us per call, best of 3 x 400 |")
    print("| --- | --- |")
    print(f"| load_index | {per_call_us(lambda s: load_index(url), starts):.0f} |")
    one = per_call_us(lambda s: sum(1 for _ in fmt.read_marked(url, s, s + 1)), starts)
    print(f"| 1-record range | {one:.0f} |")
    block = per_call_us(lambda s: sum(1 for _ in fmt.read_marked(url, s, s + 512)), starts)
    print(f"| 512-record range | {block:.0f} |")
    streamed = copy_to_memory(url)
    for n in (1, 512):
        us = per_call_us(lambda s: sum(1 for _ in fmt.read_marked(streamed, s, s + n)), starts[:100])
        print(f"| {n}-record range, streamed (memory://), {framed_bytes(fmt, streamed, n)} bytes framed | {us:.0f} |")
    urls = [write_shard(os.path.join(root, f"part-{i}.tfrecord"), args.records // 4) for i in range(4)]
    shards = shardkit.ShardList(urls, num_records=[args.records // 4] * 4)
    best = float("inf")
    for seed in range(3):
        dataset = shardkit.TFRecordDataset(shards, decode="raw", shuffle=True, seed=seed)
        began = time.perf_counter()
        count = sum(1 for _ in dataset)
        best = min(best, time.perf_counter() - began)
    print(f"| shuffled epoch, {count} records in 4 shards | {best * 1e6 / (count / 512):.0f} per block |")


if __name__ == "__main__":
    main()
