"""even_batches when a rank stalls or dies, under a real gloo group; checked by tests/even/test_even_batches.py.

Two ranks join a gloo process group with ``--timeout`` seconds (the job's
timeout) and iterate ``even_batches`` over 10 batches each. After 2 batches
rank 1 either stalls (``--fault stall``: alive, no longer iterating) until
rank 0 has given up and written its report, then tries to go on, or exits at
once (``--fault die``: ``os._exit``). Each rank
writes one JSON line (its error and its longest wait in ``next()``)
to a file in ``--out``; the script prints them, rank by rank, as one JSON line.

    python tests/scripts/even_faults_check.py --fault stall --timeout 5 --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import shardkit  # noqa: E402
from tests.helpers.processes import gloo_ranks

#: Seconds between a stalled rank's looks for the waiting rank's report.
POLL = 0.05


def stall_until_reported(out: str, timeout: float) -> None:
    """Stall (alive, not iterating) until rank 0 has raised and written its report, so that going on
    afterwards cannot complete the agreement it waited for; a bound of the job's timeout plus 60 s."""
    deadline = time.monotonic() + timeout + 60
    while not os.path.exists(os.path.join(out, "rank0.json")) and time.monotonic() < deadline:
        time.sleep(POLL)


def run(rank: int, world_size: int, fault: str, timeout: float, out: str) -> None:
    wrapped = shardkit.even_batches([[rank, step] for step in range(10)])
    iterator = iter(wrapped)
    report: dict[str, object] = {"rank": rank, "batches": 0}
    longest = 0.0  # the longest next(): a wait for the other rank
    try:
        for _ in range(10):
            if rank == 1 and report["batches"] == 2:
                if fault == "die":
                    os._exit(0)  # abrupt, no cleanup; status 0, else start_processes kills rank 0 at once
                stall_until_reported(out, timeout)
            started = time.monotonic()
            try:
                next(iterator)
            finally:
                longest = max(longest, time.monotonic() - started)
            report["batches"] += 1  # type: ignore[operator]
    except Exception as error:  # noqa: BLE001 - reported to the test
        report["error"] = f"{type(error).__name__}: {error}"
    report["seconds"] = longest
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as file:
        json.dump(report, file)
    os.replace(path + ".tmp", path)  # whole when it appears: rank 1 waits for rank 0's


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=["stall", "die"], required=True)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        # forked ranks: a spawned rank imports torch again, seconds each
        gloo_ranks(run, 2, args.fault, args.timeout, args.out, collective_timeout=args.timeout, start_method="fork")
    except Exception as error:  # noqa: BLE001 - a rank that exits on purpose fails the join
        print(f"join: {type(error).__name__}: {error}", file=sys.stderr)
    reports = []
    for rank in range(2):
        path = os.path.join(args.out, f"rank{rank}.json")
        reports.append(json.load(open(path)) if os.path.exists(path) else None)
    print(json.dumps(reports))


if __name__ == "__main__":
    main()
