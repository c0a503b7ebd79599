"""The plan as a picture: which records of each shard each (rank, worker) reads.

``shardkit plan SOURCE --picture plan.svg`` draws one bar per shard, its length
the shard's record count, cut where the readers' ranges begin and end and
coloured by reader (a hue per rank, lighter for each further worker). Records
a reader reads a second time under ``balance="pad"`` are drawn again in a thin
hatched lane under the bar; records no one reads under ``balance="drop"`` are
grey and hatched in the bar itself.

The segments come from :func:`~shardkit.planning.plan` itself, called for every
reader as the readers call it, so the picture cannot drift from what is read:
each ``<rect>`` carries ``data-rank``, ``data-worker``, ``data-order`` (the
range's place in the reader's reading order), ``data-shard``, ``data-start``,
``data-stop`` and ``data-kind`` (``read``, ``pad`` or ``drop``), which is how
the tests read the plan back out of the picture.

A range is padding when its place in the global stream is at or past the
stream's end (:func:`~shardkit.planning.rank_span` wraps those positions round
to its start); dropped records are those no reader's range covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardkit.cli.svg import document, line, reader_colour, rect, text, text_colour

#: Shards drawn at most; a note says how many more the plan has (the printed table lists every reader).
MAX_SHARDS = 100
#: Readers given a swatch each at most (else one per rank), and ranks at most.
MAX_LEGEND_READERS, MAX_LEGEND_RANKS = 24, 24
_LEFT, _BAR_WIDTH, _BAR, _PAD_LANE, _GAP = 16, 640, 20, 13, 8


@dataclass(frozen=True)
class Segment:
    """Records ``[start, stop)`` of ``shard``: read by ``(rank, worker)`` as its ``order``-th range, or dropped."""

    kind: str  # "read", "pad" or "drop"
    shard: int
    start: int
    stop: int | None
    rank: int | None = None
    worker: int | None = None
    order: int | None = None


def plan_segments(counts: np.ndarray, world_size: int, num_workers: int, **options: Any) -> list[Segment]:
    """Every reader's ranges from :func:`plan`, each marked read or pad, then the dropped records.

    ``counts`` holds -1 for an unknown count (then every range is a whole shard, ``stop`` None)."""
    from shardkit.planning import plan, rank_span, worker_span
    from shardkit.topology import Topology

    known = bool((counts >= 0).all())
    total = int(counts.sum()) if known else 0
    balance = options.get("balance", "pad")
    segments: list[Segment] = []
    for rank in range(world_size):
        rank_start, rank_size = rank_span(total, world_size, rank, balance) if known else (0, 0)
        for worker in range(num_workers):
            position = rank_start + worker_span(rank_size, num_workers, worker)[0]
            topology = Topology(rank, world_size, worker, num_workers)
            counts_in = counts if known else [None if c < 0 else int(c) for c in counts]
            for order, piece in enumerate(plan(counts_in, topology, **options)):
                who = {"rank": rank, "worker": worker, "order": order}
                if piece.stop is None:
                    segments.append(Segment("read", piece.shard, piece.start, None, **who))
                    continue
                # Positions at or past the stream's end are the repeats (a range never crosses it: the
                # stream cuts its ranges there; split anyway rather than trust it).
                first = min(max(total - position, 0), piece.stop - piece.start)
                if first:
                    segments.append(Segment("read", piece.shard, piece.start, piece.start + first, **who))
                if piece.start + first < piece.stop:
                    segments.append(Segment("pad", piece.shard, piece.start + first, piece.stop, **who))
                position += piece.stop - piece.start
    return segments + (_dropped(counts, segments) if known else [])


def _dropped(counts: np.ndarray, segments: Sequence[Segment]) -> list[Segment]:
    """The records of each shard that no reader's range covers."""
    covered: dict[int, list[tuple[int, int]]] = {}
    for segment in segments:
        if segment.stop is not None:
            covered.setdefault(segment.shard, []).append((segment.start, segment.stop))
    out = []
    for shard, count in enumerate(counts.tolist()):
        at = 0
        for start, stop in sorted(covered.get(shard, [])):
            if start > at:
                out.append(Segment("drop", shard, at, start))
            at = max(at, stop)
        if at < count:
            out.append(Segment("drop", shard, at, count))
    return out


def plan_picture(counts: np.ndarray, labels: Sequence[str], world_size: int, num_workers: int, **options: Any) -> str:
    """The SVG text of the plan's picture (see the module docstring). ``labels`` names each shard."""
    segments = plan_segments(counts, world_size, num_workers, **options)
    by_shard: dict[int, list[Segment]] = {}
    for segment in segments:
        by_shard.setdefault(segment.shard, []).append(segment)
    known = bool((counts >= 0).all())
    shown = min(len(counts), MAX_SHARDS)
    label_width = min(max((len(label) for label in labels[:shown]), default=8) * 6.6 + 100, 330)  # + the count
    bar_left = _LEFT + label_width
    width = bar_left + _BAR_WIDTH + _LEFT
    headline = (
        f"{len(counts):,} shards, {f'{int(counts.sum()):,}' if known else 'unknown'} records; "
        f"world_size={world_size}, num_workers={num_workers}, "
        + ", ".join(f"{key}={value}" for key, value in options.items())
    )
    body = [text(_LEFT, 24, "Who reads what", size=16, weight="bold"), text(_LEFT, 44, headline, size=12)]
    legend, y = _legend(segments, world_size, num_workers, width, 66)
    body += legend
    scale = _BAR_WIDTH / max(int(counts[:shown].max()) if known and shown else 1, 1)
    for shard in range(shown):
        mine = by_shard.get(shard, [])
        rows, y = _shard_row(mine, shard, labels[shard], int(counts[shard]), bar_left, scale, y, num_workers)
        body += rows
    if len(counts) > shown:
        body.append(
            text(
                _LEFT,
                y + 14,
                f"... and {len(counts) - shown} more shards, not drawn "
                f"(the first {shown} are); `shardkit plan` prints every reader's ranges",
                size=12,
                fill="#555",
            )
        )
        y += 24
    return document(width, y + 10, body, f"shardkit plan: {headline}")


