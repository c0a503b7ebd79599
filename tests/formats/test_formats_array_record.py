"""ArrayRecord (Grain's format) read in place: byte-exact with the array-record package's own reader on
files its own writer wrote, counts from the footer, exactly once over ranks and workers, exact resume,
and every kind of damage a located error or a counted skip."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from torch.utils.data import DataLoader

import shardkit
from shardkit.errors import CorruptRecordError
from shardkit.formats.array_record import ArrayRecordFormat
from tests.helpers.elastic import elastic_property
from tests.helpers.fault_server import FaultServer
from tests.helpers.reading import assert_split, read_all, sample_id

array_record_module = pytest.importorskip("array_record.python.array_record_module")

SIZES = (23, 17, 30)  # records per file; ids 0..69 across them
GROUP = 4  # records per chunk


def example(n: int) -> bytes:
    """A tf.Example of every feature kind: ``id``, a float list, a bytes payload of varying length."""
    return shardkit.encode_example(
        {"id": np.array([n], np.int64), "score": np.array([n / 4, -n], np.float32), "payload": [b"x" * (n % 9)]}
    )


def write_files(root, sizes=SIZES, options: str = f"group_size:{GROUP}") -> list[str]:
    """Files written by the package's own writer, ``part-0000i.array_record``, numbered records across them."""
    files, first = {}, 0
    for i, size in enumerate(sizes):
        files[str(root / f"part-{i:05d}.array_record")] = [example(n) for n in range(first, first + size)]
        first += size
    write_records(files, options)
    return list(files)


_WRITE_IN_A_CHILD = """
import sys
from array_record.python.array_record_module import ArrayRecordWriter
data = open(sys.argv[1], "rb").read()
at = 0
for job in sys.argv[3:]:
    url, count = job.rsplit("|", 1)
    writer = ArrayRecordWriter(url, sys.argv[2])
    for _ in range(int(count)):
        size = int.from_bytes(data[at : at + 4], "little")
        writer.write(data[at + 4 : at + 4 + size])
        at += 4 + size
    writer.close()
"""


def write_records(files: dict[str, list[bytes]], options: str) -> None:
    """Each file of ``files`` written by the package's own writer, run in a child process: the writer's
    thread pool does not survive a fork, and a DataLoader worker forked later from this (pytest's)
    process could die of a SIGSEGV inside the package when it reads."""
    import subprocess
    import sys
    import tempfile

    payload = b"".join(len(r).to_bytes(4, "little") + r for records in files.values() for r in records)
    with tempfile.NamedTemporaryFile() as data:
        data.write(payload)
        data.flush()
        jobs = [f"{url}|{len(records)}" for url, records in files.items()]
        subprocess.run([sys.executable, "-c", _WRITE_IN_A_CHILD, data.name, options, *jobs], check=True)


def owners_records(url: str) -> list[bytes]:
    """What Grain reads: the array-record package's ``ArrayRecordDataSource``, record by record."""
    from array_record.python.array_record_data_source import ArrayRecordDataSource

    source = ArrayRecordDataSource([url])
    return [source[i] for i in range(len(source))]


def ids(samples) -> list[int]:
    return [int(s["id"][0]) for s in samples]


@pytest.mark.parametrize("options", ["group_size:4", "group_size:1,uncompressed", "group_size:7,snappy", ""])
def test_every_record_is_byte_for_byte_what_the_packages_own_reader_returns(tmp_path, options) -> None:
    urls = write_files(tmp_path, options=options)
    raw = list(shardkit.ArrayRecordDataset(urls, decode="raw"))
    assert raw == [r for url in urls for r in owners_records(url)]
    assert raw == [example(n) for n in range(sum(SIZES))]


def test_records_decode_as_tfrecord_dataset_decodes_the_same_examples(tmp_path) -> None:
    urls = write_files(tmp_path)
    with shardkit.TFRecordWriter(str(tmp_path / "same.tfrecord")) as writer:
        for n in range(sum(SIZES)):
            writer.write(example(n))
    ours = list(shardkit.ArrayRecordDataset(urls))
    theirs = list(shardkit.TFRecordDataset(str(tmp_path / "same.tfrecord")))
    assert len(ours) == len(theirs) == sum(SIZES)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        for key in a:
            same = a[key] == b[key] if isinstance(b[key], list) else a[key].dtype == b[key].dtype
            assert same and np.array_equal(a[key], b[key]), key


