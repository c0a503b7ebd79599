"""Mosaic Streaming (MDS) datasets read in place: every sample equal to what Mosaic's own reader returns
for files Mosaic's own writer wrote (committed fixtures: mosaicml-streaming cannot be installed beside the
dev extra; tests/fixtures/mds/make_fixtures.py wrote them), counts from index.json held to each shard,
exactly once over ranks and workers, exact resume, and damage a located error or a counted skip."""

from __future__ import annotations

import base64
import json
import os
import shutil
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.errors import CorruptRecordError
from shardkit.formats.mds import MDSError, MDSFormat
from tests.helpers.elastic import elastic_property
from tests.helpers.fault_server import FaultServer
from tests.helpers.reading import assert_split, ids_per_rank, rank_factory, sample_id

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "mds"
SAMPLES = 40


def expected() -> list[dict]:
    """Mosaic's StreamingDataset's samples of plain/, rebuilt from their tagged JSON."""
    rows = json.loads((FIXTURES / "expected.json").read_text())
    return [{key: _value(*tagged) for key, tagged in row.items()} for row in rows]


def _value(kind: str, *payload):
    if kind == "ndarray":
        dtype, shape, data = payload
        return np.frombuffer(base64.b64decode(data), dtype).reshape(shape)
    if kind == "scalar":
        dtype, data = payload
        return np.frombuffer(base64.b64decode(data), dtype)[0]
    if kind == "bytes":
        return base64.b64decode(payload[0])
    if kind == "decimal":
        return Decimal(payload[0])
    return payload[0]


def assert_same_sample(got: dict, want: dict) -> None:
    assert list(got) == list(want)  # the columns in Mosaic's order
    for key, value in want.items():
        assert type(got[key]) is type(value), key
        if isinstance(value, np.ndarray):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape and np.array_equal(got[key], value)
        elif isinstance(value, np.generic):
            assert got[key].dtype == value.dtype and got[key].tobytes() == value.tobytes(), key
        else:
            assert got[key] == value, key


def copy(tmp_path, name: str = "plain") -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    return target


def shard_files(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith("shard."))


@pytest.mark.parametrize("name", ["plain", "zstd", "gz"])
def test_every_sample_equals_what_mosaics_own_reader_returns_in_order(name) -> None:
    got = list(shardkit.MDSDataset(str(FIXTURES / name)))
    want = expected()
    assert len(got) == len(want) == SAMPLES and len(shard_files(FIXTURES / name)) > 2
    for g, w in zip(got, want):
        assert_same_sample(g, w)


def test_images_are_their_stored_jpeg_and_png_bytes() -> None:
    first = next(iter(shardkit.MDSDataset(str(FIXTURES / "plain"))))
    assert first["jpg"][:2] == b"\xff\xd8" and first["png"][:8] == b"\x89PNG\r\n\x1a\n"


def test_a_pkl_column_is_refused_before_anything_is_unpickled(monkeypatch) -> None:
    import pickle

    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    with pytest.raises(MDSError, match=r"column 'obj' is pkl-encoded; shardkit does not unpickle"):
        shardkit.MDSDataset(str(FIXTURES / "pkl"))
    shard = str(shard_files(FIXTURES / "pkl")[0])
    with pytest.raises(MDSError, match="pkl"):
        list(MDSFormat().read(shard))


def test_counts_come_from_index_json_without_reading_a_shard(monkeypatch) -> None:
    monkeypatch.setattr(MDSFormat, "_samples", lambda *a: pytest.fail("a shard was read to count"))
    assert len(shardkit.MDSDataset(str(FIXTURES / "zstd"))) == SAMPLES
    assert len(shardkit.MDSDataset(str(FIXTURES / "plain"), rank=1, world_size=3, balance="drop")) == SAMPLES // 3


def test_a_range_reads_exactly_its_samples_of_a_shard() -> None:
    shard = str(shard_files(FIXTURES / "plain")[1])
    whole = list(MDSFormat().read(shard))
    for start, stop in [(0, 2), (1, 3), (len(whole) - 1, 10**6), (2, 2)]:
        assert [s["id"] for s in MDSFormat().read(shard, start, stop)] == [s["id"] for s in whole[start:stop]]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("balance", ["none", "pad", "drop"])
