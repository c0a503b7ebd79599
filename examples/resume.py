"""Save the loader's position with the model checkpoint, and resume after preemption.

A small regression model trains on a shuffled dataset read by a MixedLoader
with two workers. Every few steps the model, the optimizer and the loader
state go into one checkpoint file (``torch.save``; the loader state is plain
data, JSON would do too). Training is then cut short mid-epoch, as a
preempted job would be, and a new process-like restart builds everything
afresh, loads the checkpoint and finishes the run, this time with three
workers: the rest of the epoch is exactly the samples not yet delivered.

Run: ``python examples/resume.py`` (a few seconds).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils.data import Dataset

import shardkit

EPOCHS = 2
SAVE_EVERY = 4
PREEMPT_AT_STEP = 10  # mid-epoch 0


class Points(Dataset):
    """``(index, x, y)`` with ``y = 3 x - 1`` plus noise: the index lets us count deliveries."""

    def __init__(self, size: int = 200) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.rand(size, 1, generator=generator)
        self.y = 3 * self.x - 1 + 0.01 * torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


def build(num_workers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, shardkit.MixedLoader]:
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = shardkit.wrap(Points(), shuffle=True, seed=42)
    loader = shardkit.MixedLoader(dataset, batch_size=16, num_workers=num_workers, seed=42)
    return model, optimizer, loader


def train(checkpoint: Path, num_workers: int, seen: list[Counter[int]], *, preempt: bool) -> None:
    """Train from the checkpoint if there is one; stop early when ``preempt``."""
    model, optimizer, loader = build(num_workers)
    start_epoch = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])  # also sets the loader's epoch
        start_epoch = saved["loader"]["epoch"]
        # What the lost steps delivered after the checkpoint is not kept: roll it back.
        for epoch, counts in enumerate(saved["seen"]):
            seen[epoch] = Counter(counts)
        print(f"resumed in epoch {start_epoch} after batch {saved['loader']['batch_index']}, {num_workers} workers")
    step = 0
    for epoch in range(start_epoch, EPOCHS):
        loader.set_epoch(epoch)
        for index, x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen[epoch].update(index.tolist())
            step += 1
            if step % SAVE_EVERY == 0:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict(),
                    "seen": [dict(c) for c in seen],
                }
                torch.save(state, checkpoint)
            if preempt and step == PREEMPT_AT_STEP:
                print(f"preempted at step {step}, epoch {epoch}")
                return
    print(f"done: loss {loss.item():.4f}, weight {model.weight.item():.2f}, bias {model.bias.item():.2f}")


def main() -> None:
    seen: list[Counter[int]] = [Counter() for _ in range(EPOCHS)]
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = Path(directory) / "checkpoint.pt"
        train(checkpoint, num_workers=2, seen=seen, preempt=True)
        train(checkpoint, num_workers=3, seen=seen, preempt=False)
    size = len(Points())
    for epoch, counts in enumerate(seen):
        assert sorted(counts) == list(range(size)) and set(counts.values()) == {1}, f"epoch {epoch}: {counts}"
    print(f"every sample of every epoch delivered exactly once ({EPOCHS} epochs of {size})")


if __name__ == "__main__":
    main()
