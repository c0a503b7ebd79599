"""The ``.idx`` of a Megatron-LM indexed dataset, parsed and checked: where every document lies in its ``.bin``.

Megatron-LM and megatron-core (``megatron/core/datasets/indexed_dataset.py``),
GPT-NeoX and OLMo keep tokenised text as a pair of files. ``X.bin`` holds every
sequence's tokens back to back; ``X.idx`` (little-endian) is::

    b"MMIDIDX\\x00\\x00"        9 bytes of magic
    version                    uint64, 1
    dtype code                 uint8 (see DTYPES)
    S: sequence count          uint64
    D: document index count    uint64 (documents + 1)
    sequence lengths           int32[S], in tokens
    sequence pointers          int64[S], byte offsets into the .bin
    document indices           int64[D], the first sequence of each document, then S
    sequence modes             int8[S], only in multimodal files (ignored here)

A record is a whole document: sequences ``[indices[d], indices[d+1])``, which a
writer puts back to back, so that one document is one contiguous byte range.

Trust nothing. The header's counts are checked against the file's size with
Python integers before anything is allocated, so a huge count is a located
error, never an ``OverflowError`` or ``MemoryError``. Then, vectorised:

- document indices must start at 0, never decrease and stay within ``[0, S]``:
  from the first that does not, no document can be located (``broken``);
  indices that end before ``S`` leave sequences in no document (``orphans``);
- a sequence's pointer must be where the one before it ends (the first at 0),
  and its length must not be negative; where one is not, the documents of that
  sequence and of the one before it are bad (either may hold the wrong
  number), and no other: each document is read by its own pointer.

What depends on the ``.bin`` (a document past its end, a ``.bin`` longer than
the index says) is checked when the ``.bin`` is opened, against its size then
(:meth:`TokenIndex.past_end`). Errors about the ``.idx`` name it and the byte
of it at fault; errors about a document name the ``.bin``, the document and the
byte where it starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from shardkit.errors import CorruptRecordError

__all__ = [
    "DTYPES",
    "HEADER_BYTES",
    "KEY",
    "MAGIC",
    "TokenIndex",
    "bin_url",
    "dtype_code",
    "encode_index",
    "idx_url",
    "parse_header",
    "parse_index",
    "prefix_of",
]

KEY: Final = "input_ids"
"""The key of a document's tokens in a record."""

MAGIC: Final = b"MMIDIDX\x00\x00"
HEADER_BYTES: Final = 34  # magic 9, version 8, dtype code 1, sequence count 8, document index count 8

DTYPES: Final[dict[int, np.dtype]] = {
    code: np.dtype(name).newbyteorder("<")
    for code, name in {
        1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16",
    }.items()
}  # fmt: skip
"""megatron-core's ``DType`` codes (checked against megatron-core 0.16.1)."""


def prefix_of(url: str) -> str:
    """The pair's prefix: ``url`` without ``.bin`` or ``.idx``."""
    return url[:-4] if url.endswith((".bin", ".idx")) else url


def bin_url(url: str) -> str:
    """The ``.bin`` of the pair ``url`` names (by prefix, ``.bin`` or ``.idx``)."""
    return prefix_of(url) + ".bin"


def idx_url(url: str) -> str:
    """The ``.idx`` of the pair ``url`` names."""
    return prefix_of(url) + ".idx"


def dtype_code(dtype: Any) -> int:
    """The code of ``dtype`` in :data:`DTYPES`.

    Raises:
        ValueError: a dtype Megatron cannot store, naming those it can.
    """
    wanted = np.dtype(dtype)
    for code, known in DTYPES.items():
        if known == wanted.newbyteorder("<"):
            return code
    raise ValueError(f"a Megatron .bin cannot hold {wanted}; use one of {sorted(str(d) for d in DTYPES.values())}")


@dataclass(frozen=True)
class Header:
    """What the first :data:`HEADER_BYTES` of an ``.idx`` say, checked against its size."""

    dtype: np.dtype
    sequences: int
    documents: int  # document index count - 1


