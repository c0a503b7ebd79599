"""The examples run, and say what they promise."""

from __future__ import annotations

import re

import pytest

from tests.helpers.processes import EXAMPLES, free_port, run_python

pytestmark = pytest.mark.slow  # subprocesses, servers or DDP ranks: the inner loop skips them


def test_wrap_map_dataset():
    out = run_python(str(EXAMPLES / "wrap_map_dataset.py")).stdout
    assert "rank 0: 500 samples in 8 batches" in out and "rank 1: 500 samples in 8 batches" in out
    assert "distinct samples: 1000 of 1000; repeated: 0" in out


def test_tfrecord_pipeline():
    out = run_python(str(EXAMPLES / "tfrecord_pipeline.py")).stdout
    assert "wrote 4 shards, 1000 records" in out
    assert out.count("1000 samples, label counts [100, 100, 100, 100, 100, 100, 100, 100, 100, 100]") == 2


def test_ddp_train_with_torchrun():
    out = run_python(
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(EXAMPLES / "ddp_train.py"),
    ).stdout
    counts = re.findall(r"batches per rank \[(\d+), (\d+)\]", out)
    assert len(counts) == 3 and all(a == b for a, b in counts), out
    assert "(at least)" not in out and out.count("batches fetched but unused, per rank: [") == 3, out
    weight, bias = map(float, re.search(r"learned y = ([-\d.]+) x ([-+\d.]+)", out).groups())
    assert abs(weight - 3) < 0.05 and abs(bias + 1) < 0.05, out
