"""``shardkit demo``: shardkit at work on a small TFRecord dataset it writes itself.

1. Writes 6 TFRecord shards of tf.Examples (uneven sizes) and their manifest.
2. Prints the plan for 2 ranks x 2 DataLoader workers.
3. Runs each of the 2 simulated ranks through a DataLoader with 2 workers and
   checks what a DDP job needs: equal batch counts, nothing lost.
4. Shows where the samples of a few batches came from, with a plain
   DataLoader and with :class:`~shardkit.MixedLoader`.
"""

from __future__ import annotations

import collections
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, get_worker_info

import shardkit
from shardkit.cli.render import format_plan
from shardkit.writer import partial_name, publish, remove_if_present, write_manifest

SHARD_SIZES = (700, 450, 900, 300, 820, 530)
WORLD_SIZE, NUM_WORKERS, BATCH_SIZE = 2, 2, 32


def run_demo(workdir: str | None = None) -> int:
    """Run the demo in ``workdir`` (a fresh temp dir by default); returns the exit code."""
    if workdir is not None:
        return _demo(Path(workdir))
    with tempfile.TemporaryDirectory(prefix="shardkit-demo-") as tmp:
        return _demo(Path(tmp))


def _demo(root: Path) -> int:
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    shards = _write_dataset(root)
    total = shards.total_records
    print(f"== 1. wrote {len(shards)} TFRecord shards, {total} tf.Examples, to {root}")
    print(f"   manifest: {root / 'train.manifest.arrow'}  ({time.perf_counter() - started:.2f} s)\n")

    print(f"== 2. the plan: {WORLD_SIZE} ranks x {NUM_WORKERS} workers, balance='pad', shuffled")
    print(format_plan(shards, WORLD_SIZE, NUM_WORKERS, shuffle=True, balance="pad") + "\n")

    print(f"== 3. each rank through DataLoader(num_workers={NUM_WORKERS}, batch_size={BATCH_SIZE})")
    seen, batch_counts = _read_every_rank(shards)
    missing = total - len(seen)
    repeated = sum(seen.values()) - len(seen)
    equal = len(set(batch_counts)) == 1
    print(
        f"   equal batch counts across ranks: {'yes' if equal else 'NO'}; missing samples: {missing}; "
        f"repeated (padding to ceil({total}/{WORLD_SIZE})): {repeated}\n"
    )

    print(f"== 4. which worker each sample of a batch came from (first 4 batches, one rank, batch {BATCH_SIZE})")
    dataset = shardkit.TFRecordDataset(shards).map(_worker_of_sample)
    plain = DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=NUM_WORKERS)
    mixed = shardkit.MixedLoader(dataset, BATCH_SIZE, num_workers=NUM_WORKERS)
    for name, loader in (("DataLoader ", plain), ("MixedLoader", mixed)):
        shares = [dict(sorted(collections.Counter(batch.tolist()).items())) for _, batch in zip(range(4), loader)]
        print(f"   {name}: " + "  ".join(_format_share(share) for share in shares))
    ok = equal and missing == 0
    print(f"\nshardkit demo: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def _read_every_rank(shards: Any) -> tuple[collections.Counter[int], list[int]]:
    """Read each simulated rank's part through a DataLoader: how often each sample id came, and
    each rank's batch count."""
    seen: collections.Counter[int] = collections.Counter()
    batch_counts = []
    for rank in range(WORLD_SIZE):
        dataset = shardkit.TFRecordDataset(shards, shuffle=True, rank=rank, world_size=WORLD_SIZE).map(_sample_id)
        started = time.perf_counter()
        batches = list(DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=NUM_WORKERS))
        elapsed = time.perf_counter() - started
        ids = torch.cat(batches).tolist()
        seen.update(ids)
        batch_counts.append(len(batches))
        print(f"   rank {rank}: {len(batches)} batches, {len(ids)} samples, {elapsed:.2f} s")
    return seen, batch_counts


def _write_dataset(root: Path) -> Any:
    """Write the uneven shards as ShardWriter would (it cuts shards at a fixed size): the old
    manifest goes first, each shard appears by rename when complete, the manifest last."""
    manifest = str(root / "train.manifest.arrow")
    remove_if_present(manifest, None)
    urls, counts = [], []
    sample_id = 0
    for shard, size in enumerate(SHARD_SIZES):
        url = str(root / f"train-{shard:05d}.tfrecord")
        partial = partial_name(url)
        try:
            with shardkit.TFRecordWriter(partial) as out:
                for _ in range(size):
                    out.write(shardkit.encode_example({"id": [sample_id], "shard": [shard], "payload": [b"x" * 64]}))
                    sample_id += 1
            publish(partial, url, None)
        finally:
            remove_if_present(partial, None)
        urls.append(url)
        counts.append(size)
    write_manifest(shardkit.ShardList(urls, num_records=counts), manifest, None)
    return shardkit.ShardList.from_manifest(manifest)


def _sample_id(example: dict[str, Any]) -> int:
    return int(example["id"][0])


def _worker_of_sample(example: dict[str, Any]) -> int:
    info = get_worker_info()
    return -1 if info is None else info.id


def _format_share(share: dict[int, int]) -> str:
    return "{" + ", ".join(f"w{worker}:{count}" for worker, count in share.items()) + "}"
