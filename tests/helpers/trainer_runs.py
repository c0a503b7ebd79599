"""The examples' trainer runs under torchrun, and what they record (``--record``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tests.helpers.processes import REPO, free_port


def launch(args: list[str], *, torchrun: bool, timeout: int = 180) -> subprocess.CompletedProcess[str]:
    """``python [-m torch.distributed.run --nproc_per_node=2] *args`` from the repository, output captured."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(free_port())}
    env.pop("SHARDKIT_EXAMPLE_DATA", None)
    prefix = ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={env['MASTER_PORT']}"]
    command = [sys.executable, *(prefix if torchrun else []), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def recorded_steps(folder: Path, rank: int) -> dict[int, dict]:
    """Each global step a rank trained, by step: ``{"step", "epoch", "ids"}`` (``rank{r}.steps.jsonl``)."""
    lines = (folder / f"rank{rank}.steps.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    by_step = {s["step"]: s for s in steps}
    assert len(by_step) == len(steps), f"rank {rank} recorded a step twice"
    return by_step


def recorded_reads(folder: Path) -> Counter[int]:
    """How often the pipelines of every rank and worker read (mapped) each id (``rank{r}.reads.{pid}``)."""
    return Counter(int(line) for path in folder.glob("rank*.reads.*") for line in path.read_text().split())
