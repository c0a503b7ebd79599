"""Benchmark tables as charts (matplotlib, a ``bench``/``dev`` extra: never a shardkit dependency).

Two uses:

- ``python benchmarks/charts.py`` draws the charts BENCHMARKS.md shows, into
  ``docs/pictures/bench-*.svg``, **from the numbers BENCHMARKS.md states**
  (its markdown tables, read back here): a chart is only as current as the
  run the table quotes, and says so in its caption. ``tests/test_pictures.py``
  draws them again and fails when a committed chart no longer matches its
  table.
- A benchmark script's ``--chart OUT.svg`` draws the table it has just
  printed, with :func:`table_chart`, the same function.

The SVG is deterministic (no date, fixed ids: ``svg.hashsalt``; text kept as
text), so the same table draws the same bytes with the pinned matplotlib.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


@dataclass(frozen=True)
class Chart:
    """A chart of one BENCHMARKS.md table: which section, which columns, what it says."""

    file: str
    section: str  # the start of the section's heading, after "## "
    columns: tuple[str, ...]  # headers of the columns drawn, one bar each per row
    title: str
    xlabel: str
    log: bool = False
    names: tuple[str, ...] = ()  # the legend's name of each column (default: its header)


CHARTS = (
    Chart(
        "bench-compare.svg", "End to end", ("samples/s", "labels as list: samples/s"),
        "End to end: samples/s through a DataLoader (2 workers, batch 64)", "samples/s (higher is faster)",
        names=("labels as a tensor", "labels as a Python list"),
    ),
    Chart(
        "bench-mixing.svg", "MixedLoader against a plain DataLoader",
        ("DataLoader samples/s", "MixedLoader samples/s"),
        "MixedLoader against a plain DataLoader", "samples/s, log scale (higher is faster)", log=True,
    ),
    Chart(
        "bench-formats.svg", "Formats", ("ratio",),
        "Formats: shardkit's rate over the alternative's, same run", "times as fast (1 = as fast)",
    ),
    Chart(
        "bench-shuffle.svg", "Shuffle quality", ("entropy vs uniform",),
        "Shuffle quality: entropy of the jumps between neighbours", "share of a uniform permutation's (1 = uniform)",
    ),
)  # fmt: skip


def markdown_table(lines: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the first markdown table in ``lines``."""
    rows: list[list[str]] = []
    for line in lines:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    if len(rows) < 3:
        raise ValueError("no markdown table (a header, a --- line and rows) in the lines given")
    return rows[0], [row for row in rows[2:]]


def number(cell: str) -> float | None:
    """The first number in a cell: ``101,589``, ``4.20x``, ``0.05%``, ``WebDataset 12,249/s``; None if none."""
    found = re.search(r"-?\d[\d,]*(?:\.\d+)?", cell.replace("**", ""))
    return float(found.group().replace(",", "")) if found else None


def section_lines(text: str, section: str) -> list[str]:
    """The lines of the ``## section...`` of a markdown text, up to the next ``## ``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"## {section}")), None)
    if start is None:
        raise ValueError(f"no section starting '## {section}' in BENCHMARKS.md")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def table_chart(
    lines: Sequence[str],
    columns: Sequence[str],
    *,
    title: str,
    xlabel: str,
    caption: str,
    log: bool = False,
    names: Sequence[str] = (),
) -> str:
    """The SVG text of a horizontal bar chart of ``columns`` of the markdown table in ``lines``, one
    group of bars per row, labelled by the row's first cell (rows without a number are left out)."""
    header, rows = markdown_table(lines)
    missing = [column for column in columns if column not in header]
    if missing:
        raise ValueError(f"no column {missing} in the table (its columns: {header})")
    indexes = [header.index(column) for column in columns]
    labels, values, texts = [], [], []
    for row in rows:
        cells = [row[i].replace("**", "") if i < len(row) else "" for i in indexes]
        row_values = [number(cell) for cell in cells]
        if any(value is not None for value in row_values):
            labels.append(row[0].replace("`", ""))
            values.append([value or 0.0 for value in row_values])
            texts.append(cells)
    series = list(names or columns)
    return _bars(labels, values, texts, series, title=title, xlabel=xlabel, caption=caption, log=log)


def _bars(
    labels: list[str],
    values: list[list[float]],
    texts: list[list[str]],
    series: list[str],
    *,
    title: str,
    xlabel: str,
    caption: str,
    log: bool,
) -> str:
    """Grouped horizontal bars, each labelled with its table cell as written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    with matplotlib.rc_context({"svg.hashsalt": "shardkit", "svg.fonttype": "none", "font.size": 9}):
        height = 0.9 + 0.32 * len(labels) * max(len(series), 1.5)
        figure, axes = plt.subplots(figsize=(8.5, height))
        bar = 0.8 / len(series)
        for k, name in enumerate(series):
            positions = [i + (k - (len(series) - 1) / 2) * bar for i in range(len(labels))]
            drawn = axes.barh(
                positions, [row[k] for row in values], height=bar, color=COLOURS[k % len(COLOURS)], label=name
            )
            axes.bar_label(drawn, labels=[row[k] for row in texts], padding=3, fontsize=8)
        axes.set_yticks(range(len(labels)), labels)
        axes.invert_yaxis()  # the table's order, top to bottom
        if log:
            axes.set_xscale("log")
        else:
            axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}" if x >= 100 else f"{x:g}"))
        axes.set_xlabel(xlabel)
        figure.suptitle(title, x=0.01, ha="left", fontsize=11, fontweight="bold")
        axes.margins(x=0.15)
        for side in ("top", "right"):
            axes.spines[side].set_visible(False)
        if len(series) > 1:
            axes.legend(loc="lower right", frameon=False)
        figure.text(0.01, 0.01, caption, fontsize=8, color="#555", wrap=True)
        figure.tight_layout(rect=(0, 0.06, 1, 1))
        out = io.StringIO()
        figure.savefig(out, format="svg", metadata={"Date": None, "Creator": "shardkit benchmarks/charts.py"})
        plt.close(figure)
    return out.getvalue()


def benchmarks_charts(text: str) -> dict[str, str]:
    """Every chart of :data:`CHARTS`, drawn from the BENCHMARKS.md ``text``: file name -> SVG text."""
    caption = "From the table in BENCHMARKS.md (its run, load and commit are stated there); drawn, not re-run."
    return {
        chart.file: table_chart(
            section_lines(text, chart.section),
            chart.columns,
            title=chart.title,
            xlabel=chart.xlabel,
            caption=caption,
            log=chart.log,
            names=chart.names,
        )
        for chart in CHARTS
    }


def write_svg(path: str | Path, svg: str) -> None:
    """Write ``svg`` to ``path`` atomically (a temporary file beside it, renamed)."""
    partial = f"{path}.partial-{os.getpid()}"
    with open(partial, "w", encoding="utf-8", newline="\n") as file:
        file.write(svg)
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--benchmarks", default=str(REPO / "BENCHMARKS.md"), help="the tables to draw")
    parser.add_argument("--out", default=str(REPO / "docs" / "pictures"), help="folder of the charts")
    args = parser.parse_args(argv)
    for name, svg in benchmarks_charts(Path(args.benchmarks).read_text(encoding="utf-8")).items():
        write_svg(Path(args.out) / name, svg)
        print(f"wrote {Path(args.out) / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
