"""The samples of the LitData fixtures in tests/data/litdata, and the script that wrote them with litdata's own writer.

litdata is not in the dev extra: it requires torchvision, and the torchvision
wheel the registry resolves for torch 2.13.0 is a CUDA build that does not load
beside the CPU torch here (``operator torchvision::nms does not exist``). So the
chunks it wrote are committed, small, and the tests compare what shardkit reads
with the samples below (what ``optimize`` was given) and, where litdata is
installed, with its own ``StreamingDataset``. To write them again, in an
environment with litdata (``uv pip install litdata``, then ``uv pip uninstall torchvision``)::

    python -m tests.helpers.litdata_samples tests/data/litdata
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from typing import Any

import numpy as np

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "litdata")

SAMPLES = 40  # in chunks of 8
ROWS = 600  # in chunks of 300: each chunk's Arrow footer holds two record batches (256 + 44 rows)
DOCUMENTS = 30  # token documents in chunks of about 200 tokens


def png(i: int) -> bytes:
    """A PNG of :func:`pixels` ``(i)``: lossless, so its decoded pixels are exact whatever encoded it."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels(i)).save(out, format="PNG")
    return out.getvalue()


def pixels(i: int) -> np.ndarray:
    return (np.arange(5 * 4 * 3, dtype=np.uint8).reshape(5, 4, 3) * (i + 1)).astype(np.uint8)


def sample(i: int) -> dict[str, Any]:
    """Sample ``i`` of the ``samples`` and ``zstd`` fixtures: a leaf of every serializer shardkit reads, but images."""
    import torch

    return {
        "id": i,
        "score": i / 7,
        "name": f"sample {i} ü",
        "blob": bytes(range(i % 256)) * 2,
        "grid": np.arange(i * 6, dtype=np.float32).reshape(2, 3, i) if i else np.zeros((2, 3, 0), np.float32),
        "seq": np.arange(i, dtype=np.int16) - 5,
        "mat": torch.arange(6 * i, dtype=torch.int64).reshape(3, 2 * i)
        if i
        else torch.zeros((3, 0), dtype=torch.int64),
        "vec": torch.arange(i, dtype=torch.float32) / 4,
        "flag": i % 3 == 0,
        "nest": [i * 2, (str(i), -i)],
    }


def image_sample(i: int) -> dict[str, Any]:
    """Sample ``i`` of the ``images`` fixture: a raw PIL image (LitData's ``pil`` leaf) and a PNG's bytes."""
    from PIL import Image

    return {"id": i, "raw": Image.fromarray(pixels(i)), "png": png(i)}


def row(i: int) -> dict[str, Any]:
    """Row ``i`` of the ``rows`` fixture: JSON-like fields, which LitData stores as an Arrow footer."""
    return {"id": i, "text": f"row {i} " + "x" * (i % 13), "score": i * 0.25, "tags": [f"t{i % 3}", f"u{i % 5}"]}


def document(i: int) -> np.ndarray:
    """Token document ``i`` of the ``tokens`` fixture: ``5 + i % 17`` uint16 tokens."""
    return (np.arange(5 + i % 17, dtype=np.uint16) + 1000 * i).astype(np.uint16)


def pickled(i: int) -> dict[str, Any]:
    """A sample LitData can only pickle (a set): the ``pickled`` fixture, which shardkit refuses."""
    return {"id": i, "labels": {i, i + 1}}


def _image_input(i: int) -> dict[str, Any]:
    import litdata

    return {"id": i, "raw": image_sample(i)["raw"], "png": litdata.Image(bytes=png(i))}


def write(root: str) -> None:
    """Write every fixture under ``root`` with litdata's ``BinaryWriter`` (what ``litdata.optimize`` writes
    each worker's chunks and the merged ``index.json`` with), in one process: samples stay in order."""
    from litdata.streaming.item_loader import TokensLoader
    from litdata.streaming.writer import BinaryWriter

    jobs = [
        ("samples", sample, range(SAMPLES), {"chunk_size": 8}),
        ("zstd", sample, range(12), {"chunk_size": 5, "compression": "zstd", "compression_level": "chunk"}),
        ("images", _image_input, range(6), {"chunk_size": 4}),
        ("rows", row, range(ROWS), {"chunk_size": 300}),
        ("tokens", document, range(DOCUMENTS), {"chunk_size": 200, "item_loader": TokensLoader()}),
        ("pickled", pickled, range(3), {"chunk_size": 4}),
    ]
    for name, fn, inputs, options in jobs:
        out = os.path.join(root, name)
        shutil.rmtree(out, ignore_errors=True)
        writer = BinaryWriter(os.path.abspath(out), **options)
        for i in inputs:
            writer[i] = fn(i)
        writer.done()
        writer.merge()


if __name__ == "__main__":
    write(sys.argv[1] if len(sys.argv) > 1 else FIXTURES)
