"""The shard formats against the loaders their users have today.

One run writes one content per format and reads it with each pair of loaders,
through a DataLoader with ``--workers`` workers (batch ``--batch``, a plain
list collate so no loader pays for tensors):

- tar: ``shardkit.TarDataset`` vs ``webdataset.WebDataset`` on the same tars
  (written by ``webdataset.TarWriter``), samples of a 1 KB and of a 100 KB
  payload plus a label; both yield the raw sample dicts (no decoding).
- Parquet: ``shardkit.ParquetDataset`` vs Hugging Face ``datasets`` streaming
  on the same files, rows as dicts; also ``ParquetDataset(batch_size=...)``
  (column batches as numpy arrays, passed through the DataLoader as they
  come), counted in rows, with all columns (the strings and lists become
  object arrays) and with the three numeric columns only.
- JSON lines: ``shardkit.JsonlDataset`` vs ``datasets`` streaming ``json``.
- LitData: ``shardkit.LitDataDataset`` vs ``litdata.StreamingDataset`` on the
  same chunks (written by litdata's own ``BinaryWriter``), samples of an id, a
  label, a 1 KB uint8 array and a 4x4 float32 array (no bytes leaf: litdata
  yields bytes as memoryviews, which cannot leave a DataLoader worker). Run only where litdata is
  installed (it is not in the dev extra: see tests/helpers/litdata_samples.py);
  LitData splits over ranks only under torch.distributed, so its
  duplicates/missing column is not measured.
- Lance: ``shardkit.LanceDataset(batch_size=1024)`` (numpy column batches) vs
  ``lance.torch.data.LanceDataset(batch_size=1024)`` (its batches as tensors,
  its default; the vectors 2-D in both) on the same dataset written by
  ``lance.write_dataset`` (``--lance-rows`` rows, 8 fragments): an id, a label,
  a score and a 16-float vector per row. Both run with 0 workers and with
  ``--workers`` workers, each in one DataLoader of the same settings
  (``batch_size=None``, the workers spawned, as Lance advises: it is not
  fork-safe); ``lance.torch`` splits its fragments over the workers itself.
  One run (5 rounds, load 24 on 2 cores, 8M rows): 2 workers, shardkit 2.52x
  (178k vs 71k rows/s, 29.2 vs 29.5 s to the first batch, 1,468 vs 1,822 MiB
  peak RSS: ``lance.torch`` sends its tensors through shared memory, a file
  per tensor); 0 workers, 1.37x (629 vs 900 MiB). A spawned worker of either
  pays its interpreter, torch, pyarrow and Lance (whose import brings pandas
  in) before its first row; shardkit's own modules add ~0.5 s of that at load
  20. (An earlier version of this row set shardkit's forkserver workers
  against ``lance.torch`` with 0 workers on 2M rows, and read at 0.08x.)
- ArrayRecord: ``shardkit.ArrayRecordDataset`` vs Grain's own ``grain.DataLoader``
  over its ``ArrayRecordDataSource`` (``worker_count=--workers``, ``ShardOptions``
  per rank), on files the ``array-record`` package wrote with ``group_size:1``
  (what Grain asks for), tf.Examples of a 1 KB payload; both decode each record with ``shardkit.decode_example`` (Grain has
  no tf.Example decoder of its own without TensorFlow).
- MDS: ``shardkit.MDSDataset`` vs Mosaic's ``StreamingDataset`` (reading the
  directory as ``local=``, no remote) on a dataset Mosaic's ``MDSWriter`` wrote
  (zstd shards; an int, a str, a 1 KB bytes column and an int32 ndarray), each in
  a torch DataLoader. mosaicml-streaming cannot be installed beside the dev
  extra (it needs transformers<5): the row runs where it is installed, and
  says so where it is not.

Throughput is samples (rows) per second of wall time over one epoch, the
workers started fresh (their start-up is in every case). Cases run
interleaved, ``--rounds`` times, and the median of each is kept, so load
from other processes on the shared machine hurts every case alike; the
ratios are shardkit over the other loader within the run. First-batch time is
the median time from ``iter(loader)`` to the first batch. Peak RSS is the median over rounds of the
peak resident memory of the reading process plus every process below it (DataLoader workers, a
loader's own), sampled every 50 ms through the epoch (:class:`PeakRSS`). Duplicates/missing:
every id seen over 2 ranks (``RANK``/``WORLD_SIZE`` in the environment, and
each loader's documented split: ``split_by_node`` for WebDataset,
``split_dataset_by_node`` for datasets) x ``--workers`` workers.

    python benchmarks/formats.py [--rounds 5] [--workers 2] [--quick]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# Every worker a DataLoader spawns imports torch (and pyarrow, lance...) again: with bytecode caching off, as
# some container images set it (PYTHONDONTWRITEBYTECODE), each one compiled them from source, 10-15 s a worker
# at load 10 where a user's install (pip compiles on install) takes 2-7 s. Cache it as scripts/test.sh does.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False
    _venv = os.path.dirname(os.path.dirname(sys.executable))
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(_venv, "pycache"))
    sys.pycache_prefix = sys.pycache_prefix or os.environ["PYTHONPYCACHEPREFIX"]

import numpy as np  # noqa: E402
from _common import descendants  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import shardkit  # noqa: E402

Make = Callable[[int | None, int | None], Any]  # (rank, world_size) -> dataset


def _list(batch: list[Any]) -> list[Any]:
    return batch


def write_tars(root: str, shards: int, per_shard: int, payload: int) -> list[str]:
    import webdataset as wds

    rng = np.random.default_rng(0)
    urls, n = [], 0
    for s in range(shards):
        url = f"{root}/tar{payload}-{s:03d}.tar"
        with wds.TarWriter(url) as writer:
            for _ in range(per_shard):
                writer.write({"__key__": f"s{n:08d}", "bin": rng.bytes(payload), "cls": str(n % 1000)})
                n += 1
        urls.append(url)
    return urls


def rows(first: int, count: int) -> list[dict[str, Any]]:
    return [
        {
            "id": n,
            "label": n % 1000,
            "score": n / 7,
            "text": f"sample {n} " + "lorem ipsum dolor " * 5,
            "tags": [n % 3, n % 5],
        }
        for n in range(first, first + count)
    ]


def write_parquet(root: str, shards: int, per_shard: int) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    urls = []
    for s in range(shards):
        url = f"{root}/rows-{s:03d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows(s * per_shard, per_shard)), url, row_group_size=10_000)
        urls.append(url)
    return urls


def write_jsonl(root: str, shards: int, per_shard: int) -> list[str]:
    urls = []
    for s in range(shards):
        url = f"{root}/rows-{s:03d}.jsonl"
        with open(url, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows(s * per_shard, per_shard))
        urls.append(url)
    return urls


def write_array_records(root: str, shards: int, per_shard: int) -> list[str]:
    """Written in a spawned process: the package's writer leaves a thread pool that forked workers cannot use."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_write_array_records, (root, shards, per_shard))


