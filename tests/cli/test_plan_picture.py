"""``shardkit plan --picture``: the picture shows exactly the plan, repeats and drops marked, and a path it
cannot write is one error line before anything is planned."""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit
from shardkit import Topology, plan
from shardkit.cli.picture_plan import MAX_SHARDS, plan_picture
from tests.helpers.cli import run_cli
from tests.helpers.examples import examples

SVG = "{http://www.w3.org/2000/svg}"


def drawn_segments(svg: str) -> list[dict[str, str]]:
    """The ``data-*`` attributes of every rect that stands for records."""
    root = ET.fromstring(svg)
    return [
        {key[5:]: value for key, value in node.attrib.items() if key.startswith("data-")}
        for node in root.iter(f"{SVG}rect")
        if "data-kind" in node.attrib
    ]


def drawn_plans(svg: str) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """{(rank, worker): its ranges in reading order}, read back out of the picture (a range drawn as a
    first read and a repeat is joined again)."""
    pieces: dict[tuple[int, int], dict[int, list[tuple[int, int, int]]]] = {}
    for seg in drawn_segments(svg):
        if seg["kind"] == "drop":
            continue
        by_order = pieces.setdefault((int(seg["rank"]), int(seg["worker"])), {})
        by_order.setdefault(int(seg["order"]), []).append((int(seg["shard"]), int(seg["start"]), int(seg["stop"])))
    plans = {}
    for reader, by_order in pieces.items():
        joined = []
        for order in sorted(by_order):
            parts = sorted(by_order[order], key=lambda part: part[1])
            joined.append((parts[0][0], parts[0][1], parts[-1][2]))
        plans[reader] = joined
    return plans