def parse_header(head: bytes, size: int, idx_url: str) -> Header:
    """The header of the ``.idx`` at ``idx_url`` of ``size`` bytes, from its first bytes ``head``.

    Raises:
        CorruptRecordError: at the byte of the ``.idx`` at fault (record -1: no document is to blame).
    """
    if len(head) < HEADER_BYTES or size < HEADER_BYTES:
        raise _idx_error(idx_url, min(len(head), size), f"is truncated: {size} bytes, a header takes {HEADER_BYTES}")
    if head[:9] != MAGIC:
        raise _idx_error(idx_url, 0, f"does not start with Megatron's magic {MAGIC!r} but {head[:9]!r}")
    version = int.from_bytes(head[9:17], "little")
    if version != 1:
        raise _idx_error(idx_url, 9, f"has version {version}; only version 1 exists")
    code = head[17]
    if code not in DTYPES:
        known = ", ".join(f"{c} {d}" for c, d in DTYPES.items())
        raise _idx_error(idx_url, 17, f"has dtype code {code}, which is none of Megatron's ({known})")
    sequences, indices = int.from_bytes(head[18:26], "little"), int.from_bytes(head[26:34], "little")
    need = HEADER_BYTES + 12 * sequences + 8 * indices
    if size not in (need, need + sequences):  # + sequences: a multimodal file's modes, one byte each
        what = "is truncated" if size < need else f"has {size - need} bytes after its document indices"
        raise _idx_error(
            idx_url, min(size, need),
            f"{what}: its header says {sequences} sequences and {indices} document indices, which take "
            f"{need} bytes (or {need + sequences} with sequence modes); it has {size}",
        )  # fmt: skip
    if indices == 0:
        raise _idx_error(idx_url, 26, "has no document indices (even an empty dataset has the leading 0)")
    return Header(DTYPES[code], sequences, indices - 1)


def _idx_error(idx_url: str, offset: int, what: str, record: int = -1) -> CorruptRecordError:
    return CorruptRecordError(
        idx_url, record, offset, f"the Megatron index {what} (byte {offset} of the .idx); rewrite the .idx/.bin pair"
    )


@dataclass(frozen=True, eq=False)
class TokenIndex:
    """An ``.idx`` parsed and checked: document ``d`` is ``.bin`` bytes ``[starts[d], ends[d])``.

    ``bad``: documents not to read (sorted), with ``bad_sequence`` the sequence
    that condemned each. ``broken``: (first document that cannot be located,
    byte of the ``.idx``, reason) or None. ``orphans``: sequences in no
    document. ``described``: the ``.bin`` size the index describes.
    """

    url: str
    dtype: np.dtype
    sequences: int
    starts: np.ndarray
    ends: np.ndarray
    bad: np.ndarray
    bad_sequence: np.ndarray
    bad_reason: tuple[str, ...]
    broken: tuple[int, int, str] | None
    orphans: int
    described: int
    _past: dict[int, int] = field(default_factory=dict, repr=False)  # .bin size -> past_end, per open otherwise O(docs)

    @property
    def documents(self) -> int:
        return len(self.starts)

    @property
    def nbytes(self) -> int:
        return int(self.starts.nbytes + self.ends.nbytes + self.bad.nbytes + self.bad_sequence.nbytes)

    def tokens(self) -> int:
        """Tokens in the documents that can be read."""
        good = np.ones(self.documents, dtype=bool)
        good[self.bad] = False
        if self.broken is not None:
            good[self.broken[0] :] = False
        return int((self.ends[good] - self.starts[good]).sum()) // self.dtype.itemsize

    def bad_error(self, bin_url: str, document: int) -> CorruptRecordError:
        """The error of the bad document ``document`` (one of :attr:`bad`): it costs that document alone."""
        at = int(np.searchsorted(self.bad, document))
        reason = self.bad_reason[at].format(sequence=int(self.bad_sequence[at]), idx=self.url)
        return CorruptRecordError(bin_url, document, int(self.starts[document]), reason, framing_intact=True)

    def past_end(self, size: int) -> int:
        """The first document (not a bad one) that does not fit a ``.bin`` of ``size`` bytes; ``documents`` if all do."""
        if size not in self._past:
            over = self.ends > size
            over[self.bad] = False
            first = np.flatnonzero(over)
            self._past.clear()  # one size at a time: the .bin's
            self._past[size] = int(first[0]) if first.size else self.documents
        return self._past[size]


