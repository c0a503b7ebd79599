"""WebDataset tar shards: byte-compatibility both ways, splits, faults, resume, S3."""

from __future__ import annotations

import collections
import gzip
import io
import os
import re
import shutil
import subprocess
import tarfile

import pytest
import webdataset as wds
from hypothesis import given
from hypothesis import strategies as st

import shardkit
from shardkit import CorruptRecordError, TarDataset
from shardkit.formats.offsets import IndexFileError
from shardkit.formats.registry import format_for
from shardkit.formats.tar import TarFormat, TarWriter
from shardkit.formats.tar.headers import _split_key
from shardkit.formats.tar.parser import _blame
from tests.helpers.reading import assert_split, ids_per_rank, rank_factory
from tests.helpers.shards import format_ids, tar_sample, write_tar_shards

SIZES = [17, 3, 0, 25, 9, 11]  # 65 samples, an empty shard among them


sample = tar_sample


def write_shards(root: str, sizes=SIZES, storage_options=None) -> list[str]:
    return write_tar_shards(root, sizes, storage_options)


def all_keys(sizes=SIZES) -> list[str]:
    return format_ids("tar", sizes)


def webdataset_samples(url: str) -> list[dict]:
    return [{k: v for k, v in s.items() if k != "__local_path__"} for s in wds.WebDataset(url, shardshuffle=False)]


def write_with_tarfile(url: str, fmt: int, names: list[str], compress: bool = False) -> None:
    with tarfile.open(url, "w:gz" if compress else "w", format=fmt) as tar:
        for i, name in enumerate(names):
            data = f"{name}:{i}".encode() * (i + 1)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


NAMES = [
    "a/b/k1.jpg", "a/b/k1.JSON", "a/b/k1.seg.png", "k2.txt", "__meta__", "k3.cls",
    "dir.with.dots/" + "x" * 130 + ".txt", "dir.with.dots/" + "x" * 130 + ".cls", "k4.tar.gz",
]  # fmt: skip


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("compress", [False, True])
def test_tars_written_by_tarfile_are_grouped_as_webdataset_groups_them(tmp_path, fmt, compress):
    names = NAMES if fmt != tarfile.USTAR_FORMAT else [n for n in NAMES if len(n) < 100]
    url = str(tmp_path / ("t.tar.gz" if compress else "t.tar"))
    write_with_tarfile(url, fmt, names, compress)
    ours = list(TarFormat().read(url))
    assert ours == webdataset_samples(url)
    assert [s["__key__"] for s in ours][:2] == ["a/b/k1", "k2"]
    assert ours[0]["json"] == b"a/b/k1.JSON:1" * 2  # extensions lowercased, data byte-exact
    assert TarFormat().count(url) == len(ours)


def test_tars_written_by_webdataset_and_gnu_tar_read_the_same(tmp_path):
    (url,) = write_shards(str(tmp_path), [40])
    assert list(TarFormat().read(url)) == webdataset_samples(url)
    if shutil.which("tar") is None:
        pytest.skip("no GNU tar")
    src = tmp_path / "files"
    for s in webdataset_samples(url)[:10]:
        for ext in ("txt", "cls"):
            (src / "sub").mkdir(parents=True, exist_ok=True)
            (src / "sub" / f"{s['__key__']}.{ext}").write_bytes(s[ext])
    for gnu_format in ("gnu", "pax", "ustar"):
        out = str(tmp_path / f"{gnu_format}.tar")
        subprocess.run(["tar", f"--format={gnu_format}", "-cf", out, "-C", str(src), "sub"], check=True)
        assert list(TarFormat().read(out)) == webdataset_samples(out)


def test_tars_written_by_shardkit_read_by_webdataset_give_the_same_samples(tmp_path):
    url = str(tmp_path / "ours.tar")
    written = [sample(n) for n in range(30)]
    with TarWriter(url) as writer:
        for s in written:
            writer.write(s)
    theirs = webdataset_samples(url)
    expected = [{**{k: v.encode() if isinstance(v, str) else v for k, v in s.items()}, "__url__": url} for s in written]
    for s in expected:
        s["__key__"] = s["__key__"].decode()
    assert theirs == expected
    assert list(TarFormat().read(url)) == expected
    assert format_for(url).name == "tar"
    assert format_for(url.replace(".tar", ""), head=open(url, "rb").read(512)).name == "tar"  # by magic


