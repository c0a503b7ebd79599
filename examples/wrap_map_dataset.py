"""Wrap a map-style dataset you already have, and split it over workers and ranks.

    python examples/wrap_map_dataset.py

A plain DataLoader over an IterableDataset gives every worker a full replica;
``shardkit.wrap`` makes each (rank, worker) read its own share of the indices,
exactly once (``balance="none"``) or padded so every rank gets the same count.
"""

from __future__ import annotations

import collections

import torch
from torch.utils.data import DataLoader, Dataset

import shardkit


class Squares(Dataset):
    """Any map-style dataset: __len__ and __getitem__."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, index * index])


def add_noise(sample: torch.Tensor) -> torch.Tensor:
    # Runs in the worker; torch is seeded per (seed, epoch, rank, worker).
    return sample.float() + 0.01 * torch.rand(2)


def main() -> None:
    n, world_size = 1000, 2
    seen: collections.Counter[int] = collections.Counter()
    for rank in range(world_size):  # simulated ranks; under torchrun they are detected
        dataset = shardkit.wrap(Squares(n), shuffle=True, seed=42, balance="pad", rank=rank, world_size=world_size)
        pipeline = dataset.map(add_noise)
        loader = DataLoader(pipeline, batch_size=64, num_workers=2)
        batches = list(loader)
        ids = [int(row[0]) for batch in batches for row in batch]
        seen.update(ids)
        print(f"rank {rank}: {len(dataset)} samples in {len(batches)} batches")
    print(f"distinct samples: {len(seen)} of {n}; repeated: {sum(seen.values()) - len(seen)}")
    assert len(seen) == n


if __name__ == "__main__":
    main()
