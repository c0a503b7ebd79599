"""A real torch.distributed (gloo) run: equal batch counts, exactly-once or padded coverage."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.processes import last_json_line, run_python
from tests.helpers.reading import assert_split
from tests.helpers.shards import all_ids, synthetic_shards
from tests.scripts.ddp_check import COUNTS

pytestmark = pytest.mark.slow  # subprocesses, servers or DDP ranks: the inner loop skips them

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ddp_check.py"


def run_ddp(world_size: int, context: str, balance: str) -> dict:
    args = ("--world-size", str(world_size), "--context", context, "--balance", balance)
    # A hang (unequal batch counts) fails at the timeout instead of stalling CI.
    return last_json_line(run_python(str(SCRIPT), *args, timeout=240).stdout)


@pytest.mark.parametrize(
    ("world_size", "context", "balance"),
    [(2, "spawn", "pad"), (3, "fork", "drop"), (2, "fork", "none")],
)
def test_gloo_ranks_yield_equal_batches_and_cover_the_data(world_size, context, balance):
    result = run_ddp(world_size, context, balance)
    assert len(set(result["batches"])) == 1 or balance == "none", result["batches"]
    assert_split([[ids] for ids in result["ids"]], all_ids(synthetic_shards(COUNTS)), balance)
