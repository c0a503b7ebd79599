"""Smoke test: ``benchmarks/compare.py --quick`` runs to the end and prints its table.

It asserts nothing about the numbers (2 shared cores make them noisy); the
table itself says whether the targets were met.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses, servers or DDP ranks: the inner loop skips them

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "compare.py"
HEADER = "| loader | samples/s | shardkit is |"


@pytest.mark.timeout(300)
def test_compare_quick_runs_and_prints_the_table(tmp_path: Path) -> None:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--dir", str(tmp_path / "content")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert HEADER in done.stdout, done.stdout[-4000:]
    assert "| start method |" in done.stdout, done.stdout[-4000:]
