"""shardkit.ray.write_shards on a real two-node Ray cluster (``ray.cluster_utils.Cluster``: a head and one added
node, each its own raylet and object store), with faults injected for real: a write task that raises on its
first attempt, a worker process SIGKILLed mid-shard, and the added node removed mid-write. After each, the
manifest lists every input record exactly once, nothing outside it is left in the folder, and every shard
verifies.

The Ray driver runs in a child process (tests/scripts/ray_write_check.py, through
``tests/helpers/ray_cluster.py``): a raylet that dies takes its driver down, and that must not be the
pytest worker. It starts the cluster once, runs every case in turn and returns plain data; the tests
here assert on it and on the files each case left."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray", reason="Ray is the optional extra shardkit[ray]; these tests need it installed")

from shardkit.formats.example import decode_example  # noqa: E402
from shardkit.formats.registry import formats  # noqa: E402
from shardkit.ray import record_of  # noqa: E402
from shardkit.shardlist import ShardList  # noqa: E402
from shardkit.writer import ShardWriter  # noqa: E402
from tests.helpers.cli import run_cli  # noqa: E402
from tests.helpers.ray_cluster import case_result, run_cases  # noqa: E402
from tests.helpers.ray_faults import ROWS, rows  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # one child process: a cluster and every case on it


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The driver's run: every case's result, and the folder each case wrote under."""
    return run_cases(tmp_path_factory, "ray_write_check", timeout=600)


def _case(run, name):
    """Case ``name``'s result and its folder."""
    return case_result(run, name), os.path.join(run["folder"], name)


def _ids_in(manifest: str) -> list[int]:
    tfrecord = formats()["tfrecord"]
    shards = ShardList.from_manifest(manifest)
    ids = []
    for url, count in zip(shards.urls(), shards.num_records):
        records = list(tfrecord.read(url))
        assert len(records) == count, url
        ids += [int(decode_example(r)["id"][0]) for r in records]
    return ids


def _assert_committed_exactly_once(out: str) -> None:
    manifest = os.path.join(out, "manifest.arrow")
    assert sorted(_ids_in(manifest)) == list(range(ROWS))
    listed = {os.path.basename(u) for u in ShardList.from_manifest(manifest).urls()}
    expected = {"manifest.arrow"} | listed | {name + ".idx" for name in listed}
    assert set(os.listdir(out)) == expected
    done = run_cli("verify", "--manifest", manifest)
    assert done.returncode == 0, done.stderr


def test_a_dataset_written_on_two_nodes_lists_every_row_once_with_its_count(run):
    result, folder = _case(run, "plain")
    _assert_committed_exactly_once(os.path.join(folder, "out"))
    assert sum(result["num_records"]) == ROWS
    assert all(n <= 40 for n in result["num_records"])


def test_a_task_that_raises_on_its_first_attempt_is_retried_and_its_shards_committed_once(run):
    _, folder = _case(run, "raises_once")
    assert os.path.exists(os.path.join(folder, "raised"))  # the fault fired, in a write task, mid-shard
    _assert_committed_exactly_once(os.path.join(folder, "out"))


def test_a_worker_killed_mid_shard_leaves_no_partial_or_duplicate_shard(run):
    _, folder = _case(run, "killed")
    assert os.path.exists(os.path.join(folder, "killed"))
    _assert_committed_exactly_once(os.path.join(folder, "out"))


def test_shards_hold_the_bytes_shard_writer_writes_for_the_same_rows(run, tmp_path):
    _, folder = _case(run, "same_bytes")
    with ShardWriter(str(tmp_path / "one" / "part-%05d.tfrecord"), max_records=70) as writer:
        for row in rows():
            writer.write(record_of(row, "tfrecord"))
    ours = ShardList.from_manifest(os.path.join(folder, "ray", "manifest.arrow"))
    assert len(ours) == len(writer.shards) == 5
    for a, b in zip(ours.urls(), writer.shards.urls()):
        assert open(a, "rb").read() == open(b, "rb").read()
    tfrecord = formats()["tfrecord"]
    raw_records = [r for url in ShardList.from_manifest(os.path.join(folder, "raw", "manifest.arrow")).urls()
                   for r in tfrecord.read(url)]  # fmt: skip
    assert raw_records == [r["payload"] for r in rows()]


