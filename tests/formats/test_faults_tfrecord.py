"""Fault injection for the TFRecord reading layer: every malformed input is a located CorruptRecordError.

Huge length fields (with valid CRCs), damaged and truncated GZIP/ZLIB streams,
a file truncated or replaced under the reader (in a subprocess, to prove no
signal kills it), and a seeded fuzzer that mutates valid files and reads them
through every path.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import random
import struct
import subprocess
import sys
import textwrap
import tracemalloc
import zlib
from collections.abc import Callable

import fsspec
import pytest

from shardkit import CorruptRecordError
from shardkit.formats.crc import masked_crc32c
from shardkit.formats.offsets import IndexFileError, write_offsets
from shardkit.formats.tfrecord import TFRecordWriter, read_tfrecord, scan_count, scan_offsets, verify_tfrecord
from shardkit.formats.tfrecord import framing as tfr
from shardkit.formats.tfrecord.index import INDEX_MAGIC, read_index
from shardkit.io import files as skio
from tests.helpers.load import hang_bound
from tests.helpers.reading import read_all

COMPRESS = {None: lambda data: data, "gzip": lambda data: gzip.compress(data, mtime=0), "zlib": zlib.compress}


def header(length: int) -> bytes:
    """A record header claiming ``length`` data bytes, with a valid length CRC."""
    length_bytes = struct.pack("<Q", length)
    return length_bytes + struct.pack("<I", masked_crc32c(length_bytes))


def framed(record: bytes) -> bytes:
    return header(len(record)) + record + struct.pack("<I", masked_crc32c(record))


def put(url: str, data: bytes) -> str:
    with fsspec.open(url, "wb") as f:
        f.write(data)
    return url


def read_until_error(url: str, **kwargs: object) -> tuple[list[bytes], CorruptRecordError]:
    """The records read before the CorruptRecordError that must end the read, and that error."""
    got: list[bytes] = []
    with pytest.raises(CorruptRecordError) as info:
        for record in read_tfrecord(url, **kwargs):
            got.append(record)
    return got, info.value


@pytest.fixture(params=["local", "memory"])
def place(request: pytest.FixtureRequest, tmp_path) -> str:
    """A directory URL: local files are read with pread, memory:// ones streamed."""
    return str(tmp_path) if request.param == "local" else f"memory://{request.node.name}"


# --------------------------------------------------------------------------- huge lengths


@pytest.mark.parametrize("length", [2**64 - 1, 2**63, 2**40, 5000])
@pytest.mark.parametrize("compression", [None, "gzip", "zlib"])
@pytest.mark.parametrize("verify", [True, False])
def test_huge_length_with_valid_crc_is_a_truncated_record_not_an_allocation(
    place: str, length: int, compression: str | None, verify: bool
) -> None:
    good = [b"one", os.urandom(100)]
    body = b"".join(map(framed, good))
    url = put(f"{place}/huge.tfrecord", COMPRESS[compression](body + header(length) + b"x" * 200))
    tracemalloc.start()
    try:
        got, error = read_until_error(url, compression=compression, verify=verify)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == good
    assert (error.url, error.record_index, error.offset, error.framing_intact) == (url, 2, len(body), False)
    assert f"file ends inside record: expected {length + 16 - 212} more bytes" in error.reason
    assert peak < 32 << 20  # never sized by the length field: the file is a few hundred bytes


@pytest.mark.parametrize("compression", [None, "gzip", "zlib"])
def test_record_longer_than_a_block_cut_short_is_gathered_then_reported(
    place: str, compression: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tfr, "BLOCK_SIZE", 64)
    monkeypatch.setattr(skio, "BLOCK_SIZE", 64)
    big = os.urandom(1000)
    body = framed(b"a") + framed(big) + framed(b"b")
    url = put(f"{place}/long.tfrecord", COMPRESS[compression](body))
    assert list(read_tfrecord(url, compression=compression)) == [b"a", big, b"b"]
    cut = len(framed(b"a")) + 500
    put(url, COMPRESS[compression](body[:cut]))
    for verify in (True, False):
        got, error = read_until_error(url, compression=compression, verify=verify)
        assert got == [b"a"]
        assert (error.record_index, error.offset) == (1, len(framed(b"a")))
        assert f"file ends inside record: expected {len(framed(big)) - 500} more bytes" in error.reason


