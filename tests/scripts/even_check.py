"""even_batches under a real torch.distributed (gloo) run, checked by tests/even/test_even_batches.py.

Each of ``--world-size`` processes builds one ``--case`` of loader whose batch
count differs by rank, iterates it once plainly (no collective: its natural
batches), then once through ``even_batches`` (``--wrap``) with an all-reduce
per step, as DDP's gradient sync. Rank 0 prints one JSON line with, per rank:
the natural and yielded batches (as lists of sample ids), the stats, and the
error it raised, if any. ``--wrap none`` runs the plain loop with the per-step
all-reduce: with unequal counts it must hang (the short collective timeout
then fails the run), which shows the check can see a hang.

    python tests/scripts/even_check.py --world-size 2 --case filter --wrap stop

``--runs CASE/WRAP/EVERY ...`` runs several cases one after the other in the
same ranks (one launch, one rendezvous) and prints a JSON object of the
per-rank lists, keyed by run; the ranks agree on a side group that stays
matched from one case to the next, as it does over epochs.

    python tests/scripts/even_check.py --runs filter/stop/1 skip/pad/3 -- a.tfrecord b.tfrecord
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import shardkit  # noqa: E402
from tests.helpers.processes import end_loader_workers, gloo_ranks
from tests.helpers.shards import synthetic_read, synthetic_shards

COUNTS = [17, 3, 0, 25, 9, 30, 11, 6, 12]
BATCH = 4


def keep(sample: str, rank: int) -> bool:
    """A rank-dependent filter: rank r drops records whose index is a multiple of r + 2."""
    return int(sample.rsplit(":", 1)[1]) % (rank + 2) != 0


def example_id(example: dict[str, Any]) -> str:
    return str(int(example["id"][0]))


def build(case: str, rank: int, urls: list[str]) -> Any:
    """A loader whose batch count depends on the rank (see the module docstring)."""
    if case == "filter":  # planned equal, then filtered differently on each rank
        dataset = shardkit.ShardedDataset(synthetic_shards(COUNTS), synthetic_read, balance="pad", shuffle=True, seed=3)
        return DataLoader(dataset.filter(functools.partial(keep, rank=rank)), batch_size=BATCH, num_workers=2)
    if case in ("mixed", "resume", "sized", "trainer"):  # balance="none": counts not equalised
        # Unknown counts deal whole shards to ranks; known ones split records (113 = 56 + 57
        # over 2 ranks: 14 and 15 batches), and then MixedLoader has a len().
        shards = synthetic_shards(COUNTS, known=case != "mixed")
        dataset = shardkit.ShardedDataset(shards, synthetic_read, balance="none", shuffle=True)
        return shardkit.MixedLoader(dataset, batch_size=BATCH, num_workers=2, seed=5)
    if case in ("skip", "raise"):  # equal records, some of them corrupt on one rank
        on_error = "skip" if case == "skip" else "raise"
        # balance="none": a pad/drop source would make up the skipped records itself, so
        # the ranks' counts would already be equal and even_batches would have nothing to do.
        dataset = shardkit.TFRecordDataset(urls, balance="none", on_error=on_error).map(example_id)
        return DataLoader(dataset, batch_size=BATCH, num_workers=2)
    raise ValueError(f"unknown case {case!r}")


def ids(batch: Any) -> list[str]:
    return [str(sample) for sample in batch]


def natural(case: str, rank: int, urls: list[str]) -> list[list[str]] | str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [ids(batch) for batch in build(case, rank, urls)]
    except Exception as error:  # noqa: BLE001 - the "raise" case
        failed = repr(error)
    end_loader_workers()  # the failed DataLoader iterator sits in the error's traceback, in a cycle
    return failed


def train(loader: Any, wrap: str, every: int, stop_after: int | None = None) -> tuple[list[list[str]], Any]:
    """Iterate with an all-reduce per step, as DDP's backward does."""
    wrapped = loader if wrap == "none" else shardkit.even_batches(loader, at_end=wrap, every=every)
    seen: list[list[str]] = []
    for batch in wrapped:
        dist.all_reduce(torch.ones(1))
        seen.append(ids(batch))
        if stop_after is not None and len(seen) == stop_after:
            break
    return seen, wrapped


