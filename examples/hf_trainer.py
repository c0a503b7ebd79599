"""Train with the Hugging Face ``Trainer`` on 2 CPU ranks, reading TFRecord shards with shardkit.

    torchrun --nproc_per_node=2 examples/hf_trainer.py

``Trainer(train_dataset=shardkit_dataset)`` would hand the dataset to
Accelerate's loader wrappers, which lose half the data on two ranks (rank 0
alone reads, or the stream is split twice); shardkit raises a
``ShardkitError`` naming the fix when it sees that. The fix is the small
subclass below: ``get_train_dataloader`` returns the shardkit loader itself.
Trainer then still

* moves every batch to the device (``_prepare_inputs``),
* calls the loader's ``set_epoch`` each epoch (a plain ``DataLoader`` has
  none, and the dataset counts its passes instead),
* plans ``num_train_epochs`` from ``len(loader)``, which
  :class:`shardkit.MixedLoader` reports exactly (a plain DataLoader with
  several workers has no ``len()``: set ``max_steps`` then).

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
from transformers import Trainer, TrainerCallback, TrainingArguments

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
        "labels": torch.from_numpy(example["y"]).float(),
    }


class Regression(torch.nn.Module):
    """A model in Trainer's terms: keyword inputs in, a dict with ``loss`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor, id: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}


class ShardkitTrainer(Trainer):
    """A Trainer that iterates a shardkit loader as it is (shardkit splits over ranks itself)."""

    def __init__(self, *args: Any, train_loader: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.train_loader = train_loader
        self.seen: list[int] = []
        self.batches = 0

    def get_train_dataloader(self) -> Any:
        return self.train_loader

    def compute_loss(self, model: Any, inputs: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        self.seen += inputs["id"].tolist()
        self.batches += 1
        return super().compute_loss(model, inputs, *args, **kwargs)


class RecordIds(TrainerCallback):
    """Writes (and prints) what each rank trained on at the end of every epoch."""

    def __init__(self, record: str | None) -> None:
        self.record = record
        self.trainer: ShardkitTrainer | None = None
        self.epoch = 0

    def on_epoch_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        assert trainer is not None
        if self.record:
            path = Path(self.record) / f"rank{args.process_index}-epoch{self.epoch}.json"
            path.write_text(json.dumps({"ids": trainer.seen, "batches": trainer.batches}))
        if args.process_index == 0:
            print(f"epoch {self.epoch}: rank 0 trained on {len(trainer.seen)} samples in {trainer.batches} batches")
        trainer.seen, trainer.batches, self.epoch = [], 0, self.epoch + 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--record", help="write each rank's sample ids per epoch here")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="shardkit-hf-")
    training = TrainingArguments(
        output_dir=work,
        num_train_epochs=args.epochs,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )  # sets up torch.distributed under torchrun
    root = [work]
    if dist.is_initialized():
        dist.broadcast_object_list(root)  # rank 0's dir holds the data
    if training.process_index == 0:
        write_dataset(root[0])
    if dist.is_initialized():
        dist.barrier()

    shards = shardkit.ShardList.from_manifest(f"{root[0]}/train.manifest.arrow")
    dataset = shardkit.TFRecordDataset(shards, shuffle=True, balance="pad").map(to_sample).shuffle(64)
    loader = shardkit.MixedLoader(dataset, batch_size=BATCH_SIZE, num_workers=2, persistent_workers=True)
    torch.manual_seed(0)
    model = Regression()
    callback = RecordIds(args.record)
    trainer = ShardkitTrainer(model=model, args=training, train_loader=loader, callbacks=[callback])
    callback.trainer = trainer
    trainer.train()
    weight, bias = (p.item() for p in model.linear.parameters())
    if training.process_index == 0:
        print(f"learned y = {weight:.2f} x {bias:+.2f} (true: y = 3.00 x -1.00)")
    if dist.is_initialized():
        dist.barrier()
    shutil.rmtree(work, ignore_errors=True)
    if training.process_index == 0:
        shutil.rmtree(root[0], ignore_errors=True)


if __name__ == "__main__":
    main()
