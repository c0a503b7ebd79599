"""End-to-end comparison of shardkit with the loaders users pick instead.

One run generates one content and reads it with every loader:

- content: ``--shards`` x ``--records`` records of about 1 KB, each a bytes
  payload and an int label. The payload starts with a marker and the sample's
  global id, so every loader's output can be checked for duplicates and
  losses. Written as TFRecord (read by shardkit and by the ``tfrecord``
  package, each with its own index files), as WebDataset tar shards and as
  Parquet (Hugging Face ``datasets`` streaming).
- throughput: samples/s of one epoch through a DataLoader with ``--workers``
  workers and batch ``--batch``, persistent workers, measured on epoch 2 (the
  workers are up, the files are in the page cache). Every loader yields the
  same thing, ``[list of payload bytes, int64 label tensor]``, except
  ``shardkit raw``, which yields the record bytes only (no Example decoding),
  and ``shardkit columns`` (``TFRecordDataset(features=..., batch_size=...)``
  through ``DataLoader(batch_size=None)``), whose payloads come as one Arrow
  binary array per batch (a buffer and offsets, no ``bytes`` per sample).
  ``shardkit MixedLoader, columns`` reads the same column batches, of
  ``COLUMN_MICRO_BATCH`` records each in the workers, and cuts ``--batch``
  batches from them in the main process through its reusable shared-memory
  slabs (:mod:`shardkit.loader.slab_columns`): payloads come as an Arrow binary array,
  labels as a tensor; its ratio to the fastest alternative is held to
  ``COLUMN_TARGET``.
  Loaders run round-robin ``--repeat`` times; the best epoch of each is kept,
  so load from other processes on the machine hurts every loader alike.
  A second figure collates the labels to a Python list instead of a tensor:
  DataLoader hands every tensor of a batch from worker to main process through
  a new shared-memory segment and a file descriptor, a fixed cost per batch
  that every loader pays alike and that caps them all near the same rate.
- time to first batch: from ``iter(loader)`` to the first batch, in epoch 1
  (workers start, files open) and epoch 2 (persistent workers).
- correctness: every sample id seen with 1 rank and with 2 simulated ranks
  (``RANK``/``WORLD_SIZE`` set in the environment, and each loader's
  documented way to split by rank), ``--workers`` workers each: duplicates,
  missing samples, and batches per rank (unequal counts hang DDP).
- memory: total PSS of the parent and ``--workers`` DataLoader workers that
  each read a 1M-entry shard url list, over an empty-list control, divided by
  the list's data size, for a Python list (what the alternatives hold) and a
  ShardList (median of ``--memory-repeat`` runs). Measured by
  ``benchmarks/memory.py``, each run in a fresh interpreter.

Ratios are ``shardkit decoded samples/s / loader samples/s`` from the same
run: above 1 means shardkit is faster. ``--quick`` is a smoke run (8 x 128
records, one repeat, 50k-entry list, fork only) that finishes in under a
minute on 2 cores; its numbers are not meant to be quoted.

    python benchmarks/compare.py [--quick] [--shards 32] [--records 5000] [--repeat 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

# ``benchmarks/tfrecord.py`` would shadow the ``tfrecord`` package compared here.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

# Hugging Face datasets reads local Parquet files here; it must never touch the network.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import shardkit  # noqa: E402

TABLE_HEADER = "| loader | samples/s | shardkit is | labels as list: samples/s | shardkit is | 1st batch ep 1 | 1st batch ep 2 | 1 rank: dup / missing | 2 ranks: dup / missing | batches r0 / r1 | note |"
MARK = b"SKID"
PAYLOAD_BYTES = 1000
TARGET_SPEEDUP = 1.5
#: The columnar path end to end must reach this many times the fastest alternative's samples/s.
COLUMN_TARGET = 5.0
#: The README's quickstart path (MixedLoader over decoded samples) against the fastest alternative.
FAST_PATH_TARGET = 2.0
#: Records per column batch a MixedLoader worker decodes and sends at once.
COLUMN_MICRO_BATCH = 1024
TARGET_PSS = 1.1


# ---------------------------------------------------------------- content


@dataclass
class Content:
    root: str
    shards: int
    records: int
    tfrecord: list[str] = field(default_factory=list)
    tar: list[str] = field(default_factory=list)
    parquet: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.shards * self.records

    def name(self, shard: int) -> str:
        return f"shard-{shard:05d}"


def _payload(rng: np.random.Generator, sample: int) -> bytes:
    return MARK + sample.to_bytes(8, "little") + rng.bytes(PAYLOAD_BYTES - 12)


def sample_id(payload: bytes) -> int:
    """The global id written into a payload (or into a raw record holding one)."""
    at = payload.find(MARK)
    return int.from_bytes(payload[at + 4 : at + 12], "little")


def make_content(root: str, shards: int, records: int) -> Content:
    """Write the same samples as TFRecord (+ both index formats), tar and Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds
    from tfrecord.tools.tfrecord2idx import create_index

    content = Content(root, shards, records)
    for kind in ("tfrecord", "tar", "parquet"):
        os.makedirs(os.path.join(root, kind), exist_ok=True)
    rng = np.random.default_rng(0)
    for shard in range(shards):
        name = content.name(shard)
        ids = range(shard * records, (shard + 1) * records)
        payloads = [_payload(rng, i) for i in ids]
        labels = [i % 1000 for i in ids]

        url = os.path.join(root, "tfrecord", f"{name}.tfrecord")
        with shardkit.TFRecordWriter(url) as writer:
            for payload, label in zip(payloads, labels):
                writer.write(shardkit.encode_example({"payload": [payload], "label": [label]}))
        shardkit.build_index(url)  # shardkit's binary index: <url>.idx
        create_index(url, os.path.join(root, "tfrecord", f"{name}.tfindex"))  # the tfrecord package's text index
        content.tfrecord.append(url)

        tar = os.path.join(root, "tar", f"{name}.tar")
        # An integer mtime: the default (time.time(), a float) adds a PAX header
        # to every member, which makes the tars ~1.8x larger and slower to read.
        with wds.TarWriter(tar, mtime=1_700_000_000) as sink:
            for i, payload, label in zip(ids, payloads, labels):
                sink.write({"__key__": f"{i:010d}", "payload.bin": payload, "cls": str(label).encode()})
        content.tar.append(tar)

        path = os.path.join(root, "parquet", f"{name}.parquet")
        table = pa.table({"payload": pa.array(payloads, pa.binary()), "label": pa.array(labels, pa.int64())})
        pq.write_table(table, path)
        content.parquet.append(path)
    return content


