"""Which decoder serves: the compiled extension (``_example.c``) when it is built, else the pure-Python one.

Picked once, at import: :data:`BACKEND` names it, and ``SHARDKIT_PURE_PYTHON=1``
in the environment forces Python. Both give the same values and reject the
same bytes (:mod:`shardkit.formats.example.wire` says how exactly).
"""

from __future__ import annotations

import os
from typing import Any, Final

from shardkit.formats.example.wire import BytesLike, Value, decode_example_python, decode_sequence_example_python

__all__ = ["BACKEND", "COMPILED", "decode_example", "decode_sequence_example"]


def _load_c_backend() -> Any:
    """The compiled decoder (``_example.c``), or ``None`` when it is not built or ``SHARDKIT_PURE_PYTHON`` is set."""
    if os.environ.get("SHARDKIT_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from shardkit.formats import _example  # pyright: ignore[reportAttributeAccessIssue]
    except ImportError:  # not built (no compiler at install time): the pure-Python decoder serves
        return None
    return _example


COMPILED: Final = _load_c_backend()
"""The compiled decoder module, or None: then the pure-Python decoder serves."""

BACKEND: Final = "c" if COMPILED is not None else "python"
"""Which decoder :func:`decode_example`, :func:`decode_sequence_example` and
:func:`~shardkit.formats.example.columns.decode_columns` use: ``"c"`` (the compiled extension) or ``"python"``
(it is not built, or the environment sets ``SHARDKIT_PURE_PYTHON=1``)."""

_decode_example = COMPILED.decode_example if COMPILED is not None else decode_example_python
_decode_sequence_example = COMPILED.decode_sequence_example if COMPILED is not None else decode_sequence_example_python


def decode_example(record: BytesLike) -> dict[str, Value]:
    """Decode a serialized ``tf.train.Example``.

    ``int64_list`` becomes an int64 numpy array, ``float_list`` a float32 numpy
    array, ``bytes_list`` a ``list[bytes]``, and a Feature with no kind set ``[]``.
    Arrays are fresh and writable. Raises :class:`~shardkit.ShardkitError` on
    bytes that are not a valid Example. Both backends (see :data:`BACKEND`)
    give the same values and reject the same bytes.

    Example:
        >>> import shardkit
        >>> record = shardkit.encode_example({"label": [3], "score": [0.5], "text": "hi"})
        >>> shardkit.decode_example(record)
        {'label': array([3]), 'score': array([0.5], dtype=float32), 'text': [b'hi']}
    """
    return _decode_example(record)


def decode_sequence_example(record: BytesLike) -> tuple[dict[str, Value], dict[str, list[Value]]]:
    """Decode a serialized ``tf.train.SequenceExample`` into ``(context, feature_lists)``.

    ``feature_lists`` maps each name to the list of its decoded Features, with
    values as in :func:`decode_example`. Raises :class:`~shardkit.ShardkitError`
    on bytes that are not a valid SequenceExample.
    """
    return _decode_sequence_example(record)
