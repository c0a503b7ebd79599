"""Remote shards against local ones, and against other loaders reading the same remote content.

One run writes one content (``--shards`` x ``--records`` samples of about 1 KB,
as in ``benchmarks/compare.py``: TFRecord for shardkit, tar for WebDataset,
Parquet for Hugging Face ``datasets``) and serves it over HTTP from a separate
process on 127.0.0.1 (``tests/helpers/fault_server.py``, HTTP/1.1 keep-alive as object
stores serve), which sleeps ``latency`` ms before answering each request: an
object store's first-byte time. (Until the server kept connections alive,
every request of every loader paid a new TCP connection and server thread,
which was most of shardkit's gap at 0 ms.) For each
latency (``--latency``, default 0, 30 and 100 ms) it reads one epoch with:

- shardkit, decoded Examples, local files (the reference) and over HTTP;
- shardkit over HTTP with ``cache_dir``: epoch 1 fills the cache, epoch 2 reads it;
- WebDataset, ``pipe:curl -s <url>`` per shard (its fsspec path if no curl);
- Hugging Face ``datasets`` streaming over the Parquet files' HTTP urls.

Each through a DataLoader with ``--workers`` workers and batch ``--batch``,
persistent workers, timed on epoch 2 (workers up; nothing cached remotely
except in the cache row). Rounds are interleaved ``--repeat`` times and the
median kept. Reported: samples/s, the ratio to shardkit local, shardkit
remote over each other loader at the same latency, the time to the first
batch of epoch 1 (workers start, first shard opened), and the requests the
server answered per epoch (GET, HEAD, LIST: a directory page, which is how
fsspec lists over HTTP) and while the loader was built (shardkit HTTP is
given a glob, so its listing shows there, with "(N retried)" when a listing
request was not answered within its bound, 30 s, and was tried again).

Start-up at scale (``--startup N``, default 1,000,000; 0 skips it): a
manifest of N shards of 100 records (only the first few files exist: an
unshuffled plan reads those first) is loaded with ``ShardList.from_manifest``
and read through a DataLoader with 0 and ``--workers`` workers; the time from
loading the manifest to the first batch is reported, split into its steps.

    python benchmarks/remote.py [--quick] [--shards 16] [--records 5000] [--latency 0 30 100] [--repeat 3]
                                [--startup 1000000]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from torch.utils.data import DataLoader  # noqa: E402

import shardkit  # noqa: E402
from shardkit.io.remote import remote_stats  # noqa: E402


def _compare() -> Any:
    """benchmarks/compare.py, for its content and its per-loader sample conversions."""
    spec = importlib.util.spec_from_file_location("_compare", os.path.join(_HERE, "compare.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["_compare"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


compare = _compare()


@dataclass
class Server:
    """The latency server in its own process (so serving never competes with the loader for the GIL)."""

    root: str
    latency_ms: float
    url: str = ""
    process: Any = None

    def __enter__(self) -> Server:
        env = {**os.environ, "PYTHONPATH": _ROOT}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.fault_server", self.root, str(self.latency_ms / 1000)],
            stdout=subprocess.PIPE,
            env=env,
            cwd=_ROOT,
        )
        self.url = self.process.stdout.readline().decode().strip()
        if not self.url.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"latency server did not start: {self.url!r}")
        return self

    def stats(self) -> dict[str, int]:
        """Requests served since the last call."""
        with urllib.request.urlopen(f"{self.url}/_stats", timeout=30) as answer:
            return json.loads(answer.read())

    def __exit__(self, *exc_info: object) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


@dataclass
class Setup:
    workers: int
    batch: int


def _loader(dataset: Any, setup: Setup, **kwargs: Any) -> DataLoader:
    return DataLoader(
        dataset, batch_size=setup.batch, num_workers=setup.workers, persistent_workers=setup.workers > 0, **kwargs
    )


def _urls(content: Any, kind: str, base: str | None) -> list[str]:
    paths = getattr(content, kind)
    if base is None:
        return paths
    return [f"{base}/{kind}/{os.path.basename(p)}" for p in paths]


def shardkit_loader(content: Any, setup: Setup, base: str | None, cache_dir: str | None = None) -> DataLoader:
    options = {} if cache_dir is None else {"cache_dir": cache_dir}  # (also runs on versions without the cache)
    # Over HTTP a glob, as a job names a bucket's shards: the listing is counted (LIST) when the loader is built.
    shards = _urls(content, "tfrecord", None) if base is None else f"{base}/tfrecord/*.tfrecord"
    dataset = shardkit.TFRecordDataset(shards, decode="example", **options)
    return _loader(dataset.map(compare._example_pair), setup)


def webdataset_loader(content: Any, setup: Setup, base: str | None) -> DataLoader:
    import webdataset as wds

    urls = _urls(content, "tar", base)
    if base is not None and shutil.which("curl"):
        urls = [f"pipe:curl -s -f {url}" for url in urls]
    dataset = (
        wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker)
        .to_tuple("payload.bin", "cls")
        .map_tuple(bytes, int)
    )
    return _loader(dataset, setup)


def hf_loader(content: Any, setup: Setup, base: str | None) -> DataLoader:
    from datasets import load_dataset

    dataset = load_dataset("parquet", data_files=_urls(content, "parquet", base), split="train", streaming=True)
    return _loader(dataset, setup, collate_fn=compare._hf_collate)


@dataclass
class Row:
    name: str
    latency: float
    make: Callable[[], DataLoader]
    rates: list[float] = field(default_factory=list)
    first_batch: list[float] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    error: str = ""


def run_round(row: Row, expected: int, server: Server | None) -> None:
    """Two epochs of a fresh loader: first batch of epoch 1, samples/s of epoch 2, requests of epoch 2."""
    try:
        if server is not None:
            server.stats()
        retries = remote_stats()["retries"]
        loader = row.make()
        listed = server.stats()["LIST"] if server is not None else 0
        retried = remote_stats()["retries"] - retries  # a listing the server did not answer in time, tried again
        for epoch in range(2):
            if server is not None:
                server.stats()
            began = time.perf_counter()
            seen = 0
            for batch in loader:
                if seen == 0 and epoch == 0:
                    row.first_batch.append(time.perf_counter() - began)
                seen += len(batch[0])
            elapsed = time.perf_counter() - began
            if seen != expected:
                raise RuntimeError(f"read {seen} samples, expected {expected}")
        row.rates.append(seen / elapsed)
        if server is not None:
            got = server.stats()
            build = f"{listed} LIST at build" + (f" ({retried:g} retried)" if retried else "")
            row.requests.append(f"{got['GET']} GET + {got['HEAD']} HEAD + {got['LIST']} LIST; {build}")
        _close(loader)
    except Exception as error:  # a loader that fails is reported, not fatal to the run
        row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:150]}"


def _close(loader: Any) -> None:
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    gc.collect()


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--latency", type=float, nargs="+", default=[0, 30, 100])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="4 x 250 records, 0 and 30 ms, one round")
    parser.add_argument("--dir", help="where to write the content (default: a temporary directory)")
    parser.add_argument("--startup", type=int, default=1_000_000, help="shards in the start-up manifest (0: skip)")
    parser.add_argument("--only-startup", action="store_true", help="measure start-up only")
    args = parser.parse_args(argv)
    if args.only_startup:
        measure_startup(args.startup, args.workers)
        return
    if args.quick:
        args.shards, args.records, args.latency, args.repeat = 4, 250, [0, 30], 1  # 4 batches of 256 an epoch
    root = args.dir or tempfile.mkdtemp(prefix="shardkit-remote-")
    setup = Setup(args.workers, args.batch)
    try:
        content = compare.make_content(root, args.shards, args.records)
        results = measure(content, setup, args)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print_table(results, args)
    if args.startup:
        measure_startup(args.startup, args.workers)


def measure_startup(shards: int, workers: int) -> None:
    """Seconds from a manifest of ``shards`` shards to the first batch, with 0 and ``workers`` workers."""
    import numpy as np

    from shardkit.shardlist import ShardList

    root = tempfile.mkdtemp(prefix="shardkit-startup-")
    try:
        urls = [os.path.join(root, f"shard-{i:07d}.tfrecord") for i in range(shards)]
        for url in urls[:8]:
            with shardkit.TFRecordWriter(url) as writer:
                for _ in range(100):
                    writer.write(b"x" * 1000)
        manifest = os.path.join(root, "train.manifest.arrow")
        ShardList(urls, num_records=np.full(shards, 100)).to_manifest(manifest)
        del urls
        print(f"\nstart-up over a manifest of {shards:,} shards:\n")
        print("| workers | load manifest | build dataset | iter + first batch | total |")
        print("|---|---|---|---|---|")
        for count in (0, workers):
            began = time.perf_counter()
            listed = shardkit.ShardList.from_manifest(manifest)
            loaded = time.perf_counter()
            dataset = shardkit.TFRecordDataset(listed, decode="raw")
            built = time.perf_counter()
            loader = DataLoader(dataset, batch_size=64, num_workers=count)
            next(iter(loader))
            first = time.perf_counter()
            print(
                f"| {count} | {loaded - began:.2f} s | {built - loaded:.2f} s | {first - built:.2f} s | "
                f"{first - began:.2f} s |"
            )
            _close(loader)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure(content: Any, setup: Setup, args: argparse.Namespace) -> list[Row]:
    rows = [Row("shardkit, local files", 0, lambda: shardkit_loader(content, setup, None))]
    for repeat in range(args.repeat):
        run_round(rows[0], content.total, None)
    for latency in args.latency:
        with Server(content.root, latency) as server:
            cache = tempfile.mkdtemp(prefix="shardkit-cache-")
            base = server.url
            remote = [
                Row("shardkit, HTTP", latency, lambda: shardkit_loader(content, setup, base)),
                Row(
                    "shardkit, HTTP + cache_dir (epoch 2 from cache)",
                    latency,
                    lambda: shardkit_loader(content, setup, base, cache),
                ),
                Row(
                    "WebDataset, " + ("pipe:curl" if shutil.which("curl") else "fsspec http"),
                    latency,
                    lambda: webdataset_loader(content, setup, base),
                ),
                Row("HF datasets streaming (Parquet over HTTP)", latency, lambda: hf_loader(content, setup, base)),
            ]
            for _ in range(args.repeat):
                for row in remote:
                    if not row.error:
                        run_round(row, content.total, server)
                        server.stats()
                local = rows[0]
                run_round(local, content.total, None)  # interleaved: load on the machine hits both alike
            shutil.rmtree(cache, ignore_errors=True)
            rows += remote
    return rows


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    local = _median(rows[0].rates)
    print(
        f"\n{args.shards} shards x {args.records} samples of ~1 KB, {args.workers} workers, batch {args.batch}, "
        f"median of {args.repeat} rounds; cores: {os.cpu_count()}, load: {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| loader | latency | samples/s | x shardkit local | shardkit HTTP is | 1st batch (ep 1) | requests (ep 2; build) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        rate = _median(row.rates)
        same = [r for r in rows if r.latency == row.latency and r.name == "shardkit, HTTP"]
        mine = _median(same[0].rates) if same else float("nan")
        versus = "" if row.name.startswith("shardkit") else f"{mine / rate:.2f}x"
        if row.error:
            print(f"| {row.name} | {row.latency:g} ms | failed: {row.error} | | | | |")
            continue
        where = "local" if row is rows[0] else f"{row.latency:g} ms"
        print(
            f"| {row.name} | {where} | {rate:,.0f} | {rate / local:.2f} | {versus} | "
            f"{_median(row.first_batch):.2f} s | {row.requests[-1] if row.requests else '-'} |"
        )


if __name__ == "__main__":
    main()