# --------------------------------------------------------------------------- compressed stream damage


def compressible_records(count: int = 3000) -> list[bytes]:
    """Text-like records, so deflate uses Huffman codes and a flipped byte breaks the stream itself."""
    rng = random.Random(7)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"epsilon", b"zeta", b"eta", b"theta"]
    return [b" ".join(rng.choice(words) for _ in range(rng.randrange(5, 60))) for _ in range(count)]


def damaged_mid_stream(body: bytes, split: int, compression: str) -> tuple[bytes, int]:
    """``body`` compressed with a full flush after ``split`` bytes, and a bad block header right after the flush.

    A full flush byte-aligns the stream, so the next byte starts a deflate
    block; 0x07 makes it a final block of the reserved type 3, which zlib
    refuses at exactly that byte, after inflating ``body[:split]`` intact.
    """
    deflate = zlib.compressobj(9, zlib.DEFLATED, skio._WBITS[compression])
    head = deflate.compress(body[:split]) + deflate.flush(zlib.Z_FULL_FLUSH)
    packed = head + deflate.compress(body[split:]) + deflate.flush()
    assert zlib.decompress(packed, skio._WBITS[compression]) == body
    return packed[: len(head)] + b"\x07" + packed[len(head) + 1 :], len(head)


@pytest.mark.parametrize("compression", ["gzip", "zlib"])
def test_damage_inside_compressed_stream_names_record_and_both_offsets(place: str, compression: str) -> None:
    records = compressible_records(3000)
    sizes = list(map(len, map(framed, records)))
    body = b"".join(map(framed, records))
    split = sum(sizes[:2000]) + 7  # inside record 2000
    damaged, bad_byte = damaged_mid_stream(body, split, compression)
    url = put(f"{place}/damaged.tfrecord.{compression}", damaged)
    got, error = read_until_error(url, compression=compression)
    assert got == records[:2000]  # every record inflated before the bad byte is delivered
    assert (error.url, error.record_index, error.offset, error.framing_intact) == (url, 2000, sum(sizes[:2000]), False)
    assert f"{compression} stream is damaged at compressed byte {bad_byte} (" in error.reason
    assert error.compressed_offset == bad_byte  # the compressed byte, as an attribute too
    assert "invalid block type" in error.reason and "reading record 2000" in error.reason
    assert f"offset in the uncompressed {compression} stream" in error.reason
    assert "pass the right compression" not in error.reason
    with pytest.raises(CorruptRecordError, match=f"record 2000 at byte offset {sum(sizes[:2000])}"):
        verify_tfrecord(url)


@pytest.mark.parametrize("compression", ["gzip", "zlib"])
def test_truncated_compressed_stream_delivers_records_before_and_names_the_cut(place: str, compression: str) -> None:
    records = compressible_records(2000)
    packed = COMPRESS[compression](b"".join(map(framed, records)))
    cut = len(packed) * 2 // 3
    url = put(f"{place}/cut.tfrecord.{compression}", packed[:cut])
    got, error = read_until_error(url, compression=compression)
    assert 0 < len(got) < len(records) and got == records[: len(got)]
    assert (error.record_index, error.offset, error.framing_intact) == (
        len(got),
        sum(map(len, map(framed, got))),
        False,
    )
    assert (
        f"{compression} stream is truncated: the compressed file ends at byte {cut} before the end-of-stream marker"
        in error.reason
    )
    assert error.compressed_offset == cut


