"""even_batches(every="auto") under a real gloo run, checked by tests/even/test_even_auto.py.

Two ranks, one launch for several checks. Each rank wraps a stateful loader
of its own length (rank 0: 60 batches, rank 1: 52) in
``even_batches(every="auto")``; rank 1's training steps sleep 3 ms, rank 0's
take microseconds, so the ranks measure different step times and would
choose different windows. Rank 0 prints one JSON line with, per rank: the
natural batches, the yielded ones, the stats, the window chosen, the window
this rank alone would have proposed, the side group's round trip, the batches
of an epoch stopped after 12 batches, saved and resumed in a new wrapper, and
the error raised, if any.

    python tests/scripts/even_auto_check.py
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import shardkit  # noqa: E402
from shardkit.even import auto, group  # noqa: E402
from tests.helpers.processes import gloo_ranks  # noqa: E402

COUNTS = [60, 52]
SLOW_STEP = 0.003  # rank 1's step, seconds


class Counted:
    """Batches ``[rank, i]``, with the Stateful protocol (a cursor)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.position, self.loaded = rank, 0, 0

    def __iter__(self) -> Iterator[list[int]]:
        self.position, self.loaded = self.loaded, 0
        while self.position < COUNTS[self.rank]:
            self.position += 1
            yield [self.rank, self.position - 1]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded = state["position"]


def step(rank: int) -> None:
    if rank == 1:
        time.sleep(SLOW_STEP)


def epoch(rank: int, wrapped: Any, stop_after: int | None = None) -> list[list[int]]:
    seen = []
    for batch in wrapped:
        step(rank)
        seen.append(batch)
        if len(seen) == stop_after:
            break
    return seen


def run_checks(rank: int) -> dict[str, Any]:
    result: dict[str, Any] = {"natural": list(Counted(rank)), "error": None}
    try:
        wrapped = shardkit.even_batches(Counted(rank), every="auto")
        result["batches"] = epoch(rank, wrapped)
        stats = wrapped.stats()
        result["stats"] = [stats.batches, stats.padded, stats.dropped, stats.dropped_exact]
        result["window"] = stats.window
        side = group._side_group(None)
        result["round_trip"] = side.round_trip if side is not None else 0.0
        # what this rank alone would have proposed, from the steps it measured (read from its iterator)
        result["proposal"] = auto.auto_window(result["round_trip"], auto.median_step(wrapped._iterator._gaps))
        first = shardkit.even_batches(Counted(rank), every="auto")
        resumed = epoch(rank, first, stop_after=12)
        again = shardkit.even_batches(Counted(rank), every="auto")
        again.load_state_dict(first.state_dict())
        result["resumed"] = resumed + epoch(rank, again)
        result["resumed_window"] = again.stats().window
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(error).__name__}: {error}"
    return result


def run(rank: int, world_size: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank 0 drops 8 batches: expected here
        result = run_checks(rank)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print(json.dumps(gathered), flush=True)


def main() -> None:
    gloo_ranks(run, 2, start_method="fork", collective_timeout=120.0)


if __name__ == "__main__":
    main()