def test_every_sample_exactly_once_over_two_ranks_under_each_balance(workers, balance) -> None:
    make = rank_factory(shardkit.MDSDataset, str(FIXTURES / "zstd"), shuffle=True, seed=2, balance=balance)
    ranks = ids_per_rank(make, world_size=2, num_workers=workers)
    assert_split(ranks, [str(n) for n in range(SAMPLES)], balance)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "zstd"])
def test_a_state_saved_on_two_ranks_resumes_on_one_or_three_ranks_exactly_once(name) -> None:
    def make(rank: int, world_size: int, balance: str):
        dataset = shardkit.MDSDataset(
            str(FIXTURES / name), shuffle=True, seed=8, balance=balance, rank=rank, world_size=world_size
        )
        return dataset.map(sample_id)

    elastic_property(make, [str(n) for n in range(SAMPLES)])


def test_a_state_saved_mid_epoch_resumes_a_fresh_dataset_with_exactly_the_rest() -> None:
    def dataset() -> shardkit.MDSDataset:
        return shardkit.MDSDataset(str(FIXTURES / "plain"), shuffle=True, seed=7, rank=0, world_size=2)

    whole = [s["id"] for s in dataset()]
    interrupted = dataset()
    iterator = iter(interrupted)
    delivered = [next(iterator)["id"] for _ in range(9)]
    state = json.loads(json.dumps(interrupted.state_dict()))
    fresh = dataset()
    fresh.load_state_dict(state)
    assert delivered + [s["id"] for s in fresh] == whole and len(whole) == SAMPLES // 2


# --------------------------------------------------------------------------- damage


def test_a_truncated_shard_is_a_located_error_not_a_short_read(tmp_path) -> None:
    root = copy(tmp_path)
    shard = shard_files(root)[1]
    os.truncate(shard, shard.stat().st_size - 10)
    with pytest.raises(CorruptRecordError, match="index.json says") as caught:
        list(shardkit.MDSDataset(str(root)))
    assert caught.value.url == str(shard)


@pytest.mark.parametrize("name", ["plain", "zstd"])
def test_under_skip_a_truncated_shard_is_skipped_and_counted_and_ranks_stay_equal(tmp_path, name) -> None:
    root = copy(tmp_path, name)
    shards = shard_files(root)
    os.truncate(shards[0], shards[0].stat().st_size // 2)
    index = json.loads((root / "index.json").read_text())
    lost = index["shards"][0]["samples"]
    dataset = shardkit.MDSDataset(str(root), on_error="skip", balance="none")
    with pytest.warns(UserWarning):
        got = [s["id"] for s in dataset]
    assert got == list(range(lost, SAMPLES))
    assert int(dataset.stats().skipped.sum()) == lost
    padded = [list(shardkit.MDSDataset(str(root), on_error="skip", rank=r, world_size=2)) for r in range(2)]
    assert len(padded[0]) == len(padded[1]) == SAMPLES // 2


@pytest.mark.parametrize("change", [+1, -1])
def test_an_index_count_that_disagrees_with_the_shard_is_an_error(tmp_path, change) -> None:
    root = copy(tmp_path)
    index = json.loads((root / "index.json").read_text())
    index["shards"][1]["samples"] += change
    (root / "index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptRecordError, match=r"its header counts \d+ samples but index.json says") as caught:
        list(shardkit.MDSDataset(str(root)))
    assert caught.value.url.endswith(index["shards"][1]["raw_data"]["basename"])


def test_a_missing_shard_is_an_error_naming_it(tmp_path) -> None:
    root = copy(tmp_path)
    missing = shard_files(root)[2]
    missing.unlink()
    with pytest.raises(FileNotFoundError, match=missing.name):
        list(shardkit.MDSDataset(str(root)))


@pytest.mark.parametrize("name", ["zstd", "gz"])
def test_a_corrupted_compressed_block_is_a_located_error_and_under_skip_costs_its_shard(tmp_path, name) -> None:
    root = copy(tmp_path, name)
    shard = shard_files(root)[1]
    data = bytearray(shard.read_bytes())
    for at in range(len(data) // 3, len(data) // 3 + 24):
        data[at] ^= 0xA5
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError, match="does not inflate|index.json says|does not decode") as caught:
        list(shardkit.MDSDataset(str(root)))
    assert caught.value.url == str(shard)
    dataset = shardkit.MDSDataset(str(root), on_error="skip", balance="none")
    with pytest.warns(UserWarning):
        got = [s["id"] for s in dataset]
    assert 0 < SAMPLES - len(got) == int(dataset.stats().skipped.sum())


def test_a_scrambled_offset_table_is_a_located_error(tmp_path) -> None:
    root = copy(tmp_path)
    shard = shard_files(root)[0]
    data = bytearray(shard.read_bytes())
    data[4 + 4 * 2 : 4 + 4 * 3] = (10**8).to_bytes(4, "little")  # sample 2's offset past the file
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError, match="out of order or past the file") as caught:
        list(shardkit.MDSDataset(str(root)))
    assert caught.value.url == str(shard) and caught.value.record_index in (1, 2) and caught.value.offset == 12


def test_a_sample_whose_sizes_do_not_add_up_costs_itself_alone_under_skip(tmp_path) -> None:
    root = copy(tmp_path)
    shard = shard_files(root)[0]
    data = bytearray(shard.read_bytes())
    start = int.from_bytes(data[4 + 4 : 8 + 4], "little")  # sample 1's first byte: its first variable size
    data[start : start + 4] = (10**6).to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError) as caught:
        list(shardkit.MDSDataset(str(root)))
    assert caught.value.record_index == 1 and caught.value.offset == start
    with pytest.warns(UserWarning):
        got = [s["id"] for s in shardkit.MDSDataset(str(root), on_error="skip", balance="none")]
    assert got == [n for n in range(SAMPLES) if n != 1]


