"""The pipeline docs/performance.md's profile picture is of: the demo's shards, decoded, with a map that
costs CPU as an augmentation would (a 64 x 64 float blur per record).

    shardkit demo --workdir data
    PYTHONPATH=docs/_ext shardkit profile profiled:pipeline --seconds 6 --picture docs/pictures/profile.svg
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import shardkit


def augment(example: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A seeded 64 x 64 image blurred 4 times: about a millisecond of CPU, as a real augmentation costs."""
    rng = np.random.default_rng(int(example["id"][0]))
    image = rng.random((64, 64), dtype=np.float32)
    for _ in range(4):
        image = (image + np.roll(image, 1, 0) + np.roll(image, 1, 1)) / 3
    return {"image": torch.from_numpy(image), "id": torch.from_numpy(example["id"])}


def pipeline() -> Any:
    return shardkit.TFRecordDataset("data/*.tfrecord", shuffle=True, balance="none").map(augment)
