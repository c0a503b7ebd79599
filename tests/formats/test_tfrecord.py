"""TFRecord framing: CRCs, reading, writing, compression, corruption, indexes, ShardWriter, CLI."""

from __future__ import annotations

import gzip
import os
import struct
import zlib

import numpy as np
import pytest

import shardkit
from shardkit import CorruptRecordError, ShardkitError
from shardkit.cli import main
from shardkit.formats.crc import crc32c, mask, mask_array, masked_crc32c, masked_crc32c_of_lengths
from shardkit.formats.offsets import index_path_for
from shardkit.formats.tfrecord import TFRecordWriter, kernel, read_tfrecord, scan_count, scan_offsets, verify_tfrecord
from shardkit.formats.tfrecord import framing as tfr
from shardkit.formats.tfrecord.format import TFRecordFormat
from shardkit.formats.tfrecord.index import build_index, read_index
from shardkit.io import files as skio

RECORDS = [b"", b"a", b"hello world", os.urandom(300), bytes(range(256)) * 5]


def write(path: str, records: list[bytes], compression: str | None = None) -> str:
    with TFRecordWriter(str(path), compression=compression) as writer:
        for record in records:
            writer.write(record)
    return str(path)


def framed(record: bytes) -> bytes:
    """Framing written by hand from the format description, independent of the writer."""
    length = struct.pack("<Q", len(record))
    return length + struct.pack("<I", masked_crc32c(length)) + record + struct.pack("<I", masked_crc32c(record))


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the reader fetch 7 bytes at a time, so records straddle every block edge."""
    monkeypatch.setattr(tfr, "BLOCK_SIZE", 7)
    monkeypatch.setattr(skio, "BLOCK_SIZE", 7)


# --------------------------------------------------------------------------- CRC


def test_crc32c_test_vector_and_mask() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    c = 0xE3069283
    assert mask(c) == ((((c >> 15) | (c << 17)) + 0xA282EAD8) % 2**32)
    from tfrecord.writer import TFRecordWriter as Theirs

    for data in (b"", b"123456789", os.urandom(1000)):
        assert struct.pack("<I", masked_crc32c(data)) == Theirs.masked_crc(data)
    values = np.array([0xE3069283, 0, 2**32 - 1], dtype=np.uint32)
    assert mask_array(values).tolist() == [mask(int(v)) for v in values]


def test_length_crcs_vectorised_match_scalar() -> None:
    lengths = np.array([0, 1, 255, 256, 1043, 2**32 + 5, 2**64 - 1], dtype=np.uint64)
    expected = [masked_crc32c(struct.pack("<Q", int(n))) for n in lengths]
    assert masked_crc32c_of_lengths(lengths).tolist() == expected


# --------------------------------------------------------------------------- reading and writing


def test_writer_output_is_exact_framing(tmp_path) -> None:
    path = write(tmp_path / "a.tfrecord", RECORDS)
    with open(path, "rb") as f:
        assert f.read() == b"".join(map(framed, RECORDS))


@pytest.mark.parametrize("compression", [None, "gzip", "zlib"])
def test_round_trip(tmp_path, compression: str | None) -> None:
    path = write(tmp_path / "a.tfrecord", RECORDS, compression)
    assert list(read_tfrecord(path)) == RECORDS  # auto-detected
    assert list(read_tfrecord(path, compression=compression)) == RECORDS
    assert list(read_tfrecord(path, verify=False)) == RECORDS
    assert scan_count(path) == len(RECORDS)
    assert verify_tfrecord(path) == len(RECORDS)


@pytest.fixture(params=["local", "memory"])
def place(request: pytest.FixtureRequest, tmp_path) -> str:
    """A directory URL: local files are memory-mapped, memory:// ones streamed."""
    if request.param == "local":
        return str(tmp_path)
    return f"memory://{request.node.name}"


@pytest.mark.parametrize("compression", [None, "gzip", "zlib"])
def test_records_straddling_blocks(place: str, small_blocks: None, compression: str | None) -> None:
    records = [os.urandom(n) for n in (0, 1, 3, 20, 7, 100, 0, 2)]
    path = write(f"{place}/a.tfrecord", records, compression)
    assert list(read_tfrecord(path)) == records
    assert list(read_tfrecord(path, start=2, stop=5)) == records[2:5]
    assert scan_count(path) == len(records)


def test_the_old_name_count_records_still_imports_as_scan_count(tmp_path) -> None:
    from shardkit.formats.tfrecord import count_records

    assert count_records is scan_count and count_records(write(tmp_path / "a.tfrecord", RECORDS)) == len(RECORDS)


