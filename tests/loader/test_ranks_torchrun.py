"""Every rank's state in one checkpoint under torchrun (issue 24): 2 gloo ranks gather their
states through the job's store, resume from their own entries, and a state_dict() called on
rank 0 alone raises within the job's timeout instead of hanging (tests/scripts/ranks_check.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.load import hang_bound
from tests.helpers.processes import REPO, free_port

TIMEOUT = 6  # the job's timeout (init_process_group), which bounds the wait for the other ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    port = str(free_port())
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
        str(REPO / "tests" / "scripts" / "ranks_check.py"), "--timeout", str(TIMEOUT), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=hang_bound(240), env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["mixed", "stateful"])
def test_every_rank_saves_the_state_of_both_ranks_and_resumes_from_its_own_entry(ranks, loader):
    reports = [rank[loader] for rank in ranks]
    assert all(report["kind"] == "ranks" and report["world_size"] == 2 for report in reports)
    assert reports[0]["digest"] == reports[1]["digest"], "the ranks saved different checkpoints"
    assert all(report["exact"] for report in reports), reports
    assert [report["samples"] for report in reports] == [76, 76]  # 151 records, padded to 2 x 76


@pytest.mark.slow
def test_state_dict_on_rank_0_alone_raises_naming_the_fix_within_the_jobs_timeout(ranks):
    alone = ranks[0]["alone"]
    assert alone["error"] is not None, "state_dict() on rank 0 alone returned"
    assert "rank(s) 1 did not save their state within 6 s" in alone["error"]
    assert "call state_dict() on every rank" in alone["error"] and "state_dict(gather=False)" in alone["error"]
    assert TIMEOUT <= alone["seconds"] < TIMEOUT + 5
