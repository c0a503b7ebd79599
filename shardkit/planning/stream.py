"""The global record stream every reader plans from: the shards' records laid end to end,
or with shuffling the blocks of the shards in an order seeded from ``(seed,
epoch)``, and the order in which a reader yields a window of it
(:func:`window_order`).
"""

from __future__ import annotations

import numpy as np

from shardkit.planning.ranges import EMPTY, Range

#: With shuffling, shards are cut into blocks of about ``N / (BLOCKS_PER_RANK * R)``
#: records so that the pieces of a few large shards are dealt out at random too.
BLOCKS_PER_RANK = 8

#: Largest block (records) when the datasets shuffle samples: small enough that a
#: window holds blocks from many places, large enough that a block is a sequential read.
SHUFFLE_BLOCK = 512

#: Records a reader gathers and permutes at once when the datasets shuffle samples:
#: the memory cost of ``shuffle=True`` is this many samples per reader.
SHUFFLE_WINDOW = 4096


def window_order(size: int, *, seed: int, epoch: int, rank: int, first: int) -> np.ndarray:
    """The order in which a reader yields a window of ``size`` records whose first
    position in rank ``rank``'s chunk is ``first``: a permutation of ``range(size)``.

    A function of the window's identity only, so a resumed reader that reads the
    window again yields it in the same order (and a state can say how much of it
    was yielded with one number).
    """
    return np.random.default_rng([seed, epoch, rank, first, 0x5348]).permutation(size)


class Stream:
    """The global record stream: blocks of shards laid end to end.

    Block ``k`` of the stream is block ``order[k]`` of the unshuffled blocks
    (``order`` is None when not shuffled); only the stream ends are computed for
    every block, the rest only for the blocks one reader touches.
    """

    def __init__(self, shard: np.ndarray, first: np.ndarray, end: np.ndarray, order: np.ndarray | None) -> None:
        self._shard = shard  # shard index of each unshuffled block
        self._first = first  # first record (within its shard) of each unshuffled block
        self._order = order
        self.end = end  # stream position just past each block of the stream
        self.total = int(end[-1]) if len(end) else 0

    @classmethod
    def build(
        cls, counts: np.ndarray, *, seed: int, epoch: int, shuffle: bool, world_size: int, block_size: int | None = None
    ) -> Stream:
        nonempty = np.flatnonzero(counts)
        sizes = counts[nonempty]
        if not shuffle:
            return cls(nonempty, np.zeros(len(nonempty), np.int64), np.cumsum(sizes), None)
        block = max(1, -(-int(sizes.sum()) // (BLOCKS_PER_RANK * world_size)))
        if block_size is not None:
            block = min(block, block_size)
        if int(sizes.max(initial=0)) <= block:  # every shard is one block
            shard, first, length = nonempty, np.zeros(len(nonempty), np.int64), sizes
        else:
            pieces = -(-sizes // block)
            shard = np.repeat(nonempty, pieces)
            first = (np.arange(len(shard), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * block
            length = np.minimum(block, counts[shard] - first)
        order = np.random.default_rng([seed, epoch]).permutation(len(shard))
        return cls(shard, first, np.cumsum(length[order]), order)

    def _blocks(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard index and first record of stream blocks ``lo:hi``."""
        index = slice(lo, hi) if self._order is None else self._order[lo:hi]
        return self._shard[index], self._first[index]

    def ranges(self, start: int, stop: int) -> list[Range]:
        """The ranges covering stream positions ``[start, stop)``, wrapping past the end."""
        shard, first, last = self.range_arrays(start, stop)
        return [Range(*r) for r in zip(shard.tolist(), first.tolist(), last.tolist())]

    def range_arrays(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`ranges` as three int64 arrays: shard, first record, record just past the last."""
        shards, firsts, lasts = [], [], []
        while start < stop:
            position = start % self.total
            take = min(stop - start, self.total - position)
            piece_shard, piece_first, piece_last = self._cover(position, position + take)
            shards.append(piece_shard)
            firsts.append(piece_first)
            lasts.append(piece_last)
            start += take
        if not shards:
            return EMPTY, EMPTY, EMPTY
        shard, first, last = (np.concatenate(parts).astype(np.int64, copy=False) for parts in (shards, firsts, lasts))
        # Join neighbours that continue each other in the same shard.
        keep = np.ones(len(shard), dtype=bool)
        keep[1:] = (shard[1:] != shard[:-1]) | (first[1:] != last[:-1])
        last = np.maximum.reduceat(last, np.flatnonzero(keep)) if len(last) else last
        return shard[keep], first[keep], last

    def _cover(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo = int(np.searchsorted(self.end, start, side="right"))
        hi = int(np.searchsorted(self.end, stop, side="left")) + 1
        end = self.end[lo:hi]
        block_start = np.concatenate(([self.end[lo - 1] if lo > 0 else 0], end[:-1]))
        shard, first = self._blocks(lo, hi)
        begin = np.maximum(block_start, start) - block_start + first
        finish = np.minimum(end, stop) - block_start + first
        return shard, begin, finish