def test_record_larger_than_block(tmp_path) -> None:
    records = [b"x", os.urandom(3 * skio.BLOCK_SIZE + 11), b"y"]
    path = write(tmp_path / "big.tfrecord", records)
    assert list(read_tfrecord(path)) == records


def test_empty_file(tmp_path) -> None:
    for compression in (None, "gzip", "zlib"):
        path = write(tmp_path / f"empty-{compression}.tfrecord", [], compression)
        assert list(read_tfrecord(path)) == []
        assert scan_count(path) == 0


def test_gzip_written_by_stdlib_and_multi_member(tmp_path) -> None:
    data = b"".join(map(framed, RECORDS))
    path = tmp_path / "members.gz"
    path.write_bytes(gzip.compress(data[:40]) + gzip.compress(data[40:]))
    assert list(read_tfrecord(str(path))) == RECORDS
    zpath = tmp_path / "z.tfrecord"
    zpath.write_bytes(zlib.compress(data, 9))
    assert list(read_tfrecord(str(zpath), compression="zlib")) == RECORDS


@pytest.mark.parametrize(("start", "stop"), [(0, None), (2, None), (1, 3), (4, 5), (5, None), (3, 3), (0, 99)])
def test_start_stop(tmp_path, start: int, stop: int | None) -> None:
    path = write(tmp_path / "a.tfrecord", RECORDS)
    expected = RECORDS[start:stop]
    assert list(read_tfrecord(path, start=start, stop=stop)) == expected
    offsets = read_index(build_index(path))
    assert list(read_tfrecord(path, start=start, stop=stop, index=offsets)) == expected
    assert list(read_tfrecord(path, start=start, stop=stop, index=index_path_for(path))) == expected


def test_index_seeks_instead_of_scanning(tmp_path) -> None:
    path = write(tmp_path / "a.tfrecord", RECORDS)
    offsets = read_index(build_index(path))
    with open(path, "r+b") as f:  # damage record 0: only a scan from the start would notice
        f.write(b"\xff" * 8)
    assert list(read_tfrecord(path, start=2, index=offsets)) == RECORDS[2:]
    with pytest.raises(CorruptRecordError):
        list(read_tfrecord(path, start=2))


def test_index_ignored_for_compressed_files(tmp_path) -> None:
    path = write(tmp_path / "a.tfrecord.gz", RECORDS, "gzip")
    offsets = read_index(build_index(path))
    assert offsets.tolist() == scan_offsets(write(tmp_path / "plain", RECORDS)).tolist()
    assert list(read_tfrecord(path, start=3, index=offsets)) == RECORDS[3:]


@pytest.mark.parametrize("place", ["local", "memory"])
def test_a_small_indexed_range_frames_only_its_own_bytes_and_reads_them_byte_exact(tmp_path, monkeypatch, place):
    rng = np.random.default_rng(5)
    records = [rng.bytes(int(n)) for n in rng.integers(0, 300, 3000)]  # most of a block after any record
    root = str(tmp_path) if place == "local" else "memory://small-ranges"
    path = write(f"{root}/a.tfrecord", records)
    offsets = read_index(build_index(path))
    framed: list[int] = []  # bytes framed by the block reader, or read by the compiled one (read_cut)
    frame = tfr._frame
    monkeypatch.setattr(tfr, "_frame", lambda buf, check: framed.append(len(buf)) or frame(buf, check))
    if kernel.KERNEL.read_cut is not None:
        read_cut = kernel.KERNEL.read_cut

        def counted(fd, buf, state, *args):  # state[2]: the file offset read up to
            pos = int(state[2])
            result = read_cut(fd, buf, state, *args)
            framed.append(int(state[2]) - pos)
            return result

        monkeypatch.setattr(kernel, "KERNEL", kernel.KERNEL._replace(read_cut=counted))
    ends = [*offsets.tolist(), sum(len(r) + 16 for r in records)]
    for start, stop in [(1000, 1001), (2500, 2503), (17, 529), (2999, 3000)]:
        framed.clear()
        assert list(read_tfrecord(path, start=start, stop=stop, index=offsets)) == records[start:stop]
        assert sum(framed) == ends[stop] - ends[start]  # the range's bytes, not the block after its start
    framed.clear()  # the format's own reads (what the sources call) go through the index file the same way
    assert list(TFRecordFormat().read_marked(path, 1000, 1001)) == records[1000:1001]
    assert sum(framed) == len(records[1000]) + 16


