"""tf.Example and tf.SequenceExample, decoded and encoded without TensorFlow.

The package's modules, each importing only those listed after it:
:mod:`~shardkit.formats.example.columns` (:func:`decode_columns`: many records
into one array per feature), :mod:`~shardkit.formats.example.backend`
(:func:`decode_example`, :func:`decode_sequence_example`, and :data:`BACKEND`,
which decoder serves them), :mod:`~shardkit.formats.example.encode`
(:func:`encode_example`) and :mod:`~shardkit.formats.example.wire` (the
protobuf wire format, decoded in Python: the fallback and the reference for
the compiled decoder). The names below are the package's interface; import
them from here.
"""

from __future__ import annotations

from shardkit.formats.example.backend import BACKEND, decode_example, decode_sequence_example
from shardkit.formats.example.columns import ColumnBatches, FeatureCheck, FeatureSpec, decode_columns
from shardkit.formats.example.encode import encode_example
from shardkit.formats.example.wire import BytesLike, Value, decode_example_python, decode_sequence_example_python

__all__ = [
    "BACKEND",
    "BytesLike",
    "ColumnBatches",
    "FeatureCheck",
    "FeatureSpec",
    "Value",
    "decode_columns",
    "decode_example",
    "decode_example_python",
    "decode_sequence_example",
    "decode_sequence_example_python",
    "encode_example",
]