def _write_array_records(root: str, shards: int, per_shard: int) -> list[str]:
    from array_record.python.array_record_module import ArrayRecordWriter

    urls = []
    for s in range(shards):
        url = f"{root}/records-{s:03d}.array_record"
        writer = ArrayRecordWriter(url, "group_size:1")  # what Grain asks for (random access)
        for n in range(s * per_shard, (s + 1) * per_shard):
            payload = np.frombuffer(np.random.default_rng(n).bytes(1024), np.uint8).tobytes()
            writer.write(
                shardkit.encode_example({"id": np.array([n]), "label": np.array([n % 1000]), "payload": [payload]})
            )
        writer.close()
        urls.append(url)
    return urls


def write_mds(root: str, samples: int) -> str:
    from streaming import MDSWriter

    out = f"{root}/mds"
    columns = {"id": "int", "text": "str", "payload": "bytes", "tokens": "ndarray:int32"}
    with MDSWriter(out=out, columns=columns, compression="zstd", size_limit=1 << 22) as writer:
        for n in range(samples):
            payload = np.random.default_rng(n).bytes(1024)
            writer.write(
                {"id": n, "text": f"sample {n}", "payload": payload, "tokens": np.arange(n % 64 + 1, dtype=np.int32)}
            )
    return out


# --------------------------------------------------------------------------- the loaders


def shardkit_tar(urls: list[str]) -> Make:
    return lambda rank, world: shardkit.TarDataset(urls, balance="none", rank=rank, world_size=world)


def webdataset_tar(urls: list[str]) -> Make:
    def make(rank: int | None, world: int | None) -> Any:
        import webdataset as wds

        return wds.WebDataset(
            urls, shardshuffle=False, nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker
        )

    return make


