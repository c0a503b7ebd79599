"""Megatron-LM indexed datasets: byte-exact with megatron-core both ways, one record per document,
counts from the .idx header, every corruption a located error (or a counted skip), and a .bin
truncated under the reader an error, not a SIGBUS."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.errors import CorruptRecordError
from shardkit.formats.base import BadRecord
from shardkit.formats.megatron import MegatronFormat, PairWriter
from tests.helpers.examples import examples
from tests.helpers.load import hang_bound
from tests.helpers.tokens import DOCS, IDX_AT, read_tokens, write_pair


def _builder_pair(prefix: str, docs: list[np.ndarray], dtype: type) -> None:
    """The pair megatron-core's own builder writes: every third document of two sequences."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for i, tokens in enumerate(docs):
        if i % 3 == 0 and len(tokens) > 2:
            builder.add_document(torch.tensor(tokens), [2, len(tokens) - 2])
        else:
            builder.add_item(torch.tensor(tokens))
            builder.end_document()
    builder.finalize(prefix + ".idx")


def _shardkit_pair(prefix: str, docs: list[np.ndarray], dtype: type) -> None:
    with shardkit.TokenWriter(prefix, dtype=dtype) as writer:
        for i, tokens in enumerate(docs):
            split = {"sequence_lengths": [2, len(tokens) - 2]} if i % 3 == 0 and len(tokens) > 2 else {}
            writer.write({"input_ids": tokens, **split})


@pytest.fixture(scope="module")
def megatron_core():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns that Apex and Transformer Engine are missing
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


@pytest.mark.slow  # importing megatron.core takes ~20 s on a shared CPU
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # megatron-core's numpy.array(torch tensor)
@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_token_writer_writes_the_bytes_megatron_cores_builder_writes_and_each_reads_the_other(
    megatron_core, tmp_path, dtype
) -> None:
    _builder_pair(str(tmp_path / "theirs"), DOCS, dtype)
    _shardkit_pair(str(tmp_path / "ours"), DOCS, dtype)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes()
    theirs = megatron_core.IndexedDataset(str(tmp_path / "ours"))
    starts = theirs.document_indices
    for d, tokens in enumerate(DOCS):  # megatron-core's documents of our file are ours
        got = [theirs[s] for s in range(starts[d], starts[d + 1])]
        assert np.array_equal(np.concatenate(got) if got else np.zeros(0, dtype), tokens)
    ours = read_tokens(MegatronFormat().read(str(tmp_path / "theirs.bin")))
    assert [t.tolist() for t in ours] == [t.tolist() for t in DOCS]


def test_a_document_is_one_record_a_read_only_view_in_the_files_dtype(tmp_path) -> None:
    prefix = write_pair(tmp_path, dtype=np.uint16)
    records = list(MegatronFormat().read(prefix + ".bin"))
    assert len(records) == len(DOCS) and all(list(r) == ["input_ids"] for r in records)
    tokens = records[4]["input_ids"]
    assert tokens.dtype == np.uint16 and not tokens.flags.writeable and tokens.tolist() == DOCS[4].tolist()


@pytest.mark.parametrize("spelling", ["", ".bin", ".idx"])
def test_a_range_reads_exactly_its_documents_whichever_file_names_the_pair(tmp_path, spelling) -> None:
    prefix = write_pair(tmp_path)
    got = read_tokens(MegatronFormat().read(prefix + spelling, 7, 19))
    assert [t.tolist() for t in got] == [t.tolist() for t in DOCS[7:19]]
    assert read_tokens(MegatronFormat().read(prefix + spelling, len(DOCS) - 1, 10**9))[0].tolist() == DOCS[-1].tolist()


def test_an_idx_is_known_by_its_magic_whatever_its_name(tmp_path) -> None:
    prefix = write_pair(tmp_path)
    os.rename(prefix + ".idx", tmp_path / "renamed")
    assert shardkit.format_for(str(tmp_path / "renamed")).name == "megatron"


def test_counts_come_from_the_idx_header_without_the_bin(tmp_path) -> None:
    prefix = write_pair(tmp_path)
    os.truncate(prefix + ".bin", 0)  # nothing to scan
    assert MegatronFormat().stored_count(prefix + ".bin") == len(DOCS)
    assert MegatronFormat().count(prefix) == len(DOCS)


