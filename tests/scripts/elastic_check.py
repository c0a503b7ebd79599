"""Elastic resume under torchrun, checked by tests/state/test_elastic_stages.py and tests/state/test_elastic.py.

``save``: every rank reads the interleave-and-shuffle pipeline of tests/helpers/elastic.py through a
MixedLoader of 2 workers (micro-batches of 3 in batches of 8, so saving cuts them), saves after batch
20 through ``shardkit.state.gather`` and rank 0 writes the global state. ``load``: a fresh world of any
size loads it and reads to the end of the epoch. For every balance in one process group (a torchrun
start costs seconds); rank 0 prints one JSON line: each rank's ids and batch counts, and whether each
rank's saved state held cut micro-batches.

With ``WORKERS``, the same process group then runs test_elastic.py's case (:func:`merged_case`): a
plain ShardedDataset through a MixedLoader of that many workers, saved by rank ``r`` after batch
``25 + 7 r`` with a state at every micro-batch and merged with ``merge_ranks``; loaded through a
DataLoader of that many workers. Each rank writes what it delivered to ``DIR/run.BALANCE.save.RANK``
(``...loadRANKSxWORKERS.RANK`` when loading).
Both tests' worlds share one run of ``worlds``: it imports torch once and forks each world's ranks
with torchrun's environment, one world after another (three torchruns cost a launcher and a Python
per rank importing torch: the module's setup took 76 s, now 29 s, both at load 10). Under torchrun,
one world:

    python tests/scripts/elastic_check.py worlds DIR
    WORKERS=2 python -m torch.distributed.run --standalone --nproc-per-node=2 tests/scripts/elastic_check.py save DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from shardkit import MixedLoader, ShardedDataset  # noqa: E402
from shardkit.state import gather, merge_ranks  # noqa: E402
from tests.helpers.elastic import COUNTS_A, WORLDS, pipeline  # noqa: E402
from tests.helpers.processes import fork_ranks  # noqa: E402
from tests.helpers.shards import positional_read, positional_shards  # noqa: E402

BALANCES = ("none", "pad", "drop")
SAVE_AT = 20


def step(balance: str) -> None:
    """A collective per batch, as DDP's gradient all-reduce: unequal batch counts would hang here."""
    if balance != "none":
        dist.all_reduce(torch.ones(1))


def save(balance: str, folder: Path) -> tuple[list[int], int, bool]:
    loader = MixedLoader(pipeline("interleave", None, None, balance), 8, num_workers=2, micro_batch_size=3)
    assert loader._micro_batches is not None
    loader._micro_batches.restart = False  # carried micro-batches, not restart points (shardkit.loader.restart)
    delivered: list[int] = []
    for count, batch in enumerate(loader, 1):
        step(balance)
        delivered += batch.tolist()
        if count == SAVE_AT:
            break
    state = loader.state_dict()  # every rank's (a "ranks" node), as a trainer saves it
    carried = bool(state["states"][dist.get_rank()]["carry"])
    merged = gather(state)
    if dist.get_rank() == 0:
        (folder / f"{balance}.state").write_text(json.dumps(merged))
    del loader
    return delivered, SAVE_AT, carried


def load(balance: str, folder: Path) -> tuple[list[int], int, bool]:
    loader = MixedLoader(pipeline("interleave", None, None, balance), 8, num_workers=2, micro_batch_size=3)
    loader.load_state_dict(json.loads((folder / f"{balance}.state").read_text()))
    delivered: list[int] = []
    batches = 0
    for batch in loader:
        step(balance)
        delivered += batch.tolist()
        batches += 1
    del loader
    return delivered, batches, False


def merged_case(mode: str, balance: str, workers: int, out: str) -> None:
    """test_elastic.py's case: rank states merged by ``merge_ranks``, loaded by a plain DataLoader."""
    rank = dist.get_rank()
    source = ShardedDataset(positional_shards(COUNTS_A), positional_read, shuffle=True, seed=9, balance=balance)
    source.shuffle_block, source.shuffle_window = 32, 200
    if mode == "save":
        loader = MixedLoader(source, 10, num_workers=workers, micro_batch_size=5)
        # a state with every micro-batch (not only when the work since the last one outweighs
        # its cost): the dataset states alone then describe the rest, which the test merges
        loader._micro_batches.state_every = 1
        delivered: list[int] = []
        state: dict[str, Any] = {}
        for count, batch in enumerate(loader, 1):
            delivered += batch.tolist()
            if count == 25 + 7 * rank:
                state = loader.state_dict()  # every rank's (a "ranks" node), as a trainer saves it
                break
        del loader  # its workers end before the next balance's start
        assert not state["states"][rank]["carry"], "batches of whole micro-batches leave nothing cut"
        merged = merge_ranks([s["workers"] for s in state["states"]])  # the dataset's global state
        if rank == 0:
            Path(f"{out}.{balance}.state").write_text(json.dumps(merged))
    else:
        source.load_state_dict(json.loads(Path(f"{out}.{balance}.state").read_text()))
        delivered = [int(s) for s in DataLoader(source, batch_size=None, num_workers=workers)]
    tag = mode if mode == "save" else f"load{dist.get_world_size()}x{workers}"  # one file per world
    Path(f"{out}.{balance}.{tag}.{rank}").write_text(json.dumps(delivered))
    dist.barrier()


def run(mode: str, folder: Path) -> None:
    """One rank of a ``mode`` world (under torchrun, or forked by :func:`worlds`)."""
    dist.init_process_group("gloo")
    result: dict[str, Any] = {"delivered": {}, "batches": {}, "carried": []}
    for balance in BALANCES:
        mine = (save if mode == "save" else load)(balance, folder)
        dist.barrier()  # rank 0's state file is written before any rank of a later run reads it
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        result["delivered"][balance] = [g[0] for g in gathered]
        result["batches"][balance] = [g[1] for g in gathered]
        result["carried"] += [g[2] for g in gathered]
    if "WORKERS" in os.environ:
        for balance in BALANCES:
            merged_case(mode, balance, int(os.environ["WORKERS"]), str(folder / "run"))
    if dist.get_rank() == 0:
        (folder / f"{mode}.{dist.get_world_size()}.json").write_text(json.dumps(result))
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


def worlds(folder: Path) -> None:
    """Every world of tests/helpers/elastic.py's ``WORLDS`` one after another, its ranks forked from this
    process (torch imported once, here, not by a launcher and each rank of three torchruns); prints one
    JSON line: each world's rank 0 result by ``"MODE RANKS"``."""
    results = {}
    for mode, ranks, workers in WORLDS:
        codes = fork_ranks(lambda mode=mode: run(mode, folder), ranks, {"WORKERS": str(workers)})
        assert codes == [0] * ranks, f"the {mode} world of {ranks} ranks ended with {codes}"
        results[f"{mode} {ranks}"] = json.loads((folder / f"{mode}.{ranks}.json").read_text())
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "worlds":
        worlds(Path(sys.argv[2]))
    else:
        run(sys.argv[1], Path(sys.argv[2]))