def subgroup(rank: int, wrap: str, every: int) -> dict[str, Any]:
    """Ranks 0 and 1 train in a group of their own (rank 2 does not take part): they agree in it."""
    group = dist.new_group([0, 1])
    if rank == 2:
        try:
            shardkit.even_batches([], group=group)
        except shardkit.EvenBatchesError as error:
            return {"batches": [], "error": f"{type(error).__name__}: {error}"}
        return {"batches": []}
    seen = []
    wrapped = shardkit.even_batches(build("filter", rank, []), at_end=wrap, every=every, group=group)
    for batch in wrapped:
        dist.all_reduce(torch.ones(1), group=group)
        seen.append(ids(batch))
    stats = wrapped.stats()
    return {"batches": seen, "stats": [stats.batches, stats.padded, stats.dropped, stats.dropped_exact]}


def run_case(rank: int, case: str, wrap: str, every: int, urls: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = {"natural": natural("filter" if case == "subgroup" else case, rank, urls)}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if case == "resume":
                result.update(resume(rank, wrap, every, urls))
            elif case == "trainer":
                result.update(trainer_resume(rank, wrap, every, urls))
            elif case == "subgroup":
                result.update(subgroup(rank, wrap, every))
            else:
                seen, wrapped = train(build(case, rank, urls), wrap, every)
                result["batches"] = seen
                if wrap != "none":
                    stats = wrapped.stats()
                    result["stats"] = [stats.batches, stats.padded, stats.dropped, stats.dropped_exact]
        result["warnings"] = [str(w.message) for w in caught if "even_batches" in str(w.message)]
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(error).__name__}: {error}"
    return result


def resume(rank: int, wrap: str, every: int, urls: list[str]) -> dict[str, Any]:
    """Stop after 5 batches, save, resume in new loaders: the batches must be the uninterrupted run's."""
    whole, _ = train(build("resume", rank, urls), wrap, every)
    first, wrapped = train(build("resume", rank, urls), wrap, every, stop_after=5)
    state = wrapped.state_dict()
    again = shardkit.even_batches(build("resume", rank, urls), at_end=wrap, every=every)
    again.load_state_dict(state)
    rest = []
    for batch in again:
        dist.all_reduce(torch.ones(1))
        rest.append(ids(batch))
    return {"batches": whole, "resumed": first + rest}


def trainer_resume(rank: int, wrap: str, every: int, urls: list[str]) -> dict[str, Any]:
    """As :func:`resume`, but every rank loads rank 0's copy of the state, as a trainer's checkpoint holds."""
    whole, _ = train(build("resume", rank, urls), wrap, every)
    first, wrapped = train(build("resume", rank, urls), wrap, every, stop_after=5)
    state = wrapped.state_dict()  # every rank calls it, as trainers do; they write rank 0's copy
    copies: list[Any] = [state if rank == 0 else None]
    dist.broadcast_object_list(copies, src=0)
    again = shardkit.even_batches(build("resume", rank, urls), at_end=wrap, every=every)
    again.load_state_dict(json.loads(json.dumps(copies[0])))  # through JSON, as a checkpoint file
    rest = []
    for batch in again:
        dist.all_reduce(torch.ones(1))
        rest.append(ids(batch))
    return {"batches": whole, "resumed": first + rest, "state": copies[0] if rank == 0 else None}


def run(rank: int, world_size: int, args: argparse.Namespace) -> None:
    if not args.runs:
        result: Any = run_case(rank, args.case, args.wrap, args.every, args.urls)
    else:
        result = {}
        for spec in args.runs:
            case, wrap, every = spec.split("/")
            result[spec] = run_case(rank, case, wrap, int(every), args.urls)
            end_loader_workers()  # loaders left mid-epoch: ended now, not 5 s per worker at a later GC
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0 and args.runs:
        gathered = {spec: [ranks[spec] for ranks in gathered] for spec in args.runs}  # type: ignore[assignment]
    if rank == 0:
        print(json.dumps(gathered), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--case",
        default="filter",
        choices=("filter", "mixed", "sized", "skip", "raise", "resume", "trainer", "subgroup"),
    )
    parser.add_argument("--wrap", default="stop", choices=("stop", "pad", "none"))
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--runs", nargs="*", default=[], help="CASE/WRAP/EVERY: several cases in one launch")
    parser.add_argument("--collective-timeout", type=float, default=120.0)  # a hang fails; a loaded machine does not
    parser.add_argument("urls", nargs="*")
    args = parser.parse_args()
    gloo_ranks(run, args.world_size, args, start_method="fork", collective_timeout=args.collective_timeout)


if __name__ == "__main__":
    main()