def parse_index(data: bytes | memoryview, idx_url: str) -> TokenIndex:
    """The :class:`TokenIndex` of the whole ``.idx`` ``data`` read from ``idx_url``.

    Raises:
        CorruptRecordError: the header does not fit the file (see :func:`parse_header`).
    """
    header = parse_header(bytes(data[:HEADER_BYTES]), len(data), idx_url)
    seqs, docs, size = header.sequences, header.documents, header.dtype.itemsize
    lengths = np.frombuffer(data, "<i4", seqs, HEADER_BYTES).astype(np.int64)
    pointers = np.frombuffer(data, "<i8", seqs, HEADER_BYTES + 4 * seqs)
    indices_at = HEADER_BYTES + 12 * seqs
    indices = np.frombuffer(data, "<i8", docs + 1, indices_at)
    broken = _first_misplaced(indices, seqs, indices_at)
    located = docs if broken is None else broken[0]
    indices = indices[: located + 1] if located else np.zeros(1, dtype=np.int64)  # [0]: no document located
    with np.errstate(over="ignore"):  # garbage pointers wrap; they then mismatch, which is what is checked
        expected = np.concatenate(([0], pointers[:-1] + lengths[:-1] * size)) if seqs else pointers
        described = int(pointers[-1] + lengths[-1] * size) if seqs else 0
    bad, bad_sequence, reasons = _bad_documents(indices, lengths, pointers, expected, size)
    ends_at = np.concatenate((pointers, [described]))
    cumulative = np.concatenate(([0], np.cumsum(lengths)))
    starts = np.zeros(docs, dtype=np.int64)
    ends = np.zeros(docs, dtype=np.int64)
    starts[:located] = ends_at[indices[:-1]]
    ends[:located] = starts[:located] + (cumulative[indices[1:]] - cumulative[indices[:-1]]) * size
    negative = np.flatnonzero(starts[:located] < 0)
    if negative.size:  # a pointer before the .bin: its chain of pointers agrees with itself, not with the file
        bad, bad_sequence, reasons = _with(bad, bad_sequence, reasons, negative, indices[negative], _BEFORE_START)
    orphans = seqs - int(indices[-1]) if broken is None else 0
    return TokenIndex(idx_url, header.dtype, seqs, starts, ends, bad, bad_sequence, reasons, broken, orphans, described)


_MISMATCH: Final = (
    "sequence {sequence}'s pointer is not where the sequence before it ends, by the lengths in {idx}, and "
    "neither that length nor this pointer agrees with the others: neither document is read"
)
_MOVED: Final = (
    "sequence {sequence}'s pointer in {idx} is not where the sequence before it ends, while the next "
    "sequence's is: this pointer is wrong"
)
_LENGTH: Final = (
    "sequence {sequence}'s length in {idx} does not reach the next sequence's pointer, while every pointer "
    "agrees with the one before: this length is wrong"
)
_NEGATIVE: Final = "sequence {sequence} has a negative length in {idx}"
_BEFORE_START: Final = "sequence {sequence}'s pointer in {idx} is before the start of the .bin"


def _first_misplaced(indices: np.ndarray, seqs: int, indices_at: int) -> tuple[int, int, str] | None:
    """(document, byte of the .idx, reason) at the first document index out of order or range; None if none."""
    wrong = (indices < 0) | (indices > seqs)
    wrong[1:] |= indices[1:] < indices[:-1]
    wrong[0] |= indices[0] != 0
    found = np.flatnonzero(wrong)
    if not found.size:
        return None
    i = int(found[0])
    # Out of range: index i is wrong, so document i - 1 is. Lower than the one before: either may be
    # wrong, and if the one before is, so is the document that ends there (i - 2).
    first = max(i - (1 if i == 0 or not 0 <= indices[i] <= seqs else 2), 0)
    before = f"after {int(indices[i - 1])}" if i else "first (it must be 0)"
    reason = (
        f"document index {i} is {int(indices[i])}, {before}, of {seqs} sequences: the documents from "
        f"{first} on cannot be located"
    )
    return first, indices_at + 8 * i, reason