def test_a_range_reads_exactly_its_records_across_chunk_boundaries(tmp_path) -> None:
    (url,) = write_files(tmp_path, sizes=(30,))
    fmt = ArrayRecordFormat()
    for start, stop in [(0, 30), (3, 9), (4, 8), (5, 6), (29, 10**6), (30, 40), (7, 7)]:
        assert list(fmt.read(url, start, stop)) == [example(n) for n in range(start, min(stop, 30))]


def test_grain_shard_names_are_known_by_their_first_bytes(tmp_path) -> None:
    (url,) = write_files(tmp_path, sizes=(3,))
    named = str(tmp_path / "train.array_record-00000-of-00001")
    os.rename(url, named)
    assert shardkit.format_for(named).name == "array_record"
    assert ids(shardkit.ArrayRecordDataset(named)) == [0, 1, 2]


def test_counts_come_from_the_footer_without_reading_a_record(tmp_path, monkeypatch) -> None:
    urls = write_files(tmp_path)

    def no_reading(*args, **kwargs):
        raise AssertionError("a record was read to count")

    monkeypatch.setattr("shardkit.formats.array_record._Opened.span", no_reading)
    assert len(shardkit.ArrayRecordDataset(urls)) == sum(SIZES)
    assert len(shardkit.ArrayRecordDataset(urls, rank=1, world_size=2, balance="drop")) == sum(SIZES) // 2


def spawned_ids(dataset, workers: int) -> list[list[str]]:
    """Batches of sample ids through a DataLoader whose workers are spawned: the array-record package is
    not fork-safe, and shardkit refuses a worker forked from a process that used it."""
    kwargs = {"multiprocessing_context": "spawn"} if workers else {}
    return [list(b) for b in DataLoader(dataset.map(sample_id), batch_size=4, num_workers=workers, **kwargs)]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("balance", ["none", "pad", "drop"])
def test_every_record_exactly_once_over_two_ranks_under_each_balance(tmp_path, workers, balance) -> None:
    urls = write_files(tmp_path)
    ranks = []
    for rank in range(2):
        dataset = shardkit.ArrayRecordDataset(urls, shuffle=True, seed=4, balance=balance, rank=rank, world_size=2)
        ranks.append(spawned_ids(dataset, workers))
    assert_split(ranks, [str(np.array([n])) for n in range(sum(SIZES))], balance)


def test_a_state_saved_mid_epoch_resumes_a_fresh_dataset_with_exactly_the_rest(tmp_path) -> None:
    urls = write_files(tmp_path)

    def dataset() -> shardkit.ArrayRecordDataset:
        return shardkit.ArrayRecordDataset(urls, shuffle=True, seed=7, rank=1, world_size=2)

    whole = ids(dataset())
    interrupted = dataset()
    iterator = iter(interrupted)
    delivered = ids(next(iterator) for _ in range(11))
    state = json.loads(json.dumps(interrupted.state_dict()))  # plain data
    fresh = dataset()
    fresh.load_state_dict(state)
    assert delivered + ids(fresh) == whole and len(whole) == 35


