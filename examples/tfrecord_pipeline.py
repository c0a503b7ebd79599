"""A TFRecord pipeline: write shards with ShardWriter, read them back decoded,
shuffled and batched, with batches that mix every worker.

    python examples/tfrecord_pipeline.py
"""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np
import torch

import shardkit


def to_tensors(example: dict[str, Any]) -> dict[str, torch.Tensor]:
    """tf.Example features -> tensors (runs in the DataLoader workers)."""
    pixels = np.frombuffer(example["image"][0], dtype=np.uint8).reshape(4, 4)
    return {"image": torch.from_numpy(pixels.copy()), "label": torch.from_numpy(example["label"])}


def main() -> None:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as root:
        with shardkit.ShardWriter(f"{root}/train-%05d.tfrecord", max_records=250) as writer:
            for label in range(1000):
                image = rng.integers(0, 255, size=16, dtype=np.uint8).tobytes()
                writer.write(shardkit.encode_example({"image": [image], "label": [label % 10]}))
        shards = writer.shards
        print(f"wrote {len(shards)} shards, {shards.total_records} records; manifest {writer.manifest}")

        dataset = shardkit.TFRecordDataset(shards, shuffle=True, seed=1).map(to_tensors).shuffle(256)
        loader = shardkit.MixedLoader(dataset, batch_size=32, num_workers=2, persistent_workers=True)
        for epoch in range(2):
            loader.set_epoch(epoch)
            labels = torch.cat([batch["label"].flatten() for batch in loader])
            print(f"epoch {epoch}: {len(labels)} samples, label counts {torch.bincount(labels).tolist()}")
            assert len(labels) == 1000


if __name__ == "__main__":
    main()
