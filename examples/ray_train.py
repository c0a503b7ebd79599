"""Train on Ray Train with 2 CPU workers, reading shards with shardkit, and resume exactly after a failure.

    python examples/ray_train.py                    # a local Ray: write the data, train 2 epochs
    python examples/ray_train.py --kill-at 11       # rank 1 is SIGKILLed after step 11; Ray restarts, resumes
    python examples/ray_train.py --address auto     # on a running cluster (--data must be on shared storage)

``ray.train.torch.TorchTrainer`` starts two workers and a gloo process group
between them; each runs ``train_func``. Inside it a shardkit
``TFRecordDataset`` over a manifest (written by ``ShardWriter`` unless
``--data`` holds one) is read by a ``MixedLoader``, which finds its rank and
world size in that process group: ``train_func`` checks that they are the
ones Ray Train's context gives. Every ``--every`` steps each rank calls
``save_loader_state`` (``shardkit.integrations.ray``): the loader's state,
every rank's, is gathered and rank 0 writes it with the model into the
checkpoint it reports (``ray.train.report``). With
``FailureConfig(max_failures=1)`` a worker that dies makes Ray stop the group
and start it again; ``ray.train.get_checkpoint()`` then hands every worker
the last checkpoint, and ``load_loader_state`` puts each rank back where it
was: the batches after the checkpoint are exactly those an uninterrupted run
trains. With ``--elastic`` (``ScalingConfig(num_workers=(1, 2))``) Ray may
start again on fewer workers (a node lost); the saved ranks' states then
merge and split over the workers there are, and every sample of the epoch is
still trained exactly once.

``--record DIR`` writes each rank's trained ids per step to
``DIR/rank{r}.jsonl`` (with the step the run resumed from), which the tests
compare with an uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
import torch
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import shardkit
from shardkit.integrations.ray import load_loader_state, save_loader_state

RECORDS, SHARDS, BATCH_SIZE, EPOCHS, EVERY = 128, 4, 8, 2, 3
MANIFEST = "train.manifest.arrow"


def write_dataset(root: str, records: int = RECORDS) -> str:
    """``records`` records (id, x, y = 3x - 1) in 4 TFRecord shards; the manifest's path."""
    rng = np.random.default_rng(0)
    with shardkit.ShardWriter(f"{root}/train-%03d.tfrecord", max_records=-(-records // SHARDS)) as writer:
        for i, x in enumerate(rng.uniform(-1, 1, records)):
            writer.write(shardkit.encode_example({"id": [i], "x": [float(x)], "y": [3 * float(x) - 1]}))
    return f"{root}/{MANIFEST}"


def to_sample(example: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.from_numpy(example["id"]),
        torch.from_numpy(example["x"]).float(),
        torch.from_numpy(example["y"]).float(),
    )


def check_topology() -> tuple[int, int]:
    """This worker's rank and world size as Ray Train's context gives them, after checking that
    shardkit reads the same from the process group Ray Train set up."""
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    topology = shardkit.Topology.current()
    if (topology.rank, topology.world_size) != (rank, world_size):
        raise RuntimeError(
            f"shardkit reads rank {topology.rank} of {topology.world_size}, Ray Train says {rank} of {world_size}"
        )
    return rank, world_size


def train_func(config: dict[str, Any]) -> None:
    """One Ray Train worker: resume from the last checkpoint if there is one, train, checkpoint every few steps."""
    rank, world_size = check_topology()
    model = ray.train.torch.prepare_model(torch.nn.Linear(1, 1))  # DDP over Ray Train's process group
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = shardkit.TFRecordDataset(shardkit.ShardList.from_manifest(config["manifest"]), shuffle=True, seed=0)
    loader = shardkit.MixedLoader(dataset.map(to_sample), BATCH_SIZE, num_workers=config["loader_workers"], seed=0)
    loader.set_epoch(0)
    step, resumed_from = 0, None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            saved = load_loader_state(loader, folder)  # also sets the loader's epoch to the saved one
            weights = torch.load(os.path.join(folder, "model.pt"), weights_only=True)
        getattr(model, "module", model).load_state_dict(weights["model"])
        optimizer.load_state_dict(weights["optimizer"])
        step = resumed_from = saved.step
        print(f"rank {rank} of {world_size}: resumed at step {step} (saved by {saved.world_size} ranks)", flush=True)
    hook = config.get("hook")
    for epoch in range(loader.epoch, config["epochs"]):
        loader.set_epoch(epoch)
        for ids, x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # the all-reduce over Ray Train's group
            optimizer.step()
            step += 1
            if config["record"]:
                line = {"step": step, "epoch": epoch, "ids": ids.flatten().tolist(), "resumed_from": resumed_from}
                with open(Path(config["record"]) / f"rank{rank}.jsonl", "a") as f:
                    f.write(json.dumps({**line, "world_size": world_size}) + "\n")
            if step % config["every"] == 0:
                report(loader, model, optimizer, step, rank, loss.item())
            if hook is not None:
                hook(step, rank)
    if rank == 0:
        print(f"trained {step} steps on {world_size} workers; loss {loss.item():.4f}", flush=True)


def report(loader: shardkit.MixedLoader, model: Any, optimizer: Any, step: int, rank: int, loss: float) -> None:
    """Every rank gathers the loader's state; rank 0 writes it and the model into the checkpoint it reports."""
    with tempfile.TemporaryDirectory() as folder:
        save_loader_state(loader, folder if rank == 0 else None, step=step)
        if rank != 0:
            ray.train.report({"step": step, "loss": loss})
            return
        weights = getattr(model, "module", model).state_dict()
        torch.save({"model": weights, "optimizer": optimizer.state_dict()}, os.path.join(folder, "model.pt"))
        ray.train.report({"step": step, "loss": loss}, checkpoint=Checkpoint.from_directory(folder))


class KillOnce:
    """After step ``step``, rank ``rank`` SIGKILLs itself, once: ``marker`` records that it did, so the
    run Ray starts again goes on (a worker lost mid-epoch)."""

    def __init__(self, step: int, rank: int, marker: str) -> None:
        self.step, self.rank, self.marker = step, rank, marker

    def __call__(self, step: int, rank: int) -> None:
        if (step, rank) == (self.step, self.rank) and not os.path.exists(self.marker):
            Path(self.marker).write_text(f"rank {rank} killed after step {step}\n")
            os.kill(os.getpid(), signal.SIGKILL)


def run(
    manifest: str,
    storage: str,
    *,
    workers: int | tuple[int, int] = 2,
    epochs: int = EPOCHS,
    every: int = EVERY,
    loader_workers: int = 0,
    record: str | None = None,
    hook: Callable[[int, int], None] | None = None,
    name: str = "shardkit-ray-train",
) -> ray.train.Result:
    """Train with ``workers`` CPU workers (a ``(min, max)`` pair: elastic) on the connected Ray cluster."""
    config = {
        "manifest": manifest, "epochs": epochs, "every": every, "loader_workers": loader_workers,
        "record": record, "hook": hook,
    }  # fmt: skip
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(max_failures=1)),
    )
    return trainer.fit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", help="a Ray cluster to join (default: start a local one)")
    parser.add_argument("--data", help="a folder holding train.manifest.arrow (default: write one)")
    parser.add_argument("--storage", help="Ray Train's storage_path for checkpoints (default: a temporary folder)")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--every", type=int, default=EVERY, help="checkpoint every this many steps")
    parser.add_argument("--loader-workers", type=int, default=0, help="DataLoader workers of each rank's loader")
    parser.add_argument("--elastic", action="store_true", help="ScalingConfig(num_workers=(1, 2))")
    parser.add_argument("--kill-at", type=int, help="SIGKILL rank 1 after this step, on the first attempt only")
    parser.add_argument("--record", help="write each rank's ids per step here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardkit-ray-") as scratch:
        data = args.data or os.path.join(scratch, "data")
        manifest = os.path.join(data, MANIFEST)
        if not os.path.exists(manifest):
            os.makedirs(data, exist_ok=True)
            write_dataset(data)
        ray.init(address=args.address or "local", include_dashboard=False)  # "local": never join another by chance
        hook = None if args.kill_at is None else KillOnce(args.kill_at, 1, os.path.join(scratch, "killed"))
        result = run(
            os.path.abspath(manifest), os.path.abspath(args.storage or os.path.join(scratch, "ray")),
            workers=(1, 2) if args.elastic else 2, epochs=args.epochs, every=args.every,
            loader_workers=args.loader_workers, record=args.record, hook=hook,
        )  # fmt: skip
        ray.shutdown()
    if result.error is not None:
        raise SystemExit(f"training failed: {result.error}")
    print(f"done; last checkpoint at step {result.metrics['step']}")


if __name__ == "__main__":
    main()