def cover(svg: str, kinds: tuple[str, ...], counts: list[int]) -> np.ndarray:
    """How many times the picture's segments of ``kinds`` cover each record, in shard order."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    out = np.zeros(int(offsets[-1]), dtype=int)
    for seg in drawn_segments(svg):
        if seg["kind"] in kinds:
            shard = int(seg["shard"])
            out[offsets[shard] + int(seg["start"]) : offsets[shard] + int(seg["stop"])] += 1
    return out


@settings(max_examples=examples(120), deadline=None)
@given(
    st.lists(st.integers(0, 300), min_size=1, max_size=12),
    st.integers(1, 5),
    st.integers(1, 4),
    st.sampled_from(["none", "pad", "drop"]),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_the_plan_picture_holds_every_readers_ranges_as_plan_gives_them(counts, world, workers, balance, shuffle, seed):
    total = sum(counts)
    if balance == "drop" and total < world:
        return  # plan() refuses: every rank would be empty (tested in tests/planning)
    options = {"seed": seed, "epoch": 1, "shuffle": shuffle, "balance": balance}
    svg = plan_picture(np.array(counts), [f"s{i}" for i in range(len(counts))], world, workers, **options)

    expected = {
        (r, w): [tuple(piece) for piece in plan(counts, Topology(r, world, w, workers), **options)]
        for r in range(world)
        for w in range(workers)
    }
    drawn = drawn_plans(svg)
    assert {reader: ranges for reader, ranges in drawn.items() if ranges} == {
        reader: ranges for reader, ranges in expected.items() if ranges
    }
    # Every record is drawn once in the bars, read or dropped; the repeats are exactly the padding.
    assert (cover(svg, ("read", "drop"), counts) == 1).all()
    padding = -(-total // world) * world - total if balance == "pad" else 0
    assert int(cover(svg, ("pad",), counts).sum()) == padding
    assert int(cover(svg, ("drop",), counts).sum()) == (total % world if balance == "drop" else 0)


def test_a_padded_plan_marks_the_records_read_again_and_who_reads_them():
    # 11 records over 2 ranks: rank 1's last worker reads record 0 of shard 0 a second time.
    svg = plan_picture(np.array([5, 5, 1]), ["a", "b", "c"], 2, 2, seed=0, epoch=0, shuffle=False, balance="pad")
    pads = [seg for seg in drawn_segments(svg) if seg["kind"] == "pad"]
    assert [(p["rank"], p["worker"], p["shard"], p["start"], p["stop"]) for p in pads] == [("1", "1", "0", "0", "1")]
    assert "r1w1 reads [0:1] again" in svg
    assert "padding: read again" in svg


def test_a_dropping_plan_marks_the_records_no_one_reads():
    svg = plan_picture(np.array([5, 5, 1]), ["a", "b", "c"], 2, 1, seed=0, epoch=0, shuffle=False, balance="drop")
    drops = [(seg["shard"], seg["start"], seg["stop"]) for seg in drawn_segments(svg) if seg["kind"] == "drop"]
    assert drops == [("2", "0", "1")]
    assert "dropped: read by none" in svg


def test_unknown_counts_are_drawn_as_whole_shards():
    svg = plan_picture(np.array([-1, 4, -1]), ["a", "b", "c"], 2, 1, seed=0, epoch=0, shuffle=False, balance="none")
    drawn = [(seg["rank"], seg["shard"], seg["start"], seg["stop"]) for seg in drawn_segments(svg)]
    expected = [
        (str(r), str(piece.shard), str(piece.start), "" if piece.stop is None else str(piece.stop))
        for r in range(2)
        for piece in plan([None, 4, None], Topology(r, 2), balance="none")
    ]
    assert sorted(drawn) == sorted(expected)
    assert "count unknown" in svg


def test_a_plan_of_many_shards_draws_the_first_ones_and_says_how_many_more():
    counts = np.full(MAX_SHARDS + 7, 3)
    svg = plan_picture(
        counts, [f"s{i}" for i in range(len(counts))], 2, 2, seed=0, epoch=0, shuffle=False, balance="pad"
    )
    assert max(int(seg["shard"]) for seg in drawn_segments(svg)) == MAX_SHARDS - 1
    assert f"... and 7 more shards, not drawn (the first {MAX_SHARDS} are)" in svg


def test_a_shard_name_with_markup_is_escaped():
    svg = plan_picture(np.array([2]), ["<a&b>.tfrecord"], 1, 1, seed=0, epoch=0, shuffle=False, balance="pad")
    ET.fromstring(svg)  # well-formed
    assert "&lt;a&amp;b&gt;.tfrecord" in svg


def manifest_of(tmp_path, counts) -> str:
    path = str(tmp_path / "train.manifest.arrow")
    shardkit.ShardList([f"train-{i:05d}.tfrecord" for i in range(len(counts))], num_records=counts).to_manifest(path)
    return path


def test_plan_writes_the_picture_it_is_asked_for_the_same_bytes_every_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    manifest = manifest_of(tmp_path, [700, 450, 900])
    done = run_cli("plan", manifest, "--world-size", "2", "--num-workers", "2", "--picture", "plan.svg")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "picture: plan.svg"
    first = (tmp_path / "plan.svg").read_bytes()
    assert (
        run_cli("plan", manifest, "--world-size", "2", "--num-workers", "2", "--picture", "again.svg").returncode == 0
    )
    assert (tmp_path / "again.svg").read_bytes() == first
    ranges = sum(len(plan([700, 450, 900], Topology(r, 2, w, 2))) for r in range(2) for w in range(2))
    assert Counter(seg["kind"] for seg in drawn_segments(first.decode())) == Counter(
        read=ranges
    )  # 2,050 records: no padding
    assert sorted(os.listdir(tmp_path)) == ["again.svg", "plan.svg", "train.manifest.arrow"]  # no temporary left


def test_a_picture_path_that_cannot_be_written_is_one_error_line_before_planning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    manifest = manifest_of(tmp_path, [7, 5])
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir").mkdir()
    cases = {
        "missing/plan.svg": "cannot write the picture to missing/plan.svg: No such file or directory",
        "a-file/plan.svg": "cannot write the picture to a-file/plan.svg: Not a directory",
        "a-dir": "cannot write the picture to a-dir: give a name ending in .svg",
        "dir.svg": None,  # made a directory below
        "plan.png": "cannot write the picture to plan.png: give a name ending in .svg",
    }
    (tmp_path / "dir.svg").mkdir()
    cases["dir.svg"] = "cannot write the picture to dir.svg: it is a directory"
    for path, message in cases.items():
        done = run_cli("plan", manifest, "--picture", path)
        assert done.returncode == 2, (path, done)
        assert done.stdout == ""  # found before the plan was printed
        assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"shardkit plan: error: {message}"), done.stderr
    assert sorted(os.listdir(tmp_path)) == ["a-dir", "a-file", "dir.svg", "train.manifest.arrow"]


def test_a_plan_of_many_readers_keeps_a_swatch_per_rank_and_every_segment():
    counts = np.full(40, 50)
    svg = plan_picture(counts, [f"s{i}" for i in range(40)], 30, 2, seed=0, epoch=0, shuffle=False, balance="pad")
    assert "rank 0: 67 records" in svg and "rank 0 worker 0" not in re.sub(r"<title>.*?</title>", "", svg)
    assert "... and 6 more ranks" in svg
    readers = {(int(seg["rank"]), int(seg["worker"])) for seg in drawn_segments(svg) if seg["kind"] != "drop"}
    assert readers == {(r, w) for r in range(30) for w in range(2)}  # only the legend is shortened