# --------------------------------------------------------------------------- remote, the CLI


@pytest.mark.parametrize("name", ["plain", "zstd"])
def test_mosaic_written_datasets_read_over_http_equal_the_local_read(name) -> None:
    pytest.importorskip("aiohttp")
    with FaultServer(str(FIXTURES)) as server:
        got = list(shardkit.MDSDataset(f"{server.url}/{name}", shuffle=True, seed=3))
        local = list(shardkit.MDSDataset(str(FIXTURES / name), shuffle=True, seed=3))
        assert [s["id"] for s in got] == [s["id"] for s in local]
        for g, w in zip(sorted(got, key=lambda s: s["id"]), expected()):
            assert_same_sample(g, w)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "gz"])
def test_mosaic_written_datasets_read_from_s3_equal_the_local_read(name, s3_server) -> None:
    from tests.helpers.servers import upload_tree

    options = s3_server.storage_options()
    root = upload_tree(options, str(FIXTURES / name), s3_server.new_bucket(), name)
    got = list(shardkit.MDSDataset(root, shuffle=True, seed=3, storage_options=options))
    local = list(shardkit.MDSDataset(str(FIXTURES / name), shuffle=True, seed=3))
    assert [s["id"] for s in got] == [s["id"] for s in local] and len(got) == SAMPLES
    for g, w in zip(got, local):
        assert_same_sample(g, w)


def test_the_cli_inspects_verifies_and_plans_mds_shards(tmp_path) -> None:
    from tests.helpers.cli import run_cli

    shards = [str(p) for p in shard_files(FIXTURES / "zstd")]
    inspected = run_cli("inspect", shards[0])
    assert inspected.returncode == 0 and "format: mds" in inspected.stdout
    assert run_cli("verify", *shards).returncode == 0
    planned = run_cli("plan", str(FIXTURES / "zstd" / "shard.*"), "--world-size", "2")
    assert planned.returncode == 0 and str(SAMPLES) in planned.stdout
    root = copy(tmp_path, "zstd")
    broken = shard_files(root)[0]
    os.truncate(broken, 5)
    result = run_cli("verify", str(broken))
    assert result.returncode == 1 and str(broken) in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("tfrecord", r"plain/shard.00000.mds: record 0: field 'meta' holds .*a tf.Example feature holds"),
        ("tar", r"plain/shard.00000.mds: record 0: field 'f16' holds a float16, which a tar member holds only"),
        ("parquet", r"x-000.parquet: rows 0..\d+ do not fit one Parquet schema \(ArrowInvalid"),
    ],
)
def test_convert_reads_an_mds_directory_and_names_what_the_target_cannot_hold(tmp_path, target, says) -> None:
    """Before, the directory was taken for LitData's ("index.json is not a LitData index"), and a tar or
    Parquet target failed with a bare TypeError or ArrowInvalid naming no file."""
    import re

    from tests.helpers.cli import run_cli

    done = run_cli("convert", str(FIXTURES / "plain"), str(tmp_path / f"x-%03d.{target}"), "--format", target)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert re.search(says, done.stderr), done.stderr
    assert not list(tmp_path.glob(f"x-*.{target}"))  # no shard under a final name
