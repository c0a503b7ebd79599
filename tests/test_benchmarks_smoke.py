"""Smoke tests: each ``benchmarks/*.py --quick`` runs to the end and prints its table.

They assert nothing about the numbers (2 shared cores make them noisy); the
tables themselves say whether the targets were met. The scripts run one after
the other in one of two interpreters (``tests/scripts/benchmarks_quick.py``),
each importing torch, datasets and transformers once for all of its scripts;
each test asserts on its own script's part of the output.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.once import once
from tests.helpers.processes import REPO, run_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a subprocess running three or four benchmarks

DRIVER = REPO / "tests" / "scripts" / "benchmarks_quick.py"
HEADER = "| loader | samples/s | shardkit is |"


#: The scripts, in two launches that two xdist workers run at once (each launch imports torch, datasets
#: and transformers once; one launch of all seven was the suite's longest test). formats.py alone is
#: about as long as the six others: 178 s of a 3 min 24 s launch with tokens.py at load 19 (2026-12-07).
LAUNCHES = (("formats.py",), ("compare.py", "shuffle.py", "packing.py", "stalls.py", "autotune.py", "tokens.py"))


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[int, str, str]]:
    """Script name -> (exit status, stdout, stderr) of its ``--quick`` run, its launch run on first use."""
    tmp = tmp_path_factory.mktemp("benchmarks")
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf-home"),
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
    }
    arguments = {"compare.py": f":--dir={tmp / 'content'},--chart={tmp / 'compare.svg'}"}
    launched: dict[int, dict[str, tuple[int, str, str]]] = {}

    def launch(number: int) -> dict[str, tuple[int, str, str]]:  # once for every xdist worker that asks
        scripts = [script + arguments.get(script, "") for script in LAUNCHES[number]]
        done = run_python(str(DRIVER), *scripts, timeout=840, cwd=REPO, env=env)
        return {name: (status, out, err) for name, status, out, err in sections(done.stdout, done.stderr)}

    def run_of(script: str) -> tuple[int, str, str]:
        number = next(i for i, scripts in enumerate(LAUNCHES) if script in scripts)
        if number not in launched:
            runs = once(tmp_path_factory, f"benchmarks-quick-{number}", lambda: launch(number))
            launched[number] = {name: tuple(run) for name, run in runs.items()}
        return launched[number].get(
            script, (-1, "", f"{script} did not run to its end marker: {sorted(launched[number])}")
        )

    return run_of


def sections(stdout: str, stderr: str) -> list[tuple[str, int, str, str]]:
    """(script, exit status, its stdout, its stderr) for each script the driver ran."""
    pattern = r"=== begin (\S+)\n(.*?)\n=== end \1 exit (-?\d+)"
    outs = {m[1]: (int(m[3]), m[2]) for m in re.finditer(pattern, stdout, re.S)}
    errs = {m[1]: m[2] for m in re.finditer(pattern, stderr, re.S)}
    return [(name, status, out, errs.get(name, "")) for name, (status, out) in outs.items()]


def output_of(quick_runs: Callable[[str], tuple[int, str, str]], script: str) -> str:
    """The script's stdout, once it is known to have run to its end marker and ended with status 0."""
    status, out, err = quick_runs(script)
    assert status == 0, out[-3000:] + err[-3000:]
    return out


def test_compare_quick_runs_and_prints_the_table(quick_runs) -> None:
    out = output_of(quick_runs, "compare.py")
    assert HEADER in out, out[-4000:]
    assert "| start method |" in out, out[-4000:]
    chart = re.search(r"^chart: (\S+\.svg)$", out, re.M)
    assert chart is not None, out[-4000:]
    svg = Path(chart.group(1)).read_text()
    assert svg.startswith("<?xml") and "<svg" in svg
    assert "shardkit TFRecordDataset, decoded" in svg and "webdataset WebDataset, split_by_worker" in svg


