"""The CLI as a process: ``python -m shardkit`` works, and a closed pipe ends it quietly (exit 141)."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

import shardkit
from shardkit.cli import EXIT_PIPE
from tests.helpers.load import hang_bound
from tests.helpers.processes import run_python


def shell(command: str, cwd) -> subprocess.CompletedProcess:
    """``command`` in bash with pipefail, so the exit code is shardkit's, not the reader's."""
    return subprocess.run(
        ["bash", "-c", f"set -o pipefail; {command}"], capture_output=True, text=True, timeout=hang_bound(300), cwd=cwd
    )


def write_shards(root) -> None:
    with shardkit.ShardWriter(str(root / "train-%05d.tfrecord"), max_records=2) as w:
        for n in range(6):
            w.write(b"r%d" % n)


def test_python_dash_m_shardkit_shows_the_help():
    done = run_python("-m", "shardkit", "--help")
    assert "usage: shardkit" in done.stdout and "convert" in done.stdout


def test_python_dash_m_shardkit_returns_the_commands_exit_code(tmp_path):
    done = run_python("-m", "shardkit", "verify", str(tmp_path / "absent.tfrecord"), check=False)
    assert done.returncode == 2 and done.stderr.startswith("shardkit verify: error: ")


def test_plan_into_head_ends_quietly_when_head_stops_reading(tmp_path):
    write_shards(tmp_path)
    python = shlex.quote(sys.executable)
    # 2,500 lines, far more than a pipe holds: shardkit is still writing when head exits
    done = shell(f"{python} -m shardkit plan train.manifest.arrow --world-size 50 --num-workers 50 | head -2", tmp_path)
    assert done.stderr == ""
    assert len(done.stdout.splitlines()) == 2
    assert done.returncode == EXIT_PIPE


def test_verify_into_a_closed_pipe_ends_quietly(tmp_path):
    write_shards(tmp_path)
    python = shlex.quote(sys.executable)
    done = shell(f"{python} -m shardkit verify 'train-*.tfrecord' | true", tmp_path)
    assert done.stderr == ""
    assert done.returncode == EXIT_PIPE


@pytest.mark.slow
def test_demo_into_a_closed_pipe_ends_quietly(tmp_path):
    python = shlex.quote(sys.executable)
    done = shell(f"{python} -m shardkit demo --workdir data | head -3", tmp_path)
    assert done.stderr == ""
    assert len(done.stdout.splitlines()) == 3
