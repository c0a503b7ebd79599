"""Train with Hugging Face Accelerate on 2 CPU ranks, reading TFRecord shards with shardkit.

    torchrun --nproc_per_node=2 examples/accelerate_train.py
    python examples/accelerate_train.py       # one process works too

Pass only the model and the optimizer to ``accelerator.prepare``; iterate the
shardkit loader yourself and move each batch to ``accelerator.device``. Do not
pass ``DataLoader(shardkit_dataset)`` to ``prepare``: its default dispatcher
lets rank 0 alone read the loader (rank 0's share only) and hands slices of it
to every rank, and without dispatching its ``IterableDatasetShard`` splits
shardkit's already split stream again; either way data is lost, so shardkit
raises a ``ShardkitError`` naming this fix when it sees Accelerate's loader
drive it. (A :class:`shardkit.MixedLoader` given to ``prepare`` comes back
unchanged, so that is harmless, but it is not moved to the device either.)

Epochs need no ``set_epoch``: a shardkit dataset counts its passes. Every rank
gets the same number of batches (``balance="pad"``), so the gradient
all-reduce never waits for a rank that has run out.

``--record DIR`` writes the sample ids each rank trained on, per epoch, to
``DIR/rank{r}-epoch{e}.json`` (the tests check them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import send_to_device

import shardkit

RECORDS, SHARDS, BATCH_SIZE = 302, 4, 8


def write_dataset(root: str) -> None:
    """302 records (id, x, y = 3x - 1) in 4 TFRecord shards, with a manifest of record counts."""
    rng = np.random.default_rng(0)
    with shardkit.ShardWriter(f"{root}/train-%03d.tfrecord", max_records=-(-RECORDS // SHARDS)) as writer:
        for i, x in enumerate(rng.uniform(-1, 1, RECORDS)):
            writer.write(shardkit.encode_example({"id": [i], "x": [float(x)], "y": [3 * float(x) - 1]}))


def to_sample(example: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        "id": torch.from_numpy(example["id"])[0],
        "x": torch.from_numpy(example["x"]).float(),
        "y": torch.from_numpy(example["y"]).float(),
    }


def shared_temp_dir(accelerator: Accelerator) -> str:
    """A temp dir made by rank 0 and known to every rank, with the data written in it."""
    root = [tempfile.mkdtemp(prefix="shardkit-accelerate-") if accelerator.is_main_process else None]
    if dist.is_initialized():
        dist.broadcast_object_list(root)
    if accelerator.is_main_process:
        write_dataset(root[0])
    accelerator.wait_for_everyone()
    return root[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--record", help="write each rank's sample ids per epoch here")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    root = shared_temp_dir(accelerator)

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the loader: shardkit splits itself
    shards = shardkit.ShardList.from_manifest(f"{root}/train.manifest.arrow")
    dataset = shardkit.TFRecordDataset(shards, shuffle=True, balance="pad").map(to_sample).shuffle(64)
    loader = shardkit.MixedLoader(dataset, batch_size=BATCH_SIZE, num_workers=2, persistent_workers=True)

    for epoch in range(args.epochs):
        seen: list[int] = []
        batches = 0
        for batch in loader:
            batch = send_to_device(batch, accelerator.device)
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            seen += batch["id"].tolist()
            batches += 1
        if args.record:
            path = Path(args.record) / f"rank{accelerator.process_index}-epoch{epoch}.json"
            path.write_text(json.dumps({"ids": seen, "batches": batches}))
        if accelerator.is_main_process:
            print(f"epoch {epoch}: rank 0 trained on {len(seen)} samples in {batches} batches")
    weight, bias = (p.item() for p in accelerator.unwrap_model(model).parameters())
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print(f"learned y = {weight:.2f} x {bias:+.2f} (true: y = 3.00 x -1.00)")
        shutil.rmtree(root, ignore_errors=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