@pytest.mark.parametrize("name", ["tar", "parquet", "jsonl", "megatron"])
def test_every_format_shard_writer_writes_is_written_with_counts_and_verifies(run, name):
    result, folder = _case(run, "every_format")
    counts = result[name]
    assert sum(counts) == 50
    shards = ShardList.from_manifest(os.path.join(folder, name, "manifest.arrow"))
    assert list(shards.num_records) == counts
    fmt = formats()[name]
    assert sorted(len(list(fmt.read(u))) for u in shards.urls()) == sorted(counts)
    done = run_cli("verify", "--manifest", os.path.join(folder, name, "manifest.arrow"))
    assert done.returncode == 0, done.stderr


def test_a_second_run_into_a_written_path_is_refused_and_changes_nothing(run):
    result, folder = _case(run, "second_run")
    by_function, by_sink = result["refused"]
    assert by_function is not None and by_function["type"] == "DatasetExistsError"
    assert "already holds" in by_function["message"]
    assert by_sink is not None and "already holds" in by_sink["message"]  # the sink refuses on its own too
    assert _mtimes(os.path.join(folder, "out")) == result["before"]


# --------------------------------------------------------------------------- shardkit convert --ray


def test_convert_on_the_cluster_writes_what_one_process_writes_and_refuses_a_second_run(run, tmp_path):
    result, folder = _case(run, "convert")
    on_ray, again = result["first"], result["again"]
    assert on_ray["returncode"] == 0, on_ray["stderr"][-3000:]
    assert on_ray["stdout"].strip().startswith(f"{ROWS} records from 3 files -> ")
    one = run_cli("convert", os.path.join(folder, "src", "train-*.tfrecord"),
                  str(tmp_path / "one" / "rows-%05d.parquet"), "--format", "parquet")  # fmt: skip
    assert one.returncode == 0, one.stderr
    parquet = formats()["parquet"]
    read = {
        side: [r for u in ShardList.from_manifest(os.path.join(place, "rows.manifest.arrow")).urls()
               for r in parquet.read(u)]
        for side, place in (("ray", os.path.join(folder, "ray")), ("one", str(tmp_path / "one")))
    }  # fmt: skip
    assert read["ray"] == read["one"] and len(read["ray"]) == ROWS
    names = sorted(os.listdir(os.path.join(folder, "ray")))
    assert names[:2] == ["rows-00000-00000.parquet", "rows-00000-00001.parquet"] and "rows.manifest.arrow" in names
    assert again["returncode"] == 2  # a second run into the same place is refused: two runs never mix
    assert again["stderr"].strip().splitlines()[-1].startswith("shardkit convert: error: ")
    assert "already holds" in again["stderr"]
    assert _mtimes(os.path.join(folder, "ray")) == result["before"]


def test_convert_on_the_cluster_from_a_corrupt_source_exits_1_naming_the_record_and_leaves_nothing(run):
    done, folder = _case(run, "convert_corrupt")
    assert done["returncode"] == 1, done["stderr"][-3000:]
    errors = [line for line in done["stderr"].splitlines() if line.startswith("shardkit convert: error:")]
    assert len(errors) == 1 and "train-00001.tfrecord" in errors[0] and "offset" in errors[0], done["stderr"][-3000:]
    out = os.path.join(folder, "ray")
    assert not os.path.exists(out) or os.listdir(out) == []


def test_the_added_node_removed_mid_write_leaves_every_row_committed_once(run):
    result, folder = _case(run, "node_removed")
    assert result["stalled"], "no write task ran on the added node"
    assert result["finished"] and not result["errors"], result
    _assert_committed_exactly_once(os.path.join(folder, "out"))


def _mtimes(folder: str) -> dict[str, int]:
    return {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in sorted(os.listdir(folder))}
