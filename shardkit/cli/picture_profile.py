"""Where a pipeline's time goes, as a picture: ``shardkit profile ... --picture profile.svg``.

Two parts, both from the run ``shardkit profile`` made:

- **The bars**: the main process's loop split into waiting for batches and the
  time between them (what the training step would use), then each worker's wall
  time split into its stages (read, each map, collate, state) and idle (its
  prefetch was full: the main process did not ask). From the loader's
  :class:`~shardkit.loader.stalls.LoaderStats`, the figures the text report
  prints.
- **The timeline**: the same spans over time, one lane for the main process and
  one per stage of each worker, from the Chrome trace the loader recorded
  (:func:`~shardkit.loader.stalls.chrome_trace`, what ``--trace`` writes for
  Perfetto), readable without it. A pixel column's colour is as strong as the
  share of its time spent in the stage, so a long run of short spans stays a
  small file and a rare stage does not look like a busy one.

A pure function of the trace and the stats: the same run draws the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any
from xml.sax.saxutils import quoteattr

from shardkit.cli.svg import document, line, rect, text, text_colour

_LEFT, _LABEL, _WIDTH, _LANE, _BAR = 16, 190, 700, 14, 18
WAIT, COMPUTE, IDLE, OTHER = "#d62728", "#9e9e9e", "#e8e8e8", "#f6f6f6"
#: Stage colours in the order stages first appear (read, maps, collate, state); none of them red or grey.
STAGE_COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#bcbd22", "#8c564b", "#e377c2")


def profile_picture(trace: dict[str, Any], stats: Any, headline: str, bound: str) -> str:
    """The SVG text of a profile (see the module docstring)."""
    lanes, spans = _lanes(trace)
    colours = _stage_colours([*stats.stages, *sorted({name for lane in spans.values() for _, _, name in lane})])
    width = _LEFT + _LABEL + _WIDTH + _LEFT
    body = [
        text(_LEFT, 24, "Where the time goes", size=16, weight="bold"),
        text(_LEFT, 44, headline, size=12),
        text(_LEFT, 62, f"bound: {bound}", size=12, weight="bold"),
    ]
    bars, y = _bars(stats, colours, 84)
    body += bars
    timeline, y = _timeline(lanes, spans, colours, y + 10)
    body += timeline
    return document(width, y + 10, body, f"shardkit profile: {headline}")


def _stage_colours(names: Sequence[str]) -> dict[str, str]:
    colours: dict[str, str] = {"wait": WAIT, "compute": COMPUTE, "idle": IDLE, "other": OTHER}
    for name in names:
        if name not in colours:
            colours[name] = STAGE_COLOURS[(len(colours) - 4) % len(STAGE_COLOURS)]
    return colours


def _bars(stats: Any, colours: dict[str, str], y: float) -> tuple[list[str], float]:
    """The main loop's wait against compute, then each worker's stages against idle."""
    out = [text(_LEFT, y, "share of the wall time", size=13, weight="bold")]
    y += 10
    loop = stats.wait_seconds + stats.compute_seconds
    rows = [("main process", [("wait", stats.wait_seconds), ("compute", stats.compute_seconds)], loop)]
    for worker in stats.workers:
        parts = sorted(worker.stages.items(), key=lambda item: -item[1]) + [("idle", worker.idle_seconds)]
        # Start-up and the time between measured spans: the bar still adds up to the worker's wall time.
        parts.append(("other", max(worker.elapsed_seconds - sum(seconds for _, seconds in parts), 0.0)))
        rows.append((f"worker {worker.worker}", parts, worker.elapsed_seconds))
    for label, parts, whole in rows:
        out.append(text(_LEFT, y + 13, label, size=12))
        x = _LEFT + _LABEL
        for name, seconds in parts:
            share = seconds / whole if whole > 0 else 0.0
            w = min(share, 1.0) * _WIDTH
            data = {"part": name, "seconds": f"{seconds:.6f}", "share": f"{share:.4f}", "row": label}
            out.append(rect(x, y, w, _BAR, colours[name], data, title=f"{label}: {name} {seconds:.3f} s ({share:.0%})"))
            if w >= 70:
                out.append(text(x + 4, y + 13, f"{name} {share:.0%}", size=11, fill=text_colour(colours[name])))
            x += w
        y += _BAR + 6
    legend, y = _legend(colours, y + 8)
    return out + legend, y + 22


def _legend(colours: dict[str, str], y: float) -> tuple[list[str], float]:
    out, x = [], float(_LEFT + _LABEL)
    for name, colour in colours.items():
        step = 22 + 6.5 * len(name) + 12
        if x + step > _LEFT + _LABEL + _WIDTH:
            x, y = _LEFT + _LABEL, y + 18
        out.append(rect(x, y - 10, 12, 12, colour, extra=' stroke="#ccc" stroke-width="0.5"'))
        out.append(text(x + 16, y, name, size=11))
        x += step
    return out, y


def _lanes(
    trace: dict[str, Any],
) -> tuple[list[tuple[int, int, str]], dict[tuple[int, int], list[tuple[float, float, str]]]]:
    """The lanes ``(pid, tid, label)`` in the trace's order and each lane's spans ``(start, duration, name)``."""
    processes: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    order: dict[tuple[int, int], int] = {}
    spans: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for event in trace.get("traceEvents", []):
        key = (int(event.get("pid", 0)), int(event.get("tid", 0)))
        if event.get("ph") == "M":
            args = event.get("args", {})
            if event["name"] == "process_name":
                processes[key[0]] = str(args.get("name"))
            elif event["name"] == "thread_name":
                threads[key] = str(args.get("name"))
            elif event["name"] == "thread_sort_index":
                order[key] = int(args.get("sort_index", 0))
        elif event.get("ph") == "X":
            spans.setdefault(key, []).append((float(event["ts"]), float(event["dur"]), str(event["name"])))
    keys = sorted(set(threads) | set(spans), key=lambda k: (k[0], order.get(k, k[1])))
    lanes = [(pid, tid, threads.get((pid, tid), f"thread {tid}")) for pid, tid in keys]
    labels = [(pid, tid, f"{processes.get(pid, f'process {pid}')}: {name}") for pid, tid, name in lanes]
    return labels, spans


def _timeline(
    lanes: Sequence[tuple[int, int, str]],
    spans: dict[tuple[int, int], list[tuple[float, float, str]]],
    colours: dict[str, str],
    y: float,
) -> tuple[list[str], float]:
    """The spans over time, one lane each, with a seconds axis."""
    end = max((start + duration for lane in spans.values() for start, duration, _ in lane), default=0.0)
    out = [
        text(
            _LEFT,
            y + 12,
            "timeline (a colour's strength: the share of that moment the lane spent there)",
            size=13,
            weight="bold",
        )
    ]
    y += 24
    left = _LEFT + _LABEL
    for pid, tid, label in lanes:
        out.append(text(_LEFT, y + 11, label, size=11))
        out.append(f"<g data-lane={quoteattr(label)}>")
        out.append(rect(left, y, _WIDTH, _LANE, "#fafafa"))
        for first, stop, name, share in _occupancy(spans.get((pid, tid), []), end):
            colour = colours.get(name, STAGE_COLOURS[0])
            out.append(
                rect(left + first, y, stop - first, _LANE, colour, {"span": name}, extra=f' fill-opacity="{share:g}"')
            )
        out.append("</g>")
        y += _LANE + 3
    out += _axis(left, y + 2, end / 1e6)
    return out, y + 30


def _occupancy(spans: Sequence[tuple[float, float, str]], end: float) -> list[tuple[int, int, str, float]]:
    """Each name's share of each pixel column's time, as runs ``(first, last + 1, name, share)``.

    A span is often much shorter than a pixel (a stage's micro-batch takes
    microseconds, a pixel of a 10 s run 14 ms): a column's colour is as strong
    as the share of its time the lane spent in that span's name, tenths
    rounded up so that a short span still shows. The file stays bounded by the
    picture's width, however long the run.
    """
    per_pixel = end / _WIDTH if end > 0 else 1.0
    shares: dict[str, list[float]] = {}
    for start, duration, name in spans:
        column = shares.setdefault(name, [0.0] * _WIDTH)
        first, last = start / per_pixel, (start + duration) / per_pixel  # in pixels
        if int(first) == int(last) or int(first) >= _WIDTH - 1:
            column[min(int(first), _WIDTH - 1)] += last - first
            continue
        column[int(first)] += int(first) + 1 - first
        for pixel in range(int(first) + 1, min(int(last), _WIDTH)):
            column[pixel] += 1.0
        if int(last) < _WIDTH:
            column[int(last)] += last - int(last)
    runs: list[tuple[int, int, str, float]] = []
    for name in sorted(shares):
        # Tenths, rounded up (less a float's residue, which would mark an empty pixel).
        levels = [min(math.ceil(share * 10 - 1e-6), 10) / 10 for share in shares[name]]
        first = 0
        for pixel in range(1, _WIDTH + 1):
            if pixel == _WIDTH or levels[pixel] != levels[first]:
                if levels[first] > 0:
                    runs.append((first, pixel, name, levels[first]))
                first = pixel
    return runs


def _axis(left: float, y: float, seconds: float) -> list[str]:
    out = [line(left, y, left + _WIDTH, y, "#666")]
    if seconds <= 0:
        return out
    step = next(
        s for s in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1e9) if seconds / s <= 10
    )
    tick = 0.0
    while tick <= seconds + 1e-9:
        x = left + tick / seconds * _WIDTH
        out.append(line(x, y, x, y + 4, "#666"))
        out.append(text(x, y + 16, f"{tick:g} s", size=10, anchor="middle", fill="#444"))
        tick = round(tick + step, 6)
    return out