@pytest.mark.slow
def test_a_stateful_dataloader_with_two_workers_resumes_mid_epoch_exactly(tmp_path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    urls = write_files(tmp_path)

    def loader() -> StatefulDataLoader:
        source = shardkit.ArrayRecordDataset(urls, shuffle=True, seed=5).map(sample_id)
        return StatefulDataLoader(source, batch_size=None, num_workers=2, multiprocessing_context="spawn")

    first, delivered, state = loader(), [], None
    for n, record in enumerate(first, 1):
        delivered.append(record)
        if n == 19:
            state = first.state_dict()
            break
    whole = list(loader())
    resumed = loader()
    resumed.load_state_dict(state)
    assert delivered == whole[:19] and delivered + list(resumed) == whole and len(set(whole)) == sum(SIZES)


# --------------------------------------------------------------------------- damage


def _flip_in_chunk(url: str, record: int) -> None:
    """Flip a byte inside the compressed data of the chunk holding ``record`` (found by its chunk header)."""
    data = bytearray(open(url, "rb").read())
    at, chunk = 64, 0  # the first data chunk's header follows the signature chunk
    while chunk < record // GROUP:
        size = int.from_bytes(data[at + 8 : at + 16], "little")
        at += 40 + size
        chunk += 1
    data[at + 40 + 8] ^= 0x5A
    with open(url, "wb") as f:
        f.write(data)


def test_a_corrupted_compressed_chunk_is_a_located_error_naming_its_byte(tmp_path) -> None:
    urls = write_files(tmp_path)
    _flip_in_chunk(urls[0], 9)
    with pytest.raises(CorruptRecordError) as caught:
        list(shardkit.ArrayRecordDataset(urls, decode="raw"))
    error = caught.value
    assert error.url == urls[0] and error.record_index == 8 and error.offset > 64 and error.records == GROUP
    assert "hash mismatch" in str(error)


def test_under_skip_a_corrupted_chunk_costs_exactly_its_records_counted(tmp_path) -> None:
    urls = write_files(tmp_path)
    _flip_in_chunk(urls[0], 9)
    dataset = shardkit.ArrayRecordDataset(urls, on_error="skip", balance="none")
    with pytest.warns(UserWarning, match="hash mismatch"):
        got = ids(dataset)
    assert got == [n for n in range(sum(SIZES)) if not 8 <= n < 12]
    assert dataset.stats().skipped.tolist() == [GROUP, 0, 0]


def test_a_truncated_file_is_an_error_not_a_count_of_zero(tmp_path) -> None:
    urls = write_files(tmp_path)
    os.truncate(urls[1], os.path.getsize(urls[1]) - 70000)
    with pytest.raises(CorruptRecordError, match=r"footer cannot be read") as caught:
        ArrayRecordFormat().stored_count(urls[1])
    assert caught.value.url == urls[1]
    with pytest.raises(CorruptRecordError, match=urls[1]):
        list(shardkit.ArrayRecordDataset(urls))


def test_under_skip_a_truncated_file_is_skipped_and_counted_and_the_rest_read(tmp_path) -> None:
    urls = write_files(tmp_path)
    os.truncate(urls[1], 1000)
    dataset = shardkit.ArrayRecordDataset(urls, on_error="skip", balance="none")
    with pytest.warns(UserWarning):
        got = ids(dataset)
    assert got == [n for n in range(sum(SIZES)) if not SIZES[0] <= n < SIZES[0] + SIZES[1]]


def test_a_count_that_disagrees_with_the_footer_is_an_error_not_a_short_read(tmp_path) -> None:
    urls = write_files(tmp_path)
    for lie in ([23, 20, 30], [23, 12, 30]):  # more than the file holds, fewer
        shards = shardkit.ShardList(urls, num_records=lie)
        with pytest.raises(Exception, match=r"does not describe this file|shorter than|planned") as caught:
            list(shardkit.ArrayRecordDataset(shards, balance="none"))
        assert urls[1] in str(caught.value)


def test_a_missing_shard_is_an_error_naming_it(tmp_path) -> None:
    urls = write_files(tmp_path)
    os.remove(urls[2])
    with pytest.raises(FileNotFoundError, match=os.path.basename(urls[2])):
        list(shardkit.ArrayRecordDataset(urls))


def test_a_record_that_is_not_an_example_costs_itself_alone_under_skip(tmp_path) -> None:
    url = str(tmp_path / "mixed.array_record")
    write_records({url: [b"\xff\xff not a message" if n == 5 else example(n) for n in range(10)]}, "group_size:4")
    with pytest.raises(CorruptRecordError) as caught:
        list(shardkit.ArrayRecordDataset(url))
    assert caught.value.record_index == 5 and caught.value.url == url
    with pytest.warns(UserWarning):
        assert ids(shardkit.ArrayRecordDataset(url, on_error="skip", balance="none")) == [0, 1, 2, 3, 4, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def module_files(tmp_path_factory) -> list[str]:
    return write_files(tmp_path_factory.mktemp("array_record"))


@pytest.mark.slow
def test_a_state_saved_on_two_ranks_resumes_on_one_or_three_ranks_exactly_once(module_files) -> None:
    def make(rank: int, world_size: int, balance: str) -> shardkit.ArrayRecordDataset:
        return shardkit.ArrayRecordDataset(
            module_files, decode="raw", shuffle=True, seed=6, balance=balance, rank=rank, world_size=world_size
        )

    elastic_property(make, [example(n) for n in range(sum(SIZES))])


# --------------------------------------------------------------------------- remote, writing, the CLI


def test_owner_written_files_read_over_http_from_the_cache_byte_for_byte(tmp_path) -> None:
    pytest.importorskip("aiohttp")
    (tmp_path / "data").mkdir()
    urls = write_files(tmp_path / "data")
    with FaultServer(str(tmp_path / "data")) as server:
        remote = [f"{server.url}/{os.path.basename(u)}" for u in urls]
        cached = shardkit.ArrayRecordDataset(remote, decode="raw", shuffle=True, seed=1, cache_dir=str(tmp_path / "c"))
        got = list(cached)
        local = list(shardkit.ArrayRecordDataset(urls, decode="raw", shuffle=True, seed=1))
        assert got == local and sorted(got) == sorted(example(n) for n in range(sum(SIZES)))
        with pytest.raises(shardkit.ShardkitError, match="cache_dir"):
            list(shardkit.ArrayRecordDataset(remote))


@pytest.mark.slow
def test_owner_written_files_read_from_s3_equal_the_local_read_byte_for_byte(tmp_path, s3_server) -> None:
    from tests.helpers.servers import upload_tree

    (tmp_path / "data").mkdir()
    urls = write_files(tmp_path / "data")
    options = s3_server.storage_options()
    root = upload_tree(options, str(tmp_path / "data"), s3_server.new_bucket(), "grain")
    remote = [f"{root}/{os.path.basename(u)}" for u in urls]
    got = list(
        shardkit.ArrayRecordDataset(
            remote, decode="raw", shuffle=True, seed=5, storage_options=options, cache_dir=str(tmp_path / "c")
        )
    )
    assert got == list(shardkit.ArrayRecordDataset(urls, decode="raw", shuffle=True, seed=5))
    assert sorted(got) == sorted(example(n) for n in range(sum(SIZES)))


def test_shard_writer_writes_files_the_packages_reader_reads_back(tmp_path) -> None:
    with shardkit.ShardWriter(str(tmp_path / "out-%03d.array_record"), max_records=25, format="array_record") as w:
        for n in range(60):
            w.write(example(n))
    shards = w.shards
    assert shards is not None and shards.num_records.tolist() == [25, 25, 10]
    assert [r for u in shards.urls() for r in owners_records(u)] == [example(n) for n in range(60)]


def test_the_cli_inspects_verifies_and_plans_array_record_files(tmp_path) -> None:
    from tests.helpers.cli import run_cli

    urls = write_files(tmp_path)
    inspected = run_cli("inspect", urls[0])
    assert inspected.returncode == 0 and "23 records; format: array_record" in inspected.stdout
    assert run_cli("verify", *urls).returncode == 0
    planned = run_cli("plan", f"{tmp_path}/*.array_record", "--world-size", "2")
    assert planned.returncode == 0 and "70" in planned.stdout
    os.truncate(urls[0], 100)
    broken = run_cli("verify", urls[0])
    assert broken.returncode != 0 and urls[0] in broken.stderr and len(broken.stderr.strip().splitlines()) == 1


def test_convert_from_array_record_to_tfrecord_and_parquet_and_back_is_exact(tmp_path) -> None:
    from tests.helpers.cli import run_cli

    write_files(tmp_path)
    out, back = tmp_path / "tf", tmp_path / "ar"
    to_tfrecord = run_cli("convert", f"{tmp_path}/*.array_record", str(out / "t-%03d.tfrecord"), "--format", "tfrecord")
    assert to_tfrecord.returncode == 0
    back_again = run_cli("convert", f"{out}/*.tfrecord", str(back / "a-%03d.array_record"), "--format", "array_record")
    assert back_again.returncode == 0
    again = sorted(back.glob("*.array_record"))
    assert [r for u in again for r in owners_records(str(u))] == [example(n) for n in range(sum(SIZES))]
    parquet = run_cli(
        "convert", f"{tmp_path}/*.array_record", str(tmp_path / "pq" / "p-%03d.parquet"), "--format", "parquet"
    )
    assert parquet.returncode == 0
    assert [int(r["id"]) for r in shardkit.ParquetDataset(f"{tmp_path}/pq/*.parquet")] == list(range(sum(SIZES)))


@pytest.mark.slow
def test_a_worker_forked_from_a_process_that_used_the_package_is_refused_with_the_fix_not_a_segfault(tmp_path):
    urls = write_files(tmp_path)
    dataset = shardkit.ArrayRecordDataset(urls)
    assert len(dataset) == sum(SIZES)  # counted here, in this process: the package's thread pool is here now
    forked = DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(shardkit.ShardkitError, match="multiprocessing_context='spawn'"):
        read_all(forked)
    spawned = DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    assert ids(read_all(spawned)) == list(range(sum(SIZES)))