# ---------------------------------------------------------------- loaders
# Every loader yields [list of payload bytes, int64 tensor of labels] per batch
# (shardkit raw: the list of record bytes). Per-sample conversion happens in
# the workers, in each loader's own transform hook; DataLoader's default_collate
# makes the batch. Functions are module-level so that they pickle.


def _example_pair(example: dict[str, Any]) -> tuple[bytes, int]:
    return example["payload"][0], int(example["label"][0])


def _tfrecord_pkg_pair(example: dict[str, Any]) -> tuple[bytes, int]:
    # description "byte" gives the first value of the bytes_list as bytes.
    return example["payload"], int(example["label"][0])


def _hf_collate(rows: list[dict[str, Any]]) -> list[Any]:
    return [[row["payload"] for row in rows], torch.tensor([row["label"] for row in rows], dtype=torch.int64)]


# The "labels as a list" variant: no tensor in the batch. A worker hands each
# batch's tensors to the main process through a new shared-memory segment and a
# file descriptor, which costs about the same per batch for every loader.
def _list_collate(pairs: list[tuple[bytes, int]]) -> list[Any]:
    return [[payload for payload, _ in pairs], [label for _, label in pairs]]


def _hf_list_collate(rows: list[dict[str, Any]]) -> list[Any]:
    return [[row["payload"] for row in rows], [row["label"] for row in rows]]


@dataclass
class Setup:
    workers: int
    batch: int
    persistent: bool = True
    labels: str = "tensor"  # or "list": see _list_collate
    rank: int | None = None
    world_size: int | None = None


def _dataloader(dataset: Any, setup: Setup, **kwargs: Any) -> DataLoader:
    if setup.labels == "list":
        kwargs.setdefault("collate_fn", _list_collate)
    return DataLoader(
        dataset,
        batch_size=setup.batch,
        num_workers=setup.workers,
        persistent_workers=setup.persistent and setup.workers > 0,
        **kwargs,
    )


