"""``shardkit convert --ray`` when Ray cannot be used: one line, exit 2, nothing written (the runs on a cluster
are in tests/test_ray_write.py, beside the cluster they need)."""

from __future__ import annotations

import socket
import sys

import pytest

import shardkit
from shardkit.cli import convert
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


class _SlowStartingRay:
    """Ray as ``start_ray`` meets it: ``init`` raises Ray's own start-up timeout ``failures`` times."""

    TIMEOUT = (
        "The current node timed out during startup. This could happen because some of the raylet failed to startup "
        "or the GCS has become overloaded."
    )

    def __init__(self, failures: int, message: str = TIMEOUT) -> None:
        self.failures, self.message, self.calls = failures, message, []

    def init(self, **kwargs) -> None:
        self.calls.append(("init", kwargs["address"]))
        if len([c for c in self.calls if c[0] == "init"]) <= self.failures:
            raise Exception(self.message)  # Ray raises a bare Exception here (ray/_private/node.py)

    def shutdown(self) -> None:
        self.calls.append(("shutdown", None))


def test_a_local_ray_cluster_that_timed_out_starting_is_shut_down_and_started_again(capsys):
    ray = _SlowStartingRay(failures=2)
    convert.start_ray(ray, None)
    assert ray.calls == [("init", "local"), ("shutdown", None)] * 2 + [("init", "local")]
    assert capsys.readouterr().err.splitlines() == [
        "shardkit convert: the local Ray cluster did not start in time (a busy machine?); starting it again (2 of 3)",
        "shardkit convert: the local Ray cluster did not start in time (a busy machine?); starting it again (3 of 3)",
    ]


@pytest.mark.parametrize(
    ("failures", "message", "address", "inits"),
    [
        (3, _SlowStartingRay.TIMEOUT, None, 3),  # every start timed out: the last error is the user's
        (1, "GCS refused: version mismatch", None, 1),  # not a start-up timeout: no second try
        (1, _SlowStartingRay.TIMEOUT, "auto", 1),  # a cluster at an address is not ours to start again
    ],
)
def test_other_ray_start_failures_and_the_last_timeout_raise_at_once(failures, message, address, inits):
    ray = _SlowStartingRay(failures, message)
    with pytest.raises(Exception, match=message.split(".")[0]):
        convert.start_ray(ray, address)
    assert [c for c in ray.calls if c[0] == "init"] == [("init", address or "local")] * inits
