"""Documents to blocks, the part of ``.pack()`` with no state: token arrays taken from samples, a block
made from pieces of them, and the checks of the blocks' dtype.

A block is ``{"input_ids": Tensor[seq_len]}`` in one integer dtype, padded at
the end, and when asked ``position_ids`` and ``document_ids`` (int64); see
:mod:`shardkit.pipeline.packing` for what they hold and for the iterator that
chooses the pieces. Each row is a handful of numpy calls: tokens are sliced
and copied by numpy, never touched one by one in Python.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from shardkit.errors import ShardkitError

#: ``document_ids`` of the positions a block is padded with.
PAD_DOCUMENT = -1

#: A piece's document position where none is known (the piece is saved as data).
UNKNOWN = -1

# Tokens (1-D integers, any int dtype), the index of the first in its document (its ``start``) and the packed
# position of the document's record (stateful.positions), or UNKNOWN.
Piece = tuple[np.ndarray, int, int]


class PackError(ShardkitError, ValueError):
    """A sample ``.pack()`` cannot take: no token array at its key, or not a 1-D array of integers."""


def tokens_of(sample: Any, key: str) -> np.ndarray:
    """The 1-D integer token array at ``key`` of ``sample`` (a numpy array, a list of ints or a tensor),
    without copying when it already is a numpy array.

    Raises:
        PackError: the sample is not a mapping with ``key``, or its value is not 1-D integers.
    """
    if type(sample) is dict:  # the common case, checked without the ABC machinery of isinstance(Mapping)
        value = sample.get(key)
        if type(value) is np.ndarray and value.ndim == 1 and value.dtype.kind in "iu" and value.size:
            return value
    if not isinstance(sample, Mapping) or key not in sample:
        keys = sorted(map(str, sample)) if isinstance(sample, Mapping) else None
        what = f"a sample with keys {keys}" if keys is not None else f"a {type(sample).__name__} sample"
        raise PackError(
            f"pack(key={key!r}) got {what}, which has no {key!r}; pass key= the name of the token array, "
            "or .map() the samples to dicts holding one"
        )
    value = sample[key]
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)  # a view of a numpy array (or memmap), never a copy of one
    if array.ndim == 1 and array.size == 0:
        return np.zeros(0, np.int64)  # an empty document (of any dtype, [] too) packs to nothing
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise PackError(
            f"pack(key={key!r}): the sample's {key!r} must be a 1-D array of integer token ids "
            f"(numpy array, list of ints or tensor), got {type(value).__name__} of shape {array.shape} "
            f"and dtype {array.dtype}"
        )
    return array


def token_dtype(dtype: Any, error: type[Exception] = PackError) -> np.dtype | None:
    """The numpy integer dtype ``pack(dtype=)`` names (a numpy dtype, its name, or a torch integer dtype
    that numpy has), or None for None (keep the documents' own).

    Raises:
        error: not an integer dtype both numpy and torch hold.
    """
    if dtype is None:
        return None
    try:
        found = torch.empty(0, dtype=dtype).numpy().dtype if isinstance(dtype, torch.dtype) else np.dtype(dtype)
    except (TypeError, RuntimeError):
        found = None
    if found is None or found.kind not in "iu":
        raise error(
            f"pack(dtype) must be an integer dtype torch holds (np.int32, np.uint16, torch.int64, ...) or None "
            f"to keep the documents' own, got {dtype!r}"
        )
    return found.newbyteorder("=")


def check_fits(tokens: np.ndarray, dtype: np.dtype, asked: bool) -> None:
    """Raise unless every token of ``tokens`` is exactly representable in ``dtype`` (the blocks' dtype).

    Raises:
        PackError: naming the token, the dtype and ``dtype=``.
    """
    if np.can_cast(tokens.dtype, dtype, "safe"):
        return
    info = np.iinfo(dtype)
    low, high = int(tokens.min()), int(tokens.max())
    if low >= info.min and high <= info.max:
        return
    bad = low if low < info.min else high
    why = f"pack(dtype={dtype})" if asked else f"the blocks' dtype {dtype} (that of the first document)"
    raise PackError(
        f"token {bad} of a {tokens.dtype} document does not fit {why}; pass pack(dtype=) a dtype that holds "
        "every token id, e.g. dtype=np.int64"
    )


def block(
    parts: Sequence[Piece],
    seq_len: int,
    pad_id: int,
    dtype: np.dtype,
    *,
    position_ids: bool = False,
    document_ids: bool = False,
) -> dict[str, torch.Tensor]:
    """One packed block from ``parts`` (at most ``seq_len`` tokens in all, each fitting ``dtype``), padded at
    the end: ``input_ids`` in ``dtype`` and, when asked, ``position_ids`` and ``document_ids`` (int64).

    Each row is a numpy call or two per piece (the cost of a block is their overhead, not its tokens).
    """
    lengths = [len(piece[0]) for piece in parts]
    used = sum(lengths)
    input_ids = np.empty(seq_len, dtype)
    if len(parts) == 1:
        input_ids[:used] = parts[0][0]  # fits: checked
    elif parts:
        np.concatenate([piece[0] for piece in parts], out=input_ids[:used], casting="unsafe")  # fit: checked
    if used < seq_len:
        input_ids[used:] = pad_id
    out = {"input_ids": torch.from_numpy(input_ids)}
    if position_ids:
        out["position_ids"] = torch.from_numpy(_positions(parts, lengths, used, seq_len))
    if document_ids:
        out["document_ids"] = torch.from_numpy(_documents(lengths, used, seq_len))
    return out


def _positions(parts: Sequence[Piece], lengths: list[int], used: int, seq_len: int) -> np.ndarray:
    """Each token's position in its document (a piece counts on from its start); the padding counts from 0,
    like a document of its own."""
    ramp = _ramp(seq_len)
    positions = np.empty(seq_len, np.int64)
    at = 0
    for piece, length in zip(parts, lengths):
        np.add(ramp[:length], piece[1], out=positions[at : at + length])
        at += length
    positions[used:] = ramp[: seq_len - used]
    return positions


def _documents(lengths: list[int], used: int, seq_len: int) -> np.ndarray:
    """Each token's piece's index in the block; :data:`PAD_DOCUMENT` where the block is padded."""
    documents = np.empty(seq_len, np.int64)
    at = 0
    for index, length in enumerate(lengths):
        documents[at : at + length] = index
        at += length
    documents[used:] = PAD_DOCUMENT
    return documents


@functools.lru_cache(maxsize=8)
def _ramp(seq_len: int) -> np.ndarray:
    """``0, 1, ..., seq_len - 1`` (int64, read-only), sliced by every block of ``seq_len`` instead of made anew."""
    ramp = np.arange(seq_len, dtype=np.int64)
    ramp.flags.writeable = False
    return ramp
