"""The docs' pictures, made by the project's own code: ``python docs/_ext/pictures.py`` writes them into
``docs/pictures/``; ``tests/test_pictures.py`` makes them again and fails if a committed one differs.

- ``plan-pad.svg``, ``plan-drop-shuffle.svg``: what ``shardkit plan --picture`` draws for the six
  shards ``shardkit demo`` writes (their manifest's record counts), run through the command itself.
- ``path.svg``: a glob's path to a batch, drawn from a real small plan (:func:`shardkit.plan` for
  every reader of 2 ranks x 2 workers).

The benchmark charts are ``benchmarks/charts.py``'s (matplotlib, a benchmark extra); the profile picture
is from a real run of ``shardkit profile`` (see docs/performance.md), so neither is made here.
Everything is deterministic: no date, no random id, counts fixed here.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardkit.cli.svg import RANK_HUES, document, line, rect, text, text_colour, write_atomic

DOCS_PICTURES = Path(__file__).resolve().parents[1] / "pictures"
#: The record counts of the six shards `shardkit demo` writes (its manifest says so).
DEMO_COUNTS = [700, 450, 900, 300, 820, 530]
PLAN_PICTURES = {
    "plan-pad.svg": ["--world-size", "3", "--num-workers", "2"],
    "plan-drop-shuffle.svg": ["--world-size", "3", "--num-workers", "2", "--balance", "drop", "--shuffle"],
}
#: The path diagram's small job: 4 shards over 2 ranks x 2 workers, batches of 4.
PATH_COUNTS, PATH_WORLD, PATH_WORKERS, PATH_BATCH = [5, 3, 4, 4], 2, 2, 4
SHARD_HUES = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1")
_WIDTH = 820


def plan_picture_by_command(arguments: list[str]) -> str:
    """What ``shardkit plan data/train.manifest.arrow ARGUMENTS --picture plan.svg`` writes, run in a
    temporary directory holding a manifest of :data:`DEMO_COUNTS` (the shard names as the demo's)."""
    import shardkit
    from shardkit.cli import main

    with tempfile.TemporaryDirectory() as tmp, _working_directory(tmp):
        os.mkdir("data")
        urls = [f"data/train-{i:05d}.tfrecord" for i in range(len(DEMO_COUNTS))]
        shardkit.ShardList(urls, num_records=DEMO_COUNTS).to_manifest("data/train.manifest.arrow")
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(["plan", "data/train.manifest.arrow", *arguments, "--picture", "plan.svg"])
        if code != 0:
            raise SystemExit(f"shardkit plan {' '.join(arguments)} exited {code}")
        return Path("plan.svg").read_text(encoding="utf-8")


@contextlib.contextmanager
def _working_directory(path: str) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


_CELL, _LEFT, _GAP = 28, 150, 44
Readers = dict[tuple[int, int], list[Any]]


def path_picture() -> str:
    """Glob -> shards -> one stream cut per rank, then per worker -> each worker's records -> a
    MixedLoader batch, every record drawn where :func:`shardkit.plan` puts it."""
    from shardkit import Topology, plan

    readers = {
        (r, w): plan(PATH_COUNTS, Topology(r, PATH_WORLD, w, PATH_WORKERS))
        for r in range(PATH_WORLD)
        for w in range(PATH_WORKERS)
    }
    body = [text(16, 26, "From a glob to a batch", size=16, weight="bold")]
    y = 50.0
    for step in (_listed, _planned, _read, _batched):
        lines, y = step(readers, y)
        body += lines
    body.append(
        text(16, y, "A cell is a record: its colour the shard, its number the record in the shard. Every "
                    "record is read once; a batch's samples are", size=11, fill="#555")
    )  # fmt: skip
    body.append(
        text(16, y + 15, "drawn here by worker, MixedLoader places them by a seeded hash. "
                         "Drawn from plan() for 2 ranks x 2 workers.", size=11, fill="#555")
    )  # fmt: skip
    return document(_WIDTH, y + 26, body, "shardkit: from a glob to a batch")


def _listed(readers: Readers, y: float) -> tuple[list[str], float]:
    body = _step(y, "1  list", '"data/train-*.tfrecord", listed once per job: 4 shards and their record counts')
    x = _LEFT
    for shard, count in enumerate(PATH_COUNTS):
        body += _cells(x, y + 26, [(shard, i) for i in range(count)])
        body.append(text(x, y + 70, f"shard {shard}: {count}", size=11, fill="#444"))
        x += count * _CELL + 14
    return body, y + 96


def _planned(readers: Readers, y: float) -> tuple[list[str], float]:
    note = "plan(): the shards end to end in one stream, cut into equal chunks per rank, then per worker"
    body = _step(y, "2  plan", note)
    body += _cells(_LEFT, y + 26, [(shard, i) for shard, count in enumerate(PATH_COUNTS) for i in range(count)])
    at = _LEFT
    for (rank, worker), ranges in readers.items():
        size = sum(r.stop - r.start for r in ranges)
        hue = RANK_HUES[rank]
        body.append(rect(at + 1, y + 62, size * _CELL - 4, 5, hue))
        label = f"rank {rank} worker {worker}"
        body.append(text(at + size * _CELL / 2, y + 80, label, size=11, anchor="middle", fill=hue))
        at += size * _CELL
    return body, y + 106


def _read(readers: Readers, y: float) -> tuple[list[str], float]:
    note = "each DataLoader worker of each DDP rank reads its own ranges, sequentially: no duplicates"
    body = _step(y, "3  read", note)
    x = _LEFT
    for (rank, worker), ranges in readers.items():
        records = _records(ranges)
        body += _boxed(x, y, rank, records)
        body.append(text(x - 4, y + 74, f"rank {rank} worker {worker}", size=10, fill="#444"))
        where = ", ".join(f"shard {r.shard}[{r.start}:{r.stop}]" for r in ranges)
        body.append(text(x - 4, y + 87, where, size=10, fill="#444"))
        x += len(records) * _CELL + _GAP
    return body, y + 106


def _batched(readers: Readers, y: float) -> tuple[list[str], float]:
    note = f"MixedLoader, batch_size={PATH_BATCH}: every batch takes an equal share from every worker of its rank"
    body = _step(y, "4  batch", note)
    x = _LEFT
    share = PATH_BATCH // PATH_WORKERS
    for rank in range(PATH_WORLD):
        for batch in range(2):
            records = [
                record
                for worker in range(PATH_WORKERS)
                for record in _records(readers[(rank, worker)])[batch * share : (batch + 1) * share]
            ]
            body += _boxed(x, y, rank, records)
            body.append(text(x - 4, y + 74, f"rank {rank}, batch {batch}", size=10, fill="#444"))
            x += len(records) * _CELL + _GAP
    return body, y + 92


def _boxed(x: float, y: float, rank: int, records: list[tuple[int, int]]) -> list[str]:
    """``records`` as cells in a box of the rank's hue."""
    frame = f' stroke="{RANK_HUES[rank]}" stroke-width="2" rx="4"'
    return [rect(x - 4, y + 20, len(records) * _CELL + 8, _CELL + 12, "none", extra=frame), *_cells(x, y + 26, records)]


def _records(ranges: list[Any]) -> list[tuple[int, int]]:
    return [(r.shard, i) for r in ranges for i in range(r.start, r.stop)]


def _step(y: float, title: str, note: str) -> list[str]:
    return [
        text(16, y + 46, title, size=13, weight="bold"),
        text(150, y + 12, note, size=12, fill="#333"),
        line(16, y - 6, _WIDTH - 16, y - 6, "#eee"),
    ]


def _cells(x: float, y: float, records: list[tuple[int, int]]) -> list[str]:
    out = []
    for k, (shard, index) in enumerate(records):
        fill = SHARD_HUES[shard % len(SHARD_HUES)]
        out.append(rect(x + k * _CELL, y, _CELL - 2, _CELL - 2, fill, {"shard": shard, "record": index}))
        centre = x + k * _CELL + (_CELL - 2) / 2
        out.append(text(centre, y + _CELL / 2 + 3, str(index), size=11, anchor="middle", fill=text_colour(fill)))
    return out


def all_pictures() -> dict[str, str]:
    """Every picture this script makes: file name -> SVG text."""
    pictures = {name: plan_picture_by_command(arguments) for name, arguments in PLAN_PICTURES.items()}
    pictures["path.svg"] = path_picture()
    return pictures


def main() -> int:
    DOCS_PICTURES.mkdir(exist_ok=True)
    for name, svg in all_pictures().items():
        write_atomic(str(DOCS_PICTURES / name), svg)
        print(f"wrote {DOCS_PICTURES / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
