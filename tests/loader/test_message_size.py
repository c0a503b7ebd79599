"""A worker's micro-batches of small samples grow to about ``MESSAGE_BYTES`` when ``micro_batch_size`` is
not given (issue 39, item 2): a message costs about 0.5 ms of CPU whatever it holds, so 8 packed blocks
of 2,048 int32 tokens (64 KB) a message spent more on messages than on packing.

Slow samples (a remote read's) do not grow past about ``MESSAGE_NS`` of making them. Growing changes no batch (assembly depends only on what each worker yields), keeps the first message at
the batch size (the first batch is not delayed), and is left out where a saved state would carry the
undelivered samples as data (a wrapped plain iterable).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.loader import micro_batches
from shardkit.loader.micro_batches import (
    MESSAGE_BYTES,
    MESSAGE_NS,
    MESSAGE_SAMPLES,
    START,
    MicroBatches,
    message_size,
)
from shardkit.loader.slabs import SlabBatch, from_slab
from tests.helpers.examples import examples
from tests.helpers.tokens import write_pair

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@settings(max_examples=examples(300), deadline=None)
@given(
    size=st.integers(1, 600),
    count=st.integers(1, 600),
    per_sample=st.integers(1, 1 << 21),
    ns_per_sample=st.integers(1, 10_000_000),
)
def test_a_grown_micro_batch_is_whole_batches_near_the_message_bytes_and_time_and_never_smaller(
    size: int, count: int, per_sample: int, ns_per_sample: int
) -> None:
    grown = message_size(size, count, count * per_sample, count * ns_per_sample)
    assert grown % size == 0 and grown >= size
    assert grown <= max(size, MESSAGE_SAMPLES)
    if grown > size:  # grown by whole batches, the last of them needed to reach the bytes, within the time
        assert (grown - size) * per_sample < MESSAGE_BYTES
        assert grown * ns_per_sample <= MESSAGE_NS
    bound_by_samples = grown + size > MESSAGE_SAMPLES
    bound_by_time = (grown + size) * ns_per_sample > MESSAGE_NS
    if not (bound_by_samples or bound_by_time):  # stopped by nothing else: it reached the bytes
        assert grown * per_sample >= MESSAGE_BYTES


def corpus(folder: Path, tokens: int) -> str:
    """``tokens`` int32 tokens in documents of lognormal length (median 400), as the benchmark writes them."""
    rng = np.random.default_rng(3)
    docs, written = [], 0
    while written < tokens:
        docs.append(rng.integers(0, 50_000, max(1, int(rng.lognormal(np.log(400), 1.0))), dtype=np.int32))
        written += len(docs[-1])
    return write_pair(folder, docs, dtype=np.int32)


def worker(dataset: Any, size: int, grow: bool) -> Any:
    """A worker's messages (as under a MixedLoader without micro_batch_size: ``grow``), made in this process."""
    return MicroBatches(dataset, size, collate=True, resumable=True, slots=5, ask=True, grow=grow)._messages(0, None)


def worker_messages(dataset: Any, size: int, grow: bool) -> list[tuple[int, torch.Tensor]]:
    """A worker's micro-batches, made in this process through a slab ring freed after each: (count, input_ids)."""
    messages = worker(dataset, size, grow)
    first = next(messages)
    assert first[1] == START
    flags, slabs, out = first[2], {}, []
    for _, count, payload, *_ in messages:
        if count == 0:
            break
        assert type(payload) is SlabBatch
        if payload.slab is not None:
            slabs[payload.slot] = payload.slab
        out.append((count, from_slab(payload.skeleton, slabs[payload.slot])["input_ids"].clone()))
        flags[payload.slot] = 0  # copied out, as the main process does
    return out


def test_a_worker_packing_blocks_sends_the_batch_size_first_then_64_blocks_a_message_with_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(micro_batches, "MESSAGE_NS", 10**15)  # the bytes alone decide (a loaded machine is slow)
    prefix = corpus(tmp_path, 600_000)
    grown = worker_messages(shardkit.TokenDataset(prefix).pack(2048), 8, grow=True)
    plain = worker_messages(shardkit.TokenDataset(prefix).pack(2048), 8, grow=False)
    counts = [count for count, _ in grown]
    assert counts[0] == 8 and counts[1:-1] == [64] * (len(counts) - 2) and 0 < counts[-1] <= 64
    assert {count for count, _ in plain[:-1]} == {8}
    assert torch.equal(torch.cat([ids for _, ids in grown]), torch.cat([ids for _, ids in plain]))


class Counting:
    """A plain iterable (no ``__getitem__``): wrapped, its items have no positions to read again by."""

    def __iter__(self) -> Any:
        return iter(range(300))


def small(i: int) -> dict[str, Any]:
    return {"id": i}


def test_a_wrapped_plain_iterable_whose_state_carries_samples_as_data_keeps_micro_batches_of_the_size_asked() -> None:
    counts = [count for count, _ in ids_messages(shardkit.wrap(Counting()).map(small), 8)]
    assert counts[:-1] == [8] * (len(counts) - 1)


def ids_messages(dataset: Any, size: int) -> list[tuple[int, Any]]:
    messages = worker(dataset, size, grow=True)
    flags = next(messages)[2]
    out = []
    for _, count, payload, *_ in messages:
        if count == 0:
            break
        out.append((count, payload))
        flags[payload.slot] = 0
    return out


def test_small_samples_over_shards_grow_to_256_a_message() -> None:
    """Records read again by position (a map-style dataset): their positions, not they, are carried."""
    counts = [count for count, _ in ids_messages(shardkit.wrap(list(range(3000))).map(small), 8)]
    assert counts[0] == 8 and set(counts[1:-1]) == {MESSAGE_SAMPLES}


def slow(i: int) -> dict[str, Any]:
    time.sleep(0.004)  # a remote read: 8 samples take longer than MESSAGE_NS / 2
    return {"id": i}


def test_slow_small_samples_keep_micro_batches_of_the_size_asked() -> None:
    assert MESSAGE_NS < 2 * 8 * 4_000_000
    counts = [count for count, _ in ids_messages(shardkit.wrap(list(range(48))).map(slow), 8)]
    assert counts == [8] * 6


@pytest.mark.slow
def test_a_packed_loader_with_grown_messages_saved_mid_epoch_carries_nothing_and_resumes_token_for_token(
    tmp_path: Path,
) -> None:
    """3M tokens: about 730 blocks a worker, many messages of 64; a save mid-epoch leaves both workers
    running, so each answers at the delivered point (shardkit.loader.restart) and nothing is carried."""
    prefix = corpus(tmp_path, 3_000_000)

    def loader() -> shardkit.MixedLoader:
        return shardkit.MixedLoader(shardkit.TokenDataset(prefix).pack(2048), batch_size=8, num_workers=2)

    full = [batch["input_ids"] for batch in loader()]
    for cut in (1, 40):
        saving = loader()
        iterator = iter(saving)
        delivered = [next(iterator)["input_ids"] for _ in range(cut)]
        state = json.loads(json.dumps(saving.state_dict()))
        del iterator
        assert state["carry"] == [], cut
        resumed = loader()
        resumed.load_state_dict(state)
        rest = [batch["input_ids"] for batch in resumed]
        assert len(delivered + rest) == len(full)
        assert all(torch.equal(a, b) for a, b in zip(delivered + rest, full)), cut
