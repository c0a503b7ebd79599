"""``shardkit profile``: the bound it names, the timeline it writes, its one-line errors."""

from __future__ import annotations

import json
import re
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
    names = {e["name"] for e in complete}
    assert {"wait", "map(slow_decode)", "read MapSource", "collate"} <= names
    assert "state" not in names, "workers send their state only when state_dict() asks; profiling never does"
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


def test_a_folder_glob_skips_the_manifest_and_index_files_beside_the_shards(tmp_path, capsys):
    with shardkit.ShardWriter(str(tmp_path / "train-%05d.tfrecord"), max_records=50) as writer:
        for i in range(100):
            writer.write(shardkit.encode_example({"x": np.arange(4, dtype=np.int64) + i}))
    shardkit.build_index(str(tmp_path / "train-00000.tfrecord"))
    out = profiled(capsys, str(tmp_path / "*"), "--batches", "2", "--batch-size", "8")
    assert f"skipped {tmp_path}/train-00000.tfrecord.idx: a shardkit index file" in out
    assert f"skipped {tmp_path}/train.manifest.arrow: a shard manifest" in out
    assert "16 samples in 2 batches" in out and "read TFRecordDataset" in out


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


def svg_rects(svg: str) -> list[dict[str, str]]:
    import xml.etree.ElementTree as ET

    return [node.attrib for node in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}rect")]


def test_the_picture_of_a_real_run_shows_each_workers_stages_and_the_main_loops_wait(pipelines, capsys):
    out = profiled(
        capsys, "pipelines_for_profile:slow_map", "--batches", "12", "--batch-size", "16", "--picture", "run.svg"
    )
    assert out.splitlines()[-1] == "picture: run.svg"
    svg = (pipelines / "run.svg").read_text()
    bars = [rect for rect in svg_rects(svg) if "data-part" in rect]
    rows = {rect["data-row"] for rect in bars}
    assert rows == {"main process", "worker 0", "worker 1"}
    for row in rows:  # each bar is its row's whole wall time, split
        assert sum(float(rect["data-share"]) for rect in bars if rect["data-row"] == row) == pytest.approx(1, abs=0.01)
    main_parts = {rect["data-part"] for rect in bars if rect["data-row"] == "main process"}
    assert main_parts == {"wait", "compute"}
    waited = re.search(r"main process: waited (\d+)% of the loop", out)
    assert waited is not None
    wait_share = next(
        float(r["data-share"]) for r in bars if r["data-row"] == "main process" and r["data-part"] == "wait"
    )
    assert round(wait_share * 100) == int(waited.group(1))  # the picture's figure is the report's
    worker_parts = {rect["data-part"] for rect in bars if rect["data-row"] == "worker 0"}
    assert {"map(slow_decode)", "read MapSource", "collate", "idle"} <= worker_parts
    lanes = re.findall(r'<g data-lane="([^"]+)">', svg)
    assert lanes[0] == "main process: loop" and "worker 1: map(slow_decode)" in lanes
    spans = {rect["data-span"] for rect in svg_rects(svg) if "data-span" in rect}
    assert {"wait", "map(slow_decode)"} <= spans
    assert "bound: a map: map(slow_decode)" in svg
    assert not list(pipelines.glob("run.svg.partial*"))


def test_a_picture_path_that_cannot_be_written_fails_before_the_run(pipelines, capsys):
    line = one_error_line(capsys, "pipelines_for_profile:slow_map", "--batches", "2", "--picture", "no/such/dir.svg")
    assert line == "shardkit profile: error: cannot write the picture to no/such/dir.svg: No such file or directory"
    assert capsys.readouterr().out == ""  # no report: the run never started
    assert "name ending in .svg" in one_error_line(capsys, "pipelines_for_profile:slow_map", "--picture", "run.png")


def test_the_timeline_colours_a_pixel_by_the_share_of_its_time_a_stage_took():
    from shardkit.cli.picture_profile import _WIDTH, profile_picture

    # One lane: "read" runs the whole first second, then 1 ms at the end of every 100 ms of the next.
    events = [{"name": "read", "ph": "X", "pid": 1, "tid": 0, "ts": 0.0, "dur": 1e6}]
    events += [
        {"name": "read", "ph": "X", "pid": 1, "tid": 0, "ts": 1e6 + k * 1e5 + 99e3, "dur": 1e3} for k in range(10)
    ]
    events += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "read"}}]
    svg = profile_picture({"traceEvents": events}, stats(0.5, 0.1, 0.0), "headline", "bound")
    spans = [rect for rect in svg_rects(svg) if rect.get("data-span") == "read"]
    full = [rect for rect in spans if rect["fill-opacity"] == "1"]
    assert len(full) == 1 and float(full[0]["width"]) == _WIDTH / 2  # the first half, one rect
    faint = [rect for rect in spans if rect["fill-opacity"] != "1"]
    # A pixel is 2.86 ms: 1 ms is 0.35 of one, or split over two; every one is faint, none left out.
    assert 10 <= sum(float(rect["width"]) for rect in faint) <= 20
    assert {rect["fill-opacity"] for rect in faint} <= {"0.1", "0.2", "0.3", "0.4"}
