"""TFRecord: read, write, index and verify TFRecord files byte-compatibly with TensorFlow, without it.

The package's modules, each importing only those listed after it:
:mod:`~shardkit.formats.tfrecord.format` (:class:`TFRecordFormat`, what the
sources read with), :mod:`~shardkit.formats.tfrecord.reader`
(:func:`read_tfrecord`, :func:`read_tfrecord_batches`), :mod:`~shardkit.formats.tfrecord.writer`
(:class:`TFRecordWriter`), :mod:`~shardkit.formats.tfrecord.index` (index
files: build, load and check them), :mod:`~shardkit.formats.tfrecord.arrays`
(records as Arrow arrays), :mod:`~shardkit.formats.tfrecord.framing`
(records found, checked and cut from a stream; whole-file scans),
:mod:`~shardkit.formats.tfrecord.buffers` (a local file's block buffers) and
:mod:`~shardkit.formats.tfrecord.kernel` (the per-block loops of framing:
compiled, or Python when not built). The names
below are the package's interface; import them from here.
"""

from __future__ import annotations

from shardkit.formats.tfrecord.format import DECODERS, TFRecordFormat
from shardkit.formats.tfrecord.framing import (
    count_records,
    detect_compression,
    scan_count,
    scan_offsets,
    verify_tfrecord,
)
from shardkit.formats.tfrecord.index import build_index, load_index, read_index
from shardkit.formats.tfrecord.reader import IndexLike, read_tfrecord, read_tfrecord_batches
from shardkit.formats.tfrecord.writer import TFRecordWriter

__all__ = [
    "DECODERS",
    "IndexLike",
    "TFRecordFormat",
    "TFRecordWriter",
    "build_index",
    "count_records",
    "detect_compression",
    "load_index",
    "read_index",
    "read_tfrecord",
    "read_tfrecord_batches",
    "scan_count",
    "scan_offsets",
    "verify_tfrecord",
]