def shardkit_raw(content: Content, setup: Setup) -> Iterable[Any]:
    dataset = shardkit.TFRecordDataset(content.tfrecord, decode="raw", rank=setup.rank, world_size=setup.world_size)
    return _dataloader(dataset, setup, collate_fn=None)  # a list of bytes either way


def _shardkit_decoded_dataset(content: Content, setup: Setup) -> Any:
    return shardkit.TFRecordDataset(
        content.tfrecord, decode="example", rank=setup.rank, world_size=setup.world_size
    ).map(_example_pair)


def shardkit_decoded(content: Content, setup: Setup) -> Iterable[Any]:
    return _dataloader(_shardkit_decoded_dataset(content, setup), setup)


COLUMNS = {"payload": ("bytes", ()), "label": ("int64", ())}


def _column_pair(labels: str, batch: dict[str, Any]) -> list[Any]:
    label = batch["label"]
    return [batch["payload"], label.tolist() if labels == "list" else torch.from_numpy(label)]


def shardkit_columns(content: Content, setup: Setup) -> Iterable[Any]:
    dataset = shardkit.TFRecordDataset(
        content.tfrecord, features=COLUMNS, batch_size=setup.batch, rank=setup.rank, world_size=setup.world_size
    ).map(functools.partial(_column_pair, setup.labels))
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=setup.workers,
        persistent_workers=setup.persistent and setup.workers > 0,
    )


def shardkit_mixed(content: Content, setup: Setup) -> Iterable[Any]:
    return shardkit.MixedLoader(
        _shardkit_decoded_dataset(content, setup),
        setup.batch,
        num_workers=setup.workers,
        collate_fn=_list_collate if setup.labels == "list" else None,
        persistent_workers=setup.persistent and setup.workers > 0,
    )


class _ColumnPairs:
    """MixedLoader column batches as ``[payloads, labels]``, the other rows' batch form
    (labels as a list with ``labels="list"``, converted in the main process)."""

    def __init__(self, loader: shardkit.MixedLoader, labels: str) -> None:
        self.mixed, self.labels = loader, labels
        self._loader = loader._loader  # for _close

    def __iter__(self) -> Iterator[list[Any]]:
        for batch in self.mixed:
            label = batch["label"]
            yield [batch["payload"], label.tolist() if self.labels == "list" else label]


def shardkit_mixed_columns(content: Content, setup: Setup) -> Iterable[Any]:
    dataset = shardkit.TFRecordDataset(
        content.tfrecord,
        features=COLUMNS,
        batch_size=COLUMN_MICRO_BATCH,
        rank=setup.rank,
        world_size=setup.world_size,
    )
    loader = shardkit.MixedLoader(
        dataset, setup.batch, num_workers=setup.workers, persistent_workers=setup.persistent and setup.workers > 0
    )
    return _ColumnPairs(loader, setup.labels)


def tfrecord_package(content: Content, setup: Setup) -> Iterable[Any]:
    # The package has no notion of ranks: with index files it splits each
    # file's records between the workers of one process, and every rank reads
    # everything. infinite=False gives one epoch.
    from tfrecord.torch.dataset import MultiTFRecordDataset

    folder = os.path.join(content.root, "tfrecord")
    dataset = MultiTFRecordDataset(
        os.path.join(folder, "{}.tfrecord"),
        os.path.join(folder, "{}.tfindex"),
        {content.name(shard): 1.0 for shard in range(content.shards)},
        description={"payload": "byte", "label": "int"},
        transform=_tfrecord_pkg_pair,
        infinite=False,
    )
    return _dataloader(dataset, setup)


def webdataset_loader(content: Content, setup: Setup) -> Iterable[Any]:
    # The documented multi-node recipe: split_by_node (rank from RANK /
    # WORLD_SIZE, then torch.distributed) and split_by_worker, whole shards each.
    import webdataset as wds

    dataset = (
        wds.WebDataset(
            content.tar,
            shardshuffle=False,
            nodesplitter=wds.split_by_node,
            workersplitter=wds.split_by_worker,
        )
        .to_tuple("payload.bin", "cls")
        .map_tuple(bytes, int)
    )
    return _dataloader(dataset, setup)