def _legend(
    segments: Sequence[Segment], world_size: int, num_workers: int, width: float, y: float
) -> tuple[list[str], float]:
    """A swatch per reader with its record count, then what the hatching means."""
    totals: dict[tuple[int, int], int] = {}
    for segment in segments:
        if segment.rank is not None and segment.worker is not None:
            key = (segment.rank, segment.worker)
            totals[key] = totals.get(key, 0) + (segment.stop - segment.start if segment.stop is not None else 0)
    entries = _reader_entries(totals, world_size, num_workers)
    kinds = {segment.kind for segment in segments}
    if "pad" in kinds:
        entries.append(("#bbb", True, "padding: read again"))
    if "drop" in kinds:
        entries.append(("#ddd", True, "dropped: read by none"))
    out, x, column = [], float(_LEFT), 250
    for fill, hatched, label in entries:
        if x + column > width:
            x, y = _LEFT, y + 20
        out.append(rect(x, y - 11, 14, 14, fill))
        if hatched:
            out.append(rect(x, y - 11, 14, 14, "url(#hatch)"))
        out.append(text(x + 20, y, label, size=12))
        x += column
    return out, y + 26


def _reader_entries(
    totals: dict[tuple[int, int], int], world_size: int, num_workers: int
) -> list[tuple[str, bool, str]]:
    """A swatch per reader; for many readers one per rank (its workers are lighter shades of it)."""
    ranks = range(min(world_size, MAX_LEGEND_RANKS))
    if world_size * num_workers <= MAX_LEGEND_READERS:
        return [
            (reader_colour(r, w, num_workers), False, f"rank {r} worker {w}: {totals.get((r, w), 0):,} records")
            for r in ranks
            for w in range(num_workers)
        ]
    entries = [
        (reader_colour(r, 0, num_workers), False,
         f"rank {r}: {sum(totals.get((r, w), 0) for w in range(num_workers)):,} records")
        for r in ranks
    ]  # fmt: skip
    if world_size > MAX_LEGEND_RANKS:
        entries.append(("#fff", False, f"... and {world_size - MAX_LEGEND_RANKS} more ranks"))
    return entries


def _shard_row(
    mine: Sequence[Segment],
    shard: int,
    label: str,
    count: int,
    bar_left: float,
    scale: float,
    y: float,
    num_workers: int,
) -> tuple[list[str], float]:
    """One shard: its label, its bar of first reads and drops, and under it the lane of repeats if any."""
    count_text = "count unknown" if count < 0 else f"{count:,} records"
    out = [
        text(_LEFT, y + 14, _shortened(label), size=12),
        text(bar_left - 8, y + 14, count_text, size=11, anchor="end", fill="#555"),
    ]
    if count >= 0:
        out.append(rect(bar_left, y, count * scale, _BAR, "#f4f4f4"))
    lane_y = y + _BAR + 2
    for segment in mine:
        start = segment.start * scale
        stop = _BAR_WIDTH if segment.stop is None else segment.stop * scale
        top, height = (lane_y, _PAD_LANE) if segment.kind == "pad" else (y, _BAR)
        out += _segment_rects(segment, bar_left + start, top, stop - start, height, num_workers)
    pads = any(segment.kind == "pad" for segment in mine)
    bottom = lane_y + (_PAD_LANE if pads else 0)
    out.append(line(_LEFT, bottom + _GAP / 2, bar_left + _BAR_WIDTH, bottom + _GAP / 2, "#eee"))
    return out, bottom + _GAP


def _segment_rects(segment: Segment, x: float, y: float, width: float, height: float, num_workers: int) -> list[str]:
    data: dict[str, object] = {
        "kind": segment.kind,
        "shard": segment.shard,
        "start": segment.start,
        "stop": "" if segment.stop is None else segment.stop,
    }
    if segment.rank is not None and segment.worker is not None:
        data.update(rank=segment.rank, worker=segment.worker, order=segment.order)
        fill = reader_colour(segment.rank, segment.worker, num_workers)
    else:
        fill = "#ddd"
    size = "" if segment.stop is None else f" [{segment.start}:{segment.stop}]"
    who = "dropped" if segment.rank is None else f"rank {segment.rank} worker {segment.worker}"
    title = f"{who}{' (padding)' if segment.kind == 'pad' else ''}: shard {segment.shard}{size}"
    out = [rect(x, y, width, height, fill, data, title=title, extra=' stroke="#fff" stroke-width="0.5"')]
    if segment.kind != "read":
        width = max(width, 3)  # a repeat or a drop of one record among thousands still shows
        out[0] = rect(x, y, width, height, fill, data, title=title, extra=' stroke="#fff" stroke-width="0.5"')
        out.append(rect(x, y, width, height, "url(#hatch)"))
    label = f"r{segment.rank}w{segment.worker}"
    if segment.kind == "read" and width >= 38:
        out.append(text(x + width / 2, y + 14, label, size=11, anchor="middle", fill=text_colour(fill)))
    elif segment.kind == "pad":
        out.append(text(x + width + 4, y + 10, f"{label} reads [{segment.start}:{segment.stop}] again", size=10))
    return out


def _shortened(label: str, keep: int = 40) -> str:
    """A long url cut from the left (its end names the shard)."""
    return label if len(label) <= keep else "…" + label[-(keep - 1) :]
