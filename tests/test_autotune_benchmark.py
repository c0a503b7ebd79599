"""Smoke test: ``benchmarks/autotune.py --quick`` runs to the end and prints every workload's table.

It asserts nothing about the numbers (2 shared cores make them noisy); the
script itself says whether the targets were met.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # DataLoader workers and a server process: the inner loop skips it

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_autotune_benchmark_quick_runs_every_workload_and_compares_auto_with_the_best():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "autotune.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for workload in ("cheap", "map", "remote"):
        assert f"### {workload}:" in done.stdout, done.stdout[-3000:]
    assert done.stdout.count("auto / best (") == 3, done.stdout[-3000:]
    assert "targets met on" in done.stdout