def hf_datasets(content: Content, setup: Setup) -> Iterable[Any]:
    # load_dataset(..., streaming=True) over local Parquet; ranks through
    # split_dataset_by_node (whole shards when num_shards % world_size == 0).
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    dataset = load_dataset("parquet", data_files=content.parquet, split="train", streaming=True)
    if setup.world_size is not None:
        dataset = split_dataset_by_node(dataset, rank=setup.rank, world_size=setup.world_size)
    return _dataloader(dataset, setup, collate_fn=_hf_list_collate if setup.labels == "list" else _hf_collate)


@dataclass
class Loader:
    name: str
    make: Callable[[Content, Setup], Iterable[Any]]
    shardkit: bool = False


LOADERS = [
    Loader("shardkit TFRecordDataset, decoded", shardkit_decoded, shardkit=True),
    Loader("shardkit TFRecordDataset, raw bytes", shardkit_raw, shardkit=True),
    Loader("shardkit MixedLoader, decoded", shardkit_mixed, shardkit=True),
    Loader("shardkit TFRecordDataset, columns", shardkit_columns, shardkit=True),
    Loader("shardkit MixedLoader, columns", shardkit_mixed_columns, shardkit=True),
    Loader("tfrecord MultiTFRecordDataset + index", tfrecord_package),
    Loader("webdataset WebDataset, split_by_worker", webdataset_loader),
    Loader("HF datasets streaming (Parquet)", hf_datasets),
]
REFERENCE = LOADERS[0].name


def _close(loader: Any) -> None:
    """Shut persistent workers down now rather than at some later collection."""
    inner = getattr(loader, "_loader", loader)
    iterator = getattr(inner, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    gc.collect()
    # What survived is torch's, datasets' and this run's own long-lived objects: frozen out of the
    # collector, the next loader's collection does not walk them again (0.7 s each on 2 shared cores).
    gc.freeze()


# ---------------------------------------------------------------- measurements


@dataclass
class Result:
    rate: float = 0.0  # best samples/s over the repeats (epoch 2)
    list_rate: float = 0.0  # best samples/s with labels as a list, after the first batch
    first_1: float = float("inf")  # best time to the first batch of epoch 1
    first_2: float = float("inf")  # ... of epoch 2, persistent workers
    samples: int = -1  # samples of the last epoch measured
    error: str = ""
    dup_1: int = -1
    missing_1: int = -1
    dup_2: int = -1
    missing_2: int = -1
    batches: tuple[int, ...] = ()


def _batch_size(batch: Any) -> int:
    """Samples in a batch: a list of record bytes, or [payloads (a list or an Arrow array), labels]."""
    return (
        len(batch[0])
        if isinstance(batch, (list, tuple)) and not isinstance(batch[0], (bytes, bytearray))
        else len(batch)
    )


def time_epochs(loader: Loader, content: Content, setup: Setup, result: Result) -> None:
    """Two epochs on one loader with persistent workers; keeps the best figures."""
    data = loader.make(content, setup)
    try:
        for epoch in (1, 2):
            start = time.perf_counter()
            batches = iter(data)
            first = next(batches)
            first_at = time.perf_counter() - start
            samples = _batch_size(first)
            for batch in batches:
                samples += _batch_size(batch)
            elapsed = time.perf_counter() - start
            del batches
            if epoch == 1:
                result.first_1 = min(result.first_1, first_at)
            else:
                result.first_2 = min(result.first_2, first_at)
                result.rate = max(result.rate, samples / elapsed)
                result.samples = samples
    finally:
        _close(data)


def time_list_labels(loader: Loader, content: Content, setup: Setup, result: Result) -> None:
    """One epoch with labels collated to a list: samples/s after the first batch."""
    data = loader.make(content, Setup(setup.workers, setup.batch, persistent=False, labels="list"))
    batches = iter(data)
    samples = 0
    next(batches)
    start = time.perf_counter()
    for batch in batches:
        samples += _batch_size(batch)
    result.list_rate = max(result.list_rate, samples / (time.perf_counter() - start))
    del batches
    _close(data)


def _ids(batch: Any) -> list[int]:
    payloads = batch if isinstance(batch[0], (bytes, bytearray)) else batch[0]
    if hasattr(payloads, "to_pylist"):  # the columnar path's Arrow binary array
        payloads = payloads.to_pylist()
    return [sample_id(bytes(p)) for p in payloads]


def check_splits(loader: Loader, content: Content, workers: int, batch: int, result: Result) -> None:
    """Every id seen with 1 rank, then with 2 simulated ranks, non-persistent workers."""
    single = Counter()
    data = loader.make(content, Setup(workers, batch, persistent=False))
    for b in data:
        single.update(_ids(b))
    result.dup_1 = sum(single.values()) - len(single)
    result.missing_1 = content.total - len(single.keys() & range(content.total))

    seen: Counter[int] = Counter()
    batches = []
    saved = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    try:
        for rank in range(2):
            os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0")
            data = loader.make(content, Setup(workers, batch, persistent=False, rank=rank, world_size=2))
            count = 0
            for b in data:
                seen.update(_ids(b))
                count += 1
            batches.append(count)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    result.dup_2 = sum(seen.values()) - len(seen)
    result.missing_2 = content.total - len(seen.keys() & range(content.total))
    result.batches = tuple(batches)


def _memory_module() -> Any:
    """benchmarks/memory.py, and the ``_common`` it imports, by their paths: this folder is off
    ``sys.path`` (its tfrecord.py would shadow the tfrecord package)."""
    for name, file in (("_common", "_common.py"), ("_shardkit_bench_memory", "memory.py")):
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, file))
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            sys.modules[name] = module
            spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules["_shardkit_bench_memory"]