def shardkit_parquet(urls: list[str], batch_size: int | None = None, columns: list[str] | None = None) -> Make:
    return lambda rank, world: shardkit.ParquetDataset(
        urls, balance="none", rank=rank, world_size=world, batch_size=batch_size, columns=columns
    )


def hf_streaming(kind: str, urls: list[str]) -> Make:
    def make(rank: int | None, world: int | None) -> Any:
        from datasets import load_dataset
        from datasets.distributed import split_dataset_by_node

        dataset = load_dataset(kind, data_files=urls, split="train", streaming=True)
        if world is not None:
            dataset = split_dataset_by_node(dataset, rank=rank, world_size=world)
        return dataset

    return make


def write_litdata(root: str, chunks: int, per_chunk: int) -> str:
    """A LitData dataset written by litdata's own writer: ``chunks`` chunks of ``per_chunk`` samples."""
    from litdata.streaming.writer import BinaryWriter

    out = os.path.join(root, "litdata")
    writer = BinaryWriter(out, chunk_size=per_chunk)
    rng = np.random.default_rng(0)
    for i in range(chunks * per_chunk):
        payload = rng.integers(0, 256, 1024, dtype=np.uint8)  # an array: litdata yields bytes as unpicklable views
        writer[i] = {"id": i, "label": i % 10, "payload": payload, "features": rng.random((4, 4), np.float32)}
    writer.done()
    writer.merge()
    return out


def shardkit_litdata(path: str) -> Make:
    return lambda rank, world: shardkit.LitDataDataset(path, rank=rank, world_size=world, balance="none")


def litdata_streaming(path: str) -> Make:
    import litdata

    return lambda rank, world: litdata.StreamingDataset(path)


def write_lance(root: str, fragments: int, per_fragment: int) -> str:
    import lance
    import pyarrow as pa

    n = fragments * per_fragment
    rng = np.random.default_rng(0)
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * 16, np.float32)), 16)
    table = pa.table({"id": np.arange(n), "label": np.arange(n) % 10, "score": rng.random(n), "vector": vectors})
    out = os.path.join(root, "table.lance")
    lance.write_dataset(table, out, max_rows_per_file=per_fragment)
    return out


def shardkit_lance(uri: str) -> Make:
    return lambda rank, world: shardkit.LanceDataset(uri, rank=rank, world_size=world, batch_size=1024, balance="none")


def lance_torch(uri: str) -> Make:
    from lance.torch.data import LanceDataset

    return lambda rank, world: LanceDataset(uri, batch_size=1024, rank=rank, world_size=world)


def shardkit_jsonl(urls: list[str]) -> Make:
    return lambda rank, world: shardkit.JsonlDataset(urls, balance="none", rank=rank, world_size=world)


def shardkit_array_record(urls: list[str]) -> Make:
    return lambda rank, world: shardkit.ArrayRecordDataset(urls, balance="none", rank=rank, world_size=world)


