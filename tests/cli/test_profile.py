"""``shardkit profile``: the bound it names, the timeline it writes, its one-line errors."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

import shardkit
from shardkit.cli import main
from shardkit.cli.profile import diagnose
from shardkit.loader.stalls import LoaderStats, WorkerStats

PIPELINES = '''
import time

import shardkit


def slow_decode(x):
    # 10 ms: on a machine loaded ~10 deep, a 2 ms map let the main process fall behind the
    # workers, which then truly waited on transport (the profile said so, rightly).
    time.sleep(0.01)
    return x


class SlowStorage:
    """A plain iterable that takes 2 ms per item, as a slow disk or bucket would."""

    def __iter__(self):
        for item in range(100_000):
            time.sleep(0.002)
            yield item


def slow_map():
    return shardkit.wrap(list(range(4000))).map(slow_decode)


def slow_storage():
    return shardkit.wrap(SlowStorage()).map(str)


def a_loader():
    return shardkit.MixedLoader(slow_map(), batch_size=8, num_workers=1)


def not_a_pipeline():
    return [1, 2, 3]
'''


@pytest.fixture
def pipelines(tmp_path, monkeypatch):
    (tmp_path / "pipelines_for_profile.py").write_text(textwrap.dedent(PIPELINES))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def profiled(capsys, *argv: str) -> str:
    assert main(["profile", *argv]) == 0
    return capsys.readouterr().out


def one_error_line(capsys, *argv: str) -> str:
    assert main(["profile", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardkit profile: error: "), lines
    return lines[0]


def test_a_deliberately_slow_map_is_named_as_the_bound_and_the_trace_holds_every_stage(pipelines, capsys):
    trace = pipelines / "out.json"
    out = profiled(
        capsys, "pipelines_for_profile:slow_map", "--batches", "12", "--batch-size", "16", "--trace", str(trace)
    )
    assert "bound: a map: map(slow_decode)" in out, out
    assert "samples/s" in out and "map(slow_decode)" in out
    events = json.loads(trace.read_text())["traceEvents"]
    complete = [event for event in events if event["ph"] == "X"]
    assert {"wait", "map(slow_decode)", "read MapSource", "collate", "state"} <= {e["name"] for e in complete}
    assert {e["pid"] for e in complete} == {0, 1, 2}, "the main process and each of the 2 workers"
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    assert not list(pipelines.glob("out.json.partial*")), "written under a temporary name, renamed"


def test_a_pipeline_throttled_at_storage_is_named_storage_bound(pipelines, capsys):
    out = profiled(capsys, "pipelines_for_profile:slow_storage", "--batches", "4", "--batch-size", "8")
    assert "bound: storage (read " in out, out
    assert "cache_dir" in out


def test_a_loader_is_profiled_as_it_was_built(pipelines, capsys):
    out = profiled(capsys, "pipelines_for_profile:a_loader", "--batches", "3")
    assert "24 samples in 3 batches" in out and out.count("\n0 ") + out.count("\n1 ") == 1, out


def test_a_glob_of_shards_is_read_with_its_formats_defaults(tmp_path, capsys):
    with shardkit.ShardWriter(str(tmp_path / "train-%05d.tfrecord"), max_records=50) as writer:
        for i in range(100):
            writer.write(shardkit.encode_example({"x": np.arange(4, dtype=np.int64) + i}))
    out = profiled(capsys, str(tmp_path / "train-*.tfrecord"), "--batches", "2", "--batch-size", "8")
    assert "16 samples in 2 batches" in out and "read TFRecordDataset" in out and "MB/s" in out


def test_errors_are_one_line_with_exit_code_2(pipelines, capsys):
    assert "cannot import 'no_such_module'" in one_error_line(capsys, "no_such_module:build")
    assert "has no function 'missing'" in one_error_line(capsys, "pipelines_for_profile:missing")
    assert "returned a list" in one_error_line(capsys, "pipelines_for_profile:not_a_pipeline")
    assert "no files match" in one_error_line(capsys, str(pipelines / "nothing-*.tfrecord"))
    assert "not module:function, nor a glob" in one_error_line(capsys, "just words")
    with pytest.raises(SystemExit) as exited:
        main(["profile", "pipelines_for_profile:slow_map", "--seconds", "1", "--batches", "2"])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def stats(utilisation: float, receive: float, assemble: float, workers: int = 2) -> LoaderStats:
    busy = {"read X": 0.1 * utilisation, "map(f)": 0.9 * utilisation}
    return LoaderStats(
        rank=0, steps=10, wait_seconds=receive + assemble, compute_seconds=0.0, recent_steps=10,
        recent_wait_seconds=receive + assemble, recent_compute_seconds=0.0, receive_seconds=receive,
        assemble_seconds=assemble, stages=busy,
        workers=tuple(WorkerStats(w, 1.0, utilisation, 1 - utilisation, 100, busy) for w in range(workers)),
    )  # fmt: skip


def test_idle_workers_put_the_bound_on_transport_or_on_the_main_process():
    assert diagnose(stats(0.95, 1.0, 0.1))[0] == "a map: map(f)"
    assert diagnose(stats(0.3, 1.0, 0.1))[0] == "transport"
    assert diagnose(stats(0.3, 0.1, 1.0))[0] == "the main process"
    assert diagnose(stats(0.3, 0.1, 1.0, workers=0))[0] == "the main process"
    heavy_state = stats(0.3, 1.0, 0.1)
    heavy_state.stages["state"] = 5.0
    bound, advice = diagnose(heavy_state)
    assert bound.startswith("transport of the dataset state") and "resumable=False" in advice