def test_an_end_offset_from_the_index_is_not_used_on_a_compressed_stream(tmp_path) -> None:
    plain = write(tmp_path / "plain.tfrecord", RECORDS)
    path = write("memory://small-ranges/a.tfrecord.gz", RECORDS, "gzip")
    offsets = read_index(build_index(plain))  # uncompressed offsets: only a plain file could seek by them
    assert list(read_tfrecord(path, start=1, stop=3, index=offsets)) == RECORDS[1:3]


def test_bad_arguments(tmp_path) -> None:
    path = write(tmp_path / "a.tfrecord", RECORDS)
    with pytest.raises(ValueError, match="start"):
        read_tfrecord(path, start=3, stop=2)
    with pytest.raises(ValueError, match="compression"):
        list(read_tfrecord(path, compression="bz2"))
    with pytest.raises(ValueError, match="compression"):
        TFRecordWriter(str(tmp_path / "b"), compression="lz4")


def test_writer_rejects_write_after_close(tmp_path) -> None:
    writer = TFRecordWriter(str(tmp_path / "a.tfrecord"))
    writer.close()
    writer.close()
    with pytest.raises(ShardkitError, match="closed"):
        writer.write(b"x")


def test_memory_filesystem() -> None:
    for compression in (None, "gzip"):
        url = f"memory://tfrecord-test/{compression}/a.tfrecord"
        write(url, RECORDS, compression)
        assert list(read_tfrecord(url)) == RECORDS
        assert scan_count(url) == len(RECORDS)
    url = "memory://tfrecord-test/None/a.tfrecord"
    assert read_index(build_index(url)).tolist() == scan_offsets(url).tolist()
    assert list(read_tfrecord(url, start=3, index=index_path_for(url))) == RECORDS[3:]


def test_file_url(tmp_path) -> None:
    path = write(tmp_path / "a.tfrecord", RECORDS)
    assert list(read_tfrecord("file://" + path)) == RECORDS


# --------------------------------------------------------------------------- corruption


def flipped(data: bytes, position: int) -> bytes:
    damaged = bytearray(data)
    damaged[position] ^= 0x10
    return bytes(damaged)


@pytest.mark.parametrize(
    ("where", "reason"),
    [
        (0, "length CRC mismatch"),
        (3, "length CRC mismatch"),
        (9, "length CRC mismatch"),
        (12, "data CRC mismatch"),
        (12 + 299, "data CRC mismatch"),
        (12 + 300 + 2, "data CRC mismatch"),
    ],
)
def test_flipped_bit_names_record_offset_and_check(place: str, where: int, reason: str) -> None:
    import fsspec

    records = [b"first", os.urandom(300), b"third"]
    data = b"".join(map(framed, records))
    second = len(framed(records[0]))
    path = f"{place}/bad.tfrecord"
    with fsspec.open(path, "wb") as f:
        f.write(flipped(data, second + where))
    got = []
    with pytest.raises(CorruptRecordError) as info:
        for record in read_tfrecord(str(path)):
            got.append(record)
    assert got == records[:1]  # the good record before the bad one is still returned
    error = info.value
    assert (error.url, error.record_index, error.offset) == (str(path), 1, second)
    assert reason in error.reason and "expected 0x" in error.reason and "found 0x" in error.reason
    assert error.framing_intact == reason.startswith("data")  # the records after a bad data CRC can still be found
    assert f"record 1 at byte offset {second}" in str(error)
    with pytest.raises(CorruptRecordError, match=reason):
        verify_tfrecord(str(path))
    if reason.startswith("data"):
        assert list(read_tfrecord(str(path), verify=False))[0] == records[0]


def test_truncation_at_every_boundary(place: str, small_blocks: None) -> None:
    import fsspec

    records = [b"abc", b"", os.urandom(20)]
    data = b"".join(map(framed, records))
    boundaries = {0}
    for record in records:
        boundaries.add(max(boundaries) + len(framed(record)))
    path = f"{place}/cut.tfrecord"
    for cut in range(len(data)):
        with fsspec.open(path, "wb") as f:
            f.write(data[:cut])
        if cut in boundaries:
            count = sorted(boundaries).index(cut)
            assert list(read_tfrecord(str(path), compression=None)) == records[:count]
            continue
        record_start = max(b for b in boundaries if b < cut)
        index = sorted(boundaries).index(record_start)
        for verify in (True, False):
            with pytest.raises(CorruptRecordError, match="file ends inside record") as info:
                list(read_tfrecord(str(path), compression=None, verify=verify))
            assert (info.value.record_index, info.value.offset) == (index, record_start)
        with pytest.raises(CorruptRecordError, match=r"expected \d+ more bytes"):
            scan_count(str(path), compression=None)