class Ready:
    """A loader that is its own DataLoader (Grain's): ``loader_for`` passes it on as it is."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Any:
        return iter(self.loader)


class _DecodeExample:  # a grain.transforms.Map: a class at module level, picklable into Grain's workers
    def map(self, record: bytes) -> Any:
        return shardkit.decode_example(record)


def grain_array_record(urls: list[str], workers: int, batch: int) -> Make:
    def make(rank: int | None, world: int | None) -> Any:
        import grain.python as gp

        source = gp.ArrayRecordDataSource(urls)
        shard = gp.ShardOptions(shard_index=rank or 0, shard_count=world or 1, drop_remainder=False)
        sampler = gp.IndexSampler(len(source), shard, shuffle=False, num_epochs=1)
        ops = [type("DecodeExample", (_DecodeExample, gp.MapTransform), {})(), gp.Batch(batch, batch_fn=_list)]
        return Ready(gp.DataLoader(data_source=source, sampler=sampler, operations=ops, worker_count=workers))

    return make


def shardkit_mds(root: str) -> Make:
    return lambda rank, world: shardkit.MDSDataset(root, balance="none", rank=rank, world_size=world)


def mosaic_mds(root: str, batch: int) -> Make:
    def make(rank: int | None, world: int | None) -> Any:
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        return StreamingDataset(local=root, shuffle=False, batch_size=batch, replication=None)

    return make


# --------------------------------------------------------------------------- measuring


def lance_context(dataset: Any, workers: int) -> dict[str, Any]:
    """Lance's loaders start their workers by spawn, as Lance advises (its runtime does not survive a fork,
    and shardkit refuses a worker forked from a process that used it): the same settings for both."""
    lance_kind = isinstance(dataset, shardkit.LanceDataset) or type(dataset).__module__ == "lance.torch.data"
    return {"multiprocessing_context": "spawn"} if workers and lance_kind else {}


def loader_for(dataset: Any, workers: int, batch: int) -> Any:
    if isinstance(dataset, Ready):
        return dataset
    spawn = lance_context(dataset, workers)
    if getattr(dataset, "column_batches", False) or type(dataset).__module__ == "lance.torch.data":
        # Column batches are batches already: the loader passes them on as they come.
        return DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=_list, **spawn)
    return DataLoader(dataset, batch_size=batch, num_workers=workers, collate_fn=_list)


def samples_in(batch: Any) -> int:
    if isinstance(batch, dict):
        return len(batch["id"])  # a column batch: count rows
    return len(batch)


def _rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` (0 once it has gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0


class PeakRSS:
    """The peak of this process's resident memory plus its descendants' (DataLoader workers, a loader's
    own processes), sampled every 50 ms on a thread while the block runs. Resident pages two processes
    share count in each: the figure is an upper bound of what the loader holds, the same bound for both."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        me = os.getpid()
        while True:
            self.peak = max(self.peak, sum(_rss_bytes(p) for p in [me, *descendants(me)]))
            if self._stop.wait(0.05):
                return

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def epoch(make: Make, workers: int, batch: int) -> tuple[float, float, int, int]:
    """(seconds for the epoch, seconds to the first batch, samples, peak resident bytes of this process and
    its workers)."""
    with PeakRSS() as rss:
        loader = loader_for(make(None, None), workers, batch)
        start = time.perf_counter()
        first = None
        n = 0
        for b in loader:
            if first is None:
                first = time.perf_counter() - start
            n += samples_in(b)
        seconds = time.perf_counter() - start
        del loader  # its workers end inside the measured block
    return seconds, first or 0.0, n, rss.peak


def ids_of(sample: Any) -> list[Any]:
    if "__key__" in sample:
        return [sample["__key__"]]
    value = sample["id"]
    return list(np.asarray(value).tolist()) if hasattr(value, "__len__") else [value]


def dup_missing(make: Make, workers: int, batch: int, total: int) -> tuple[int, int]:
    """Duplicates and missing samples over 2 ranks (RANK/WORLD_SIZE set) x ``workers`` workers."""
    seen: collections.Counter[Any] = collections.Counter()
    for rank in range(2):
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), "2"
        try:
            for b in loader_for(make(rank, 2), workers, batch):
                for sample in [b] if isinstance(b, dict) else b:
                    seen.update(ids_of(sample))
        finally:
            del os.environ["RANK"], os.environ["WORLD_SIZE"]
    dup = sum(c - 1 for c in seen.values() if c > 1)
    return dup, total - len(seen)


def _importable(name: str) -> bool:
    import importlib.util

    if importlib.util.find_spec(name) is None:
        print(f"  (no {name} here: its block is left out)", file=sys.stderr)
        return False
    return True


ONE_RANK_ONLY = {"mosaic StreamingDataset"}
"""Loaders whose ranks need a real process group (Mosaic's barriers): their 2-rank split is not simulated here."""