def test_compressed_offset_is_none_for_plain_files_and_survives_a_dataloader_worker(tmp_path) -> None:
    import pickle

    from torch.utils.data import DataLoader

    import shardkit

    records = compressible_records(2000)
    plain = b"".join(map(framed, records))
    cut_plain = put(f"{tmp_path}/cut.tfrecord", plain[: len(plain) // 2])
    assert read_until_error(cut_plain, compression=None)[1].compressed_offset is None
    damaged, bad_byte = damaged_mid_stream(plain, sum(map(len, map(framed, records[:1500]))) + 3, "gzip")
    url = put(f"{tmp_path}/damaged.tfrecord.gz", damaged)
    error = read_until_error(url, compression="gzip")[1]
    assert pickle.loads(pickle.dumps(error)).compressed_offset == bad_byte
    dataset = shardkit.TFRecordDataset([url], decode="raw", compression="gzip")
    with pytest.raises(CorruptRecordError) as raised:  # rebuilt by torch in the main process from the text
        read_all(DataLoader(dataset, batch_size=None, num_workers=1))
    assert raised.value.compressed_offset == bad_byte and raised.value.record_index == 1500


@pytest.mark.parametrize("compression", ["gzip", "zlib"])
def test_bad_trailer_checksum_comes_after_every_record(place: str, compression: str) -> None:
    records = compressible_records(200)
    body = b"".join(map(framed, records))
    packed = bytearray(COMPRESS[compression](body))
    packed[-5 if compression == "gzip" else -1] ^= 0x01  # gzip: CRC32 then ISIZE; zlib: Adler-32 last
    url = put(f"{place}/trailer.tfrecord.{compression}", bytes(packed))
    got, error = read_until_error(url, compression=compression)
    assert got == records
    assert (error.record_index, error.offset, error.framing_intact) == (len(records), len(body), False)
    assert "incorrect data check" in error.reason and "pass the right compression" not in error.reason


@pytest.mark.parametrize(("written", "given"), [(None, "gzip"), (None, "zlib"), ("gzip", "zlib"), ("zlib", "gzip")])
def test_data_not_compressed_from_the_first_byte_keeps_the_compression_hint(
    place: str, written: str | None, given: str
) -> None:
    url = put(f"{place}/plain.tfrecord", COMPRESS[written](b"".join(map(framed, [b"abc", b"defg"]))))
    got, error = read_until_error(url, compression=given)
    assert got == []
    assert (error.url, error.record_index, error.offset) == (url, 0, 0)
    assert f"cannot decompress as compression={given!r}" in error.reason
    assert "pass the right compression or compression='auto'" in error.reason


# --------------------------------------------------------------------------- the file changing under the reader


def test_local_file_truncated_under_the_reader_at_a_record_boundary_is_reported(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tfr, "BLOCK_SIZE", 256)
    records = [os.urandom(50) for _ in range(40)]
    path = put(str(tmp_path / "a.tfrecord"), b"".join(map(framed, records)))
    reader = read_tfrecord(path)
    assert next(reader) == records[0]  # the first block (records 0..2, 3 x 66 bytes) is now in memory
    os.truncate(path, 2 * len(framed(records[0])))  # cut between records 1 and 2, behind the reader
    rest = []
    with pytest.raises(CorruptRecordError, match="file shrank from 2640 to 132 bytes while being read") as info:
        for record in reader:
            rest.append(record)
    assert rest == records[1:3]
    assert (info.value.record_index, info.value.offset) == (3, 3 * 66)


def test_index_pointing_past_the_end_of_a_shortened_file_is_an_error(place: str) -> None:
    records = [os.urandom(30) for _ in range(6)]
    url = put(f"{place}/a.tfrecord", b"".join(map(framed, records)))
    offsets = scan_offsets(url)
    write_offsets(url + ".idx", INDEX_MAGIC, offsets, 6 * 46)
    put(url, b"".join(map(framed, records[:3])))  # the shard was rewritten shorter; the index is stale
    for start in (3, 4):  # offsets given as an array: where they lead, the file ends
        got, error = read_until_error(url, start=start, index=read_index(url + ".idx"))
        assert got == []
        assert (error.record_index, error.offset) == (start, offsets[start])
        assert "file ends where this record should start (as the index says)" in error.reason
    assert list(read_tfrecord(url, start=1, index=read_index(url + ".idx"))) == records[1:3]
    with pytest.raises(IndexFileError, match="describes 276 bytes but the file has 138 .it shrank"):
        list(read_tfrecord(url, start=1, index=url + ".idx"))  # an index file is checked against the file first


CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    from shardkit import CorruptRecordError, read_tfrecord

    path, pause_after = sys.argv[1], int(sys.argv[2])
    digest, count = hashlib.sha256(), 0
    try:
        for record in read_tfrecord(path):
            digest.update(record)
            count += 1
            if count == pause_after:
                print("paused", flush=True)
                sys.stdin.readline()  # the test changes the file now
    except CorruptRecordError as error:
        fields = [error.url, error.record_index, error.offset, error.framing_intact, error.reason, count]
        print(json.dumps(fields), flush=True)
        sys.exit(3)
    print(json.dumps([count, digest.hexdigest()]), flush=True)
    """
)


def run_child_and_change_file(path: str, pause_after: int, change: Callable[[], object]) -> tuple[int, list, str]:
    """Read ``path`` in a subprocess, call ``change()`` once it has read ``pause_after`` records, let it finish."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, path, str(pause_after)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout.readline() == "paused\n"
        change()
        out, err = child.communicate("go\n", timeout=hang_bound(120))
    finally:
        child.kill()
        child.wait()
    return child.returncode, json.loads(out) if out else [], err


def large_shard(path: str, count: int = 20_000) -> tuple[list[bytes], list[int]]:
    """About 21 MB of 1 KB records (five reader blocks); returns the records and their offsets."""
    rng = random.Random(3)
    records = [rng.randbytes(1000 + i % 50) for i in range(count)]
    with TFRecordWriter(path) as writer:
        for record in records:
            writer.write(record)
    offsets = [0]
    for record in records:
        offsets.append(offsets[-1] + len(record) + 16)
    return records, offsets


@pytest.mark.slow
def test_truncating_a_large_shard_under_a_reader_process_raises_instead_of_killing_it(tmp_path) -> None:
    path = str(tmp_path / "large.tfrecord")
    records, offsets = large_shard(path)
    cut = 3 * skio.BLOCK_SIZE + 12345  # ahead of the reader, which holds only its first block
    returncode, result, err = run_child_and_change_file(path, 1000, lambda: os.truncate(path, cut))
    assert returncode == 3, f"reader died with {returncode} (negative: a signal such as SIGBUS); stderr: {err}"
    url, index, offset, framing_intact, reason, delivered = result
    inside = max(i for i, start in enumerate(offsets) if start < cut)  # the record the cut falls in
    assert (url, index, offset, framing_intact, delivered) == (path, inside, offsets[inside], False, inside)
    assert "file ends inside record" in reason


@pytest.mark.slow
def test_a_shard_replaced_by_rename_under_a_reader_process_is_read_to_the_end_as_it_was(tmp_path) -> None:
    path = str(tmp_path / "large.tfrecord")
    records, _ = large_shard(path)
    replacement = str(tmp_path / "new.tfrecord")
    with TFRecordWriter(replacement) as writer:
        writer.write(b"a different, shorter shard")

    returncode, result, err = run_child_and_change_file(path, 1000, lambda: os.replace(replacement, path))
    assert returncode == 0, err
    # The open descriptor keeps the old inode: the reader finishes the shard it opened, unchanged.
    assert result == [len(records), hashlib.sha256(b"".join(records)).hexdigest()]
    assert list(read_tfrecord(path)) == [b"a different, shorter shard"]  # a new read sees the new file


# --------------------------------------------------------------------------- fuzzing


def mutate(data: bytes, boundaries: list[int], rng: random.Random) -> bytes:
    """One random fault: flipped bytes, a cut, a spliced range, or a huge length with a valid CRC."""
    kind = rng.randrange(5)
    out = bytearray(data)
    if kind == 0:
        for _ in range(rng.randint(1, 3)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    elif kind == 1:
        del out[rng.randrange(len(out)) :]
    elif kind == 2:
        a, b = sorted(rng.randrange(len(out)) for _ in range(2))
        at = rng.randrange(len(out))
        out[at:at] = out[a:b]
    elif kind == 3:
        at = rng.choice(boundaries[:-1])
        length = rng.choice([2**64 - 1, 2**63 + rng.randrange(2**20), 2**32, 2**31 - 1, len(data), 10**9])
        out[at : at + 12] = header(length)
    else:
        at = rng.randrange(len(out))
        out[at:at] = header(rng.choice([2**64 - 1, 2**40, 7]))
    return bytes(out)


def fuzz_once(url: str, compression: str | None, verify: bool, start: int, index: object) -> None:
    """Read ``url`` every way; anything but a located CorruptRecordError fails the test."""
    kwargs = {"compression": compression, "verify": verify, "start": start, "index": index}
    calls = [lambda: list(read_tfrecord(url, **kwargs))]
    if start == 0 and verify:
        calls += [lambda: scan_count(url, compression=compression), lambda: verify_tfrecord(url)]
    for call in calls:
        try:
            call()
        except CorruptRecordError as error:
            assert error.url == url
            assert error.record_index >= 0 and error.offset >= 0, error


@pytest.mark.parametrize("block_size", [skio.BLOCK_SIZE, 61])
def test_fuzzed_files_only_ever_raise_located_corrupt_record_errors(
    tmp_path, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tfr, "BLOCK_SIZE", block_size)
    monkeypatch.setattr(skio, "BLOCK_SIZE", block_size)
    rng = random.Random(block_size)
    records = [rng.randbytes(rng.choice([0, 1, 5, 40, 150])) for _ in range(25)]
    data = b"".join(map(framed, records))
    boundaries = list(itertools.accumulate([0, *map(len, map(framed, records))]))
    offsets = boundaries[:-1]
    places = [("local", str(tmp_path)), ("memory", "memory://fuzz-tfrecord")]
    for round_ in range(60):
        damaged = mutate(data, boundaries, rng)
        for (name, where), compression in [(p, c) for p in places for c in COMPRESS]:
            url = f"{where}/{round_}-{compression}.tfrecord"
            plain = put(url, COMPRESS[compression](damaged))
            assert plain == url
            for verify in (True, False):
                fuzz_once(url, compression, verify, 0, None)
                fuzz_once(url, "auto", verify, 0, None)
                fuzz_once(url, compression, verify, 7, offsets)
            if compression is not None:  # and the compressed bytes themselves damaged
                put(url, mutate(COMPRESS[compression](data), [0, 1], rng))
                fuzz_once(url, compression, True, 0, None)
                fuzz_once(url, "auto", False, 3, offsets)


# -- a stale index and a start past its count ------------------------------------------------------------------


def _rewritten_after_indexing(tmp_path) -> tuple[str, str, list[bytes]]:
    """A file indexed with 10 records, then rewritten with 20 (the first 10 the same): (url, index, records)."""
    from shardkit import build_index

    url = str(tmp_path / "data.tfrecord")
    records = [f"record {i:02d}".encode() for i in range(20)]
    with TFRecordWriter(url) as out:
        for record in records[:10]:
            out.write(record)
    index = build_index(url)
    with TFRecordWriter(url) as out:  # the file rewritten, the index left as it was
        for record in records:
            out.write(record)
    return url, index, records


def test_a_start_past_a_stale_index_file_raises_naming_both_files_and_the_fix(tmp_path) -> None:
    url, index, records = _rewritten_after_indexing(tmp_path)
    for start in (12, 10, 3):  # past its count, at it, and inside it
        with pytest.raises(IndexFileError, match=f"index file {index} does not fit {url}: .*grew.*no index= to read_"):
            list(read_tfrecord(url, start=start, index=index))
    assert list(read_tfrecord(url, start=12)) == records[12:]  # without the index: the 8 records


def test_a_start_past_stale_index_offsets_raises_instead_of_returning_nothing(tmp_path) -> None:
    url, index, records = _rewritten_after_indexing(tmp_path)
    offsets = read_index(index)  # the stale offsets passed as an array: the file is the only check
    for start in (12, 10):
        with pytest.raises(IndexFileError, match=f"does not fit {url}: .*last offset {offsets[-1]}.*shardkit index"):
            list(read_tfrecord(url, start=start, index=offsets))
    assert list(read_tfrecord(url, start=3, stop=6, index=offsets)) == records[3:6]  # its records are still there


def test_a_start_past_a_fitting_index_reads_nothing_and_raises_nothing(tmp_path) -> None:
    from shardkit import build_index

    url = str(tmp_path / "data.tfrecord")
    with TFRecordWriter(url) as out:
        for i in range(10):
            out.write(b"x" * i)
    index = build_index(url)
    for start in (10, 12):
        assert list(read_tfrecord(url, start=start, index=index)) == []
        assert list(read_tfrecord(url, start=start, index=read_index(index))) == []
    empty = str(tmp_path / "empty.tfrecord")
    TFRecordWriter(empty).close()
    assert list(read_tfrecord(empty, start=1, index=[])) == []