def test_truncated_compressed_stream(tmp_path) -> None:
    path = write(tmp_path / "a.tfrecord.gz", RECORDS, "gzip")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CorruptRecordError, match="gzip stream is truncated"):
        list(read_tfrecord(path))


def test_offsets_in_compressed_errors_say_uncompressed(tmp_path) -> None:
    data = flipped(b"".join(map(framed, RECORDS)), len(framed(RECORDS[0])) + 14)
    path = tmp_path / "bad.gz"
    path.write_bytes(gzip.compress(data))
    with pytest.raises(CorruptRecordError, match="uncompressed gzip stream"):
        list(read_tfrecord(str(path)))


@pytest.mark.parametrize(
    ("written", "given", "match"),
    [
        (None, "gzip", "cannot decompress as compression='gzip'"),
        (None, "zlib", "cannot decompress as compression='zlib'"),
        ("gzip", "zlib", "cannot decompress as compression='zlib'"),
        ("gzip", None, "starts like a gzip stream"),
        ("zlib", None, "starts like a zlib stream"),
    ],
)
def test_wrong_compression_is_a_clear_error(tmp_path, written: str | None, given: str | None, match: str) -> None:
    path = write(tmp_path / "a.tfrecord", RECORDS, written)
    with pytest.raises(CorruptRecordError, match=match) as info:  # located at record 0, byte 0
        list(read_tfrecord(path, compression=given))
    assert (info.value.record_index, info.value.offset) == (0, 0)


def test_garbage_file(tmp_path) -> None:
    path = tmp_path / "garbage"
    path.write_bytes(b"this is not a tfrecord file at all")
    with pytest.raises(CorruptRecordError, match="record 0 at byte offset 0: length CRC mismatch"):
        list(read_tfrecord(str(path)))


# --------------------------------------------------------------------------- indexes


def test_index_format_and_tfrecord_package_text_index(tmp_path) -> None:
    path = write(tmp_path / "a.tfrecord", RECORDS)
    index = build_index(path)
    assert index == path + ".idx"
    raw = open(index, "rb").read()
    offsets = np.cumsum([0] + [len(framed(r)) for r in RECORDS])
    assert raw[:8] == b"SKTFIDX1"
    assert struct.unpack_from("<QQ", raw, 8) == (len(RECORDS), offsets[-1])
    assert np.frombuffer(raw, "<u8", offset=24).tolist() == offsets[:-1].tolist()
    text = tmp_path / "a.tidx"
    text.write_text("".join(f"{o} {n}\n" for o, n in zip(offsets[:-1], np.diff(offsets))))
    assert read_index(str(text)).tolist() == offsets[:-1].tolist()
    bad = tmp_path / "bad.idx"
    bad.write_bytes(b"SKTFIDX1" + struct.pack("<QQ", 3, 0) + b"\0" * 8)
    with pytest.raises(ShardkitError, match="3 offsets"):
        read_index(str(bad))


def test_index_of_empty_file(tmp_path) -> None:
    path = write(tmp_path / "empty.tfrecord", [])
    assert read_index(build_index(path)).tolist() == []


# --------------------------------------------------------------------------- cross-check with the tfrecord package


def test_tfrecord_package_files_read_by_shardkit(tmp_path) -> None:
    from tfrecord.reader import tfrecord_iterator
    from tfrecord.writer import TFRecordWriter as Theirs

    path = str(tmp_path / "theirs.tfrecord")
    writer = Theirs(path)
    examples = [
        {"label": (i, "int"), "x": ([0.5 * i, -1.0], "float"), "name": (f"n{i}".encode(), "byte")} for i in range(50)
    ]
    for example in examples:
        writer.write(example)
    writer.close()
    assert list(read_tfrecord(path)) == [bytes(r) for r in tfrecord_iterator(path)]
    for i, record in enumerate(read_tfrecord(path)):
        decoded = shardkit.decode_example(record)
        assert decoded["label"].tolist() == [i]
        assert decoded["x"].tolist() == [0.5 * i, -1.0]
        assert decoded["name"] == [f"n{i}".encode()]


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_shardkit_files_read_by_tfrecord_package(tmp_path, compression: str | None) -> None:
    from tfrecord.reader import tfrecord_loader

    path = str(tmp_path / "ours.tfrecord")
    examples = [{"label": i, "x": np.array([i, -0.25], np.float32), "name": [f"n{i}".encode()]} for i in range(50)]
    write(path, [shardkit.encode_example(e) for e in examples], compression)
    loaded = list(tfrecord_loader(path, None, compression_type=compression))
    assert len(loaded) == len(examples)
    for example, theirs in zip(examples, loaded):
        assert theirs["label"].tolist() == [example["label"]]
        assert theirs["x"].tolist() == example["x"].tolist()
        assert bytes(theirs["name"]) == example["name"][0]


