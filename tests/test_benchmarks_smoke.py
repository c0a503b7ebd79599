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


@pytest.mark.timeout(300)
def test_shuffle_benchmark_quick_runs_and_scores_every_loader(tmp_path: Path) -> None:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "shuffle.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 7, done.stdout  # header, reference, five loaders
    assert all(row.rstrip().endswith("0 / 0 |") for row in rows[2:]), done.stdout  # nothing lost or repeated


@pytest.mark.timeout(300)
def test_formats_benchmark_quick_runs_and_loses_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "formats.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if "duplicates" in line]
    assert len(rows) == 10, done.stdout  # 2 + 2 tar, 4 Parquet, 2 JSON lines
    shardkit_rows = [row for row in rows if "shardkit" in row]
    assert all("0 duplicates, 0 missing" in row for row in shardkit_rows), done.stdout


@pytest.mark.timeout(300)
def test_packing_benchmark_quick_runs_and_every_packer_keeps_every_token(tmp_path: Path) -> None:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "packing.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # a packer that lost tokens exits 1
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")}
    assert "shardkit best_fit" in rows and "shardkit concat" in rows, done.stdout
    assert float(rows["shardkit best_fit"][3]) >= 0.99, done.stdout  # the fill column


@pytest.mark.timeout(300)
def test_stalls_benchmark_quick_runs_and_prints_the_cost_of_both_cases() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "stalls.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| resumable=")]
    assert len(rows) == 2 and all("%" in row for row in rows), done.stdout


@pytest.mark.timeout(300)
def test_remote_benchmark_quick_reads_every_loader_over_its_loopback_server(tmp_path: Path) -> None:
    """Restored: in one CI run its shardkit round waited on an HTTP listing (aiohttp's 5-minute bound, the
    only one then). A listing now gets 30 s per try and 60 s in all; a stall past the timeout prints every
    process's stacks (``run_python``)."""
    from tests.helpers.processes import run_python

    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    script = str(ROOT / "benchmarks" / "remote.py")
    args = ("--quick", "--startup", "10000", "--dir", str(tmp_path / "data"))
    done = run_python(script, *args, timeout=280, cwd=ROOT, env=env)
    rows = [line for line in done.stdout.splitlines() if line.startswith("| shardkit, HTTP |")]
    assert len(rows) == 2 and not any("failed" in row for row in rows), done.stdout[-3000:]  # 0 and 30 ms
    assert all("LIST at build" in row for row in rows), done.stdout[-3000:]  # given a glob, listed while built