def compare(
    title: str,
    cases: dict[str, Make],
    total: int,
    args: argparse.Namespace,
    *,
    split: bool = True,
    workers: dict[str, int] | None = None,
) -> list[str]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    firsts: dict[str, list[float]] = {name: [] for name in cases}
    peaks: dict[str, list[int]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, make in cases.items():
            seconds, first, n, peak = epoch(make, (workers or {}).get(name, args.workers), args.batch)
            if n != total:
                print(f"  ! {name} yielded {n} samples of {total}", file=sys.stderr)
            times[name].append(seconds)
            firsts[name].append(first)
            peaks[name].append(peak)
    names = list(cases)
    ref = statistics.median(times[names[-1]])
    used = sorted(set((workers or {}).values())) or [args.workers]
    lines = [
        f"{title} ({total} samples, {'/'.join(map(str, used))} workers, median of {args.rounds} interleaved rounds)"
    ]
    for name in names:
        median = statistics.median(times[name])
        line = (
            f"  {name:<44} {total / median:>11,.0f}/s  x{ref / median:5.2f}  first batch "
            f"{statistics.median(firsts[name]):6.3f}s  peak RSS {statistics.median(peaks[name]) / 2**20:7,.0f} MiB"
        )
        if name in ONE_RANK_ONLY:
            line += "  2 ranks: not run (its ranks need a process group)"
        elif split:
            dup, missing = dup_missing(cases[name], args.workers, args.batch, total)
            line += f"  2 ranks x {args.workers} workers: {dup} duplicates, {missing} missing"
        lines.append(line)
    return lines


def compare_mds(root: str, total: int, args: argparse.Namespace) -> list[str]:
    try:
        import streaming  # noqa: F401
    except ImportError:
        return ["MDS: skipped, mosaicml-streaming is not installed (it cannot be beside the dev extra)"]
    mds = write_mds(root, total)
    cases = {"shardkit MDSDataset": shardkit_mds(mds), "mosaic StreamingDataset": mosaic_mds(mds, args.batch)}
    return compare("MDS, zstd shards, 1 KB samples", cases, total, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="small content, 1 round (a smoke run)")
    parser.add_argument("--lance-rows", type=int, default=8_000_000, help="rows of the Lance dataset")
    parser.add_argument(
        "--only", choices=["tar", "parquet", "jsonl", "litdata", "lance", "array_record", "mds"], action="append"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 1
    scale = 20 if args.quick else 1  # still more than one 1,024-row batch in every Parquet and JSONL shard
    only = set(args.only or ["tar", "parquet", "jsonl", "litdata", "lance", "array_record", "mds"])
    out: list[str] = []
    with tempfile.TemporaryDirectory() as root:
        if "tar" in only:
            for payload, per_shard in [(1024, 5000 // scale), (100 * 1024, 150 // scale)]:
                urls = write_tars(root, 8, per_shard, payload)
                cases = {"shardkit TarDataset": shardkit_tar(urls), "webdataset WebDataset": webdataset_tar(urls)}
                out += compare(f"tar, {payload // 1024} KB samples", cases, 8 * per_shard, args)
        if "parquet" in only:
            urls = write_parquet(root, 8, 25_000 // scale)
            cases = {
                "shardkit ParquetDataset (rows as dicts)": shardkit_parquet(urls),
                "shardkit ParquetDataset(batch_size=1024)": shardkit_parquet(urls, 1024),
                "shardkit ParquetDataset(batch_size=1024), numbers": shardkit_parquet(
                    urls, 1024, ["id", "label", "score"]
                ),
                "HF datasets streaming parquet": hf_streaming("parquet", urls),
            }
            out += compare("Parquet", cases, 8 * (25_000 // scale), args)
        if "jsonl" in only:
            urls = write_jsonl(root, 8, 25_000 // scale)
            cases = {
                "shardkit JsonlDataset": shardkit_jsonl(urls),
                "HF datasets streaming json": hf_streaming("json", urls),
            }
            out += compare("JSON lines", cases, 8 * (25_000 // scale), args)
        if "litdata" in only and _importable("litdata"):
            path = write_litdata(root, 8, 5_000 // scale)
            cases = {
                "shardkit LitDataDataset": shardkit_litdata(path),
                "litdata StreamingDataset": litdata_streaming(path),
            }
            out += compare("LitData", cases, 8 * (5_000 // scale), args, split=False)
        if "lance" in only and _importable("lance"):
            rows = args.lance_rows // scale
            uri = write_lance(root, 8, rows // 8)
            for workers in sorted({0, args.workers}):
                cases = {
                    "shardkit LanceDataset(batch_size=1024)": shardkit_lance(uri),
                    "lance.torch LanceDataset(batch_size=1024)": lance_torch(uri),
                }
                title = f"Lance, {workers} workers" + (" (spawned)" if workers else "")
                on = dict.fromkeys(cases, workers)
                out += compare(title, cases, 8 * (rows // 8), args, split=False, workers=on)
        if "array_record" in only:
            urls = write_array_records(root, 8, 10_000 // scale)
            cases = {
                "shardkit ArrayRecordDataset": shardkit_array_record(urls),
                "grain DataLoader(ArrayRecordDataSource)": grain_array_record(urls, args.workers, args.batch),
            }
            out += compare("ArrayRecord, tf.Examples of 1 KB", cases, 8 * (10_000 // scale), args)
        if "mds" in only:
            out += compare_mds(root, 80_000 // scale, args)
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus; ratios are over the last loader of each block"
    )
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
