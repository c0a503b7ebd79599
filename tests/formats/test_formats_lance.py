"""Lance datasets read in place: datasets pylance writes, row for row, split, resumed, pinned and damaged."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pyarrow as pa
import pytest

import shardkit
from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.lance import LanceFormat, fragment_url
from tests.helpers.elastic import elastic_property
from tests.helpers.reading import assert_split, ids_per_rank, rank_factory, sample_id

lance = pytest.importorskip("lance")

ROWS = 50  # in fragments of 16, 16, 16 and 2


def table(first: int = 0, count: int = ROWS) -> pa.Table:
    """Rows ``first..first+count``: a column of each kind Lance users keep (nulls in some)."""
    ids = list(range(first, first + count))
    vector = pa.FixedSizeListArray.from_arrays(pa.array([float(i) / 8 for i in ids for _ in range(4)], pa.float32()), 4)
    return pa.table({
        "id": pa.array(ids, pa.int64()),
        "score": pa.array([i * 0.5 for i in ids], pa.float64()),
        "text": pa.array([None if i % 7 == 3 else f"row {i} é" for i in ids]),
        "blob": pa.array([bytes([i % 256]) * (i % 5) for i in ids], pa.binary()),
        "flag": pa.array([i % 2 == 0 for i in ids]),
        "tags": pa.array([[f"t{j}" for j in range(i % 3)] for i in ids], pa.list_(pa.string())),
        "vector": vector,
        "meta": pa.array([{"a": i, "b": str(-i)} for i in ids]),
    })  # fmt: skip


@pytest.fixture
def uri(tmp_path) -> str:
    path = str(tmp_path / "table.lance")
    lance.write_dataset(table(), path, max_rows_per_file=16)
    return path


def test_rows_equal_what_lance_reads_in_order_with_each_column_type(uri) -> None:
    rows = list(shardkit.LanceDataset(uri, balance="none"))
    assert rows == lance.dataset(uri).to_table().to_pylist() == table().to_pylist()
    dataset = shardkit.LanceDataset(uri)
    assert dataset.shards.num_records.tolist() == [16, 16, 16, 2]  # from the manifest


def test_columns_are_projected_and_batches_are_numpy_columns_of_one_fragment(uri) -> None:
    assert list(shardkit.LanceDataset(uri, balance="none", columns=["id", "text"]))[3] == {"id": 3, "text": None}
    batches = list(shardkit.LanceDataset(uri, balance="none", batch_size=5, columns=["id", "vector"]))
    assert [len(b["id"]) for b in batches] == [5, 5, 5, 1] * 3 + [2]
    assert np.concatenate([b["id"] for b in batches]).tolist() == list(range(ROWS))
    vectors = table()["vector"].to_numpy(zero_copy_only=False)
    assert batches[1]["vector"].shape == (5, 4) and batches[1]["vector"].dtype == np.float32  # an embedding: 2-D
    assert np.array_equal(batches[1]["vector"], np.stack(vectors[5:10]))


# Spawned workers cost ~6 s a rank: with workers, "none" (exactly once); pad/drop in one process.
@pytest.mark.parametrize(
    ("balance", "num_workers"),
    [("none", 0), ("pad", 0), ("drop", 0), pytest.param("none", 2, marks=pytest.mark.slow)],
)
def test_every_row_exactly_once_over_two_ranks_and_workers(uri, balance, num_workers) -> None:
    make = rank_factory(shardkit.LanceDataset, uri, balance=balance, shuffle=True, seed=3, columns=["id"])
    ranks = ids_per_rank(make, world_size=2, num_workers=num_workers, batch_size=3, context="spawn")
    assert_split(ranks, [str(i) for i in range(ROWS)], balance)


@pytest.mark.slow
def test_a_worker_forked_after_lance_was_used_is_refused_naming_spawn_not_left_hanging(uri) -> None:
    from torch.utils.data import DataLoader

    dataset = shardkit.LanceDataset(uri, balance="none", columns=["id"])  # pins its version: Lance used here
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=120)
    with pytest.raises(ShardkitError, match="forked from one that used Lance.*multiprocessing_context='spawn'"):
        list(loader)


@pytest.mark.slow
def test_spawned_workers_read_every_row_once(uri) -> None:
    from torch.utils.data import DataLoader

    dataset = shardkit.LanceDataset(uri, balance="none", shuffle=True, columns=["id"])
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    assert sorted(r["id"] for r in loader) == list(range(ROWS))


def test_a_state_saved_mid_epoch_resumes_a_fresh_dataset_with_exactly_the_rest(uri) -> None:
    def dataset() -> shardkit.LanceDataset:
        return shardkit.LanceDataset(uri, shuffle=True, seed=5, rank=0, world_size=2, columns=["id"])

    whole = [r["id"] for r in dataset()]
    interrupted = dataset()
    iterator = iter(interrupted)
    delivered = [next(iterator)["id"] for _ in range(9)]
    state = json.loads(json.dumps(interrupted.state_dict()))
    fresh = dataset()
    fresh.load_state_dict(state)
    assert delivered + [r["id"] for r in fresh] == whole and len(whole) == ROWS // 2


@pytest.fixture(scope="module")
def module_uri(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("lance") / "table.lance")
    lance.write_dataset(table(), path, max_rows_per_file=16)
    return path


@pytest.mark.slow
def test_a_state_saved_on_two_ranks_resumes_on_one_or_three_ranks_exactly_once(module_uri) -> None:
    def make(rank: int, world_size: int, balance: str):
        dataset = shardkit.LanceDataset(
            module_uri, columns=["id"], shuffle=True, seed=8, balance=balance, rank=rank, world_size=world_size
        )
        return dataset.map(sample_id)

    elastic_property(make, [str(i) for i in range(ROWS)])


def test_an_append_or_delete_committed_mid_epoch_changes_nothing_the_epoch_or_its_resume_reads(uri) -> None:
    dataset = shardkit.LanceDataset(uri, balance="none", columns=["id"])
    iterator = iter(dataset)
    first = [next(iterator)["id"] for _ in range(10)]
    state = dataset.state_dict()
    lance.write_dataset(table(ROWS, 30), uri, mode="append", max_rows_per_file=16)
    lance.dataset(uri).delete("id < 40")
    rest = [r["id"] for r in iterator]
    assert first + rest == list(range(ROWS))
    resumed = shardkit.LanceDataset(uri, balance="none", columns=["id"], version=dataset.version)
    resumed.load_state_dict(state)
    assert [r["id"] for r in resumed] == list(range(10, ROWS))
    latest = shardkit.LanceDataset(uri, balance="none", columns=["id"])  # a new dataset sees the new version
    assert latest.version > dataset.version and [r["id"] for r in latest] == list(range(40, ROWS + 30))


@pytest.mark.slow
def test_a_dataset_on_s3_reads_the_same_rows_and_batches_as_the_local_copy(uri, s3_server) -> None:
    """Lance reads its object store itself (S3, GCS, Azure, local; no plain HTTP store), so S3 it is."""
    from tests.helpers.servers import lance_s3_options, upload_tree

    root = upload_tree(s3_server.storage_options(), uri, s3_server.new_bucket(), "table.lance")
    options = lance_s3_options(s3_server.storage_options())
    remote = list(shardkit.LanceDataset(root, shuffle=True, seed=4, storage_options=options))
    assert remote == list(shardkit.LanceDataset(uri, shuffle=True, seed=4)) and len(remote) == ROWS
    batches = list(shardkit.LanceDataset(root, batch_size=5, columns=["id", "vector"], storage_options=options))
    local = list(shardkit.LanceDataset(uri, batch_size=5, columns=["id", "vector"]))
    assert len(batches) == len(local)
    for a, b in zip(batches, local):
        assert all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in ("id", "vector"))


def _data_files(uri: str) -> list[str]:
    fragments = lance.dataset(uri).get_fragments()
    return [os.path.join(uri, "data", f.metadata.files[0].path) for f in fragments]


def test_a_truncated_data_file_is_a_located_error_or_a_counted_skip(uri) -> None:
    second = _data_files(uri)[1]
    with open(second, "r+b") as f:
        f.truncate(os.path.getsize(second) // 2)
    url = fragment_url(uri, lance.dataset(uri).get_fragments()[1].fragment_id, lance.dataset(uri).version)
    with pytest.raises(CorruptRecordError, match=rf"{url}: record 0 .*the fragment does not read"):
        list(shardkit.LanceDataset(uri, balance="none"))
    lenient = shardkit.LanceDataset(uri, balance="none", on_error="skip", columns=["id"])
    with pytest.warns(UserWarning, match="skipping 16 records"):
        ids = [r["id"] for r in lenient]
    assert ids == [i for i in range(ROWS) if not 16 <= i < 32]
    assert lenient.stats().skipped.tolist() == [0, 16, 0, 0]


def test_a_missing_data_file_is_a_located_error_or_a_counted_skip(uri) -> None:
    os.remove(_data_files(uri)[2])
    with pytest.raises(CorruptRecordError, match=r"#fragment=2&version=1: record 0 .*the fragment does not read"):
        list(shardkit.LanceDataset(uri, balance="none"))
    lenient = shardkit.LanceDataset(uri, balance="none", on_error="skip", columns=["id"])
    with pytest.warns(UserWarning, match="skipping 16 records"):
        ids = [r["id"] for r in lenient]
    assert ids == [i for i in range(ROWS) if not 32 <= i < 48]


def test_a_fragment_shorter_than_its_manifest_is_a_located_error_not_a_short_read(uri, monkeypatch) -> None:
    fmt = LanceFormat(columns=["id"])
    url = fragment_url(uri, 0, 1)
    fragment = fmt.fragment(url)
    short = type("Short", (), {"metadata": fragment.metadata, "to_batches": lambda self, **kw: iter([])})()
    monkeypatch.setattr(fmt, "fragment", lambda url: short)  # the manifest says 16 rows; the data holds none
    with pytest.raises(
        CorruptRecordError, match=r"record 0 .*the fragment ended after 0 rows; version 1's manifest says 16"
    ):
        list(fmt.read(url))


def test_a_url_that_names_no_fragment_says_how_to_read_a_lance_dataset(uri) -> None:
    with pytest.raises(ShardkitError, match=r"names no Lance fragment .* shardkit.LanceDataset\(uri\)"):
        list(LanceFormat().read(uri))


def test_without_pylance_the_error_names_the_extra(uri, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "lance", None)
    with pytest.raises(ShardkitError, match=r"pip install 'shardkit\[lance\]'"):
        shardkit.LanceDataset(uri)


def test_inspect_plan_and_convert_take_the_dataset_directory_and_its_manifest_counts(uri, tmp_path) -> None:
    import pyarrow.parquet as pq

    from tests.helpers.cli import run_cli

    inspected = run_cli("inspect", uri)
    assert inspected.returncode == 0, inspected.stderr
    assert inspected.stdout.count("16 records; format: lance") == 3 and "2 records; format: lance" in inspected.stdout
    planned = run_cli("plan", uri, "--world-size", "2")
    assert planned.returncode == 0 and "4 shards, 50 records" in planned.stdout and "25, 25" in planned.stdout
    done = run_cli("convert", uri, str(tmp_path / "rows-%03d.parquet"), "--format", "parquet")
    assert done.returncode == 0, done.stderr
    assert pq.read_table(str(tmp_path / "rows-000.parquet")).to_pylist() == table().to_pylist()


@pytest.mark.slow
@pytest.mark.parametrize("through", ["tfrecord", "array_record"])
def test_convert_to_tf_examples_and_back_to_parquet_keeps_every_row(tmp_path, through) -> None:
    """The columns a tf.Example can hold (no nulls, no structs), exact but for its types: text as UTF-8 bytes,
    a vector as a list."""
    import pyarrow.parquet as pq

    from tests.helpers.cli import run_cli

    columns = ["id", "score", "blob", "flag", "vector"]
    source = table().select(columns)
    uri = str(tmp_path / "t.lance")
    lance.write_dataset(source, uri, max_rows_per_file=16)
    there = run_cli("convert", uri, str(tmp_path / "ex" / f"r-%03d.{through}"), "--format", through)
    assert there.returncode == 0, there.stderr
    back = run_cli(
        "convert", str(tmp_path / "ex" / f"*.{through}"), str(tmp_path / "r-%03d.parquet"), "--format", "parquet"
    )
    assert back.returncode == 0, back.stderr
    got = pq.read_table(str(tmp_path / "r-000.parquet")).to_pylist()
    want = [{**row, "flag": int(row["flag"])} for row in source.to_pylist()]
    assert got == want


# --------------------------------------------------------------------------- convert to Lance


def every_type(first: int, count: int) -> pa.Table:
    """:func:`table`'s columns and the other types a Parquet file holds and the Lance reader gives back."""
    import datetime

    ids = list(range(first, first + count))
    more = pa.table({
        "small": pa.array([i - 20 for i in ids], pa.int32()),
        "half": pa.array([i / 4 for i in ids], pa.float32()),
        "when": pa.array([datetime.datetime(2026, 1, 1) + datetime.timedelta(seconds=i) for i in ids], pa.timestamp("us")),
        "day": pa.array([datetime.date(2026, 1, 1) + datetime.timedelta(days=i) for i in ids], pa.date32()),
    })  # fmt: skip
    base = table(first, count)
    return pa.table({**{n: base[n] for n in base.column_names}, **{n: more[n] for n in more.column_names}})