def measure_memory(
    entries: int, workers: int, methods: list[str], repeat: int
) -> list[tuple[str, float, float, float, float]]:
    """(method, list ratio, list extra MiB, ShardList ratio, ShardList extra MiB) per start method.

    The ShardList figure is the median of ``repeat`` runs (a few MiB of
    per-process noise is several percent of its data); the Python list, far
    from its bound, is run once.
    """
    import statistics

    memory = _memory_module()
    rows = []
    for method in methods:
        cells: list[float] = []
        for kind, runs in (("list", 1), ("shardlist", max(repeat, 1))):
            extras, data_bytes = [], 0
            for _ in range(runs):
                full = memory._run(kind, method, entries, workers)
                control = memory._run(kind, method, 0, workers)
                extras.append((full["pss_kib"] - control["pss_kib"]) * 1024)
                data_bytes = full["data_bytes"]
            extra = statistics.median(extras)
            cells += [extra / data_bytes, extra / 2**20]
        rows.append((method, *cells))
    return rows


# ---------------------------------------------------------------- report


def _dup_missing(dup: int, missing: int) -> str:
    return "-" if dup < 0 else f"{dup:,} / {missing:,}"


def _seconds(value: float) -> str:
    return "-" if value == float("inf") else f"{value:.2f} s"


def note_for(loader: Loader, result: Result, reference: Result, total: int) -> str:
    notes = []
    if result.error:
        return f"failed: {result.error}"
    if result.samples not in (-1, total):
        notes.append(f"epoch gave {result.samples:,} of {total:,} samples")
    if loader.name == "shardkit TFRecordDataset, raw bytes":
        notes.append("record bytes only, no Example decoding")
    if loader.name in ("shardkit TFRecordDataset, columns", "shardkit MixedLoader, columns"):
        notes.append("payloads as one Arrow binary array per batch")
    if result.dup_2 > 0 and loader.name.startswith("tfrecord"):
        notes.append("no rank support: every rank reads everything")
    if len(set(result.batches)) > 1:
        notes.append("ranks yield different batch counts: DDP hangs at the last collective")
    if not loader.shardkit and reference.rate and result.rate and reference.rate / result.rate < TARGET_SPEEDUP:
        notes.append(f"below the {TARGET_SPEEDUP}x target with tensor labels")
    return "; ".join(notes)


def print_table(results: dict[str, Result], total: int) -> list[str]:
    """Print the markdown table of ``results``; return its lines (what ``--chart`` draws)."""
    reference = results[REFERENCE]
    lines = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    for loader in LOADERS:
        r = results[loader.name]
        ratio = f"{reference.rate / r.rate:.2f}x" if r.rate and reference.rate else "-"
        list_ratio = f"{reference.list_rate / r.list_rate:.2f}x" if r.list_rate and reference.list_rate else "-"
        batches = " / ".join(f"{b:,}" for b in r.batches) or "-"
        lines.append(
            f"| {loader.name} | {r.rate:,.0f} | {ratio} | {r.list_rate:,.0f} | {list_ratio} | {_seconds(r.first_1)} | {_seconds(r.first_2)} "
            f"| {_dup_missing(r.dup_1, r.missing_1)} | {_dup_missing(r.dup_2, r.missing_2)} | {batches} "
            f"| {note_for(loader, r, reference, total)} |"
        )
    print("\n".join(lines))
    return lines


