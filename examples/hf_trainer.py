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

Resume: ``callbacks=[shardkit.integrations.hf.ResumeCallback(loader)]`` is the one
line the loader needs. Every checkpoint the Trainer saves then holds each
rank's loader position (``checkpoint-N/shardkit_loader_rank{r}.json``), and
``trainer.train(resume_from_checkpoint=...)`` loads it back; the callback sets
``ignore_data_skip=True``, so the Trainer does not re-read and drop the batches
trained before the checkpoint: it goes on with exactly the batches an
uninterrupted run would have trained.

    torchrun --nproc_per_node=2 examples/hf_trainer.py --data /tmp/d --checkpoints /tmp/ck --checkpoint-every 8
    torchrun --nproc_per_node=2 examples/hf_trainer.py --data /tmp/d --checkpoints /tmp/ck --resume /tmp/ck/checkpoint-8

``--record DIR`` writes the sample ids each rank trained on, per epoch, to
``DIR/rank{r}-epoch{e}.json``, per step to ``DIR/rank{r}.steps.jsonl``, and each
id its pipeline reads (maps) to ``DIR/rank{r}.reads.{pid}`` (the tests check them); ``--kill-at S``
SIGKILLs every rank after global step S (a preemption, for the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

import shardkit
from shardkit.integrations.hf import ResumeCallback

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
        "labels": torch.from_numpy(example["y"]).float(),
    }


class LogReads:
    """``to_sample`` that also appends each id it maps to a file per process (``--record``): what the
    pipeline read, so a test can tell that a resumed run reads nothing trained before its checkpoint."""

    def __init__(self, folder: str, rank: int) -> None:
        self.prefix = f"{folder}/rank{rank}.reads"

    def __call__(self, example: dict[str, Any]) -> dict[str, torch.Tensor]:
        sample = to_sample(example)
        with open(f"{self.prefix}.{os.getpid()}", "a") as f:
            f.write(f"{int(sample['id'])}\n")
        return sample


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

    def get_train_dataloader(self) -> Any:
        return self.train_loader

    def compute_loss(self, model: Any, inputs: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        self.seen += inputs["id"].tolist()
        return super().compute_loss(model, inputs, *args, **kwargs)


class RecordIds(TrainerCallback):
    """Writes (and prints) what each rank trained on: every step's ids, and each epoch's at its end
    ``--kill-at`` ends every rank with SIGKILL after that step."""

    def __init__(self, record: str | None, loader: Any, kill_at: int) -> None:
        self.record, self.loader, self.kill_at = record, loader, kill_at
        self.trainer: ShardkitTrainer | None = None
        self.epoch_ids: list[int] = []
        self.batches = 0

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        assert trainer is not None
        ids, trainer.seen = trainer.seen, []
        self.epoch_ids += ids
        self.batches += 1
        if self.record:
            with open(Path(self.record) / f"rank{args.process_index}.steps.jsonl", "a") as f:
                f.write(json.dumps({"step": state.global_step, "epoch": self.loader.epoch, "ids": ids}) + "\n")
        if state.global_step == self.kill_at and not control.should_save:
            self.kill()

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.kill_at:
            self.kill()  # after ResumeCallback (earlier in callbacks) saved the loader

    def kill(self) -> None:
        if dist.is_initialized():
            dist.barrier()  # every rank recorded and saved: now a preemption
        os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        epoch = self.loader.epoch
        if self.record:
            path = Path(self.record) / f"rank{args.process_index}-epoch{epoch}.json"
            path.write_text(json.dumps({"ids": self.epoch_ids, "batches": self.batches}))
        if args.process_index == 0:
            print(f"epoch {epoch}: rank 0 trained on {len(self.epoch_ids)} samples in {self.batches} batches")
        self.epoch_ids, self.batches = [], 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--records", type=int, default=RECORDS)
    parser.add_argument("--data", help="the dataset's folder (written if empty); a temp dir by default")
    parser.add_argument("--checkpoints", help="the Trainer's output_dir, where checkpoint-STEP folders go")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save every K steps")
    parser.add_argument("--resume", help="a checkpoint folder to train(resume_from_checkpoint=...) from")
    parser.add_argument("--record", help="write each rank's sample ids per epoch and per step here")
    parser.add_argument("--kill-at", type=int, default=0, help="SIGKILL every rank after this global step")
    return parser.parse_args()


def training_arguments(args: argparse.Namespace, work: str) -> TrainingArguments:
    return TrainingArguments(
        output_dir=args.checkpoints or work,
        num_train_epochs=args.epochs,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        report_to=[],
        save_strategy="steps" if args.checkpoint_every else "no",
        save_steps=args.checkpoint_every or 500,
        logging_strategy="no",
        disable_tqdm=True,
    )  # sets up torch.distributed under torchrun


def shared_data_dir(training: TrainingArguments, data: str | None, work: str, records: int) -> str:
    """``data`` (or rank 0's work dir), known to every rank, with the data written in it once.
    A resumed run must read the same files: a saved state is bound to the shards' urls and counts."""
    root = [data or work]
    if dist.is_initialized():
        dist.broadcast_object_list(root)
    if training.process_index == 0 and not os.path.exists(f"{root[0]}/train.manifest.arrow"):
        os.makedirs(root[0], exist_ok=True)
        write_dataset(root[0], records)
    if dist.is_initialized():
        dist.barrier()
    return root[0]


def main() -> None:
    args = parse_args()
    work = tempfile.mkdtemp(prefix="shardkit-hf-")
    training = training_arguments(args, work)
    root = shared_data_dir(training, args.data, work, args.records)

    shards = shardkit.ShardList.from_manifest(f"{root}/train.manifest.arrow")
    read = LogReads(args.record, training.process_index) if args.record else to_sample
    dataset = shardkit.TFRecordDataset(shards, shuffle=True, balance="pad").map(read).shuffle(64)
    loader = shardkit.MixedLoader(dataset, batch_size=BATCH_SIZE, num_workers=2, persistent_workers=True)
    torch.manual_seed(0)
    model = Regression()
    record = RecordIds(args.record, loader, args.kill_at)
    callbacks = [ResumeCallback(loader), record]  # the loader's position goes into every checkpoint
    trainer = ShardkitTrainer(model=model, args=training, train_loader=loader, callbacks=callbacks)
    record.trainer = trainer
    trainer.train(resume_from_checkpoint=args.resume)
    weight, bias = (p.item() for p in model.linear.parameters())
    if training.process_index == 0:
        print(f"learned y = {weight:.2f} x {bias:+.2f} (true: y = 3.00 x -1.00)")
    if dist.is_initialized():
        dist.barrier()
    shutil.rmtree(work, ignore_errors=True)
    if training.process_index == 0 and not args.data:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
