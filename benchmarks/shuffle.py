"""Shuffle quality against read throughput, for shardkit and the alternatives.

One content (``benchmarks/compare.py``'s: ``--shards`` x ``--records`` records
of about 1 KB, each carrying its global id, as TFRecord, WebDataset tar and
Parquet) is read by each loader through a DataLoader with ``--workers``
workers. The ids in the order the loader yields them are the storage
positions that :func:`shardkit.quality.shuffle_quality` scores:

* adjacent: the fraction of neighbouring output pairs that were neighbours in
  storage (file order 1.0, a uniform permutation about 2/n);
* entropy: the entropy of the jumps between neighbours relative to a uniform
  permutation's (1.0 is as good as a uniform shuffle).

Throughput is samples/s of a whole epoch, best of ``--repeat`` interleaved
rounds, and ``vs no shuffle`` divides it by the same loader without
shuffling (shardkit's target: >= 0.8x with the default ``shuffle=True``, while
at most 1% adjacent and entropy >= 0.9). ``shuffle_window=0`` is the
shard-and-block shuffle that ``shuffle=True`` was before sample-level shuffling.

    python benchmarks/shuffle.py [--quick] [--shards 32] [--records 4096] [--buffer 1000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("_compare", os.path.join(_HERE, "compare.py"))
compare = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["_compare"] = compare
_spec.loader.exec_module(compare)  # type: ignore[union-attr]

import shardkit  # noqa: E402
from shardkit.planning import SHUFFLE_BLOCK, SHUFFLE_WINDOW  # noqa: E402
from shardkit.quality import shuffle_quality  # noqa: E402

Make = Callable[[Any, "Options"], Iterable[Any]]


@dataclass
class Options:
    workers: int
    batch: int
    buffer: int
    shuffle: bool = True
    window: int = SHUFFLE_WINDOW
    block: int = SHUFFLE_BLOCK


def _ids_of(batch: Any) -> list[int]:
    return [compare.sample_id(payload) for payload in batch[0]]


def shardkit_loader(content: Any, opts: Options, *, buffer: bool, window: int | None = None) -> Iterable[Any]:
    source = shardkit.TFRecordDataset(content.tfrecord, decode="example", shuffle=opts.shuffle)
    source.shuffle_window = opts.window if window is None else window
    source.shuffle_block = opts.block
    dataset = source.map(compare._example_pair)
    if buffer and opts.shuffle:
        dataset = dataset.shuffle(opts.buffer)
    return compare._dataloader(dataset, compare.Setup(opts.workers, opts.batch))


def webdataset_loader(content: Any, opts: Options) -> Iterable[Any]:
    import webdataset as wds

    dataset = wds.WebDataset(
        content.tar, shardshuffle=100 if opts.shuffle else False, workersplitter=wds.split_by_worker
    )
    if opts.shuffle:
        dataset = dataset.shuffle(opts.buffer)
    dataset = dataset.to_tuple("payload.bin", "cls").map_tuple(bytes, int)
    return compare._dataloader(dataset, compare.Setup(opts.workers, opts.batch))


def hf_loader(content: Any, opts: Options) -> Iterable[Any]:
    from datasets import load_dataset

    dataset = load_dataset("parquet", data_files=content.parquet, split="train", streaming=True)
    if opts.shuffle:
        dataset = dataset.shuffle(seed=0, buffer_size=opts.buffer)
    return compare._dataloader(dataset, compare.Setup(opts.workers, opts.batch), collate_fn=compare._hf_collate)


def loaders(buffer: int) -> dict[str, Make]:
    return {
        "shardkit shuffle=True (default: sample-level)": lambda c, o: shardkit_loader(c, o, buffer=False),
        "shardkit shuffle=True, shuffle_window=0 (shards and blocks only)": lambda c, o: shardkit_loader(
            c, o, buffer=False, window=0
        ),
        f"shardkit shuffle=True + .shuffle({buffer})": lambda c, o: shardkit_loader(c, o, buffer=True),
        f"webdataset shardshuffle + .shuffle({buffer})": webdataset_loader,
        f"HF datasets streaming .shuffle(buffer_size={buffer})": hf_loader,
    }


def one_epoch(make: Make, content: Any, opts: Options) -> tuple[list[int], float]:
    loader = make(content, opts)
    start = time.perf_counter()
    order = [i for batch in loader for i in _ids_of(batch)]
    seconds = time.perf_counter() - start
    compare._close(loader)
    return order, seconds


def measure(content: Any, opts: Options, repeat: int, only: str = "") -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    chosen = {name: make for name, make in loaders(opts.buffer).items() if only in name}
    for _ in range(repeat):  # interleaved rounds: load on the machine hurts every loader alike
        for name, make in chosen.items():
            for shuffled in (True, False):
                options = Options(opts.workers, opts.batch, opts.buffer, shuffled, opts.window, opts.block)
                order, seconds = one_epoch(make, content, options)
                row = results.setdefault(name, {"times": {True: [], False: []}})
                row["times"][shuffled].append(seconds)
                if shuffled:
                    row["order"] = order
    return results


def print_table(results: dict[str, dict[str, Any]], total: int) -> None:
    print("| loader | adjacent in storage | entropy vs uniform | samples/s | vs no shuffle | missing / dup |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    uniform = shuffle_quality(np.random.default_rng(0).permutation(total))
    print(
        f"| uniform permutation (reference) | {uniform.adjacent_fraction:.2%} | {uniform.difference_entropy:.3f} | | | |"
    )
    for name, row in results.items():
        quality = shuffle_quality(row["order"])
        rate, plain = total / min(row["times"][True]), total / min(row["times"][False])
        seen = set(row["order"])
        missing, dup = total - len(seen), len(row["order"]) - len(seen)
        print(
            f"| {name} | {quality.adjacent_fraction:.2%} | {quality.difference_entropy:.3f} | "
            f"{rate:,.0f} | {rate / plain:.2f}x | {missing} / {dup} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 x 250 records, one round: a smoke run")
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--records", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--buffer", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--window", type=int, default=SHUFFLE_WINDOW, help="shardkit's shuffle_window")
    parser.add_argument("--block", type=int, default=SHUFFLE_BLOCK, help="shardkit's shuffle_block")
    parser.add_argument("--only", default="", help="only the loaders whose name contains this (e.g. shardkit)")
    args = parser.parse_args(argv)
    if args.quick:
        args.shards, args.records, args.repeat = 8, 250, 1
    with tempfile.TemporaryDirectory(prefix="shardkit-shuffle-") as root:
        content = compare.make_content(root, args.shards, args.records)
        opts = Options(args.workers, args.batch, args.buffer, True, args.window, args.block)
        results = measure(content, opts, args.repeat, args.only)
    print(
        f"{args.shards} shards x {args.records} records, {args.workers} workers, batch {args.batch}, "
        f"shardkit shuffle_window {args.window}, shuffle_block {args.block}, "
        f"best of {args.repeat} interleaved rounds; {compare._machine()}"
    )
    print_table(results, args.shards * args.records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
