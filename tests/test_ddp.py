"""A real torch.distributed (gloo) run: equal batch counts, exactly-once or padded coverage."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ddp_check import COUNTS
from tests.helpers import all_ids, synthetic_shards

pytestmark = pytest.mark.slow  # subprocesses, servers or DDP ranks: the inner loop skips them

SCRIPT = Path(__file__).with_name("ddp_check.py")


def run_ddp(world_size: int, context: str, balance: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--world-size", str(world_size), "--context", context, "--balance", balance],
        capture_output=True,
        text=True,
        timeout=240,  # a hang (unequal batch counts) fails here instead of stalling CI
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("world_size", "context", "balance"),
    [(2, "spawn", "pad"), (3, "fork", "drop"), (2, "fork", "none")],
)
def test_gloo_ranks_yield_equal_batches_and_cover_the_data(world_size, context, balance):
    result = run_ddp(world_size, context, balance)
    everything = all_ids(synthetic_shards(COUNTS))
    seen = collections.Counter(i for rank_ids in result["ids"] for i in rank_ids)
    if balance == "none":
        assert sorted(seen.elements()) == sorted(everything)
        return
    assert len(set(result["batches"])) == 1, result["batches"]
    per_rank = {len(ids) for ids in result["ids"]}
    total = len(everything)
    assert per_rank == {-(-total // world_size) if balance == "pad" else total // world_size}
    if balance == "pad":
        assert set(seen) == set(everything)
    else:
        assert max(seen.values()) == 1 and len(set(everything) - set(seen)) == total % world_size
