"""The examples run, and say what they promise."""

from __future__ import annotations

import json
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


def torchrun_example(script: str, *args: str, check: bool = True):
    return run_python(
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(EXAMPLES / script),
        *args,
        check=check,
    )


def test_pretrain_gpt_killed_after_a_checkpoint_resumes_with_exactly_the_batches_it_would_have_had(tmp_path):
    """Megatron token files -> a token schedule -> best-fit packing -> MixedLoader on two
    gloo ranks: killed at step 17 after the checkpoint of step 15, the resumed run trains
    steps 16-17 on the very batches the killed one had (token checksums per rank), then on to 20."""
    common = ["--data", str(tmp_path / "data"), "--checkpoint", str(tmp_path / "ck.pt"), "--steps", "20"]
    common += ["--save-every", "5"]
    killed = torchrun_example(
        "pretrain_gpt.py", *common, "--record", str(tmp_path / "a"), "--kill-at", "17", check=False
    )
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-2000:]
    resumed = torchrun_example("pretrain_gpt.py", *common, "--resume", "--record", str(tmp_path / "b")).stdout
    assert "trained 20 steps" in resumed and "token shares realised" in resumed, resumed
    for rank in (0, 1):
        before = json.loads((tmp_path / "a" / f"rank{rank}.json").read_text())
        after = json.loads((tmp_path / "b" / f"rank{rank}.json").read_text())
        assert sorted(map(int, after)) == list(range(16, 21))
        assert [after[str(s)] for s in range(16, 18)] == [before[str(s)] for s in range(16, 18)]
