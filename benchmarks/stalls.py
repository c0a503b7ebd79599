"""What stall accounting costs: MixedLoader throughput with it and without it, on the quickstart path.

The quickstart's pipeline (``TFRecordDataset(shuffle=True).map(to_tensors).shuffle(256)``,
small tf.Examples, ``MixedLoader(batch_size=64, num_workers=2, persistent_workers=True)``)
read by two loaders built alike. The one without accounting has workers that run
the untimed micro-batch loop (``Untimed`` below, the loop as it was before
accounting) and is iterated through its epoch's mixer directly, past the
per-step clock. Epochs alternate between the two loaders; the median epoch of
each counts, and the cost is one minus the median of the rounds' ratios.

It also times what a sampled micro-batch adds: a timing proxy per stage per sample
(:mod:`shardkit.loader.timing`), paid in one micro-batch of ``SAMPLE_EVERY``.

    python benchmarks/stalls.py            # full run
    python benchmarks/stalls.py --quick    # a few seconds, for CI
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterator
from itertools import islice
from typing import Any

import numpy as np
import torch

import shardkit
from shardkit.loader.micro_batches import START, MicroBatches, StateSaver
from shardkit.loader.slabs import SlabRing
from shardkit.loader.timing import SAMPLE_EVERY, _Timed


def to_tensors(example: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"x": torch.from_numpy(example["x"]), "label": torch.from_numpy(example["label"])}


class Untimed(MicroBatches):
    """The workers' loop without any clock (figures None), for comparison."""

    def _messages(self, worker: int, states: Any) -> Iterator[Any]:
        if states is not None:
            self.dataset.load_state_dict(states[worker])  # type: ignore[attr-defined]
        samples = iter(self.dataset)
        saver = StateSaver(self.dataset, self.resumable)
        ring = SlabRing(self.slots) if self.collate and self.slots else None
        yield worker, START, None if ring is None else ring.flags, saver(), None
        while chunk := list(islice(samples, self.size)):
            payload = (
                chunk if not self.collate else ring.collate(chunk) if ring else torch.utils.data.default_collate(chunk)
            )
            yield worker, len(chunk), payload, saver(), None
        yield worker, 0, None, saver(), None


def write(root: str, records: int) -> shardkit.ShardList:
    rng = np.random.default_rng(0)
    with shardkit.ShardWriter(f"{root}/train-%05d.tfrecord", max_records=records // 8) as writer:
        for i in range(records):
            writer.write(shardkit.encode_example({"x": rng.normal(size=4), "label": [i % 10]}))
    return shardkit.ShardList.from_manifest(writer.manifest)


def loader(shards: shardkit.ShardList, timed: bool, resumable: bool) -> shardkit.MixedLoader:
    pipeline = shardkit.TFRecordDataset(shards, shuffle=True, seed=0, balance="pad").map(to_tensors).shuffle(256)
    built = shardkit.MixedLoader(pipeline, batch_size=64, num_workers=2, persistent_workers=True, resumable=resumable)
    if not timed:
        assert built._micro_batches is not None
        built._micro_batches.__class__ = Untimed
    return built


def epoch(built: shardkit.MixedLoader, timed: bool) -> float:
    """Seconds for one epoch; untimed, through the mixer, past the per-step clock."""
    start = time.perf_counter()
    batches = iter(built) if timed else built._start_epoch()
    samples = sum(len(batch["label"]) for batch in batches)
    return samples / (time.perf_counter() - start)


def proxy_ns(items: int = 300_000) -> float:
    """Nanoseconds a timing proxy adds to one ``next``."""
    start = time.perf_counter()
    for _ in iter(range(items)):
        pass
    plain = time.perf_counter() - start
    start = time.perf_counter()
    for _ in _Timed(iter(range(items))):
        pass
    return (time.perf_counter() - start - plain) / items * 1e9


def compare(shards: shardkit.ShardList, rounds: int, resumable: bool) -> tuple[dict[bool, list[float]], Any]:
    """Each loader's epochs per second, interleaved; and the timed loader's stats."""
    loaders = {timed: loader(shards, timed, resumable) for timed in (True, False)}
    for timed, built in loaders.items():  # warm-up: starts the persistent workers
        epoch(built, timed)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(rounds):
        for timed in (True, False) if round_ % 2 == 0 else (False, True):
            rates[timed].append(epoch(loaders[timed], timed))
    return rates, loaders[True].stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run whose numbers are not meant to be quoted")
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    records, rounds = (2_000, 2) if args.quick else (args.records, args.rounds)
    print(f"quickstart path, {records:,} records, {rounds} interleaved rounds, 2 workers, batch 64")
    print("| case | accounting off, samples/s | on, samples/s | cost | slowest stage |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        shards = write(root, records)
        for resumable in (True, False):
            rates, stats = compare(shards, rounds, resumable)
            cost = 1 - statistics.median(on / off for on, off in zip(rates[True], rates[False]))
            slowest = stats.slowest_stage[0] if stats.slowest_stage else "-"
            print(
                f"| resumable={resumable} | {statistics.median(rates[False]):,.0f} | "
                f"{statistics.median(rates[True]):,.0f} | {cost:+.2%} | {slowest} |"
            )
    print("cost: 1 - the median of the rounds' on/off ratios (negative: within noise)")
    print(f"a timing proxy adds {proxy_ns():.0f} ns per sample per stage, in one micro-batch of {SAMPLE_EVERY}")


if __name__ == "__main__":
    main()
