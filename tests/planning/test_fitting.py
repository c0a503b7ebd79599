"""Best-fit packing as pure logic: the bit-mask index chooses exactly what a plain best-fit chooses."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.planning.fitting import FitIndex, best_fit_blocks, pieces_of
from tests.helpers.examples import examples


def reference_best_fit(lengths: list[int], seq_len: int, buffer_size: int) -> list[list[int]]:
    """Best-fit written plainly: a list of (piece id, length) oldest first, scanned whole for each choice.

    Before each block the buffer is refilled to ``buffer_size`` pieces (a document's pieces enter
    together); the block opens with the oldest piece and takes, while any fits, the longest piece
    that fits, of equal lengths the newest."""
    pieces = [piece for length in lengths for piece in pieces_of(length, seq_len)]
    per_document = [len(pieces_of(length, seq_len)) for length in lengths]
    held: list[tuple[int, int]] = []
    next_piece = next_document = 0
    blocks = []
    while True:
        while len(held) < buffer_size and next_document < len(lengths):
            for _ in range(per_document[next_document]):
                held.append((next_piece, pieces[next_piece]))
                next_piece += 1
            next_document += 1
        if not held:
            return blocks
        piece, length = held.pop(0)
        block, room = [piece], seq_len - length
        while True:
            fitting = [i for i, (_, n) in enumerate(held) if n <= room]
            if not fitting:
                break
            longest = max(held[i][1] for i in fitting)
            newest = max(i for i in fitting if held[i][1] == longest)
            piece, length = held.pop(newest)
            block.append(piece)
            room -= length
        blocks.append(block)


@settings(max_examples=examples(300), deadline=None)
@given(
    lengths=st.lists(st.integers(0, 200), max_size=60),
    seq_len=st.integers(1, 64),
    buffer_size=st.integers(1, 20),
)
def test_best_fit_blocks_are_those_of_a_plain_best_fit_over_the_same_lengths(lengths, seq_len, buffer_size):
    got = best_fit_blocks(lengths, seq_len, buffer_size)
    assert got == reference_best_fit(lengths, seq_len, buffer_size)
    pieces = [piece for length in lengths for piece in pieces_of(length, seq_len)]
    assert sorted(p for block in got for p in block) == list(range(len(pieces))), "every piece exactly once"
    assert all(sum(pieces[p] for p in block) <= seq_len for block in got), "no block overflows"


@settings(max_examples=examples(100), deadline=None)
@given(lengths=st.lists(st.integers(0, 150), max_size=40), seq_len=st.integers(1, 48), buffer_size=st.integers(1, 9))
def test_the_pack_stage_makes_the_blocks_best_fit_blocks_plans(lengths, seq_len, buffer_size):
    """``.pack(strategy="best_fit")`` over documents of these lengths: each block holds, in order, the
    pieces :func:`best_fit_blocks` puts in it (pieces told apart by their tokens)."""
    bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    docs = [{"input_ids": np.arange(a, b, dtype=np.int64)} for a, b in zip(bounds, bounds[1:])]
    starts = [int(a) + first for a, n in zip(bounds, lengths) for first in range(0, n, seq_len)]
    pieces = [piece for n in lengths for piece in pieces_of(n, seq_len)]
    expected = [
        np.concatenate([np.arange(starts[p], starts[p] + pieces[p]) for p in block])
        for block in best_fit_blocks(lengths, seq_len, buffer_size)
    ]
    packed = shardkit.wrap(docs).pack(seq_len, strategy="best_fit", buffer_size=buffer_size, pad_id=-1)
    got = [block["input_ids"].numpy() for block in packed]
    assert len(got) == len(expected)
    for tokens, want in zip(got, expected):
        assert np.array_equal(tokens[: len(want)], want) and (tokens[len(want) :] == -1).all()


def test_the_index_takes_the_longest_piece_that_fits_and_of_equal_lengths_the_newest():
    index = FitIndex()
    for piece, length in enumerate([5, 3, 5, 8, 1]):
        index.add(piece, length)
    assert index.take_longest(7) == (2, 5)  # pieces 0 and 2 have 5 tokens: the newer
    assert index.remove_oldest(5) == 0
    assert index.take_longest(0) is None
    assert index.take_longest(100) == (3, 8)
    assert [index.take_longest(100), index.take_longest(100)] == [(1, 3), (4, 1)]
    assert not index and index.take_longest(100) is None
