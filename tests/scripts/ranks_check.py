"""Every rank's state in one checkpoint, under torchrun with 2 gloo ranks; checked by tests/loader/test_ranks_torchrun.py.

    python -m torch.distributed.run --nproc_per_node=2 tests/scripts/ranks_check.py --timeout 6 --out DIR

Each rank, for MixedLoader and StatefulDataLoader over a shuffled shardkit pipeline
(2 workers): takes 3 batches, calls ``state_dict()`` (every rank's state), and
resumes a fresh loader from it; then rank 0 alone calls ``state_dict()``, which
must raise StateError within the job's timeout (``--timeout``) instead of
hanging. Each rank writes one JSON file to ``--out``: per loader, whether the
state holds both ranks, a digest of it (equal on both ranks), and whether the
head plus the resumed rest equal an uninterrupted epoch; then the error and how
long it took.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402

import shardkit  # noqa: E402
from tests.helpers.shards import synthetic_read, synthetic_shards  # noqa: E402

COUNTS, TAKEN = [40, 40, 40, 31], 3


def build(kind: str):  # type: ignore[no-untyped-def]
    source = shardkit.ShardedDataset(synthetic_shards(COUNTS), synthetic_read, shuffle=True).map(str.upper).shuffle(16)
    if kind == "mixed":
        return shardkit.MixedLoader(source, batch_size=8, num_workers=2, collate_fn=list)
    return shardkit.StatefulDataLoader(source, batch_size=8, num_workers=2, collate_fn=list)


def flat(batches) -> list[str]:  # type: ignore[no-untyped-def]
    return [sample for batch in batches for sample in batch]


def resumes(kind: str) -> dict[str, object]:
    uninterrupted = flat(build(kind))
    loader = build(kind)
    iterator = iter(loader)
    head = flat(next(iterator) for _ in range(TAKEN))
    state = loader.state_dict()
    text = json.dumps(state, sort_keys=True)
    resumed = build(kind)
    resumed.load_state_dict(json.loads(text))
    return {
        "kind": state.get("kind"),
        "world_size": state.get("world_size"),
        "digest": hashlib.sha256(text.encode()).hexdigest(),
        "exact": head + flat(resumed) == uninterrupted,
        "samples": len(uninterrupted),
    }


def rank0_alone() -> dict[str, object]:
    loader = build("mixed")
    next(iter(loader))
    started = time.monotonic()
    try:
        loader.state_dict()
    except shardkit.state.StateError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    report: dict[str, object] = {"rank": rank, "mixed": resumes("mixed"), "stateful": resumes("stateful")}
    dist.barrier()
    if rank == 0:
        report["alone"] = rank0_alone()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as file:
        json.dump(report, file)


if __name__ == "__main__":
    main()
