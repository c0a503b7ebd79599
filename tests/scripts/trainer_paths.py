"""The ways of handing a shardkit dataset to Accelerate and the Hugging Face
Trainer that would lose data; run under torchrun by tests/test_trainers.py.

    torchrun --nproc_per_node=2 tests/scripts/trainer_paths.py MODE [--workers N] [--context fork|spawn] [--data DIR]

Each mode writes the examples' 302 records (in DIR, a temp dir by default), hands the dataset over as the
trainer's documentation shows, and reads one epoch. Prints ``SHARDKIT_ERROR:
<message>`` and exits 3 when shardkit refuses (the expected outcome), or
``READ <n> samples`` and exits 0 if the epoch ran. ``accelerate-skip`` resumes
a MixedLoader with ``accelerator.skip_first_batches(loader, 8)``;
``accelerate-stateful`` prepares under ``use_stateful_dataloader=True``: a
MixedLoader (printing ``MIXED UNCHANGED`` when it comes back as it went in),
then a DataLoader (printing ``PREPARED`` if ``prepare()`` returns).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from accelerate_train import to_sample, write_dataset  # noqa: E402

import shardkit  # noqa: E402

MODES = ("accelerate-dispatch", "accelerate-shard", "accelerate-skip", "accelerate-stateful", "hf-trainer")


def shared_dataset(rank: int, data: str | None) -> shardkit.Pipeline:
    root = [(data or tempfile.mkdtemp(prefix="shardkit-paths-")) if rank == 0 else None]
    dist.broadcast_object_list(root)
    if rank == 0:
        write_dataset(root[0])
    dist.barrier()
    shards = shardkit.ShardList.from_manifest(f"{root[0]}/train.manifest.arrow")
    return shardkit.TFRecordDataset(shards, shuffle=True, balance="pad").map(to_sample)


def through_accelerate(mode: str, workers: int, context: str | None, data: str | None) -> int:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    stateful = mode == "accelerate-stateful"
    config = DataLoaderConfiguration(dispatch_batches=mode == "accelerate-dispatch", use_stateful_dataloader=stateful)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    dataset = shared_dataset(accelerator.process_index, data)
    if mode == "accelerate-skip":
        mixed = shardkit.MixedLoader(dataset, batch_size=8, num_workers=workers, persistent_workers=True)
        return sum(len(batch["id"]) for batch in accelerator.skip_first_batches(mixed, 8))
    if stateful:
        mixed = shardkit.MixedLoader(dataset, batch_size=8, num_workers=workers)
        if accelerator.prepare(mixed) is mixed:
            print("MIXED UNCHANGED", flush=True)
    loader = DataLoader(dataset, batch_size=8, num_workers=workers, multiprocessing_context=context)
    prepared = accelerator.prepare(loader)
    print("PREPARED", flush=True)
    return sum(len(batch["id"]) for batch in prepared)


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor, id: Any = None) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}


def through_hf_trainer(workers: int, data: str | None) -> int:
    from transformers import Trainer, TrainingArguments

    work = f"{data}/trainer" if data else tempfile.mkdtemp(prefix="shardkit-paths-hf-")
    training = TrainingArguments(
        output_dir=work,
        max_steps=40,
        per_device_train_batch_size=8,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=workers,
    )
    dataset = shared_dataset(training.process_index, data)
    trainer = Trainer(model=Regression(), args=training, train_dataset=dataset)
    return trainer.train().global_step * 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--context", choices=("fork", "spawn"))
    parser.add_argument("--data", help="write the records here (a temp dir by default)")
    args = parser.parse_args()
    try:
        if args.mode == "hf-trainer":
            read = through_hf_trainer(args.workers, args.data)
        else:
            read = through_accelerate(args.mode, args.workers, args.context if args.workers else None, args.data)
    except shardkit.ShardkitError as error:
        print(f"SHARDKIT_ERROR: {error}", flush=True)
        sys.exit(3)
    print(f"READ {read} samples", flush=True)


if __name__ == "__main__":
    main()
