"""Valid items over 2 GiB, in real sparse files: read whole, never reported as a truncated file.

Linux moves at most 0x7ffff000 bytes per ``pread``; a reader that read a
whole item in one call took the short read for the end of the file. Each
test reads a sparse file holding one item of just over 2 GiB between small
ones: up to three times the item's memory (an Arrow batch), 20-30 s a test
on a shared 2-core machine; marked slow. (Why the readers needed a fix: one
``os.pread`` of such an item moves :data:`~tests.helpers.sparse.PREAD_LIMIT` bytes.)
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from shardkit import CorruptRecordError, ShardkitError
from shardkit.formats.megatron import MegatronFormat
from shardkit.formats.tfrecord import buffers, read_tfrecord, read_tfrecord_batches
from shardkit.formats.tfrecord.buffers import BlockBuffers
from shardkit.io.files import pread_exactly, preadv_exactly
from tests.helpers.once import one_at_a_time
from tests.helpers.sparse import HEAD, OVER_2_GIB, PREAD_LIMIT, TAIL, sparse_file, sparse_megatron, sparse_tfrecord

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _alone(tmp_path_factory):
    """Each test holds up to three times 2 GiB: one at a time over the whole session's workers."""
    with one_at_a_time(tmp_path_factory, "over-2-gib"):
        yield


@pytest.fixture(scope="module")
def big_tfrecord(tmp_path_factory):
    return sparse_tfrecord(tmp_path_factory.mktemp("sparse") / "big.tfrecord", OVER_2_GIB, b"small")


def test_reading_exactly_n_bytes_reads_on_past_one_preads_limit_and_stops_at_the_end(tmp_path):
    path = sparse_file(tmp_path / "f", OVER_2_GIB + 4, {0: HEAD, OVER_2_GIB - 4: TAIL + b"rest"})
    fd = os.open(path, os.O_RDONLY)
    try:
        data = pread_exactly(fd, OVER_2_GIB, 0)
        assert (len(data) > PREAD_LIMIT, len(data), data[:4], data[-4:]) == (True, OVER_2_GIB, HEAD, TAIL)
        del data
        assert pread_exactly(fd, 100, OVER_2_GIB) == b"rest"  # fewer only where the file ends
        assert pread_exactly(fd, 100, OVER_2_GIB + 4) == b""
        buf = bytearray(8)
        assert (preadv_exactly(fd, buf, OVER_2_GIB - 4), bytes(buf)) == (8, TAIL + b"rest")
        assert preadv_exactly(fd, bytearray(100), OVER_2_GIB) == 4
        assert preadv_exactly(fd, bytearray(100), OVER_2_GIB + 4) == 0
    finally:
        os.close(fd)


def test_a_valid_tfrecord_record_over_2_gib_is_read_whole_with_its_crc_checked(big_tfrecord):
    records = read_tfrecord(str(big_tfrecord), verify=True)
    big = next(records)
    assert (len(big), big[:4], big[-4:]) == (OVER_2_GIB, HEAD, TAIL)
    del big
    assert list(records) == [b"small"]


def test_a_tfrecord_record_over_2_gib_with_a_wrong_crc_is_a_data_crc_error_not_a_truncation(tmp_path):
    path = sparse_tfrecord(tmp_path / "flipped.tfrecord", OVER_2_GIB, b"small", crc_flip=1)
    with pytest.raises(CorruptRecordError, match="data CRC mismatch") as raised:
        list(read_tfrecord(str(path), verify=True))
    assert (raised.value.record_index, raised.value.offset) == (0, 0)


def test_tfrecord_batches_hold_a_record_over_2_gib_in_a_large_binary_array(big_tfrecord):
    batches = read_tfrecord_batches(str(big_tfrecord), arrow_type="large_binary")
    batch = next(batches)
    offsets = np.frombuffer(batch.buffers()[1], dtype=np.int64)[: len(batch) + 1]
    assert np.diff(offsets).tolist() == [OVER_2_GIB, 5]
    big = batch[0].as_buffer()
    assert (bytes(big[:4]), bytes(big[-4:])) == (HEAD, TAIL)
    assert batch[1].as_py() == b"small"
    del big, batch
    assert list(batches) == []
    # The buffers that record needed are not kept once it is dropped (they were: 4 GiB held for good).
    kept = [len(buf) for pool in buffers._shared.values() for buf in pool._pool]  # pyright: ignore[reportPrivateUsage]
    assert max(kept, default=0) <= BlockBuffers.LARGEST_KEPT


def test_a_binary_view_batch_refuses_a_record_over_2_gib_naming_large_binary(big_tfrecord):
    with pytest.raises(ShardkitError, match="arrow_type='large_binary'"):
        list(read_tfrecord_batches(str(big_tfrecord), arrow_type="binary_view"))


def test_a_valid_megatron_document_over_2_gib_is_read_whole(tmp_path):
    tokens = OVER_2_GIB // 4 + 1
    data = sparse_megatron(tmp_path / "big", tokens)
    documents = MegatronFormat().read(str(data))
    assert next(documents)["input_ids"].tolist() == [7, 8, 9]
    big = next(documents)["input_ids"]
    assert len(big) == tokens and not big.flags.writeable
    assert (big[:1].tobytes(), big[-1:].tobytes()) == (HEAD, TAIL)
    del big
    assert [d["input_ids"].tolist() for d in documents] == [[5, 6]]