def test_shuffle_benchmark_quick_runs_and_scores_every_loader(quick_runs) -> None:
    out = output_of(quick_runs, "shuffle.py")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 7, out  # header, reference, five loaders
    assert all(row.rstrip().endswith("0 / 0 |") for row in rows[2:]), out  # nothing lost or repeated


def test_formats_benchmark_quick_runs_and_loses_nothing(quick_runs) -> None:
    out = output_of(quick_runs, "formats.py")
    rows = [line for line in out.splitlines() if "duplicates" in line]
    assert len(rows) == 12, out  # 2 + 2 tar, 4 Parquet, 2 JSON lines, 2 ArrayRecord (MDS: where Mosaic installs)
    shardkit_rows = [row for row in rows if "shardkit" in row]
    assert all("0 duplicates, 0 missing" in row for row in shardkit_rows), out
    assert all("peak RSS" in row for row in rows), out  # memory side by side


def test_packing_benchmark_quick_runs_and_every_packer_keeps_every_token(quick_runs) -> None:
    out = output_of(quick_runs, "packing.py")  # a packer that lost tokens exits 1
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in out.splitlines() if line.startswith("| ")}
    assert "shardkit best_fit" in rows and "shardkit concat" in rows, out
    assert float(rows["shardkit best_fit"][3]) >= 0.99, out  # the fill column


def test_stalls_benchmark_quick_runs_and_prints_the_cost_of_both_cases(quick_runs) -> None:
    out = output_of(quick_runs, "stalls.py")
    rows = [line for line in out.splitlines() if line.startswith("| resumable=")]
    assert len(rows) == 2 and all("%" in row for row in rows), out


def test_autotune_benchmark_quick_runs_every_workload_and_compares_auto_with_the_best(quick_runs) -> None:
    out = output_of(quick_runs, "autotune.py")
    for workload in ("cheap", "map", "remote"):
        assert f"### {workload}:" in out, out[-3000:]
    assert out.count("auto / best (") == 3, out[-3000:]
    assert "targets met on" in out


def test_tokens_benchmark_quick_reads_every_document_and_packs_every_token_once_in_int32(quick_runs) -> None:
    out = output_of(quick_runs, "tokens.py")
    seen = [line.split(" | ")[-1].strip(" |") for line in out.splitlines() if line.startswith("| shardkit ")]
    assert len(seen) == 4 and len(set(seen[:3])) == 1, out  # every shardkit reader saw the same tokens
    written = int(re.search(r"^([\d,]+) int32 tokens in blocks of 2048", out, re.M).group(1).replace(",", ""))
    row = next(line for line in out.splitlines() if line.startswith("| shardkit TokenDataset.pack + MixedLoader |"))
    per_epoch, dtype = (cell.strip() for cell in row.strip("| ").split(" | ")[2:4])
    assert dtype == "torch.int32", row
    assert written <= int(per_epoch.replace(",", "")) < written + 2 * 2048, row  # at most a padded block per worker


@pytest.mark.timeout(300)
def test_remote_benchmark_quick_reads_every_loader_over_its_loopback_server(tmp_path: Path) -> None:
    """Restored: in one CI run its shardkit round waited on an HTTP listing (aiohttp's 5-minute bound, the
    only one then). A listing now gets 30 s per try and 60 s in all; a stall past the timeout prints every
    process's stacks (``run_python``)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    script = str(REPO / "benchmarks" / "remote.py")
    args = ("--quick", "--startup", "10000", "--dir", str(tmp_path / "data"))
    done = run_python(script, *args, timeout=280, cwd=REPO, env=env)
    rows = [line for line in done.stdout.splitlines() if line.startswith("| shardkit, HTTP |")]
    assert len(rows) == 2 and not any("failed" in row for row in rows), done.stdout[-3000:]  # 0 and 30 ms
    assert all("LIST at build" in row for row in rows), done.stdout[-3000:]  # given a glob, listed while built