def test_shard_writer_writes_pairs_and_a_manifest_token_dataset_reads(tmp_path) -> None:
    with shardkit.ShardWriter(str(tmp_path / "part-%03d.bin"), max_records=20, format="megatron") as writer:
        for tokens in DOCS:
            writer.write({"input_ids": tokens})
    shards = writer.shards
    assert shards is not None and shards.num_records.tolist() == [20, 20, len(DOCS) - 40]
    assert sorted(os.listdir(tmp_path)) == [
        *(f"part-{i:03d}.{s}" for i in range(3) for s in ("bin", "idx")),
        "part.manifest.arrow",
    ]
    assert [t.tolist() for t in read_tokens(shardkit.TokenDataset(shards))] == [t.tolist() for t in DOCS]


def test_a_failed_write_leaves_neither_file(tmp_path) -> None:
    with pytest.raises(RuntimeError), shardkit.TokenWriter(str(tmp_path / "x")) as writer:
        writer.write([1, 2, 3])
        raise RuntimeError("stop")
    assert os.listdir(tmp_path) == []


def test_a_token_the_dtype_cannot_hold_is_an_error_naming_the_document(tmp_path) -> None:
    with pytest.raises(shardkit.ShardkitError, match=r"document 1: tokens \[70000\] do not fit uint16"):
        with PairWriter(str(tmp_path / "x.bin"), dtype=np.uint16) as writer:
            writer.write([1])
            writer.write([2, 70000])


# --------------------------------------------------------------------------- corruption

S = len(DOCS)  # one sequence per document in write_pair's files


