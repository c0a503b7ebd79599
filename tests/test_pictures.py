"""The docs' pictures are current and shown: each one the project's code draws is drawn again here and
compared byte for byte with the committed file (``python docs/_ext/pictures.py`` and
``python benchmarks/charts.py`` write them); the profile picture, from a real run, is checked for what
the command draws; every picture is shown on a page."""

from __future__ import annotations

import re
import runpy
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.processes import REPO

PICTURES = REPO / "docs" / "pictures"
SVG = "{http://www.w3.org/2000/svg}"


def rects(path: Path) -> list[dict[str, str]]:
    return [node.attrib for node in ET.parse(path).getroot().iter(f"{SVG}rect")]


def test_the_plan_pictures_and_the_path_diagram_are_what_the_code_draws_today():
    script = runpy.run_path(str(REPO / "docs" / "_ext" / "pictures.py"))
    drawn = script["all_pictures"]()
    assert set(drawn) == {"plan-pad.svg", "plan-drop-shuffle.svg", "path.svg"}
    for name, svg in drawn.items():
        assert (PICTURES / name).read_text(encoding="utf-8") == svg, (
            f"docs/pictures/{name} is stale: run `python docs/_ext/pictures.py` and commit it"
        )


def test_the_benchmark_charts_are_drawn_from_the_tables_benchmarks_md_states():
    charts = runpy.run_path(str(REPO / "benchmarks" / "charts.py"))
    drawn = charts["benchmarks_charts"]((REPO / "BENCHMARKS.md").read_text(encoding="utf-8"))
    assert set(drawn) == {"bench-compare.svg", "bench-mixing.svg", "bench-formats.svg", "bench-shuffle.svg"}
    for name, svg in drawn.items():
        assert (PICTURES / name).read_text(encoding="utf-8") == svg, (
            f"docs/pictures/{name} no longer matches BENCHMARKS.md: run `python benchmarks/charts.py` and commit it"
        )


def test_a_chart_labels_each_bar_with_its_table_cell_and_leaves_out_rows_without_numbers():
    charts = runpy.run_path(str(REPO / "benchmarks" / "charts.py"))
    table = [
        "| case | rate | ratio |",
        "|---|---:|---:|",
        "| a `x` | 1,234/s | **2.50x** |",
        "| b | | - |",
        "| c | 99 | 0.50x |",
    ]
    svg = charts["table_chart"](table, ["rate", "ratio"], title="t", xlabel="x", caption="c")
    labels = re.findall(r">([^<>]+)</text>", svg)
    assert {"1,234/s", "2.50x", "99", "0.50x", "a x", "c"} <= set(labels) and "b" not in labels
    with pytest.raises(ValueError, match="no column"):
        charts["table_chart"](table, ["speed"], title="t", xlabel="x", caption="c")


def test_the_path_diagram_draws_every_record_once_at_each_step():
    cells = Counter(
        (rect["data-shard"], rect["data-record"]) for rect in rects(PICTURES / "path.svg") if "data-record" in rect
    )
    counts = [5, 3, 4, 4]  # docs/_ext/pictures.py's PATH_COUNTS
    assert cells == Counter({(str(shard), str(i)): 4 for shard, count in enumerate(counts) for i in range(count)})


def test_the_profile_picture_in_the_docs_is_a_real_run_of_the_command():
    path = PICTURES / "profile.svg"
    root = ET.parse(path).getroot()
    title = root.find(f"{SVG}title")
    assert title is not None and re.match(r"shardkit profile: [\d,]+ samples in [\d,]+ batches", title.text or "")
    bars = [rect for rect in rects(path) if "data-part" in rect]
    assert {rect["data-row"] for rect in bars} == {"main process", "worker 0", "worker 1"}
    for row in ("main process", "worker 0", "worker 1"):
        assert sum(float(rect["data-share"]) for rect in bars if rect["data-row"] == row) == pytest.approx(1, abs=0.01)
    text = path.read_text(encoding="utf-8")
    assert "bound: a map: map(augment)" in text  # docs/performance.md says so
    lanes = re.findall(r'<g data-lane="([^"]+)">', text)
    assert lanes[0] == "main process: loop" and {"worker 0: map(augment)", "worker 1: map(augment)"} <= set(lanes)


def shown_pictures() -> set[str]:
    pages = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
    return {
        Path(target).name for page in pages for target in re.findall(r"!\[[^\]]*\]\(([^)]+\.svg)\)", page.read_text())
    }


def test_every_picture_is_shown_on_a_page():
    committed = {path.name for path in PICTURES.glob("*.svg")}
    assert committed and committed <= shown_pictures()


@pytest.mark.parametrize(
    ("page", "target"), [("README.md", "docs/pictures/path.svg"), ("docs/index.md", "pictures/path.svg")]
)
def test_the_path_diagram_is_on_the_first_screen(page, target):
    lines = (REPO / page).read_text().splitlines()
    images = [i for i, line in enumerate(lines) if line.startswith("![")]
    assert images and images[0] < 8 and lines[images[0]].endswith(f"]({target})")
    assert (REPO / page).parent.joinpath(target).is_file()
