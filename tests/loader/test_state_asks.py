"""Saving costs one dataset state per worker per ``state_dict()``, not one per micro-batch (issue 39).

Under a MixedLoader a worker sends its dataset's state only with its first and
last message and when the main process asks (a count in shared memory, sent
with the first message), and
its micro-batches carry their samples' record positions, which a saved state
names the undelivered samples by. The carried positions travel as runs of
consecutive records where they follow one another.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.loader.micro_batches import START, MicroBatches, positions_of
from shardkit.state import StateError
from shardkit.stateful import decode_runs, encode_positions, encode_runs, pack
from tests.helpers.examples import examples
from tests.helpers.shards import positional_read, positional_shards


def dataset() -> shardkit.Pipeline:
    return shardkit.ShardedDataset(positional_shards([30, 30]), positional_read, shuffle=False).map(as_sample)


def as_sample(i: int) -> dict[str, Any]:
    return {"id": i}


def test_a_worker_sends_its_state_only_with_its_first_and_last_message_and_when_asked() -> None:
    messages = MicroBatches(dataset(), 4, collate=False, resumable=True, ask=True)._messages(0, None)
    first = next(messages)
    assert first[1] == START and isinstance(first[3], dict)
    asks = first[5]  # the iteration's ask count, in shared memory
    assert isinstance(asks, torch.Tensor) and asks.is_shared()
    unasked = [next(messages) for _ in range(3)]
    assert [message[3] for message in unasked] == [None] * 3
    asks[0] += 1  # state_dict() in the main process
    answer = next(messages)
    assert isinstance(answer[3], dict)
    rest = list(messages)
    assert [message[3] is None for message in rest[:-1]] == [True] * (len(rest) - 1)
    assert rest[-1][1] == 0 and isinstance(rest[-1][3], dict)
    # Every micro-batch carries its samples' record positions: 60 records read in order, shard after shard.
    positions = np.concatenate([positions_of(message[5]) for message in [*unasked, answer, *rest[:-1]]])
    assert positions.tolist() == [pack(shard, record) for shard in (0, 1) for record in range(30)]


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2**32 - 1)), max_size=60), st.booleans())
def test_positions_as_runs_decode_to_the_same_positions_and_are_never_larger(
    pairs: list[tuple[int, int]], consecutive: bool
) -> None:
    if consecutive and pairs:  # runs of consecutive records, as a micro-batch without a shuffle buffer reads them
        shard, first = pairs[0]
        first = min(first, 2**32 - 1 - len(pairs))
        pairs = [(shard, first + k) for k in range(len(pairs))]
    positions = np.array([pack(shard, record) for shard, record in pairs], dtype=np.int64)
    runs = encode_runs(positions)
    if runs is None:
        return
    assert decode_runs(runs, len(positions), "test").tolist() == positions.tolist()
    assert len(str(runs)) <= len(str(encode_positions(positions)))
    if consecutive:
        assert runs[2] == [1, 3]  # one run


def test_runs_that_do_not_add_up_to_the_count_are_refused_before_they_are_laid_out() -> None:
    runs = encode_runs(np.array([pack(1, k) for k in range(10)], dtype=np.int64))
    with pytest.raises(StateError, match=r"'runs'\] names 10 records, but 'count' is 9"):
        decode_runs(runs, 9, "test")
    huge = shardkit.state.encode(np.array([[0, 0, 2**31 - 1], [0, 0, 2**31 - 1]], dtype=np.int64))
    with pytest.raises(StateError, match="names 4294967294 records"):
        decode_runs(huge, 5, "test")
