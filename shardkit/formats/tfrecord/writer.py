"""Writing TFRecord files, byte-compatibly with TensorFlow (see :mod:`shardkit.formats.tfrecord.framing`)."""

from __future__ import annotations

import struct
from typing import Any

from shardkit.errors import ShardkitError
from shardkit.formats.crc import masked_crc32c
from shardkit.formats.tfrecord.framing import OVERHEAD_BYTES
from shardkit.io.files import Sink, open_output

__all__ = ["TFRecordWriter"]

_pack_u32 = struct.Struct("<I").pack
_pack_u64 = struct.Struct("<Q").pack


class TFRecordWriter:
    """Write records to a TFRecord file at any fsspec URL.

    Use as a context manager::

        with TFRecordWriter("s3://bucket/train-0.tfrecord") as writer:
            writer.write(record)

    ``compression`` is ``None``, ``"gzip"`` or ``"zlib"`` (whole-stream, as TensorFlow).
    """

    def __init__(self, url: str, compression: str | None = None, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.compression = compression
        self.num_records = 0
        self.num_bytes = 0  # framed, uncompressed bytes written so far
        self._sink: Sink | None = open_output(url, compression, storage_options)

    def write(self, record: bytes | bytearray | memoryview) -> None:
        """Append one record."""
        if self._sink is None:
            raise ShardkitError(f"{self.url}: write() on a closed TFRecordWriter")
        length = len(record)
        length_bytes = _pack_u64(length)
        self._sink.write(length_bytes + _pack_u32(masked_crc32c(length_bytes)))
        self._sink.write(record)
        self._sink.write(_pack_u32(masked_crc32c(record)))
        self.num_records += 1
        self.num_bytes += length + OVERHEAD_BYTES

    def close(self) -> None:
        """Flush and close the file; calling it again does nothing."""
        if self._sink is not None:
            sink, self._sink = self._sink, None
            sink.close()

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
