"""A record count a file's size cannot hold is a lie, whatever path reads the file.

Under ``on_error="skip"`` with ``balance="pad"``/``"drop"`` a lost record is made up by a stand-in. A shard
whose framing breaks mid-file costs the rest of its planned range; when the planned count is far above what
the file can hold (``num_records=[10**12]`` on 50 records) that range would be made up practically without
end. Each format knows the fewest bytes a record takes, so a file of ``size`` bytes holds at most
:func:`~shardkit.formats.base.max_records` records; a count above that raises :class:`BalanceError` naming
the url, the count, the size and the bound. Faults are injected for real: files cut short, lines spoilt.
"""

from __future__ import annotations

import gzip
import itertools
import os
import tarfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

import shardkit
from shardkit import JsonlDataset, TarDataset, TFRecordDataset
from shardkit.formats.base import MAX_EXPANSION, max_records
from shardkit.sources import BalanceError
from tests.helpers.shards import write_jsonl_shards, write_tar_shards

pytestmark = [
    pytest.mark.filterwarnings("ignore:skipping:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*counted as missing:UserWarning"),
]

LIE = 10**12
CAP = 10_000  # today's code yields stand-ins past this cap (about 5 * 10**11 per rank)


def _tfrecords(path: str, count: int) -> str:
    with shardkit.TFRecordWriter(path) as out:
        for k in range(count):
            out.write(f"r{k:05d}".encode())
    return path


def _cut(path: str, drop: int) -> int:
    """Cut the last ``drop`` bytes off ``path`` (a write that never finished); its new size."""
    size = os.path.getsize(path) - drop
    os.truncate(path, size)
    return size


def _read_capped(dataset) -> int:
    """Samples until the dataset ends or raises, at most CAP (today's code reaches the cap)."""
    return sum(1 for _ in itertools.islice(dataset, CAP))


def _assert_every_rank_raises(make, url: str, size: int, bound: int) -> None:
    for rank in range(2):
        dataset = make(rank=rank, world_size=2)
        with pytest.raises(BalanceError) as info:
            assert _read_capped(dataset) < CAP, "made up stand-ins without end"
        message = str(info.value)
        assert url in message and str(LIE) in message and f"{size} bytes" in message and f"at most {bound}" in message
        assert "count_records()" in message and dataset.stats().total_padded < CAP


def test_a_trillion_count_on_a_tfrecord_cut_mid_record_raises_on_every_rank_instead_of_padding(tmp_path):
    url = _tfrecords(str(tmp_path / "part-000.tfrecord"), 50)
    size = _cut(url, 3)  # the last record's data CRC is gone: the framing breaks there
    shards = shardkit.ShardList([url], num_records=[LIE])

    def make(**kwargs):
        return TFRecordDataset(shards, decode="raw", on_error="skip", balance="pad", compression=None, **kwargs)

    _assert_every_rank_raises(make, url, size, max_records(size, 16))


