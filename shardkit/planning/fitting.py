"""Best-fit packing as pure logic: which buffered pieces go into which block.

``.pack(strategy="best_fit")`` (:mod:`shardkit.pipeline.packing`) holds a
buffer of *pieces* (documents, or ``seq_len`` cuts of a longer one); each
block opens with the oldest piece and is then filled, again and again, with
the longest piece that still fits (of equal lengths, the newest). This module
is that choice without tokens: pieces are ids with lengths.

:class:`FitIndex` finds "the longest piece of at most ``room`` tokens" in
O(seq_len / 64) machine-word operations, whatever the buffer holds: one
bucket of ids per length (a deque: oldest at the left, newest at the right)
and a bit mask of the lengths whose bucket is not empty, a Python ``int``,
so that the longest length up to ``room`` is ``(mask & low_bits).bit_length()``,
done in C. It replaced a sorted list kept with ``bisect.insort`` (a tuple and
a list shift per piece).

:func:`best_fit_blocks` runs the whole streaming packer over document lengths
(the buffer refilled to ``buffer_size`` pieces before each block, as the
iterator does), for tests and for planning without data.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = ["FitIndex", "best_fit_blocks", "pieces_of"]


class FitIndex:
    """Piece ids by length, to take the oldest piece of a length or the longest (newest) that fits."""

    def __init__(self) -> None:
        self._buckets: dict[int, deque[int]] = {}
        self._mask = 0  # bit L set: some piece has length L

    def add(self, piece: int, length: int) -> None:
        """Index ``piece`` of ``length`` tokens (>= 1), as the newest of its length."""
        bucket = self._buckets.get(length)
        if bucket is None:
            bucket = self._buckets[length] = deque()
        if not bucket:
            self._mask |= 1 << length
        bucket.append(piece)

    def remove_oldest(self, length: int) -> int:
        """Remove and return the oldest piece of ``length`` (the buffer's oldest piece is the oldest of its length)."""
        bucket = self._buckets[length]
        piece = bucket.popleft()
        if not bucket:
            self._mask ^= 1 << length
        return piece

    def take_longest(self, room: int) -> tuple[int, int] | None:
        """Remove and return ``(piece, length)`` of the longest piece of at most ``room`` tokens (the newest
        of that length), or None when none fits."""
        fits = self._mask & ((2 << room) - 1)
        if not fits:
            return None
        length = fits.bit_length() - 1
        bucket = self._buckets[length]
        piece = bucket.pop()
        if not bucket:
            self._mask ^= 1 << length
        return piece, length

    def __bool__(self) -> bool:
        return bool(self._mask)


def pieces_of(length: int, seq_len: int) -> list[int]:
    """The lengths of a document's pieces: ``seq_len`` cuts and a shorter rest (none for an empty document)."""
    return [min(seq_len, length - first) for first in range(0, length, seq_len)]


def best_fit_blocks(lengths: Iterable[int], seq_len: int, buffer_size: int) -> list[list[int]]:
    """The blocks best-fit packing makes of documents of ``lengths``: each a list of piece ids, in the order
    the block holds them; piece ids count the pieces of all documents in order (see :func:`pieces_of`)."""
    documents = iter(lengths)
    index, held = FitIndex(), {}  # held: piece id -> length, oldest first (a dict keeps insertion order)
    blocks: list[list[int]] = []
    count = 0
    while True:
        while len(held) < buffer_size and (length := next(documents, None)) is not None:
            for piece in pieces_of(length, seq_len):
                index.add(count, piece)
                held[count] = piece
                count += 1
        if not held:
            return blocks
        oldest = next(iter(held))
        room = seq_len - held[oldest]
        index.remove_oldest(held.pop(oldest))
        block = [oldest]
        while room and (found := index.take_longest(room)) is not None:
            block.append(found[0])
            room -= held.pop(found[0])
        blocks.append(block)
