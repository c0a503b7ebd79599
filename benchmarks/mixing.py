"""Throughput of shardkit.MixedLoader against a plain DataLoader on the same dataset.

Small samples (a Python int; a 1 KB record with an int label, as
``benchmarks/compare.py`` reads them) and large samples (a 3x224x224 uint8
tensor), 2 workers. The datasets do no work of their own, so most rows measure loader
overhead alone, the case least favourable to MixedLoader; the "random pixels"
row adds per-sample work of the order of decoding a small image. Each row is
timed ``--repeats`` times after a warm-up epoch (persistent workers, so no
start-up), the two loaders taking turns; the median epoch counts, and the
ratio is the median of the rounds' ratios.

MixedLoader copies each batch once in the main process while joining the
workers' micro-batches; that copy is where the first touch of the
shared-memory pages happens. A plain DataLoader leaves that first touch to
the training step, so the "pages read" row has the loop read one byte of each
4 KiB page of every batch, as any use of the batch (a copy to the GPU) must.

    python benchmarks/mixing.py            # full run
    python benchmarks/mixing.py --quick    # a few seconds, for CI
    python benchmarks/mixing.py --pin-memory   # both loaders pin their batches (on a GPU machine)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from shardkit import MixedLoader

WORKERS = 2


class IntStream(IterableDataset):
    """``samples`` ints split evenly over the workers."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(worker, self.samples, workers))


class ImageStream(IterableDataset):
    """``samples`` 3x224x224 uint8 tensors split evenly over the workers: one
    tensor yielded again and again, or with ``random_pixels`` a new one per
    sample (about 0.7 ms, the order of decoding a small JPEG)."""

    def __init__(self, samples: int, *, random_pixels: bool = False) -> None:
        self.samples = samples
        self.random_pixels = random_pixels

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        image = torch.full((3, 224, 224), worker, dtype=torch.uint8)
        pixels = torch.Generator().manual_seed(worker)
        for _ in range(worker, self.samples, workers):
            if self.random_pixels:
                image = torch.randint(0, 256, (3, 224, 224), dtype=torch.uint8, generator=pixels)
            yield image


class RecordStream(IterableDataset):
    """``samples`` (1,000-byte payload, int label) pairs split evenly over the workers."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __iter__(self) -> Iterator[tuple[bytes, int]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        payload = bytes(1000)
        return ((payload, index) for index in range(worker, self.samples, workers))


def read_pages(batch: torch.Tensor) -> None:
    """What any use of a batch costs at least: touching each of its pages once."""
    batch.view(-1)[::4096].sum()


@dataclass(frozen=True)
class Case:
    name: str
    dataset: IterableDataset
    samples: int
    batch_size: int
    consume: Callable[[Any], None] | None = None


def epoch_seconds(loader: Iterable[Any], consume: Callable[[Any], None] | None) -> float:
    start = time.perf_counter()
    for batch in loader:
        if consume is not None:
            consume(batch)
    return time.perf_counter() - start


def compare(case: Case, repeats: int, *, pin_memory: bool = False) -> tuple[dict[str, float], float]:
    """Median samples/s per loader over ``repeats`` epochs after a warm-up
    epoch, the loaders taking turns so that load from other processes hits
    both, and the median of the rounds' MixedLoader / DataLoader ratios."""
    common: dict[str, Any] = {"num_workers": WORKERS, "persistent_workers": True, "pin_memory": pin_memory}
    loaders: dict[str, Iterable[Any]] = {
        "DataLoader": DataLoader(case.dataset, batch_size=case.batch_size, **common),
        "MixedLoader": MixedLoader(case.dataset, case.batch_size, **common),
    }
    seconds: dict[str, list[float]] = {name: [] for name in loaders}
    for round_ in range(repeats + 1):
        for name, loader in loaders.items():
            taken = epoch_seconds(loader, case.consume)
            if round_:
                seconds[name].append(taken)
    ratios = [dl / mixed for dl, mixed in zip(seconds["DataLoader"], seconds["MixedLoader"])]
    rates = {name: case.samples / statistics.median(times) for name, times in seconds.items()}
    return rates, statistics.median(ratios)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small epochs, one repeat")
    parser.add_argument("--repeats", type=int, default=None, help="timed epochs per loader")
    parser.add_argument("--pin-memory", action="store_true", help="pin_memory=True on both loaders (needs a GPU)")
    args = parser.parse_args(argv)
    scale = 1 if args.quick else 8
    repeats = args.repeats or (1 if args.quick else 5)
    cases = [
        Case("int, batch 256", IntStream(50_000 * scale), 50_000 * scale, 256),
        Case("1 KB record + label, batch 64", RecordStream(20_000 * scale), 20_000 * scale, 64),
        Case("3x224x224 uint8, batch 32", ImageStream(1_000 * scale), 1_000 * scale, 32),
        Case("  ... pages read", ImageStream(1_000 * scale), 1_000 * scale, 32, read_pages),
        Case(
            "  ... random pixels",
            ImageStream(1_000 * scale, random_pixels=True),
            1_000 * scale,
            32,
        ),
    ]
    pinned = ", pin_memory=True" if args.pin_memory else ""
    print(f"{WORKERS} workers{pinned}, median of {repeats} interleaved epoch(s), samples/s")
    print(f"{'case':<32}{'DataLoader':>12}{'MixedLoader':>13}{'ratio':>8}")
    for case in cases:
        rates, ratio = compare(case, repeats, pin_memory=args.pin_memory)
        print(f"{case.name:<32}{rates['DataLoader']:>12,.0f}{rates['MixedLoader']:>13,.0f}{ratio:>8.2f}")


if __name__ == "__main__":
    main()
