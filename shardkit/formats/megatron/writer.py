"""Writing a Megatron ``.bin``/``.idx`` pair that megatron-core reads back byte for byte as its own.

Tokens go to the ``.bin`` as they come; sequence lengths and document indices
are kept (4 + 8 bytes per sequence, in compact arrays) and the ``.idx`` is
written on :meth:`PairWriter.close`, as megatron-core's
``IndexedDatasetBuilder.finalize`` does, with the same bytes.

Two files cannot appear at once. Given ``name`` (the final ``.bin`` name, the
writer itself writing under a temporary one), the ``.idx`` too is written under
a temporary name and listed in ``companions``: :class:`~shardkit.ShardWriter`
and :class:`~shardkit.TokenWriter` rename it into place just before the
``.bin``, so that a ``*.bin`` glob never finds a ``.bin`` without its ``.idx``.
"""

from __future__ import annotations

import uuid
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardkit.errors import ShardkitError
from shardkit.formats.megatron.index import KEY, dtype_code, encode_index, idx_url
from shardkit.io.files import open_raw

__all__ = ["PairWriter", "as_document"]

_INT32_MAX = (1 << 31) - 1


class PairWriter:
    """Write documents to the ``.bin`` at ``url`` and, on :meth:`close`, the ``.idx`` of ``name`` (default ``url``).

    A record is a document: ``{"input_ids": tokens}`` (what the reader yields),
    optionally with ``"sequence_lengths"`` (a document of several sequences, as
    sentence-split files have; they must add up to its length), or the tokens alone.
    """

    def __init__(
        self, url: str, *, name: str | None = None, dtype: Any = np.int32, storage_options: dict[str, Any] | None = None
    ) -> None:
        dtype_code(dtype)
        self.url = url
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.num_records = 0
        self.num_bytes = 0
        self.storage_options = storage_options
        final = idx_url(name if name is not None else url)
        self.idx_url = final if name is None else f"{final}.{uuid.uuid4().hex[:16]}.partial"
        self.companions: list[tuple[str, str]] = [] if name is None else [(self.idx_url, final)]
        self._lengths = array("i")
        self._indices = array("q", [0])
        self._sink: Any = open_raw(url, "wb", storage_options)

    def write(self, record: Any) -> None:
        """Append one document."""
        if self._sink is None:
            raise ShardkitError(f"{self.url}: write() on a closed writer")
        tokens, lengths = as_document(record, self.dtype, self.num_records)
        self._sink.write(tokens.tobytes())
        self._lengths.extend(lengths)
        self._indices.append(len(self._lengths))
        self.num_records += 1
        self.num_bytes += tokens.nbytes

    def close(self) -> None:
        """Close the ``.bin`` and write the ``.idx``; calling it again does nothing."""
        if self._sink is None:
            return
        sink, self._sink = self._sink, None
        sink.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if len(self._lengths) else np.zeros(0, np.int32)
        data = encode_index(self.dtype, lengths, np.frombuffer(self._indices, dtype=np.int64))
        with open_raw(self.idx_url, "wb", self.storage_options) as f:
            f.write(data)

    def __enter__(self) -> PairWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def as_document(record: Any, dtype: np.dtype, number: int) -> tuple[np.ndarray, Sequence[int]]:
    """(tokens in ``dtype``, sequence lengths) of a document record; errors name document ``number``.

    Raises:
        ShardkitError: a token ``dtype`` cannot hold exactly, lengths that do not add up.
    """
    lengths = None
    if isinstance(record, dict):
        if KEY not in record:
            raise ShardkitError(f"document {number}: a record is {{{KEY!r}: tokens}}; got keys {sorted(record)}")
        lengths = record.get("sequence_lengths")
        record = record[KEY]
    given = np.asarray(record)
    if given.ndim != 1 or (given.dtype.kind not in "iuf" and given.size):
        raise ShardkitError(
            f"document {number}: tokens must be a 1-d array of numbers, got {given.dtype} {given.shape}"
        )
    tokens = given.astype(dtype)
    if not np.array_equal(tokens, given):
        wrong = given[tokens != given][:3].tolist()
        raise ShardkitError(
            f"document {number}: tokens {wrong} do not fit {dtype.newbyteorder('=')}; write with a wider dtype"
        )
    if lengths is None:
        lengths = [len(tokens)]
    lengths = [int(n) for n in lengths]
    if sum(lengths) != len(tokens) or any(n < 0 or n > _INT32_MAX for n in lengths):
        raise ShardkitError(
            f"document {number}: sequence_lengths {lengths[:8]} must be int32s >= 0 adding up to its {len(tokens)} tokens"
        )
    return tokens, lengths
