"""MixedLoader's workers send their dataset's state with some micro-batches only; its
saved states stay exact: resuming at any step gives the uninterrupted run's batches."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset

import shardkit
from shardkit.loader import timing
from shardkit.loader.micro_batches import START, STATE_EVERY, STATE_RATIO, in_process

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

SAMPLES = 150
BATCH, MICRO = 8, 3  # batches cut micro-batches part-way


def to_sample(index: int) -> dict[str, torch.Tensor]:
    return {"index": torch.tensor(index), "values": torch.arange(3, dtype=torch.float64) * index / 7}


def loader(workers: int = 2, every: int | None = None, **kwargs: Any) -> shardkit.MixedLoader:
    """A shuffle buffer (a state that changes with every sample) over a shuffled source; ``every``:
    a state with exactly one micro-batch in ``every`` (None: the default, by the work since the last)."""
    pipeline = shardkit.wrap(list(range(SAMPLES)), shuffle=True, seed=3).map(to_sample).shuffle(16)
    built = shardkit.MixedLoader(pipeline, BATCH, num_workers=workers, micro_batch_size=MICRO, seed=5, **kwargs)
    if every is not None:
        assert built._micro_batches is not None
        built._micro_batches.state_every, built._micro_batches.state_ratio = every, float("inf")
    return built


def same_batches(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> bool:
    """Byte-exact: the same keys, dtypes, shapes and values, batch by batch."""
    return len(got) == len(want) and all(
        a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(got, want)
    )


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 4, STATE_EVERY, None])
def test_resuming_at_any_step_gives_the_uninterrupted_runs_batches_whichever_micro_batches_carry_a_state(
    every: int | None,
) -> None:
    plain = list(loader(every=every))
    saving = loader(every=every)
    batches, states = [], []
    for batch in saving:
        batches.append(batch)
        states.append(saving.state_dict())  # receives messages ahead, up to the next state: no batch changes
    assert same_batches(batches, plain) and len(batches) == -(-SAMPLES // BATCH)
    carried = [sum(tail["count"] for tail in state["carry"]) for state in states]
    if every == STATE_EVERY:  # whole micro-batches before the next state travel in the saved state
        assert max(carried) > MICRO
    for step in (1, 6, 11, len(batches) - 1):
        resumed = loader(every=every)
        resumed.load_state_dict(states[step - 1])
        assert same_batches(list(resumed), batches[step:]), (every, step)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 3])
def test_a_state_carrying_several_micro_batches_resumes_exactly_once_with_another_worker_count(
    workers: int,
) -> None:
    saving = loader(every=STATE_EVERY)
    delivered: list[int] = []
    for step, batch in enumerate(saving, 1):
        delivered += batch["index"].tolist()
        if step == 7:
            state = saving.state_dict()
            break
    assert sum(tail["count"] for tail in state["carry"]) > MICRO
    resumed = loader(workers, every=STATE_EVERY)
    resumed.load_state_dict(state)
    delivered += [index for batch in resumed for index in batch["index"].tolist()]
    assert Counter(delivered) == Counter(range(SAMPLES))


class Clock:
    """A clock for the worker's timing that moves only when told (nanoseconds)."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


class Timed(IterableDataset):
    """Counts up to ``length``; each sample takes ``sample_ms`` and its state ``state_ms`` on ``clock``."""

    def __init__(self, clock: Clock, length: int, sample_ms: int, state_ms: int) -> None:
        self.clock, self.length, self.sample_ms, self.state_ms = clock, length, sample_ms, state_ms
        self.position = 0

    def __iter__(self) -> Iterator[int]:
        while self.position < self.length:
            self.clock.now += self.sample_ms * 1_000_000
            self.position += 1
            yield self.position - 1

    def state_dict(self) -> dict[str, int]:
        self.clock.now += self.state_ms * 1_000_000
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def states_sent(monkeypatch: pytest.MonkeyPatch, sample_ms: int, state_ms: int, length: int = 80) -> list[int]:
    """The micro-batches (of 2 samples, numbered from 1) whose message carries the dataset's state."""
    clock = Clock()
    monkeypatch.setattr(timing, "_now", clock)
    dataset = Timed(clock, length, sample_ms, state_ms)
    messages = list(in_process(dataset, 2, collate=False, resumable=True))
    assert messages[0][1] == START and messages[-1][1] == 0 and messages[-1][3] == {"position": length}
    return [number for number, message in enumerate(messages[1:-1], 1) if message[3] is not None]


def test_a_worker_sends_its_state_once_the_work_since_the_last_is_nine_times_what_it_cost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert STATE_RATIO == 9 and STATE_EVERY == 16
    # a state of 20 ms after micro-batches of 2 x 10 ms: one in 9 (180 ms of work) after the first
    assert states_sent(monkeypatch, sample_ms=10, state_ms=20) == [1, 10, 19, 28, 37]
    # a state dearer than 16 micro-batches' work: one in 16, the most a saved state then carries
    assert states_sent(monkeypatch, sample_ms=0, state_ms=20) == [1, 17, 33]
    # a state that costs nothing against its micro-batch goes with every one
    assert states_sent(monkeypatch, sample_ms=3, state_ms=0, length=12) == [1, 2, 3, 4, 5, 6]
