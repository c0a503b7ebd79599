"""Exact distributed evaluation: every sample counted once, whatever the world size.

    torchrun --nproc_per_node=3 examples/ddp_eval.py
    python examples/ddp_eval.py             # one process: the reference result

``DistributedSampler`` pads an evaluation set to a multiple of the world
size, so metrics count some samples twice (pytorch issue 25162). A shardkit
source with ``balance="none"`` reads every record exactly once over all ranks
and workers; ranks just read different numbers of them. Evaluation needs no
equal batch counts as long as no collective runs per step: call the plain
module (``model.module`` under DDP, whose forward may broadcast buffers), sum
the metric's parts on each rank, and all-reduce the sums once at the end.

Rank 0 writes 1,001 records (two features, a 0/1 label; 1,001 is not a
multiple of 2 or 3) into a temp dir. Every rank scores its records with the
same fixed logistic model, then the sums are all-reduced and rank 0 prints
the accuracy and mean log-loss, which equal the one-process result, and how
many samples padding would have counted twice.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import shardkit

RECORDS, SHARDS, BATCH_SIZE = 1001, 4, 64


def write_dataset(root: str) -> None:
    rng = np.random.default_rng(1)
    features = rng.normal(0, 1, (RECORDS, 2)).astype(np.float32)
    labels = ((features @ np.array([1.5, -1.0]) + rng.normal(0, 0.7, RECORDS)) > 0).astype(np.int64)
    with shardkit.ShardWriter(f"{root}/eval-%03d.tfrecord", max_records=-(-RECORDS // SHARDS)) as writer:
        for index, (x, label) in enumerate(zip(features, labels)):
            writer.write(shardkit.encode_example({"id": [index], "x": x.tolist(), "label": [int(label)]}))


def to_sample(example: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.from_numpy(example["id"]), torch.from_numpy(example["x"]), torch.from_numpy(example["label"])


def model() -> torch.nn.Module:
    """A fixed logistic model, the same on every rank."""
    linear = torch.nn.Linear(2, 1)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[1.2, -0.9]]))
        linear.bias.fill_(0.1)
    return linear.double()


def evaluate(root: str) -> torch.Tensor:
    """This rank's sums: [samples, correct, log-loss, ids, squared ids], in float64."""
    shards = shardkit.ShardList.from_manifest(f"{root}/eval.manifest.arrow")
    dataset = shardkit.TFRecordDataset(shards, balance="none").map(to_sample)  # each record once, unequal counts
    net = model()
    sums = torch.zeros(5, dtype=torch.float64)
    with torch.no_grad():
        workers = max(1, min(2, (os.cpu_count() or 1) // dist.get_world_size()))  # the ranks share the cores
        for ids, x, label in DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=workers):
            logits = net(x.double()).squeeze(1)
            target = label.squeeze(1).double()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="sum")
            ids = ids.squeeze(1).double()
            sums += torch.stack(
                [
                    torch.tensor(float(len(ids)), dtype=torch.float64),
                    ((logits > 0).double() == target).sum(),
                    loss,
                    ids.sum(),
                    (ids * ids).sum(),
                ]
            )
    return sums


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def main() -> None:
    if "RANK" not in os.environ:  # plain `python examples/ddp_eval.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shared_dir = [tempfile.mkdtemp(prefix="shardkit-eval-") if rank == 0 else None]
    dist.broadcast_object_list(shared_dir)
    root = shared_dir[0]
    if rank == 0:
        write_dataset(root)
    dist.barrier()

    sums = evaluate(root)
    print(f"rank {rank}: {int(sums[0])} samples", flush=True)
    dist.all_reduce(sums)  # once, at the end: per-rank counts may differ
    samples, correct, loss, id_sum, id_squares = sums.tolist()
    if rank == 0:
        n = RECORDS
        once = samples == n and id_sum == n * (n - 1) / 2 and id_squares == (n - 1) * n * (2 * n - 1) / 6
        print(f"world size {world}: {int(samples)} samples counted of {n}; each once (id checksums): {once}")
        print(f"accuracy {int(correct)}/{int(samples)} = {correct / samples:.6f}")
        print(f"mean log-loss {loss / samples:.12f}")
        padded = -(-n // world) * world
        print(f"DistributedSampler-style padding would count {padded} samples ({padded - n} of them twice)")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