def test_an_index_gives_counts_and_ranges_that_seek(tmp_path):
    (url,) = write_shards(str(tmp_path), [50])
    fmt = TarFormat()
    everything = list(fmt.read(url))
    assert fmt.build_index(url) == url + ".idx"
    assert fmt.count(url) == 50
    for start, stop in [(0, 1), (7, 8), (13, 40), (49, None), (50, 51), (45, 99)]:
        assert list(fmt.read(url, start, stop)) == everything[start:stop]


def test_unindexed_ranges_equal_slices(tmp_path):
    (url,) = write_shards(str(tmp_path), [20])
    fmt = TarFormat()
    everything = list(fmt.read(url))
    assert [list(fmt.read(url, a, b)) for a, b in [(3, 9), (19, 25), (0, 0)]] == [everything[3:9], everything[19:], []]


def make_dataset(urls, **kwargs):
    return rank_factory(TarDataset, urls, **kwargs)


def header_offsets(url: str) -> list[int]:
    with tarfile.open(url) as tar:
        return [member.offset for member in tar.getmembers()]


def test_a_truncated_tar_raises_where_it_ends_or_is_skipped_and_counted(tmp_path):
    urls = write_shards(str(tmp_path), [10, 10])
    cut = header_offsets(urls[1])[3 * 3 + 1] + 700  # inside the 4th sample's second member
    with open(urls[1], "r+b") as f:
        f.truncate(cut)
    with pytest.raises(
        CorruptRecordError, match=r"part-001.tar: record 3 at byte offset \d+: the file ends inside"
    ) as info:
        list(TarDataset(urls, balance="none"))
    assert info.value.record_index == 3 and not info.value.framing_intact
    lenient = TarDataset(shardkit.ShardList(urls, num_records=[10, 10]), balance="none", on_error="skip")
    with pytest.warns(UserWarning, match=r"skipping 7 records of .*part-001.tar from record 3"):
        keys = [s["__key__"] for s in lenient]
    assert keys == all_keys([13])
    assert lenient.stats().skipped.tolist() == [0, 7]