def test_tfrecord_package_reads_our_index(tmp_path) -> None:
    from tfrecord.tools.tfrecord2idx import create_index

    path = write(tmp_path / "a.tfrecord", RECORDS)
    create_index(path, str(tmp_path / "theirs.idx"))
    assert read_index(str(tmp_path / "theirs.idx")).tolist() == read_index(build_index(path)).tolist()


# --------------------------------------------------------------------------- ShardWriter


def test_shard_writer_rolls_over_and_writes_manifest(tmp_path) -> None:
    from shardkit.shardlist import ShardList

    pattern = str(tmp_path / "out" / "train-%05d.tfrecord")
    records = [os.urandom(i) for i in range(23)]
    with shardkit.ShardWriter(pattern, max_records=5) as writer:
        for record in records:
            writer.write(record)
    shards = ShardList.from_manifest(str(tmp_path / "out" / "train.manifest.arrow"))
    assert list(shards) == [pattern % i for i in range(5)]
    assert shards.num_records.tolist() == [5, 5, 5, 5, 3]
    assert [r for url in shards for r in read_tfrecord(url)] == records
    assert writer.shards == shards


def test_shard_writer_max_bytes_and_compression(tmp_path) -> None:
    pattern = str(tmp_path / "%d.tfrecord.gz")
    manifest = str(tmp_path / "m.arrow")
    with shardkit.ShardWriter(pattern, max_bytes=100, compression="gzip", manifest=manifest) as writer:
        for size in (10, 10, 10, 200, 5):
            writer.write(b"z" * size)
    # 26 + 26 + 26 = 78 fit in 100; the 200-byte record gets a shard of its own
    assert writer.shards.num_records.tolist() == [3, 1, 1]
    assert os.path.exists(manifest)
    assert [len(r) for url in writer.shards for r in read_tfrecord(url)] == [10, 10, 10, 200, 5]


def test_shard_writer_validation_and_failure(tmp_path) -> None:
    with pytest.raises(ValueError, match="integer field"):
        shardkit.ShardWriter(str(tmp_path / "no-field.tfrecord"))
    with pytest.raises(ValueError, match="max_records"):
        shardkit.ShardWriter(str(tmp_path / "%d"), max_records=0)
    with pytest.raises(RuntimeError):
        with shardkit.ShardWriter(str(tmp_path / "f-%d.tfrecord")) as writer:
            writer.write(b"x")
            raise RuntimeError
    assert not os.path.exists(tmp_path / "f.manifest.arrow")  # no manifest for a failed write


# --------------------------------------------------------------------------- CLI


def test_cli_inspect(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(
        tmp_path / "a.tfrecord", [shardkit.encode_example({"y": i, "img": b"abc", "f": [1.0, 2.0]}) for i in range(7)]
    )
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "7 records" in out
    assert "img" in out and "bytes" in out and "int64" in out and "float  x 2" in out


def test_cli_verify(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path / "good.tfrecord", RECORDS)
    bad = tmp_path / "bad.tfrecord"
    bad.write_bytes(flipped(open(good, "rb").read(), 40))
    assert main(["verify", good]) == 0
    assert f"ok {good}: {len(RECORDS)} records" in capsys.readouterr().out
    assert main(["verify", good, str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: record 2 at byte offset 33: length CRC mismatch" in err


def test_cli_index(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = [write(tmp_path / f"{i}.tfrecord", RECORDS[: i + 1]) for i in range(3)]
    assert main(["index", *paths]) == 0
    for i, path in enumerate(paths):
        assert len(read_index(index_path_for(path))) == i + 1
    # A file that is not gzip from its first byte reads as corrupt data (exit 1), with the fix named.
    assert main(["index", "--compression", "gzip", paths[0]]) == 1
    assert "pass the right compression" in capsys.readouterr().err
