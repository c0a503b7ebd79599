"""The `shardkit plan` and `shardkit demo` commands, and topology detection."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import shardkit
from shardkit.cli import main
from tests.helpers.load import hang_bound


def test_plan_prints_every_reader_and_equal_rank_totals(tmp_path, capsys):
    manifest = str(tmp_path / "m.arrow")
    shardkit.ShardList([f"{tmp_path}/s{i}.tfrecord" for i in range(5)], num_records=[10, 0, 7, 30, 4]).to_manifest(
        manifest
    )
    assert main(["plan", manifest, "--world-size", "2", "--num-workers", "3", "--shuffle", "--seed", "4"]) == 0
    out = capsys.readouterr().out
    assert "5 shards, 51 records; world_size=2, num_workers=3" in out
    rows = re.findall(r"^\s+(\d)\s+(\d)\s+(\d+)\s+(\d+)", out, flags=re.M)
    assert [(r, w) for r, w, _, _ in rows] == [(str(r), str(w)) for r in range(2) for w in range(3)]
    per_worker = [int(n) for _, _, n, _ in rows]
    assert per_worker[:3] == per_worker[3:]  # worker w reads the same count on every rank
    assert "records per rank: 26, 26" in out


def test_plan_reports_bad_arguments_without_a_traceback(tmp_path, capsys):
    manifest = str(tmp_path / "m.arrow")
    shardkit.ShardList(["a", "b"], num_records=[1, None]).to_manifest(manifest)
    assert main(["plan", manifest, "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardkit plan: error: balance='pad' needs the record count of every shard")
    assert main(["plan", manifest, "--world-size", "2", "--balance", "none"]) == 0
    assert "unknown records" in capsys.readouterr().out


@pytest.mark.slow  # a new interpreter importing torch: seconds of CPU
def test_demo_runs_end_to_end(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "shardkit", "demo", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=hang_bound(300),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "equal batch counts across ranks: yes; missing samples: 0" in out
    assert "MixedLoader: {w0:16, w1:16}" in out and "DataLoader : {w0:32}" in out
    assert out.rstrip().endswith("shardkit demo: ok")
    written = sorted(path.name for path in tmp_path.iterdir())  # no .partial file left behind
    assert written == [f"train-{i:05d}.tfrecord" for i in range(6)] + ["train.manifest.arrow"]


def test_topology_detection_order(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert shardkit.Topology.current() == shardkit.Topology(0, 1, 0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert shardkit.Topology.current() == shardkit.Topology(2, 4, 0, 1)
    assert shardkit.Topology.current(rank=1, world_size=2) == shardkit.Topology(1, 2, 0, 1)
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: SimpleNamespace(id=2, num_workers=3))
    topology = shardkit.Topology.current()
    assert (topology.worker_id, topology.num_workers, topology.reader_index, topology.num_readers) == (2, 3, 8, 12)
    with pytest.raises(ValueError, match=r"worker_id must be an int in \[0, num_workers\) = \[0, 3\), got 3"):
        shardkit.Topology.current(worker_id=3)


@pytest.mark.slow  # a new interpreter importing torch: seconds of CPU
def test_a_clone_run_from_its_parent_folder_imports_the_package_not_the_folder(tmp_path):
    # A clone named like the package, run from its parent: the folder must not
    # shadow the installed package as an empty namespace package.
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "shardkit").symlink_to(root)
    code = "import shardkit; print(shardkit.__file__); print(len(dir(shardkit)))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=hang_bound(60)
    )
    assert done.returncode == 0, done.stderr
    path, names = done.stdout.split()
    assert path.endswith("__init__.py")
    assert int(names) > 10
