"""Ranks as threads for even_batches tests: a fake side group whose all-reduce (MIN) matches calls
in order as gloo does, and a small stateful loader of named batches."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from shardkit.even import wrapper as even_module
from tests.helpers.load import hang_bound


class FakeWorld:
    """All-reduce (MIN) among ``size`` threads, matched by call order as gloo does."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.posted: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
        self.local = threading.local()


class FakeWork:
    def __init__(self, world: FakeWorld, seq: int, tensor: torch.Tensor) -> None:
        self.world, self.seq, self.tensor = world, seq, tensor

    def wait(self) -> None:
        world = self.world
        with world.cond:
            if not world.cond.wait_for(lambda: len(world.posted[self.seq]) == world.size, timeout=hang_bound(60)):
                raise TimeoutError(f"agreement {self.seq} never completed: the ranks would hang")
            self.tensor.copy_(torch.stack(list(world.posted[self.seq].values())).min(0).values)


class FakeSide:
    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world, self.rank, self.size, self.seq = world, rank, world.size, 0

    def all_reduce_min(self, tensor: torch.Tensor) -> FakeWork:
        seq, self.seq = self.seq, self.seq + 1
        with self.world.cond:
            self.world.posted[seq][self.rank] = tensor.clone()
            self.world.cond.notify_all()
        return FakeWork(self.world, seq, tensor)


def run_ranks(
    monkeypatch: pytest.MonkeyPatch, size: int, body: Callable[[int], Any], round_trips: list[float] | None = None
) -> list[Any]:
    """Run ``body(rank)`` in ``size`` threads that agree through one FakeWorld;
    returns each rank's result or the exception it raised. With ``round_trips``,
    rank r's side group measured ``round_trips[r]`` seconds per agreement."""
    world = FakeWorld(size)
    monkeypatch.setattr(even_module, "_side_group", lambda group: world.local.side)
    results: list[Any] = [None] * size

    def target(rank: int) -> None:
        world.local.side = FakeSide(world, rank)
        if round_trips is not None:
            world.local.side.round_trip = round_trips[rank]
        try:
            results[rank] = body(rank)
        except BaseException as error:  # noqa: BLE001 - reported to the test
            results[rank] = error

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=hang_bound(120))
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return results


class Batches:
    """A stateful, sized loader of ``batches`` (the Stateful protocol: a cursor)."""

    def __init__(self, batches: list[Any], *, sized: bool = True) -> None:
        self.batches = batches
        self.sized = sized
        self.position = 0
        self.loaded: int | None = None
        self.epochs: list[int] = []

    def __iter__(self) -> Iterator[Any]:
        self.position, self.loaded = self.loaded or 0, None
        while self.position < len(self.batches):
            self.position += 1
            yield self.batches[self.position - 1]

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("unsized")
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded = state["position"]


def rank_batches(rank: int, count: int) -> list[str]:
    return [f"r{rank}b{i}" for i in range(count)]


def expected(rank: int, counts: list[int], at_end: str) -> list[str]:
    own = rank_batches(rank, counts[rank])
    if at_end == "stop":
        return own[: min(counts)]
    return own + own[:1] * (max(counts) - counts[rank])