def _poke(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _int(value: int, size: int = 8) -> bytes:
    return value.to_bytes(size, "little", signed=True)


# (name, how to damage the pair, the message, the url's suffix, record, offset or None for "any")
WHOLE_FILE = [
    ("bad magic", lambda p: _poke(p + ".idx", 0, b"NOTMEGATR"), "does not start with Megatron's magic", 0),
    ("version", lambda p: _poke(p + ".idx", 9, _int(2)), "has version 2; only version 1", 9),
    ("dtype code", lambda p: _poke(p + ".idx", 17, b"\x09"), "has dtype code 9, which is none of Megatron's", 17),
    ("huge count", lambda p: _poke(p + ".idx", 18, _int(2**63 - 1)), "is truncated: its header says 9223372036854775807 sequences", None),
    ("truncated idx", lambda p: os.truncate(p + ".idx", os.path.getsize(p + ".idx") - 5), "is truncated", None),
    ("trailing idx", lambda p: open(p + ".idx", "ab").write(b"12345"), "has 5 bytes after its document indices", None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "damage", "message", "offset"), WHOLE_FILE, ids=[c[0] for c in WHOLE_FILE])
def test_an_idx_whose_header_does_not_fit_is_located_in_the_idx_before_anything_is_read(
    tmp_path, name, damage, message, offset
) -> None:
    prefix = write_pair(tmp_path)
    damage(prefix)
    for call in (lambda: MegatronFormat().stored_count(prefix), lambda: list(MegatronFormat().read(prefix))):
        with pytest.raises(CorruptRecordError, match=message) as caught:
            call()
        assert caught.value.url == prefix + ".idx" and caught.value.record_index == -1
        assert offset is None or caught.value.offset == offset


def _pointer(k: int) -> int:
    return IDX_AT["pointers"] + 8 * k


def _length(k: int) -> int:
    return IDX_AT["lengths"] + 4 * k


# (name, damage, message, first bad document, documents lost, framing_intact)
PER_DOCUMENT = [
    ("pointer moved", lambda p: _poke(p + ".idx", _pointer(10), _int(3)), "sequence 10's pointer .* while the next sequence's is: this pointer is wrong", 10, 1, True),
    ("pointer past the end", lambda p: _poke(p + ".idx", _pointer(S - 1), _int(10**12)), "pointer is not where", S - 2, 2, True),
    ("length that does not add up", lambda p: _poke(p + ".idx", _length(20), _int(999, 4)), "sequence 20's length .* does not reach the next sequence's pointer", 20, 1, True),
    ("negative length", lambda p: _poke(p + ".idx", _length(30), _int(-4, 4)), "sequence 30 has a negative length", 30, 1, True),
    ("indices out of order", lambda p: _poke(p + ".idx", IDX_AT["indices"] + 8 * 41, _int(39)), "document index 41 is 39, after 40", 39, S - 39, False),
    ("truncated bin", lambda p: os.truncate(p + ".bin", os.path.getsize(p + ".bin") - 3), "but the .bin ends at byte", S - 1, 1, False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "damage", "message", "first", "lost", "intact"), PER_DOCUMENT, ids=[c[0] for c in PER_DOCUMENT]
)
def test_a_document_the_idx_misplaces_is_a_located_error_or_a_counted_skip(
    tmp_path, name, damage, message, first, lost, intact
) -> None:
    prefix = write_pair(tmp_path)
    damage(prefix)
    records = MegatronFormat().read_marked(prefix + ".bin")
    good = []
    with pytest.raises(CorruptRecordError, match=message) as caught:
        for record in records:
            if isinstance(record, BadRecord):
                raise record.error
            good.append(record["input_ids"].tolist())
    error = caught.value
    assert error.record_index == first and error.framing_intact == intact and error.offset >= 0
    assert good == [t.tolist() for t in DOCS[:first]]
    lenient = shardkit.TokenDataset(prefix, balance="none", on_error="skip")
    with pytest.warns(UserWarning, match=f"{first}"):
        read = read_tokens(lenient)
    assert lenient.stats().skipped.tolist() == [lost] and len(read) == S - lost
    kept = [t.tolist() for i, t in enumerate(DOCS) if not first <= i < first + lost]
    assert [t.tolist() for t in read] == kept  # the other documents, whole and in place


def test_a_bin_longer_than_its_idx_says_is_a_stale_pair(tmp_path) -> None:
    prefix = write_pair(tmp_path)
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(CorruptRecordError, match="8 more than its lengths in .* add up to") as caught:
        list(MegatronFormat().read(prefix, 5))
    assert caught.value.record_index == 5 and caught.value.url == prefix + ".bin"


def test_a_missing_idx_says_what_a_megatron_dataset_is(tmp_path) -> None:
    prefix = write_pair(tmp_path)
    os.remove(prefix + ".idx")
    with pytest.raises(FileNotFoundError, match=r"has no .*x\.idx beside it: a Megatron indexed dataset"):
        len(shardkit.TokenDataset(prefix))


def test_a_bin_truncated_under_the_reader_is_a_located_error_not_a_sigbus(tmp_path) -> None:
    docs = [np.full(5000, i, dtype=np.int32) for i in range(400)]  # 8 MB: several pread spans
    prefix = str(tmp_path / "big")
    with shardkit.TokenWriter(prefix) as writer:
        for tokens in docs:
            writer.write(tokens)
    records = MegatronFormat().read(prefix)
    early = [next(records)["input_ids"] for _ in range(10)]
    os.truncate(prefix + ".bin", 4 * 5000 * 150 + 6)
    with pytest.raises(CorruptRecordError, match="ended at byte .* while it was read") as caught:
        for _ in records:
            pass
    assert caught.value.record_index == 150 and not caught.value.framing_intact
    assert all((tokens == i).all() for i, tokens in enumerate(early))  # what was read stays valid


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.integers(0, IDX_AT["indices"] + 8 * (S + 1) - 1), value=st.integers(0, 255))
def test_any_byte_of_the_idx_changed_reads_true_documents_or_raises_located_errors(tmp_path, at, value) -> None:
    prefix = write_pair(tmp_path)
    _poke(prefix + ".idx", at, bytes([value]))
    in_index = IDX_AT["lengths"] <= at < IDX_AT["indices"]  # a length or pointer: every document it moves is caught
    position = 0
    try:
        for record in MegatronFormat().read_marked(prefix):
            if not isinstance(record, BadRecord) and in_index:
                assert record["input_ids"].tolist() == DOCS[position].tolist(), (at, value, position)
            position += 1
    except CorruptRecordError as error:  # nothing else: no OverflowError, MemoryError, IndexError
        assert error.record_index >= -1 and error.offset >= -1


# --------------------------------------------------------------------------- command line


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardkit", *args], capture_output=True, text=True, timeout=hang_bound(60)
    )


def test_inspect_shows_documents_tokens_and_dtype_of_a_pair_named_once_by_a_glob(tmp_path) -> None:
    prefix = write_pair(tmp_path, dtype=np.uint16)
    tokens = sum(len(t) for t in DOCS)
    done = _cli("inspect", str(tmp_path / "*"), prefix + ".idx")
    assert done.returncode == 0, done.stderr
    line = f"{prefix}.bin: {len(DOCS)} documents, {tokens} tokens, dtype uint16; format: megatron"
    assert done.stdout.count(line) == 2 and "skipped" not in done.stdout
    _poke(prefix + ".idx", _pointer(3), _int(1))
    bad = _cli("verify", prefix + ".bin")
    assert bad.returncode != 0 and "record 3 at byte offset" in bad.stdout + bad.stderr
