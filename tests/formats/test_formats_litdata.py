"""LitData optimized datasets read in place: chunks litdata's own writer wrote (BinaryWriter, what optimize
writes with; tests/data/litdata, see tests/helpers/litdata_samples.py), sample for sample, split, resumed,
damaged and served over HTTP."""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
import torch

import shardkit
from shardkit.errors import CorruptRecordError, ShardkitError
from shardkit.formats.litdata import LitDataFormat
from tests.helpers import litdata_samples as fx
from tests.helpers.elastic import elastic_property
from tests.helpers.fault_server import FaultServer
from tests.helpers.reading import assert_split, ids_per_rank, rank_factory, sample_id


def fixture(name: str) -> str:
    return os.path.join(fx.FIXTURES, name)


def copy(tmp_path, name: str) -> str:
    """A copy of fixture ``name`` to damage."""
    return shutil.copytree(fixture(name), str(tmp_path / name))


def assert_equal(got, expected, where: str = "sample") -> None:
    """Equal values of equal types: arrays and tensors element for element with their dtype and shape."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and list(got) == list(expected), where
        for key in expected:
            assert_equal(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), where
        for n, (a, b) in enumerate(zip(got, expected)):
            assert_equal(a, b, f"{where}[{n}]")
    elif isinstance(expected, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == expected.dtype and got.shape == expected.shape, where
        assert got.tobytes() == expected.tobytes(), where
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype, where
        assert got.shape == expected.shape and torch.equal(got, expected), where
    else:
        assert type(got) is type(expected) and got == expected, f"{where}: {got!r} != {expected!r}"


# --------------------------------------------------------------------------- what the writer was given, in order


@pytest.mark.parametrize(("name", "count"), [("samples", fx.SAMPLES), ("zstd", 12)])
def test_every_sample_equals_what_litdatas_writer_was_given_in_order(name, count) -> None:
    got = list(shardkit.LitDataDataset(fixture(name), balance="none"))
    assert len(got) == count
    for i, sample in enumerate(got):
        assert_equal(sample, fx.sample(i), f"sample {i}")


def test_images_are_their_encoded_bytes_or_pil_images_with_the_exact_pixels() -> None:
    pytest.importorskip("PIL")
    as_bytes = list(shardkit.LitDataDataset(fixture("images"), balance="none"))
    decoded = list(shardkit.LitDataDataset(fixture("images"), balance="none", images="pil"))
    assert [s["id"] for s in as_bytes] == [s["id"] for s in decoded] == list(range(6))
    for i, (raw, pil) in enumerate(zip(as_bytes, decoded)):
        assert raw["png"][:8] == b"\x89PNG\r\n\x1a\n" and isinstance(raw["png"], bytes)
        assert np.array_equal(np.asarray(pil["png"]), fx.pixels(i))
        for image in (raw["raw"], pil["raw"]):  # a raw PIL leaf is an image either way
            assert image.mode == "RGB" and np.array_equal(np.asarray(image), fx.pixels(i))


def test_json_rows_come_from_the_arrow_footer_and_a_range_across_its_batches_reads_exactly_it() -> None:
    rows = list(shardkit.LitDataDataset(fixture("rows"), balance="none"))
    assert rows == [fx.row(i) for i in range(fx.ROWS)]
    first = os.path.join(
        fixture("rows"), json.load(open(os.path.join(fixture("rows"), "index.json")))["chunks"][0]["filename"]
    )
    assert list(LitDataFormat().read(first, 250, 262)) == [fx.row(i) for i in range(250, 262)]


def test_token_items_are_documents_a_token_dataset_packs_and_blocks_are_cut_as_tokens_loader_cuts_them() -> None:
    documents = list(shardkit.LitDataDataset(fixture("tokens"), balance="none"))
    assert [d["input_ids"].tolist() for d in documents] == [fx.document(i).tolist() for i in range(fx.DOCUMENTS)]
    assert all(d["input_ids"].dtype == np.uint16 for d in documents)
    packed = list(shardkit.LitDataDataset(fixture("tokens"), balance="none").pack(32))
    stream = np.concatenate([fx.document(i) for i in range(fx.DOCUMENTS)]).astype(np.int64)
    assert torch.cat([b["input_ids"] for b in packed])[: len(stream)].tolist() == stream.tolist()
    index = json.load(open(os.path.join(fixture("tokens"), "index.json")))
    expected, at = [], 0
    for chunk in index["chunks"]:  # blocks of 16 tokens within each chunk, a chunk's rest dropped
        items = [fx.document(i) for i in range(at, at + chunk["chunk_size"])]
        at += chunk["chunk_size"]
        tokens = np.concatenate(items)
        expected += [tokens[k * 16 : (k + 1) * 16] for k in range(len(tokens) // 16)]
    blocks = list(shardkit.LitDataDataset(fixture("tokens"), balance="none", block_size=16))
    assert len(blocks) == len(expected) and all(np.array_equal(b, e) for b, e in zip(blocks, expected))


@pytest.mark.parametrize("name", ["samples", "zstd", "rows", "tokens", "images"])
def test_samples_equal_what_litdatas_own_streaming_dataset_reads(tmp_path, name) -> None:
    litdata = pytest.importorskip(
        "litdata", reason="litdata is not in the dev extra (see tests/helpers/litdata_samples.py)"
    )
    from litdata.streaming.item_loader import TokensLoader

    if name == "images":
        pytest.skip("litdata decodes PNG leaves with torchvision, which does not load beside CPU torch here")
    kwargs = {"item_loader": TokensLoader(block_size=16)} if name == "tokens" else {}
    # A copy: litdata's reader inflates a compressed local dataset in place and deletes its .zstd.bin chunks.
    theirs = list(litdata.StreamingDataset(copy(tmp_path, name), **kwargs))
    ours = list(
        shardkit.LitDataDataset(fixture(name), balance="none", **({"block_size": 16} if name == "tokens" else {}))
    )
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if isinstance(b, dict) and "blob" in b:
            b = {**b, "blob": bytes(b["blob"])}  # litdata hands bytes out as a view of its memory map
        if isinstance(b, torch.Tensor) and isinstance(a, np.ndarray):
            b = b.numpy()
        assert_equal(a, b, f"{name} sample {i}")


def test_a_pickled_leaf_is_refused_when_the_dataset_is_built_naming_why() -> None:
    with pytest.raises(ShardkitError, match="pickled .* unpickling runs code"):
        shardkit.LitDataDataset(fixture("pickled"))


def test_a_directory_without_an_index_says_what_a_litdata_dataset_is(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="index.json does not exist: a LitData dataset is a directory"):
        shardkit.LitDataDataset(str(tmp_path))


# --------------------------------------------------------------------------- splits and resuming


@pytest.mark.parametrize("balance", ["none", "pad", "drop"])
@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_every_sample_exactly_once_over_two_ranks_and_workers(balance, num_workers) -> None:
    make = rank_factory(shardkit.LitDataDataset, fixture("samples"), balance=balance, shuffle=True, seed=3)
    ranks = ids_per_rank(make, world_size=2, num_workers=num_workers, batch_size=3)
    assert_split(ranks, [str(i) for i in range(fx.SAMPLES)], balance)
    assert shardkit.LitDataDataset(fixture("samples")).shards.num_records.tolist() == [8] * 5  # from index.json


@pytest.mark.slow
def test_a_state_saved_on_two_ranks_resumes_on_one_or_three_ranks_exactly_once() -> None:
    def make(rank: int, world_size: int, balance: str):
        dataset = shardkit.LitDataDataset(
            fixture("samples"), shuffle=True, seed=8, balance=balance, rank=rank, world_size=world_size
        )
        return dataset.map(sample_id)

    elastic_property(make, [str(i) for i in range(fx.SAMPLES)])


def test_counts_come_from_the_index_without_opening_a_chunk(tmp_path) -> None:
    path = copy(tmp_path, "samples")
    for name in os.listdir(path):
        if name.endswith(".bin"):
            os.truncate(os.path.join(path, name), 0)
    dataset = shardkit.LitDataDataset(path, rank=1, world_size=3, balance="drop")
    assert len(dataset) == fx.SAMPLES // 3


def test_a_state_saved_mid_epoch_resumes_a_fresh_dataset_with_exactly_the_rest() -> None:
    def dataset() -> shardkit.LitDataDataset:
        return shardkit.LitDataDataset(fixture("samples"), shuffle=True, seed=5, rank=1, world_size=2)

    whole = [s["id"] for s in dataset()]
    interrupted = dataset()
    iterator = iter(interrupted)
    delivered = [next(iterator)["id"] for _ in range(7)]
    state = json.loads(json.dumps(interrupted.state_dict()))
    fresh = dataset()
    fresh.load_state_dict(state)
    assert delivered + [s["id"] for s in fresh] == whole and len(whole) == fx.SAMPLES // 2


# --------------------------------------------------------------------------- damage


def _chunks(path: str) -> list[str]:
    return [os.path.join(path, c["filename"]) for c in json.load(open(os.path.join(path, "index.json")))["chunks"]]


def test_a_truncated_chunk_is_a_located_error_after_its_whole_items_or_a_counted_skip(tmp_path) -> None:
    path = copy(tmp_path, "samples")
    second = _chunks(path)[1]
    offsets = np.fromfile(second, dtype="<u4", count=10)[1:]
    os.truncate(second, int(offsets[5]) + 3)  # items 0..4 whole, item 5 cut
    with pytest.raises(
        CorruptRecordError, match=r"chunk-0-1.bin: record 5 .*item 5 is bytes .* the chunk ends at byte"
    ):
        list(shardkit.LitDataDataset(path, balance="none"))
    lenient = shardkit.LitDataDataset(path, balance="none", on_error="skip")
    with pytest.warns(UserWarning, match="skipping 3 records"):
        ids = [s["id"] for s in lenient]
    assert ids == [i for i in range(fx.SAMPLES) if not 13 <= i < 16]
    assert lenient.stats().skipped.tolist() == [0, 3, 0, 0, 0]


def test_an_index_count_the_chunk_header_disagrees_with_is_a_located_error_or_a_counted_skip(tmp_path) -> None:
    path = copy(tmp_path, "samples")
    index = json.load(open(os.path.join(path, "index.json")))
    index["chunks"][2]["chunk_size"] = 6  # the header says 8
    json.dump(index, open(os.path.join(path, "index.json"), "w"))
    with pytest.raises(CorruptRecordError, match=r"chunk-0-2.bin: record 0 .*header holds 8 items, index.json says 6"):
        list(shardkit.LitDataDataset(path, balance="none"))
    lenient = shardkit.LitDataDataset(path, balance="none", on_error="skip")
    with pytest.warns(UserWarning, match="skipping 6 records"):
        ids = [s["id"] for s in lenient]
    assert ids == [i for i in range(fx.SAMPLES) if not 16 <= i < 24] and lenient.stats().skipped.sum() == 6


def test_a_missing_chunk_is_an_error_naming_it_or_a_counted_skip(tmp_path) -> None:
    path = copy(tmp_path, "samples")
    os.remove(_chunks(path)[3])
    with pytest.raises(FileNotFoundError, match="chunk-0-3.bin"):
        list(shardkit.LitDataDataset(path, balance="none"))
    lenient = shardkit.LitDataDataset(path, balance="none", on_error="skip")
    with pytest.warns(UserWarning):
        ids = [s["id"] for s in lenient]
    assert ids == [i for i in range(fx.SAMPLES) if not 24 <= i < 32]
    assert lenient.stats().skipped.tolist() == [0, 0, 0, 8, 0]


def test_a_corrupted_zstd_chunk_is_a_located_error_or_costs_the_item_it_broke(tmp_path) -> None:
    """LitData's zstd frames carry no checksum, so a flipped block inflates; what it breaks (here item 4's
    tensor shape) is the record reported, with its offset, not a torch RuntimeError."""
    path = copy(tmp_path, "zstd")
    second = _chunks(path)[1]
    size = os.path.getsize(second)
    with open(second, "r+b") as f:
        f.seek(size // 2)
        flipped = bytes(b ^ 0xFF for b in f.read(8))
        f.seek(size // 2)
        f.write(flipped)
    with pytest.raises(
        CorruptRecordError, match=r"chunk-0-1.zstd.bin: record 4 at byte offset \d+: the item does not decode"
    ):
        list(shardkit.LitDataDataset(path, balance="none"))
    lenient = shardkit.LitDataDataset(path, balance="none", on_error="skip")
    with pytest.warns(UserWarning, match="skipping record 4 of .*chunk-0-1.zstd.bin"):
        got = list(lenient)
    assert [s["id"] for s in got] == [i for i in range(12) if i != 9] and lenient.stats().skipped.tolist() == [0, 1, 0]
    for sample in got:
        assert_equal(sample, fx.sample(sample["id"]))


def test_an_item_whose_leaf_sizes_do_not_add_up_costs_itself_alone(tmp_path) -> None:
    path = copy(tmp_path, "samples")
    first = _chunks(path)[0]
    offsets = np.fromfile(first, dtype="<u4", count=10)[1:]
    with open(first, "r+b") as f:  # item 2's first leaf size (the int: 8 bytes) made 9
        f.seek(int(offsets[2]))
        f.write(struct.pack("<I", 9))
    with pytest.raises(
        CorruptRecordError,
        match=rf"chunk-0-0.bin: record 2 at byte offset {offsets[2]}: the item does not decode \(its 12 leaf sizes add up",
    ):
        list(shardkit.LitDataDataset(path, balance="none"))
    lenient = shardkit.LitDataDataset(path, balance="none", on_error="skip")
    with pytest.warns(UserWarning, match="skipping record 2"):
        ids = [s["id"] for s in lenient]
    assert ids == [i for i in range(fx.SAMPLES) if i != 2]


# --------------------------------------------------------------------------- remote


def test_a_dataset_served_over_http_reads_the_same_samples_by_ranged_reads(tmp_path) -> None:
    pytest.importorskip("aiohttp")
    shutil.copytree(fixture("samples"), str(tmp_path / "samples"))
    with FaultServer(str(tmp_path)) as server:
        remote = list(shardkit.LitDataDataset(f"{server.url}/samples", shuffle=True, seed=1))
        local = list(shardkit.LitDataDataset(fixture("samples"), shuffle=True, seed=1))
        assert len(remote) == len(local) == fx.SAMPLES
        for a, b in zip(remote, local):
            assert_equal(a, b)
        assert server.gets("samples/index.json") and server.gets("samples/chunk-0-0.bin")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["samples", "tokens"])
def test_a_dataset_on_s3_reads_the_same_samples_as_the_local_copy(name, s3_server) -> None:
    from tests.helpers.servers import upload_tree

    options = s3_server.storage_options()
    root = upload_tree(options, fixture(name), s3_server.new_bucket(), name)
    remote = list(shardkit.LitDataDataset(root, shuffle=True, seed=2, storage_options=options))
    local = list(shardkit.LitDataDataset(fixture(name), shuffle=True, seed=2))
    assert len(remote) == len(local) > 0
    for a, b in zip(remote, local):
        assert_equal(a, b)


# --------------------------------------------------------------------------- the command line


def test_inspect_verify_and_plan_take_the_dataset_directory_and_its_index_counts(tmp_path) -> None:
    from tests.helpers.cli import run_cli

    inspected = run_cli("inspect", fixture("samples"))
    assert inspected.returncode == 0, inspected.stderr
    assert inspected.stdout.count("8 records; format: litdata; every record read") == 5
    verified = run_cli("verify", fixture("rows"))
    assert verified.returncode == 0 and verified.stdout.count(": 300 records") == 2
    planned = run_cli("plan", fixture("samples"), "--world-size", "2", "--num-workers", "2")
    assert planned.returncode == 0 and "from the dataset's own index" in planned.stdout
    assert "5 shards, 40 records" in planned.stdout and "records per rank: 20, 20" in planned.stdout
    path = copy(tmp_path, "samples")
    os.truncate(_chunks(path)[1], 100)
    damaged = run_cli("verify", path)
    assert damaged.returncode != 0 and "chunk-0-1.bin" in damaged.stderr and damaged.stdout.count("ok ") == 4


@pytest.mark.slow
@pytest.mark.parametrize("through", ["tfrecord", "array_record"])
def test_convert_to_tf_examples_and_back_to_parquet_keeps_every_row(tmp_path, through) -> None:
    """Exact but for tf.Example's types: text comes back as its UTF-8 bytes."""
    import pyarrow.parquet as pq

    from tests.helpers.cli import run_cli

    there = run_cli("convert", fixture("rows"), str(tmp_path / "ex" / f"r-%03d.{through}"), "--format", through)
    assert there.returncode == 0, there.stderr
    back = run_cli(
        "convert", str(tmp_path / "ex" / f"*.{through}"), str(tmp_path / "r-%03d.parquet"), "--format", "parquet"
    )
    assert back.returncode == 0, back.stderr
    want = [fx.row(i) for i in range(fx.ROWS)]
    for row in want:
        row["text"], row["tags"] = row["text"].encode(), [t.encode() for t in row["tags"]]
    assert pq.read_table(str(tmp_path / "r-000.parquet")).to_pylist() == want


def test_convert_writes_the_rows_of_a_litdata_dataset_to_parquet_in_order(tmp_path) -> None:
    import pyarrow.parquet as pq

    from tests.helpers.cli import run_cli

    done = run_cli("convert", fixture("rows"), str(tmp_path / "rows-%03d.parquet"), "--format", "parquet")
    assert done.returncode == 0, done.stderr
    assert pq.read_table(str(tmp_path / "rows-000.parquet")).to_pylist() == [fx.row(i) for i in range(fx.ROWS)]
