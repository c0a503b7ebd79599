"""Train with PyTorch Lightning on 2 CPU ranks (DDP, gloo), reading TFRecord shards with shardkit.

    python examples/lightning_train.py                    # Lightning starts both ranks itself
    python examples/lightning_train.py --loader dataloader

The ``LightningModule``'s ``train_dataloader`` returns a shardkit loader over a
``TFRecordDataset``. Nothing else is needed:

* each rank reads its own part (the dataset splits itself over ranks and
  DataLoader workers when iteration starts; Lightning adds no sampler to an
  IterableDataset), ``balance="pad"`` gives every rank the same number of
  batches;
* every epoch has a new order although Lightning never calls the dataset's
  ``set_epoch``: a shardkit dataset counts its passes (pass ``k`` reads
  epoch ``k``);
* ``--loader mixed`` (default): :class:`shardkit.MixedLoader`, whose
  ``len()`` is exact, so Lightning's progress and epoch end are right.
  ``--loader dataloader``: a plain ``DataLoader(batch_size=8, num_workers=2)``.
  Its ``ceil(samples / batch_size)`` length would be one batch short (each
  worker ends with its own partial batch), so shardkit gives it no ``len()``
  and Lightning runs it to exhaustion: nothing is lost.

Build the dataset once (here in ``setup``), not inside ``train_dataloader``:
its pass counter then survives a loader rebuilt every epoch (``--reload``,
Lightning's ``reload_dataloaders_every_n_epochs=1``); a dataset built anew
each epoch would start again from epoch 0 (or call its ``set_epoch(self.current_epoch)``).

``--record DIR`` writes the sample ids each rank trained on, per epoch, to
``DIR/rank{r}-epoch{e}.json`` (the tests check them).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

import shardkit

# Lightning warns that an IterableDataset's `__len__` "could be inaccurate ... duplicate data" for every
# loader over one that has a length. Here each worker reads its own ranges of the plan (no duplicates)
# and MixedLoader's len() is its exact batch count, so the warning does not apply.
warnings.filterwarnings("ignore", message=r".*`__len__` could be inaccurate")

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


class Regression(L.LightningModule):
    def __init__(self, root: str, loader: str, record: str | None) -> None:
        super().__init__()
        self.root, self.loader, self.record = root, loader, record
        self.model = torch.nn.Linear(1, 1)
        self.seen: list[int] = []
        self.batches = 0

    def setup(self, stage: str) -> None:
        # Built once: the dataset counts its passes, so a loader rebuilt every
        # epoch (reload_dataloaders_every_n_epochs) still gets a new order.
        shards = shardkit.ShardList.from_manifest(f"{self.root}/train.manifest.arrow")
        self.dataset = shardkit.TFRecordDataset(shards, shuffle=True, balance="pad").map(to_sample).shuffle(64)

    def train_dataloader(self) -> Any:
        dataset = self.dataset
        if self.loader == "mixed":
            return shardkit.MixedLoader(dataset, batch_size=BATCH_SIZE, num_workers=2, persistent_workers=True)
        return DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=2, persistent_workers=True)

    def training_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> torch.Tensor:
        self.seen += batch["id"].tolist()
        self.batches += 1
        return torch.nn.functional.mse_loss(self.model(batch["x"]), batch["y"])

    def on_train_epoch_end(self) -> None:
        if self.record:
            path = Path(self.record) / f"rank{self.global_rank}-epoch{self.current_epoch}.json"
            path.write_text(json.dumps({"ids": self.seen, "batches": self.batches}))
        if self.global_rank == 0:
            print(f"epoch {self.current_epoch}: rank 0 trained on {len(self.seen)} samples in {self.batches} batches")
        self.seen, self.batches = [], 0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loader", choices=("mixed", "dataloader"), default="mixed")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--record", help="write each rank's sample ids per epoch here")
    parser.add_argument("--reload", action="store_true", help="rebuild the loader every epoch")
    args = parser.parse_args()
    # Lightning re-runs this script for rank 1 with the environment of rank 0,
    # which writes the data first (before fit() starts the other rank).
    if "SHARDKIT_EXAMPLE_DATA" not in os.environ:
        os.environ["SHARDKIT_EXAMPLE_DATA"] = tempfile.mkdtemp(prefix="shardkit-lightning-")
        write_dataset(os.environ["SHARDKIT_EXAMPLE_DATA"])
    root = os.environ["SHARDKIT_EXAMPLE_DATA"]
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        reload_dataloaders_every_n_epochs=int(args.reload),
    )
    module = Regression(root, args.loader, args.record)
    trainer.fit(module)
    weight, bias = (p.item() for p in module.model.parameters())
    if trainer.global_rank == 0:
        print(f"learned y = {weight:.2f} x {bias:+.2f} (true: y = 3.00 x -1.00)")
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
