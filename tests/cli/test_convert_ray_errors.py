"""``shardkit convert --ray`` when Ray cannot be used: one line, exit 2, nothing written (the runs on a cluster
are in tests/test_ray_write.py, beside the cluster they need)."""

from __future__ import annotations

import socket
import sys

import pytest

import shardkit
from tests.helpers.cli import run_cli


def _sources(tmp_path) -> str:
    with shardkit.ShardWriter(str(tmp_path / "src" / "train-%05d.tfrecord"), max_records=5) as writer:
        for i in range(12):
            writer.write(shardkit.encode_example({"id": [i]}))
    return str(tmp_path / "src" / "train-*.tfrecord")


def test_convert_on_ray_without_ray_installed_exits_2_naming_the_extra(tmp_path, monkeypatch):
    sources = _sources(tmp_path)
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where Ray is not installed
    done = run_cli("convert", sources, str(tmp_path / "out" / "x-%05d.jsonl"), "--format", "jsonl", "--ray")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "shardkit convert: error: --ray needs Ray: pip install 'shardkit[ray]' (import of ray halted; None in "
        "sys.modules)"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # imports Ray (seconds)
def test_convert_on_a_ray_address_nothing_answers_on_exits_2_at_once(tmp_path):
    pytest.importorskip("ray", reason="Ray is the optional extra shardkit[ray]")
    sources = _sources(tmp_path)
    with socket.socket() as closed:  # a port that was free a moment ago: nothing listens on it
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    done = run_cli("convert", sources, str(tmp_path / "out" / "x-%05d.jsonl"), "--format", "jsonl",
                   "--ray", f"127.0.0.1:{port}")  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"shardkit convert: error: cannot start or reach the Ray cluster at 127.0.0.1:{port}: nothing answers at "
        f"127.0.0.1:{port} (Connection refused)"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a fresh interpreter
def test_importing_shardkit_and_its_command_line_never_imports_ray():
    from tests.helpers.processes import run_python

    code = "import sys, shardkit, shardkit.cli.main, shardkit.cli.convert; print('ray' in sys.modules)"
    assert run_python("-c", code).stdout.strip() == "False"
