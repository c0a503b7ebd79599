"""even_batches(every="auto") under a real gloo run, checked by tests/even/test_even_auto.py.

Two ranks, one launch for several checks. Each rank reads the same 400
records through a rank-dependent filter with no ``len()`` (rank 1 drops
every 8th record, so its count is only known when it runs out: 350 batches
against rank 0's 400), wrapped in ``even_batches(every="auto")``; rank 1's
training steps sleep 2 ms, rank 0's take microseconds, so the ranks measure
different step times and would choose different windows. Rank 0 prints one
JSON line with, per rank: the natural batches, the yielded ones, the stats,
the window chosen, the window this rank alone would have proposed first,
the side group's round trip, the agreements posted, the batches of epochs
stopped after 12 and after 100 batches (inside the first windows and inside
the large one), saved and resumed in a new wrapper, with the resumed
epochs' windows, and the error raised, if any.

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

RECORDS = 400
SLOW_STEP = 0.002  # rank 1's step, seconds
STOPS = (12, 100)  # batches after which an epoch is saved and resumed


def keep(rank: int, record: int) -> bool:
    """Rank 1 drops every 8th record: a filter whose count is known only by reading."""
    return rank == 0 or record % 8 != 5


class Filtered:
    """Batches ``[rank, record]`` of the records ``keep`` keeps, with the Stateful protocol (a cursor); no len()."""

    def __init__(self, rank: int) -> None:
        self.rank, self.position, self.loaded = rank, 0, 0

    def __iter__(self) -> Iterator[list[int]]:
        self.position, self.loaded = self.loaded, 0
        while self.position < RECORDS:
            self.position += 1
            if keep(self.rank, self.position - 1):
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
    result: dict[str, Any] = {"natural": list(Filtered(rank)), "error": None}
    try:
        side = group._side_group(None)
        assert side is not None
        posted = side.posted
        wrapped = shardkit.even_batches(Filtered(rank), every="auto")
        result["batches"] = epoch(rank, wrapped)
        result["agreements"] = side.posted - posted
        stats = wrapped.stats()
        result["stats"] = [stats.batches, stats.padded, stats.dropped, stats.dropped_exact]
        result["window"] = stats.window
        result["round_trip"] = side.round_trip
        # what this rank alone would have proposed at the first agreement with a measured step (the
        # second, posted after 2 batches for a window of 16), from the step it measured then
        gaps = wrapped._iterator._gaps[:1]
        result["proposal"] = auto.proposal(side.round_trip, gaps, agreements=2, batches=2, current=16)
        result["resumed"], result["resumed_window"] = [], []
        for stop in STOPS:
            first = shardkit.even_batches(Filtered(rank), every="auto")
            seen = epoch(rank, first, stop_after=stop)
            again = shardkit.even_batches(Filtered(rank), every="auto")
            again.load_state_dict(first.state_dict())
            result["resumed"].append(seen + epoch(rank, again))
            result["resumed_window"].append(again.stats().window)
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(error).__name__}: {error}"
    return result


def run(rank: int, world_size: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank 0 drops 50 batches: expected here
        result = run_checks(rank)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print(json.dumps(gathered), flush=True)


def main() -> None:
    gloo_ranks(run, 2, start_method="fork", collective_timeout=120.0)


if __name__ == "__main__":
    main()