def leftovers(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_convert_parquet_to_lance_keeps_every_column_type_and_back_to_parquet_every_value(tmp_path) -> None:
    import pyarrow.parquet as pq

    from tests.helpers.cli import run_cli

    source = pa.concat_tables([every_type(0, 30), every_type(30, 20)])
    pq.write_table(source.slice(0, 30), str(tmp_path / "a.parquet"))
    pq.write_table(source.slice(30), str(tmp_path / "b.parquet"))
    out = tmp_path / "out"
    done = run_cli(
        "convert", str(tmp_path / "*.parquet"), str(out / "t.lance"), "--format", "lance", "--max-records", "16"
    )
    assert done.returncode == 0, done.stderr
    assert "50 records from 2 files -> 4 lance fragments" in done.stdout
    assert leftovers(out) == ["t.lance"]  # no temporary directory beside it
    written = lance.dataset(str(out / "t.lance"))
    assert written.schema == source.schema and written.to_table().equals(source)  # the Parquet types kept
    assert [f.metadata.num_rows for f in written.get_fragments()] == [16, 16, 16, 2]
    assert list(shardkit.LanceDataset(str(out / "t.lance"))) == source.to_pylist()
    back = run_cli("convert", str(out / "t.lance"), str(tmp_path / "back-%03d.parquet"), "--format", "parquet")
    assert back.returncode == 0, back.stderr
    assert pq.read_table(str(tmp_path / "back-000.parquet")).to_pylist() == source.to_pylist()


def test_convert_lance_to_a_new_lance_dataset_keeps_its_types_rows_and_fragment_sizes(uri, tmp_path) -> None:
    from tests.helpers.cli import run_cli

    done = run_cli("convert", uri, str(tmp_path / "copy.lance"), "--format", "lance", "--max-records", "16")
    assert done.returncode == 0, done.stderr
    copy = lance.dataset(str(tmp_path / "copy.lance"))
    assert copy.schema == lance.dataset(uri).schema and copy.to_table().equals(table())
    assert [f.metadata.num_rows for f in copy.get_fragments()] == [16, 16, 16, 2]


def test_convert_tf_examples_to_lance_and_on_to_parquet_gives_the_rows_a_direct_conversion_gives(tmp_path) -> None:
    import pyarrow.parquet as pq

    from tests.helpers.cli import run_cli

    with shardkit.TFRecordWriter(str(tmp_path / "src.tfrecord")) as writer:
        for n in range(40):
            box = np.array([0.1 * n, 0.5, 1.0, 2.0], np.float32)
            writer.write(
                shardkit.encode_example({"label": n, "image": [bytes([n, 255])], "box": box, "tags": [b"a"] * (n % 3)})
            )
    src = str(tmp_path / "src.tfrecord")
    assert run_cli("convert", src, str(tmp_path / "t.lance"), "--format", "lance").returncode == 0
    assert (
        run_cli(
            "convert", str(tmp_path / "t.lance"), str(tmp_path / "via-%02d.parquet"), "--format", "parquet"
        ).returncode
        == 0
    )
    assert run_cli("convert", src, str(tmp_path / "direct-%02d.parquet"), "--format", "parquet").returncode == 0
    direct = pq.read_table(str(tmp_path / "direct-00.parquet"))
    assert pq.read_table(str(tmp_path / "via-00.parquet")).to_pylist() == direct.to_pylist()
    assert lance.dataset(str(tmp_path / "t.lance")).schema.field("box").type == pa.list_(pa.float32())
    assert direct.num_rows == 40 and direct.column("image").to_pylist()[3] == bytes([3, 255])


def two_tfrecord_files(tmp_path, counts=(20_000, 10_000)) -> str:
    rng = np.random.default_rng(0)
    first = 0
    for part, count in enumerate(counts):
        with shardkit.TFRecordWriter(str(tmp_path / f"src-{part}.tfrecord")) as writer:
            for n in range(first, first + count):
                writer.write(shardkit.encode_example({"id": n, "payload": [rng.bytes(100)]}))
        first += count
    return str(tmp_path / "src-*.tfrecord")


@pytest.mark.slow
def test_a_source_truncated_mid_write_is_exit_1_naming_the_record_and_leaves_no_dataset_and_no_temporary(
    tmp_path,
) -> None:
    from tests.helpers.cli import run_cli

    sources = two_tfrecord_files(tmp_path)
    second = tmp_path / "src-1.tfrecord"
    with open(second, "r+b") as f:
        f.truncate(os.path.getsize(second) // 2 + 7)  # inside record 5,000 of the second file
    out = tmp_path / "out"
    out.mkdir()
    done = run_cli("convert", sources, str(out / "t.lance"), "--format", "lance", "--max-records", "1000")
    assert done.returncode == 1
    assert "src-1.tfrecord: record 5000 at byte offset" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert leftovers(out) == []  # the first file's data files were written before it: gone with their folder


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:lance is not fork-safe")  # the fork before exec that sets the limit
def test_a_disk_that_refuses_a_data_file_is_one_line_exit_2_and_leaves_nothing(tmp_path) -> None:
    """The write fails for real inside Lance: the process may not write a file past 1 MB (EFBIG)."""
    import resource
    import signal
    import subprocess

    sources = two_tfrecord_files(tmp_path, counts=(20_000,))

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG to the writer, not death by signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))

    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "shardkit", "convert", sources, str(out / "t.lance"), "--format", "lance"]
    done = subprocess.run(command, preexec_fn=limit, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    error = done.stderr.strip().splitlines()
    assert len(error) == 1 and "t.lance: Lance could not write the dataset" in error[0] and "File too large" in error[0]
    assert leftovers(out) == []


def test_rows_that_change_type_after_the_first_batch_are_refused_naming_them_and_nothing_is_left(tmp_path) -> None:
    from shardkit.writer import LANCE_CHUNK_ROWS
    from tests.helpers.cli import run_cli

    with open(tmp_path / "rows.jsonl", "w") as f:
        for n in range(LANCE_CHUNK_ROWS + 5):
            f.write(json.dumps({"id": n, "label": n if n < LANCE_CHUNK_ROWS else f"label {n}"}) + "\n")
    done = run_cli("convert", str(tmp_path / "rows.jsonl"), str(tmp_path / "out" / "t.lance"), "--format", "lance")
    assert done.returncode == 2
    assert f"rows {LANCE_CHUNK_ROWS}..{LANCE_CHUNK_ROWS + 4} do not fit one Lance schema" in done.stderr
    assert leftovers(tmp_path / "out") == []


def test_a_column_missing_from_the_first_row_is_refused_not_dropped(tmp_path) -> None:
    from tests.helpers.cli import run_cli

    with open(tmp_path / "rows.jsonl", "w") as f:
        f.writelines(json.dumps({"id": n, **({"extra": n} if n else {})}) + "\n" for n in range(5))
    done = run_cli("convert", str(tmp_path / "rows.jsonl"), str(tmp_path / "t.lance"), "--format", "lance")
    assert done.returncode == 2 and "hold columns ['extra']" in done.stderr
    assert not os.path.exists(tmp_path / "t.lance")


def test_an_existing_or_remote_destination_is_refused_before_anything_is_written(uri, tmp_path) -> None:
    from tests.helpers.cli import run_cli

    before = lance.dataset(uri).version
    done = run_cli("convert", uri, uri, "--format", "lance")
    assert done.returncode == 2 and "exists: a Lance dataset is written only where nothing is" in done.stderr
    assert lance.dataset(uri).version == before and lance.dataset(uri).to_table().equals(table())
    remote = run_cli("convert", uri, "s3://bucket/t.lance", "--format", "lance")
    assert remote.returncode == 2 and "written to a local directory" in remote.stderr
    on_ray = run_cli("convert", uri, str(tmp_path / "t.lance"), "--format", "lance", "--ray")
    assert on_ray.returncode == 2 and "leave out --ray" in on_ray.stderr
    assert leftovers(tmp_path) == ["table.lance"]
