"""Train a tiny model with DDP on CPU (gloo), reading TFRecord shards with shardkit.

    torchrun --nproc_per_node=2 examples/ddp_train.py
    python examples/ddp_train.py            # one process works too

Rank 0 writes a small dataset (y = 3x - 1 plus noise) into a temp dir; every
rank then reads its own part with TFRecordDataset (rank detected from the
process group when iteration starts). ``balance="pad"`` gives every rank the
same number of records, even though 1,003 records do not split evenly. A
``.filter`` then drops the records with ``|x| > 0.9``, a different number on
each rank, so the ranks would yield different numbers of batches and the
gradient all-reduce would hang at the end of an epoch: ``shardkit.even_batches``
has the ranks agree as they go and stop together when the first runs out
(the batches the others had fetched ahead but not used are printed).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import shardkit

RECORDS, SHARDS, BATCH_SIZE, EPOCHS = 1003, 5, 16, 3


def write_dataset(root: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, RECORDS).astype(np.float32)
    y = 3 * x - 1 + rng.normal(0, 0.01, RECORDS).astype(np.float32)
    with shardkit.ShardWriter(f"{root}/train-%03d.tfrecord", max_records=-(-RECORDS // SHARDS)) as writer:
        for xi, yi in zip(x, y):
            writer.write(shardkit.encode_example({"x": [float(xi)], "y": [float(yi)]}))


def to_pair(example: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(example["x"]), torch.from_numpy(example["y"])


def in_range(pair: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return abs(float(pair[0])) <= 0.9


def main() -> None:
    if "RANK" not in os.environ:  # plain `python examples/ddp_train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shared_dir = [tempfile.mkdtemp(prefix="shardkit-ddp-") if rank == 0 else None]
    dist.broadcast_object_list(shared_dir)
    root = shared_dir[0]
    if rank == 0:
        write_dataset(root)
    dist.barrier()

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    shards = shardkit.ShardList.from_manifest(f"{root}/train.manifest.arrow")
    dataset = shardkit.TFRecordDataset(shards, shuffle=True, balance="pad").map(to_pair).filter(in_range)
    # Two workers per rank at most, and no more than the cores allow: the ranks share the machine.
    workers = max(1, min(2, (os.cpu_count() or 1) // world))
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=workers, persistent_workers=True)
    batches = shardkit.even_batches(loader)  # at_end="stop": every rank stops when the first runs out
    for epoch in range(EPOCHS):
        batches.set_epoch(epoch)  # passes on to the dataset
        steps, total_loss = 0, 0.0
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # all-reduce across ranks: equal batch counts keep it from hanging
            optimizer.step()
            steps += 1
            total_loss += loss.item()
        counts = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([steps, batches.stats().dropped]))
        if rank == 0:
            per_rank, unread = [int(c[0]) for c in counts], [int(c[1]) for c in counts]
            # The filtered stream has no len(), so a rank knows only the batches its workers had
            # fetched ahead when the ranks stopped together, not how many more its shards held.
            print(
                f"epoch {epoch}: batches per rank {per_rank}, mean loss {total_loss / steps:.4f}; "
                f"the ranks stopped together; batches fetched but unused, per rank: {unread}"
            )
    weight, bias = (p.detach().item() for p in model.module.parameters())
    if rank == 0:
        print(f"learned y = {weight:.2f} x {bias:+.2f} (true: y = 3.00 x -1.00)")
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