def test_a_trillion_count_on_a_tar_cut_mid_sample_raises_on_every_rank_instead_of_padding(tmp_path):
    (url,) = write_tar_shards(str(tmp_path), [50])
    size = _cut(url, os.path.getsize(url) // 2 - 100)  # mid-file, inside a member: the framing is gone
    shards = shardkit.ShardList([url], num_records=[LIE])

    def make(**kwargs):
        return TarDataset(shards, on_error="skip", balance="drop", **kwargs)

    _assert_every_rank_raises(make, url, size, max_records(size, 512))


def test_a_trillion_count_on_a_jsonl_with_a_malformed_line_raises_naming_what_its_size_can_hold(tmp_path):
    (url,) = write_jsonl_shards(str(tmp_path), [50])
    lines = open(url, "rb").read().splitlines(keepends=True)
    lines[20] = b'{"id": "r00020", broken\n'
    open(url, "wb").write(b"".join(lines))
    size = os.path.getsize(url)
    shards = shardkit.ShardList([url], num_records=[LIE])

    def make(**kwargs):
        return JsonlDataset(shards, on_error="skip", compression=None, **kwargs)

    _assert_every_rank_raises(make, url, size, max_records(size, 2))


def test_a_trillion_count_on_a_gzip_jsonl_cut_short_raises_with_the_bound_of_its_inflated_size(tmp_path):
    (url,) = write_jsonl_shards(str(tmp_path), [50], suffix=".jsonl.gz")
    size = _cut(url, 40)  # the gzip stream ends mid-member: the framing breaks
    shards = shardkit.ShardList([url], num_records=[LIE])

    def make(**kwargs):
        return JsonlDataset(shards, on_error="skip", **kwargs)

    _assert_every_rank_raises(make, url, size, max_records(size, 2, "gzip"))


def test_an_honest_large_count_with_damage_early_still_pads_the_rest_of_its_range(tmp_path):
    url = _tfrecords(str(tmp_path / "part-000.tfrecord"), 20_000)
    with open(url, "r+b") as f:  # record 10's length CRC: the framing breaks there, the count is true
        f.seek(10 * 22 + 8)
        f.write(b"\xff\xff\xff\xff")
    shards = shardkit.ShardList([url], num_records=[20_000])
    counts = []
    for rank in range(2):
        dataset = TFRecordDataset(shards, decode="raw", on_error="skip", rank=rank, world_size=2, compression=None)
        samples = list(dataset)
        counts.append(len(samples))
        assert dataset.stats().total_padded == (10_000 - 10 if rank == 0 else 10_000)
    assert counts == [10_000, 10_000]


def test_an_honest_count_on_a_file_cut_short_is_padded_under_the_allowance_as_before(tmp_path):
    url = _tfrecords(str(tmp_path / "part-000.tfrecord"), 50)
    _cut(url, 3)
    dataset = TFRecordDataset(shardkit.ShardList([url], num_records=[50]), decode="raw", on_error="skip")
    assert len(list(dataset)) == 50 and dataset.stats().total_padded == 1


def test_a_count_beyond_the_bound_but_within_the_allowance_is_still_padded_as_a_clean_short_end_is(tmp_path):
    url = _tfrecords(str(tmp_path / "part-000.tfrecord"), 50)
    size = _cut(url, 3)
    assert max_records(size, 16) < 100  # a lie, but a small one: 51 stand-ins, as for a shard ending cleanly short
    dataset = TFRecordDataset(shardkit.ShardList([url], num_records=[100]), decode="raw", on_error="skip")
    assert sum(1 for _ in dataset) == 100 and dataset.stats().total_padded == 51


def test_a_lying_count_under_balance_none_makes_nothing_up_and_does_not_raise(tmp_path):
    url = _tfrecords(str(tmp_path / "part-000.tfrecord"), 50)
    _cut(url, 3)
    dataset = TFRecordDataset(
        shardkit.ShardList([url], num_records=[LIE]), decode="raw", on_error="skip", balance="none"
    )
    assert sum(1 for _ in dataset) == 49 and dataset.stats().total_padded == 0  # not list(): len() is the count


# -- the pure bound -------------------------------------------------------------------------------------------


@given(
    st.integers(0, 10**9), st.integers(0, 10**9), st.sampled_from([1, 2, 16, 512]), st.sampled_from(list(MAX_EXPANSION))
)
def test_the_bound_grows_with_the_size(a, b, min_bytes, compression):
    small, large = sorted((a, b))
    assert max_records(small, min_bytes, compression) <= max_records(large, min_bytes, compression)


@given(st.lists(st.binary(max_size=40), max_size=30))
def test_no_valid_tfrecord_file_holds_more_records_than_its_bound(records):
    size = sum(16 + len(r) for r in records)
    assert len(records) <= max_records(size, 16)
    assert len(records) <= max_records(size, 16, "gzip")


@given(st.lists(st.sampled_from(["1", "{}", "[]", '"x"', "null"]), max_size=30), st.booleans())
def test_no_valid_jsonl_file_holds_more_records_than_its_bound(values, final_newline):
    text = "\n".join(values) + ("\n" if final_newline and values else "")
    assert len(values) <= max_records(len(text.encode()), 2)


@given(st.lists(st.binary(max_size=1200), max_size=6))
def test_no_valid_tar_holds_more_samples_than_its_bound(contents):
    import io

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, data in enumerate(contents):
            info = tarfile.TarInfo(f"s{i:05d}.bin")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert len(contents) <= max_records(len(buffer.getvalue()), 512)


def test_a_gzip_file_inflated_to_its_limit_holds_no_more_records_than_its_bound():
    data = gzip.compress(b"\x00" * (16 << 20), compresslevel=9)  # about the most deflate can inflate a byte to
    assert (16 << 20) // 16 <= max_records(len(data), 16, "gzip")
    assert len(data) * 1000 < 16 << 20  # and deflate's ratio is indeed near MAX_EXPANSION["gzip"]


def test_the_bound_refuses_a_compression_it_does_not_know():
    with pytest.raises(ValueError, match="bz2"):
        max_records(100, 16, "bz2")


def test_a_trillion_count_on_a_tar_with_a_header_damaged_mid_file_raises_naming_what_its_size_can_hold(tmp_path):
    (url,) = write_tar_shards(str(tmp_path), [50])
    offsets = [info.offset for info in tarfile.open(url).getmembers()]
    with open(url, "r+b") as f:  # a flipped byte in the checksum of a header halfway through
        f.seek(offsets[len(offsets) // 2] + 148)
        f.write(b"9")
    size = os.path.getsize(url)
    shards = shardkit.ShardList([url], num_records=[LIE])

    def make(**kwargs):
        return TarDataset(shards, on_error="skip", **kwargs)

    _assert_every_rank_raises(make, url, size, max_records(size, 512))