def write_chart(path: str, lines: list[str], args: argparse.Namespace) -> None:
    """The table as a bar chart (``benchmarks/charts.py``, matplotlib: the ``bench`` extra)."""
    spec = importlib.util.spec_from_file_location("_charts", os.path.join(_HERE, "charts.py"))
    charts = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["_charts"] = charts  # its dataclasses look their module up there
    spec.loader.exec_module(charts)  # type: ignore[union-attr]
    caption = (
        f"benchmarks/compare.py, this run: {args.shards} shards x {args.records} records, {args.workers} workers, "
        f"batch {args.batch}, best of {args.repeat}; load average at the end {_loadavg()}"
    )
    chart = charts.CHARTS[0]
    svg = charts.table_chart(
        lines, chart.columns, title=chart.title, xlabel=chart.xlabel, caption=caption, names=chart.names
    )
    charts.write_svg(path, svg)
    print(f"chart: {path}")


def _one_line(error: Exception) -> str:
    """The error's type and last message line (a worker's traceback is in the message)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:200].replace("|", "/")


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import datasets
    import tfrecord
    import webdataset

    versions = (
        f"shardkit {shardkit.__version__}, torch {torch.__version__}, tfrecord {getattr(tfrecord, '__version__', '1.14.6')}, "
        f"webdataset {webdataset.__version__}, datasets {datasets.__version__}"
    )
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()} {platform.release()}; {versions}"


def _source_state() -> str:
    """The commit measured, and any uncommitted changes to the library (others edit the checkout)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(shardkit.__file__)))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "shardkit"], cwd=root, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return f"shardkit source: {root} (not a git checkout)"
    changed = [line[3:] for line in dirty.stdout.splitlines()]
    return f"shardkit source: commit {head.stdout.strip()}" + (
        f" with uncommitted changes to {', '.join(changed)}" if changed else " (clean)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 8 x 128 records, 1 repeat, 50k-entry list, fork only"
    )
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--records", type=int, default=5000, help="records per shard")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="round-robin passes; the best of each loader is kept")
    parser.add_argument("--list-entries", type=int, default=1_000_000, help="shard urls in the memory row's list")
    parser.add_argument("--methods", default="fork,forkserver,spawn", help="start methods for the memory row")
    parser.add_argument("--memory-repeat", type=int, default=3, help="ShardList memory runs per start method (median)")
    parser.add_argument("--dir", help="where to write the content (default: a temporary directory, removed at the end)")
    parser.add_argument("--only", help="comma-separated substrings: run only the loaders whose name contains one")
    parser.add_argument(
        "--chart", metavar="OUT.svg", help="also draw the table's samples/s as a bar chart (matplotlib)"
    )
    args = parser.parse_args(argv)
    if args.chart and not os.path.isdir(os.path.dirname(os.path.abspath(args.chart))):
        parser.error(f"--chart {args.chart}: its folder does not exist")  # before minutes of measuring
    if args.quick:
        args.shards, args.records, args.repeat, args.list_entries, args.methods = 8, 128, 1, 50_000, "fork"
        args.memory_repeat = 1
    loaders = [
        entry for entry in LOADERS if not args.only or any(s.strip() in entry.name for s in args.only.split(","))
    ]
    if LOADERS[0] not in loaders:
        loaders.insert(0, LOADERS[0])

    root = args.dir or tempfile.mkdtemp(prefix="shardkit-compare-")
    os.makedirs(root, exist_ok=True)
    os.environ.setdefault("HF_HOME", os.path.join(root, "hf-home"))  # nothing of ours in ~/.cache
    began = time.perf_counter()
    try:
        print(f"machine: {_machine()}")
        print(_source_state())
        print(f"command: python benchmarks/compare.py {' '.join(sys.argv[1:] if argv is None else argv)}")
        print(f"load average at start: {_loadavg()}", flush=True)
        content = make_content(root, args.shards, args.records)
        size = sum(os.path.getsize(p) for p in content.tfrecord)
        print(
            f"content: {args.shards} shards x {args.records:,} records = {content.total:,} samples "
            f"({size / 2**20:,.0f} MiB of TFRecord), written in {time.perf_counter() - began:.1f} s; "
            f"{args.workers} workers, batch {args.batch}, best of {args.repeat}",
            flush=True,
        )

        results = {entry.name: Result() for entry in LOADERS}
        for _ in range(args.repeat):
            for loader in loaders:
                if results[loader.name].error:
                    continue
                print(f"  timing {loader.name}", file=sys.stderr, flush=True)
                try:
                    time_epochs(loader, content, Setup(args.workers, args.batch), results[loader.name])
                    time_list_labels(loader, content, Setup(args.workers, args.batch), results[loader.name])
                except Exception as error:  # report it in the table, keep measuring the others
                    results[loader.name].error = _one_line(error)
        print(f"load average after throughput: {_loadavg()}", flush=True)
        for loader in loaders:
            if not results[loader.name].error:
                print(f"  checking {loader.name}", file=sys.stderr, flush=True)
                try:
                    check_splits(loader, content, args.workers, args.batch, results[loader.name])
                except Exception as error:
                    results[loader.name].error = "correctness pass: " + _one_line(error)

        print()
        table = print_table({entry.name: results[entry.name] for entry in LOADERS}, content.total)
        if args.chart:
            write_chart(args.chart, table, args)
        print()
        reference = results[REFERENCE]
        others = [entry for entry in loaders if not entry.shardkit and results[entry.name].rate]
        if others and reference.rate:
            for what, rate in (("", "rate"), (", labels as list", "list_rate")):
                ratios = [
                    getattr(reference, rate) / getattr(results[entry.name], rate)
                    for entry in others
                    if getattr(results[entry.name], rate)
                ]
                if ratios:
                    slowest = min(ratios)
                    verdict = "met" if slowest >= TARGET_SPEEDUP else "NOT met"
                    print(
                        f"throughput target shardkit >= {TARGET_SPEEDUP}x each alternative{what}: {verdict} (lowest {slowest:.2f}x)"
                    )
            fastest = max(results[entry.name].rate for entry in others)
            for what, rate in (("", "rate"), (", labels as list", "list_rate")):
                mixed = getattr(results.get("shardkit MixedLoader, decoded"), rate, None)
                best = max(getattr(results[entry.name], rate) or 0 for entry in others)
                if mixed and best:
                    verdict = "met" if mixed >= FAST_PATH_TARGET * best else "NOT met"
                    print(
                        f"fast-path target MixedLoader decoded >= {FAST_PATH_TARGET}x the fastest alternative{what}: "
                        f"{verdict} ({mixed / best:.2f}x)"
                    )
            columns = results["shardkit MixedLoader, columns"].rate
            if columns:
                verdict = "met" if columns >= COLUMN_TARGET * fastest else "NOT met"
                print(
                    f"columnar target MixedLoader columns >= {COLUMN_TARGET}x the fastest alternative: {verdict} "
                    f"({columns:,.0f} vs {fastest:,.0f} samples/s, {columns / fastest:.2f}x)"
                )

        print(f"\nmemory: {args.list_entries:,} shard urls, parent + {args.workers} workers each reading every entry;")
        print("extra PSS over an empty-list control / the list's data size (extra MiB in brackets)\n")
        print(
            f"| start method | Python list (what the alternatives hold) | shardkit ShardList (median of {args.memory_repeat}) |"
        )
        print("|---|---|---|")
        worst = 0.0
        for method, list_ratio, list_mib, sl_ratio, sl_mib in measure_memory(
            args.list_entries, args.workers, args.methods.split(","), args.memory_repeat
        ):
            worst = max(worst, sl_ratio)
            print(f"| {method} | {list_ratio:.2f}x ({list_mib:,.0f} MiB) | {sl_ratio:.2f}x ({sl_mib:,.0f} MiB) |")
        caveat = (
            " (--quick: at this list size a few MiB of per-process noise is a large fraction of the data)"
            if args.quick
            else ""
        )
        print(
            f"memory target ShardList <= {TARGET_PSS}x: {'met' if worst <= TARGET_PSS else 'NOT met'} (worst {worst:.2f}x){caveat}"
        )
        print(f"\nload average at end: {_loadavg()}; total {time.perf_counter() - began:.0f} s")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