def test_a_header_checksum_mismatch_and_a_missing_end_marker_are_located_errors(tmp_path):
    (url,) = write_shards(str(tmp_path), [6])
    offset = header_offsets(url)[6]  # the first header of sample 2
    with open(url, "r+b") as f:
        f.seek(offset + 3)
        f.write(b"!")
    # The damaged header is sample 2's (its pax header names no key; the member after it is s00002's).
    with pytest.raises(CorruptRecordError, match=rf"record 2 at byte offset {offset}: tar header checksum mismatch"):
        list(TarFormat().read(url))
    (tmp_path / "b").mkdir()
    (url,) = write_shards(str(tmp_path / "b"), [6])
    with tarfile.open(url) as tar:
        last = tar.getmembers()[-1]
    with open(url, "r+b") as f:  # cut the zero blocks after the last member: a cut on a member boundary
        f.truncate(last.offset_data + -(-last.size // 512) * 512)
    with pytest.raises(CorruptRecordError, match="the file ends without the end-of-archive marker"):
        list(TarFormat().read(url))


def test_a_stale_index_is_refused_for_seeking_and_replaced_by_a_scan_for_counting(tmp_path):
    (url,) = write_shards(str(tmp_path), [8])
    fmt = TarFormat()
    fmt.build_index(url)
    write_shards(str(tmp_path), [9])  # the shard is rewritten with one sample more; the index is stale
    with pytest.raises(IndexFileError, match="part-000.tar.idx does not fit"):
        list(fmt.read(url, 4))
    with pytest.warns(UserWarning, match="counting its samples by a scan instead"):
        assert fmt.count(url) == 9
    with open(url + ".idx", "r+b") as f:  # a damaged index
        f.truncate(30)
    with pytest.raises(IndexFileError, match="should hold"):
        list(fmt.read(url, 4))


def test_shard_writer_rolls_tars_over_and_writes_a_manifest_webdataset_agrees_with(tmp_path):
    with shardkit.ShardWriter(str(tmp_path / "out-%03d.tar"), max_records=7) as writer:
        for n in range(20):
            writer.write(sample(n))
    shards = writer.shards
    assert shards.num_records.tolist() == [7, 7, 6]
    assert [s for url in shards for s in webdataset_samples(url)] == [
        s for url in shards for s in TarFormat().read(url)
    ]
    manifest = shardkit.ShardList.from_manifest(str(tmp_path / "out.manifest.arrow"))
    assert [s["__key__"] for s in TarDataset(manifest, balance="none")] == all_keys([20])
    with shardkit.ShardWriter(str(tmp_path / "b-%03d.tar"), max_bytes=6000) as writer:
        for n in range(20):
            writer.write(sample(n))
    assert sum(writer.shards.num_records) == 20 and len(writer.shards) > 2


@given(st.text(alphabet="ab./\nXé", max_size=14))
def test_keys_split_as_webdatasets_regex_splits_them(name):
    match = re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", name)
    assert _split_key(name) == (None if match is None else (match.group(1), match.group(2).lower()))


def test_a_size_field_that_lies_costs_no_memory_and_is_a_located_error(tmp_path):
    (url,) = write_shards(str(tmp_path), [4])
    offset = header_offsets(url)[2]  # the header of sample 0's third member
    with open(url, "r+b") as f:
        f.seek(offset)
        header = bytearray(f.read(512))
        header[124:136] = b"\x80" + (2**60).to_bytes(11, "big")  # GNU base-256: an exabyte member
        header[148:156] = b" " * 8
        header[148:156] = f"{sum(header):06o}\0 ".encode()
        f.seek(offset)
        f.write(header)
    with pytest.raises(
        CorruptRecordError, match=rf"record 0 at byte offset {offset}: tar header size field .* past the end"
    ):
        list(TarFormat().read(url))


def test_gzip_tars_are_streamed_counted_by_a_scan_and_split(tmp_path):
    urls = []
    for url in write_shards(str(tmp_path), [7, 12, 5]):
        with open(url, "rb") as f, gzip.open(f"{url}.gz", "wb") as g:
            g.write(f.read())
        urls.append(f"{url}.gz")
    assert (
        TarFormat().count(urls[1]) == 12 and list(TarFormat().read(urls[1], 4, 6)) == webdataset_samples(urls[1])[4:6]
    )
    with pytest.raises(shardkit.ShardkitError, match="cannot seek, so it gets no index"):
        TarFormat().build_index(urls[0])
    for balance in ("none", "pad"):
        ranks = ids_per_rank(make_dataset(urls, balance=balance, shuffle=True), world_size=2, num_workers=0)
        assert_split(ranks, all_keys([7, 12, 5]), balance)
    with open(urls[2], "r+b") as f:  # a damaged gzip stream: located at the sample being inflated
        f.truncate(f.seek(0, 2) // 2)
    with pytest.raises(
        CorruptRecordError, match=r"part-002.tar.gz: record \d+ at byte offset \d+: gzip stream is truncated"
    ):
        list(TarFormat().read(urls[2]))


def test_with_an_index_a_bad_header_costs_exactly_its_sample(tmp_path):
    urls = write_shards(str(tmp_path), [10, 10])
    TarFormat().build_index(urls[0])
    offset = header_offsets(urls[0])[3 * 4 + 1]  # sample 4's second member (its pax header)
    with open(urls[0], "r+b") as f:
        f.seek(offset + 2)
        f.write(b"?")
    with pytest.raises(CorruptRecordError, match=rf"record 4 at byte offset {offset}: tar header checksum") as info:
        list(TarFormat().read(urls[0]))
    assert info.value.framing_intact  # the index says where sample 5 starts
    lenient = TarDataset(urls, balance="none", on_error="skip")
    with pytest.warns(UserWarning, match="skipping record 4 of .*part-000.tar"):
        keys = [s["__key__"] for s in lenient]
    assert keys == [k for n, k in enumerate(all_keys([20])) if n != 4]
    assert lenient.stats().skipped.tolist() == [1, 0]


def test_an_index_whose_boundaries_cut_a_sample_is_refused(tmp_path):
    (url,) = write_shards(str(tmp_path), [6])
    offsets = TarFormat().scan(url)
    members = header_offsets(url)
    moved = offsets.copy()
    moved[4] = members[3 * 3 + 1]  # sample 3's second member: the index no longer fits the samples
    from shardkit.formats.offsets import write_offsets
    from shardkit.formats.tar import INDEX_MAGIC

    write_offsets(url + ".idx", INDEX_MAGIC, moved, os.path.getsize(url))
    read = []
    with pytest.raises(CorruptRecordError, match="the index file puts a sample boundary inside the sample 's00003'"):
        read.extend(TarFormat().read(url))
    assert [s["__key__"] for s in read] == all_keys([3])  # no part of sample 3 came out as a sample


def test_garbage_in_a_header_with_a_valid_checksum_is_a_located_error(tmp_path):
    (url,) = write_shards(str(tmp_path), [4])
    offset = header_offsets(url)[4]  # sample 1's second member's pax header
    with open(url, "r+b") as f:
        f.seek(offset)
        header = bytearray(f.read(512))
        header[124:136] = b"9x9x9x9x9x9\0"  # not octal
        header[148:156] = b" " * 8
        header[148:156] = f"{sum(header):06o}\0 ".encode()
        f.seek(offset)
        f.write(header)
    with pytest.raises(CorruptRecordError, match=rf"record 1 at byte offset {offset}: tar header size field"):
        list(TarFormat().read(url))


def test_a_malformed_pax_record_is_a_located_error(tmp_path):
    (url,) = write_shards(str(tmp_path), [4])
    offset = header_offsets(url)[4]
    with open(url, "r+b") as f:
        f.seek(offset + 512)  # the pax records: "<length> key=value\n"
        f.write(b"zz path=x\n")
    with pytest.raises(CorruptRecordError, match=rf"record 1 at byte offset {offset}: malformed pax header"):
        list(TarFormat().read(url))


# --------------------------------------------------------------------------- resync after a bad header (no index)


def write_two_member_tar(url: str, fmt: int, count: int = 8) -> None:
    """``count`` samples ``k000..`` of two members (.txt, .cls), written by tarfile in format ``fmt``."""
    with tarfile.open(url, "w", format=fmt) as tar:
        for i in range(count):
            for ext in ("txt", "cls"):
                data = f"{i}{ext}".encode() * (i * 70 + 1)
                info = tarfile.TarInfo(f"k{i:03d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def flip(url: str, at: int, mask: int = 0x41) -> None:
    with open(url, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ mask]))


WRITERS = {
    "webdataset": lambda url: write_shards(os.path.dirname(url), [8])[0],
    "tarfile-ustar": lambda url: write_two_member_tar(url, tarfile.USTAR_FORMAT) or url,
    "tarfile-gnu": lambda url: write_two_member_tar(url, tarfile.GNU_FORMAT) or url,
    "tarfile-pax": lambda url: write_two_member_tar(url, tarfile.PAX_FORMAT) or url,
}
# Bytes of a header: a key character, the extension, the size, the checksum field, the type flag, padding.
HEADER_BYTES = [1, 6, 130, 150, 156, 300]


@pytest.mark.filterwarnings("ignore:skipping record")
@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("byte", HEADER_BYTES)
@pytest.mark.parametrize("member", ["first", "last"])
def test_without_an_index_a_flipped_header_costs_exactly_the_sample_of_the_hit_member(tmp_path, writer, byte, member):
    url = WRITERS[writer](str(tmp_path / "part-000.tar"))
    intact = list(TarFormat().read(url))
    with tarfile.open(url) as tar:
        members = tar.getmembers()
    per_sample = len(members) // len(intact)
    lost = 3
    hit = members[lost * per_sample + (0 if member == "first" else per_sample - 1)]
    with open(url, "rb") as f:
        original = f.read()
    for header in sorted({hit.offset, hit.offset_data - 512}):  # a pax header, and the member's own header
        with open(url, "wb") as f:
            f.write(original)
        flip(url, header + byte)
        with pytest.raises(CorruptRecordError) as info:
            list(TarFormat(index=False).read(url))
        error = info.value
        assert (error.url, error.record_index, error.offset, error.framing_intact) == (url, lost, header, True)
        assert TarFormat(index=False).count(url) == len(intact)  # the scan counts the lost sample: numbering holds
        lenient = TarDataset(shardkit.ShardList([url], num_records=[len(intact)]), balance="none", on_error="skip")
        assert list(lenient) == intact[:lost] + intact[lost + 1 :]  # every later sample byte-exact
        assert lenient.stats().skipped.tolist() == [1]


@pytest.mark.filterwarnings("ignore:skipping record")
def test_garbage_over_a_header_costs_its_sample_and_a_gzip_tar_resyncs_too(tmp_path):
    (url,) = write_shards(str(tmp_path), [8])
    intact = list(TarFormat().read(url))
    with tarfile.open(url) as tar:  # sample 6's first member: its ustar header, after its pax header
        at = tar.getmembers()[3 * 6].offset_data - 512
    with open(url, "r+b") as f:
        f.seek(at)
        f.write(os.urandom(512))
    with pytest.raises(CorruptRecordError, match=rf"record 6 at byte offset {at}: tar header checksum mismatch"):
        list(TarFormat().read(url))
    with open(url, "rb") as f, gzip.open(url + ".gz", "wb") as g:
        g.write(f.read())
    for shard in (url, url + ".gz"):
        lenient = TarDataset([shard], balance="none", on_error="skip")
        assert [s["bin"] for s in lenient] == [s["bin"] for i, s in enumerate(intact) if i != 6]
        assert lenient.stats().skipped.tolist() == [1]


@pytest.mark.filterwarnings("ignore:skipping record")
def test_an_index_from_before_the_damage_and_a_scan_after_it_lose_the_same_sample(tmp_path):
    urls = write_shards(str(tmp_path), [10, 10])
    TarFormat().build_index(urls[0])
    intact = list(TarFormat().read(urls[0]))
    flip(urls[0], header_offsets(urls[0])[3 * 7 + 2] + 140)  # sample 7's third member, its mtime
    with pytest.raises(shardkit.ShardkitError, match="record 7"):
        TarFormat().build_index(urls[0])  # the index is not rebuilt over damage
    for index in (True, False):
        counted = TarFormat(index=index).count(urls[0])
        lenient = TarDataset(urls, balance="none", on_error="skip", index=index)
        keys = [s["__key__"] for s in lenient]
        assert counted == 10 and keys == [k for n, k in enumerate(all_keys([20])) if n != 7]
        assert [s for s in TarFormat(index=index).read(urls[0], 8, 10)] == intact[8:]


@pytest.mark.filterwarnings("ignore:skipping record")
@pytest.mark.parametrize("balance", ["pad", "drop"])
@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_bad_header_keeps_planned_counts_equal_over_ranks(tmp_path, balance, num_workers):
    urls = write_shards(str(tmp_path), [10, 10, 5])
    flip(urls[1], header_offsets(urls[1])[3 * 4] + 150)  # sample 14: its first header's checksum field
    ranks = ids_per_rank(make_dataset(urls, balance=balance, on_error="skip"), world_size=3, num_workers=num_workers)
    per_rank = -(-25 // 3) if balance == "pad" else 25 // 3
    assert [sum(len(b) for b in batches) for batches in ranks] == [per_rank] * 3
    seen = {s for batches in ranks for batch in batches for s in batch}
    assert "s00014" not in seen and (balance == "drop" or seen == set(all_keys([25])) - {"s00014"})


@pytest.mark.filterwarnings("ignore:skipping")
@pytest.mark.parametrize("writer", ["webdataset", "tarfile-gnu"])
def test_a_tar_cut_mid_member_is_a_located_error_or_a_counted_skip_with_equal_counts(tmp_path, writer):
    url = WRITERS[writer](str(tmp_path / "part-000.tar"))
    members = header_offsets(url)
    per_sample = len(members) // 8
    with open(url, "r+b") as f:
        f.truncate(members[per_sample * 5 + 1] + 600)  # inside sample 5's second member
    with pytest.raises(CorruptRecordError, match="the file ends inside") as info:
        list(TarFormat().read(url))
    assert info.value.record_index == 5 and info.value.url == url
    lenient = TarDataset(shardkit.ShardList([url], num_records=[8]), balance="pad", on_error="skip")
    assert len(list(lenient)) == 8 and lenient.stats().skipped.tolist() == [3]


def test_a_damaged_run_is_blamed_on_the_sample_its_name_or_neighbours_point_to():
    current = {"__key__": "k001", "__url__": "u", "txt": b""}
    previous = {"__key__": "k000", "__url__": "u", "txt": b"", "cls": b""}
    assert _blame(("k001", "cls"), current, ("k002", "txt"), previous) == "current"  # names the open sample
    assert _blame(("k0Q1", "cls"), current, ("k001", "json"), previous) == "current"  # the next member is its
    assert _blame(("k0Q1", "cls"), current, ("k002", "txt"), previous) == "current"  # the open one lacks .cls
    assert _blame(("", ""), None, ("k002", "cls"), previous) == "next"  # an extended header
    assert _blame(("k0Q2", "txt"), previous, ("k002", "cls"), previous) == "next"  # the next one lacks .txt
    complete = {**current, "cls": b""}
    assert _blame(("k002", "tXt"), complete, ("k003", "txt"), previous) == "own"  # an unknown extension
    assert _blame(None, current, ("k003", "txt"), previous) == "current"  # garbage: the open one is short
    assert _blame(None, previous, ("k003", "cls"), previous) == "next"  # garbage: .cls never comes first
    assert _blame(None, previous, ("k003", "txt"), previous) == "own"


# --------------------------------------------------------------------------- headers whose fields lie


def write_pax_tar(url: str, count: int = 6, pax: int = 3) -> None:
    """``count`` samples ``k000..`` of two members (.txt, .cls); sample ``pax``'s .txt carries a pax ``path`` record."""
    with tarfile.open(url, "w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(count):
            for ext in ("txt", "cls"):
                data = f"{i}{ext}".encode() * (i * 70 + 1)
                info = tarfile.TarInfo(f"k{i:03d}.{ext}")
                info.size = len(data)
                if i == pax and ext == "txt":
                    info.pax_headers = {"path": info.name}
                tar.addfile(info, io.BytesIO(data))


def rewrite_header(url: str, offset: int, **fields: bytes) -> None:
    """Set fields of the header at ``offset`` (``size=``: bytes 124..136) and fix its checksum, as a writer would."""
    spans = {"size": (124, 136)}
    with open(url, "r+b") as f:
        f.seek(offset)
        header = bytearray(f.read(512))
        for name, value in fields.items():
            begin, end = spans[name]
            header[begin:end] = value.ljust(end - begin, b"\0")
        header[148:156] = b" " * 8
        header[148:156] = f"{sum(header):06o}\0 ".encode()
        f.seek(offset)
        f.write(header)


def rewrite_pax_records(url: str, offset: int, records: bytes) -> None:
    """Replace the records of the pax header at ``offset`` (they fit its first data block) and fix its size field."""
    assert len(records) <= 512
    rewrite_header(url, offset, size=f"{len(records):011o}".encode())
    with open(url, "r+b") as f:
        f.seek(offset + 512)
        f.write(records.ljust(512, b"\0"))


@pytest.mark.filterwarnings("ignore:skipping record")
@pytest.mark.parametrize(
    "records",
    [
        b"99999999999999999999999 path=k003.txt\n",  # a length past the header's end: tarfile raises
        b"99999999999999999999999 mtime=1\n",  # the same in a header that names no path
        b"17 path=k003.txtX",  # the record does not end with a newline
        b"3 a=\n",  # shorter than its own length field
        b"12 path k003\n",  # no '='
        b"19 path=k003.txt\n",  # a length past the end of the records
    ],
)
def test_a_pax_record_whose_length_lies_is_a_located_error_that_costs_exactly_its_sample(tmp_path, records):
    url = str(tmp_path / "part-000.tar")
    write_pax_tar(url)
    intact = list(TarFormat().read(url))
    offset = header_offsets(url)[6]  # sample 3's .txt: its pax header
    rewrite_pax_records(url, offset, records)
    with pytest.raises(CorruptRecordError, match=r"malformed pax header") as info:
        list(TarFormat().read(url))
    error = info.value
    assert (error.url, error.record_index, error.offset, error.framing_intact) == (url, 3, offset, True)
    assert TarFormat().count(url) == 6
    lenient = TarDataset([url], balance="none", on_error="skip")
    assert list(lenient) == intact[:3] + intact[4:]  # every other sample byte-exact
    assert lenient.stats().skipped.tolist() == [1]


@pytest.mark.filterwarnings("ignore:skipping record")
@pytest.mark.parametrize("lost", [10, 19])  # 19: the last sample, before the end-of-archive marker
@pytest.mark.parametrize("member", [0, 2])
@pytest.mark.parametrize("index", [False, True])
def test_a_size_field_past_the_end_of_the_file_costs_exactly_its_sample(tmp_path, lost, member, index):
    (url,) = write_shards(str(tmp_path), [20])
    intact = list(TarFormat().read(url))
    if index:
        TarFormat().build_index(url)  # an index from before the damage
    with tarfile.open(url) as tar:
        at = tar.getmembers()[3 * lost + member].offset_data - 512  # the member's own ustar header
    rewrite_header(url, at, size=b"77777777777")  # 8 GiB: far past the end of the file
    with pytest.raises(CorruptRecordError, match=rf"record {lost} at byte offset {at}: .*past the end") as info:
        list(TarFormat(index=index).read(url))
    assert (info.value.url, info.value.framing_intact) == (url, True)
    assert TarFormat(index=index).count(url) == 20  # the lost sample counts, as the reader numbers it
    lenient = TarDataset([url], balance="none", on_error="skip", index=index)
    assert list(lenient) == intact[:lost] + intact[lost + 1 :]  # every later sample read, byte-exact
    assert (lenient.stats().skipped.tolist(), lenient.stats().errors.tolist()) == ([1], [1])


@pytest.mark.filterwarnings("ignore:skipping record")
def test_a_size_field_past_the_end_of_the_file_leaves_counts_resolvable_and_ranks_equal(tmp_path):
    urls = write_shards(str(tmp_path), [20, 7])
    with tarfile.open(urls[0]) as tar:
        rewrite_header(urls[0], tar.getmembers()[3 * 10].offset_data - 512, size=b"77777777777")
    counted = TarDataset(urls, on_error="skip", index=False).count_records()
    assert counted.shards.num_records.tolist() == [20, 7]
    ranks = ids_per_rank(make_dataset(urls, balance="pad", on_error="skip", index=False), world_size=2, num_workers=0)
    per_rank = [sum(len(b) for b in batches) for batches in ranks]
    seen = collections.Counter(s for batches in ranks for batch in batches for s in batch)
    good = set(all_keys([27])) - {"s00010"}
    assert per_rank == [14, 14] and set(seen) == good  # every good sample, the lost one never
    assert sum(seen.values()) - len(seen) == 28 - 26  # repeats stand in for the lost sample and the pad, no more


@pytest.mark.filterwarnings("ignore:skipping record")
def test_a_size_field_past_the_end_of_a_gzip_tar_costs_exactly_its_sample(tmp_path):
    (url,) = write_shards(str(tmp_path), [20])
    intact = [s["bin"] for s in TarFormat().read(url)]
    with tarfile.open(url) as tar:
        rewrite_header(url, tar.getmembers()[3 * 10].offset_data - 512, size=b"77777777777")
    with open(url, "rb") as f, gzip.open(url + ".gz", "wb") as g:
        g.write(f.read())
    with pytest.raises(CorruptRecordError, match=r"record 10 at byte offset \d+: .*past the end"):
        list(TarFormat().read(url + ".gz"))
    assert TarFormat().count(url + ".gz") == 20
    lenient = TarDataset([url + ".gz"], balance="none", on_error="skip")
    assert [s["bin"] for s in lenient] == intact[:10] + intact[11:]
    assert lenient.stats().skipped.tolist() == [1]
