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

Resume: ``accelerator.register_for_checkpointing(loader)`` is the one line a
shardkit loader needs. ``accelerator.save_state(dir)`` then saves the loader's
position with the model and optimizer (every rank's: under a process group
the loader's ``state_dict()`` holds every rank's state), and
``accelerator.load_state(dir)`` puts it back: the next epoch goes on with
exactly the batches an uninterrupted run would have trained, reading nothing
twice. Do not call ``accelerator.skip_first_batches`` on a shardkit loader: it
re-reads the skipped batches, and shardkit refuses it naming this fix.

    torchrun --nproc_per_node=2 examples/accelerate_train.py --data /tmp/d --checkpoints /tmp/ck --checkpoint-every 8
    torchrun --nproc_per_node=2 examples/accelerate_train.py --data /tmp/d --checkpoints /tmp/ck --resume /tmp/ck/checkpoint-8

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
from accelerate import Accelerator
from accelerate.utils import send_to_device

import shardkit

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


def shared_data_dir(accelerator: Accelerator, data: str | None, records: int) -> str:
    """``data`` (or a temp dir made by rank 0), known to every rank, with the data written in it once.
    A resumed run must read the same files: a saved state is bound to the shards' urls and counts."""
    root = [(data or tempfile.mkdtemp(prefix="shardkit-accelerate-")) if accelerator.is_main_process else None]
    if dist.is_initialized():
        dist.broadcast_object_list(root)
    if accelerator.is_main_process and not os.path.exists(f"{root[0]}/train.manifest.arrow"):
        write_dataset(root[0], records)
    accelerator.wait_for_everyone()
    return root[0]


class Progress:
    """The epoch and global step, saved beside the loader by ``accelerator.save_state``."""

    def __init__(self) -> None:
        self.epoch = self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.step = state["epoch"], state["step"]


class Recorder:
    """What each rank trained on (``--record``): every step's ids as they happen, each epoch's at its end."""

    def __init__(self, folder: str | None, rank: int) -> None:
        self.folder, self.rank = folder, rank

    def step(self, step: int, epoch: int, ids: list[int]) -> None:
        if self.folder:
            with open(Path(self.folder) / f"rank{self.rank}.steps.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "epoch": epoch, "ids": ids}) + "\n")

    def epoch(self, epoch: int, ids: list[int], batches: int) -> None:
        if self.folder:
            path = Path(self.folder) / f"rank{self.rank}-epoch{epoch}.json"
            path.write_text(json.dumps({"ids": ids, "batches": batches}))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--records", type=int, default=RECORDS)
    parser.add_argument("--data", help="the dataset's folder (written if empty); a temp dir by default")
    parser.add_argument("--checkpoints", help="save_state to CHECKPOINTS/checkpoint-STEP")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save every K steps")
    parser.add_argument("--resume", help="a checkpoint folder to load_state from")
    parser.add_argument("--record", help="write each rank's sample ids per epoch and per step here")
    parser.add_argument("--kill-at", type=int, default=0, help="SIGKILL every rank after this global step")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(cpu=True)
    root = shared_data_dir(accelerator, args.data, args.records)

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the loader: shardkit splits itself
    shards = shardkit.ShardList.from_manifest(f"{root}/train.manifest.arrow")
    rank = accelerator.process_index
    read = LogReads(args.record, rank) if args.record else to_sample
    dataset = shardkit.TFRecordDataset(shards, shuffle=True, balance="pad").map(read).shuffle(64)
    loader = shardkit.MixedLoader(dataset, batch_size=BATCH_SIZE, num_workers=2, persistent_workers=True)
    progress = Progress()
    accelerator.register_for_checkpointing(loader, progress)  # the loader's position goes into save_state
    if args.resume:
        accelerator.load_state(args.resume)  # model, optimizer, and where every rank's loader stopped
    recorder = Recorder(args.record, rank)

    for epoch in range(progress.epoch, args.epochs):
        progress.epoch = epoch
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
            progress.step += 1
            recorder.step(progress.step, epoch, batch["id"].tolist())
            if args.checkpoints and args.checkpoint_every and progress.step % args.checkpoint_every == 0:
                accelerator.save_state(f"{args.checkpoints}/checkpoint-{progress.step}")
            if progress.step == args.kill_at:
                accelerator.wait_for_everyone()  # every rank recorded and saved: now a preemption
                os.kill(os.getpid(), signal.SIGKILL)
        progress.epoch = epoch + 1
        recorder.epoch(epoch, seen, batches)
        if accelerator.is_main_process:
            print(f"epoch {epoch}: rank 0 trained on {len(seen)} samples in {batches} batches")
    weight, bias = (p.item() for p in accelerator.unwrap_model(model).parameters())
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print(f"learned y = {weight:.2f} x {bias:+.2f} (true: y = 3.00 x -1.00)")
        if not args.data:
            shutil.rmtree(root, ignore_errors=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