def _bad_documents(
    indices: np.ndarray, lengths: np.ndarray, pointers: np.ndarray, expected: np.ndarray, itemsize: int
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """The documents a wrong pointer or length condemns: (sorted documents, the sequence to blame for
    each, their reasons). Only sequences inside located documents count.

    A sequence whose pointer is not where the one before it ends is told apart by its neighbours:
    one wrong pointer moves itself and the next sequence, which starts where it would after a right
    one (``_MOVED``: that document alone); one wrong length moves only the next sequence
    (``_LENGTH``: the document holding the length). Anything else, the last sequence included,
    condemns both documents around the break.
    """
    n = int(indices[-1])
    pointers, lengths, expected = pointers[:n], lengths[:n], expected[:n]
    moved = np.append(pointers != expected, False)  # moved[n]: no sequence after the last
    with np.errstate(over="ignore"):
        follows = np.append(pointers[1:] == expected[:-1] + lengths[:-1] * itemsize, False) if n else moved[:0]
    pointer = moved[:-1] & moved[1:] & follows
    rest = moved[:-1] & ~pointer & ~np.concatenate(([False], pointer[:-1]))
    inner = (np.arange(n) > 0) & (np.arange(n) < n - 1)
    length = rest & ~moved[1:] & inner
    both = rest & ~length
    doc_of = lambda s: np.searchsorted(indices, s, side="right") - 1  # noqa: E731 - sequence -> its document
    empty = np.zeros(0, dtype=np.int64)
    found: tuple[np.ndarray, np.ndarray, tuple[str, ...]] = (empty, empty, ())
    breaks = np.flatnonzero(both)
    for seqs, blame, reason in (
        (np.flatnonzero(lengths < 0), None, _NEGATIVE),
        (np.flatnonzero(pointer), None, _MOVED),
        (np.flatnonzero(length) - 1, None, _LENGTH),
        (breaks, None, _MISMATCH),
        (breaks[breaks > 0] - 1, breaks[breaks > 0], _MISMATCH),  # the document before each break
    ):
        found = _with(*found, doc_of(seqs), seqs if blame is None else blame, reason)
    return found


def _with(
    bad: np.ndarray, blame: np.ndarray, reasons: tuple[str, ...], docs: np.ndarray, seqs: np.ndarray, reason: str
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """``bad`` with ``docs`` added (the first reason found for a document stays), sorted."""
    docs = np.asarray(docs, dtype=np.int64)
    fresh = ~np.isin(docs, bad)
    docs, seqs = docs[fresh], np.asarray(seqs, dtype=np.int64)[fresh]
    docs, first = np.unique(docs, return_index=True)
    merged = np.concatenate((bad, docs))
    order = np.argsort(merged, kind="stable")
    all_reasons = reasons + (reason,) * len(docs)
    return merged[order], np.concatenate((blame, seqs[first]))[order], tuple(all_reasons[i] for i in order)


def encode_index(dtype: np.dtype, lengths: np.ndarray, indices: np.ndarray) -> bytes:
    """The bytes of the ``.idx`` megatron-core writes for sequences of ``lengths`` tokens in
    documents starting at ``indices`` (with the final ``len(lengths)``): pointers follow from lengths."""
    lengths = np.asarray(lengths, dtype="<i4")
    pointers = np.concatenate(([0], np.cumsum(lengths.astype(np.int64))[:-1] * dtype.itemsize)) if len(lengths) else []
    return b"".join((
        MAGIC,
        (1).to_bytes(8, "little"),
        bytes([dtype_code(dtype)]),
        len(lengths).to_bytes(8, "little"),
        len(indices).to_bytes(8, "little"),
        lengths.tobytes(),
        np.asarray(pointers, dtype="<i8").tobytes(),
        np.asarray(indices, dtype="<i8").tobytes(),
    ))  # fmt: skip
