"""Train with PyTorch Lightning on 2 CPU ranks (DDP, gloo), reading TFRecord shards with shardkit.

    python examples/lightning_train.py                    # Lightning starts both ranks itself
    python examples/lightning_train.py --loader dataloader
    python examples/lightning_train.py --checkpoint-every 8 --checkpoints ckpts --kill-at 30
    python examples/lightning_train.py --resume ckpts/step=24.ckpt

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
  ``--loader stateful``: :class:`shardkit.StatefulDataLoader` (torchdata's, with
  an exact ``len()``). ``--loader torchdata``: torchdata's own
  ``StatefulDataLoader``, which saves the calling rank's state alone: Lightning
  writes rank 0's, so a resume is refused on rank 1 with the fix (import
  shardkit's instead).

Resuming from Lightning's own checkpoints needs no code either:
``ModelCheckpoint(every_n_train_steps=k, save_on_train_epoch_end=False)`` and
``trainer.fit(model, ckpt_path=...)``. Lightning saves the train loader's
``state_dict()`` in the checkpoint (written by rank 0); the shardkit loaders
put every rank's state in it, so each rank resumes exactly where it was: the
remaining samples of the epoch, in the batches the uninterrupted run would
have made, with nothing read again. Their ``len()`` is exact, so Lightning
fetches no batch ahead of the one a checkpoint is saved after.
``--checkpoint-every K --checkpoints DIR`` saves every K steps;
``--kill-at STEP`` ends both ranks with SIGKILL after that global step (a
crash); ``--resume CKPT`` resumes from a checkpoint in a fresh launch.

Build the dataset once (here in ``setup``), not inside ``train_dataloader``:
its pass counter then survives a loader rebuilt every epoch (``--reload``,
Lightning's ``reload_dataloaders_every_n_epochs=1``); a dataset built anew
each epoch would start again from epoch 0 (or call its ``set_epoch(self.current_epoch)``).

``--max-steps N --save CKPT`` stops ``fit`` after N steps and then saves
``trainer.save_checkpoint(CKPT)``: the loader's position when ``fit`` ended,
which ``--resume CKPT --epochs -1 --max-steps M`` goes on from. (Lightning
loads a loader's state from such a checkpoint only in iteration-based
training: with ``max_epochs`` it counts the epoch ``fit`` ended in as
finished and starts the next without loading it.)

``--record DIR`` writes the sample ids each rank trained on, per epoch, to
``DIR/rank{r}-epoch{e}.json`` (the tests check them): ``ids`` in order,
``steps`` and ``sizes`` (the global step and size of each batch) and
``batches``; and every sample
the pipeline makes (in the workers, before shuffling and batching) as
``epoch id`` lines to ``DIR/made-rank{r}-{pid}.txt``, which shows that a
resumed run makes no sample again that was trained on before the checkpoint.
``--data DIR`` reads (or first writes) the data there and keeps it, so
several launches share it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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


def write_dataset(root: str, records: int = RECORDS) -> None:
    """``records`` records (id, x, y = 3x - 1) in 4 TFRecord shards, with a manifest of record counts."""
    rng = np.random.default_rng(0)
    with shardkit.ShardWriter(f"{root}/train-%03d.tfrecord", max_records=-(-records // SHARDS)) as writer:
        for i, x in enumerate(rng.uniform(-1, 1, records)):
            writer.write(shardkit.encode_example({"id": [i], "x": [float(x)], "y": [3 * float(x) - 1]}))


def to_sample(example: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        "id": torch.from_numpy(example["id"])[0],
        "x": torch.from_numpy(example["x"]).float(),
        "y": torch.from_numpy(example["y"]).float(),
    }


class RecordedSample:
    """``to_sample`` that also appends ``epoch id`` of every sample it makes to a file per process."""

    def __init__(self, source: shardkit.TFRecordDataset, folder: str) -> None:
        self.source, self.folder = source, folder

    def __call__(self, example: dict[str, Any]) -> dict[str, torch.Tensor]:
        sample = to_sample(example)
        path = Path(self.folder) / f"made-rank{self.source.topology().rank}-{os.getpid()}.txt"
        with path.open("a") as file:
            file.write(f"{self.source.epoch} {int(sample['id'])}\n")
        return sample


class Regression(L.LightningModule):
    def __init__(self, root: str, loader: str, record: str | None, kill_at: int | None = None) -> None:
        super().__init__()
        self.root, self.loader, self.record, self.kill_at = root, loader, record, kill_at
        self.model = torch.nn.Linear(1, 1)
        self.seen: list[int] = []
        self.steps: list[int] = []
        self.sizes: list[int] = []
        self.batches = 0

    def setup(self, stage: str) -> None:
        # Built once: the dataset counts its passes, so a loader rebuilt every
        # epoch (reload_dataloaders_every_n_epochs) still gets a new order.
        shards = shardkit.ShardList.from_manifest(f"{self.root}/train.manifest.arrow")
        source = shardkit.TFRecordDataset(shards, shuffle=True, balance="pad")
        self.dataset = source.map(RecordedSample(source, self.record) if self.record else to_sample).shuffle(64)

    def train_dataloader(self) -> Any:
        dataset = self.dataset
        if self.loader == "mixed":
            return shardkit.MixedLoader(dataset, batch_size=BATCH_SIZE, num_workers=2, persistent_workers=True)
        if self.loader == "stateful":
            return shardkit.StatefulDataLoader(dataset, batch_size=BATCH_SIZE, num_workers=2, persistent_workers=True)
        if self.loader == "torchdata":
            from torchdata.stateful_dataloader import StatefulDataLoader as TorchdataLoader

            return TorchdataLoader(dataset, batch_size=BATCH_SIZE, num_workers=2, persistent_workers=True)
        return DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=2, persistent_workers=True)

    def training_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> torch.Tensor:
        self.seen += batch["id"].tolist()
        self.steps.append(self.global_step + 1)  # the global step this batch completes
        self.sizes.append(len(batch["id"]))
        self.batches += 1
        return torch.nn.functional.mse_loss(self.model(batch["x"]), batch["y"])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_index: int) -> None:
        if self.kill_at is not None and self.global_step == self.kill_at:
            self.write_record()
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no clean-up, no checkpoint

    def on_train_epoch_end(self) -> None:
        self.write_record()
        if self.global_rank == 0:
            print(f"epoch {self.current_epoch}: rank 0 trained on {len(self.seen)} samples in {self.batches} batches")
        self.seen, self.steps, self.sizes, self.batches = [], [], [], 0

    def write_record(self) -> None:
        if self.record and self.batches:  # not again after the epoch's end wrote (and cleared) it
            path = Path(self.record) / f"rank{self.global_rank}-epoch{self.current_epoch}.json"
            record = {"ids": self.seen, "steps": self.steps, "sizes": self.sizes, "batches": self.batches}
            path.write_text(json.dumps(record))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loader", choices=("mixed", "stateful", "dataloader", "torchdata"), default="mixed")
    parser.add_argument("--epochs", type=int, default=2, help="max_epochs (-1: until --max-steps)")
    parser.add_argument("--record", help="write each rank's sample ids per epoch here")
    parser.add_argument("--reload", action="store_true", help="rebuild the loader every epoch")
    parser.add_argument("--records", type=int, default=RECORDS, help="records in the dataset written")
    parser.add_argument("--data", help="read the data here (written first if absent), and keep it")
    parser.add_argument("--checkpoint-every", type=int, help="save a checkpoint every this many steps")
    parser.add_argument("--checkpoints", help="the folder of the checkpoints")
    parser.add_argument("--kill-at", type=int, help="end both ranks with SIGKILL after this global step")
    parser.add_argument("--resume", metavar="CKPT", help="resume from this checkpoint")
    parser.add_argument("--max-steps", type=int, default=-1, help="end fit() after this many steps")
    parser.add_argument("--save", metavar="CKPT", help="after fit(), trainer.save_checkpoint(CKPT)")
    args = parser.parse_args()
    root = data_folder(args.data, args.records)
    torch.manual_seed(0)
    callbacks = []
    if args.checkpoint_every:
        every = L.pytorch.callbacks.ModelCheckpoint(
            dirpath=args.checkpoints,
            filename="{step}",
            every_n_train_steps=args.checkpoint_every,
            save_on_train_epoch_end=False,
            save_top_k=-1,
        )
        callbacks.append(every)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        reload_dataloaders_every_n_epochs=int(args.reload),
    )
    module = Regression(root, args.loader, args.record, args.kill_at)
    trainer.fit(module, ckpt_path=args.resume)
    module.write_record()  # the batches of an epoch fit() ended in (max_steps), if any
    if args.save:
        trainer.save_checkpoint(args.save)  # on every rank: each joins in gathering the loader's state
    weight, bias = (p.item() for p in module.model.parameters())
    if trainer.global_rank == 0:
        print(f"learned y = {weight:.2f} x {bias:+.2f} (true: y = 3.00 x -1.00)")
        if args.data is None:
            import shutil

            shutil.rmtree(root, ignore_errors=True)


def data_folder(data: str | None, records: int) -> str:
    """The folder of the data, written first where there is none yet. Lightning re-runs this
    script for rank 1 with the environment of rank 0, which writes the data before fit()
    starts the other rank."""
    if data is not None:
        os.environ["SHARDKIT_EXAMPLE_DATA"] = data
    if "SHARDKIT_EXAMPLE_DATA" not in os.environ:
        os.environ["SHARDKIT_EXAMPLE_DATA"] = tempfile.mkdtemp(prefix="shardkit-lightning-")
    root = os.environ["SHARDKIT_EXAMPLE_DATA"]
    if not os.path.exists(f"{root}/train.manifest.arrow"):
        write_dataset(root, records)
    return root


if __name__ == "__main__":
    main()
