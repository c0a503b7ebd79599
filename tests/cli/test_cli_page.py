"""docs/cli.md shows what the commands print: this runs every command of its example blocks, in order, in
one shell, on the data the page says it reads (``shardkit demo --workdir data``), and compares the output
with the page, line for line.

Only what truly varies is normalised: ``shardkit profile``'s timings (seconds, shares, rates, each worker's
sample count) and the order of its stage and worker rows, which follows the timings. A ``python`` block
whose first line is ``# NAME.py: ...`` is written to NAME.py first, as the page asks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)  # a fence may carry a title
MARK = "@@shardkit-page-command {}@@"


def page_blocks() -> tuple[list[tuple[str, list[str]]], dict[str, str]]:
    """The page's ``$ command`` lines with the lines shown after each, and the files its python blocks name."""
    commands: list[tuple[str, list[str]]] = []
    files: dict[str, str] = {}
    for language, body in FENCE.findall(PAGE.read_text()):
        if language == "python" and (named := re.match(r"# ([\w.]+\.py):", body)):
            files[named.group(1)] = body
        if language != "console":
            continue
        for line in body.splitlines():
            if line.startswith("$ "):
                commands.append((line[2:], []))
            else:
                commands[-1][1].append(line)
    return commands, files


def run_page(commands: list[tuple[str, list[str]]], cwd: Path) -> list[list[str]]:
    """Each command's output (stdout and stderr, in order), run one after another in one bash."""
    script = ["exec 2>&1", "__mark() { local rc=$?; printf '\\n%s\\n' \"$1\"; return $rc; }"]
    for i, (command, _) in enumerate(commands):
        script += [command, f"__mark '{MARK.format(i)}'"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # this checkout's `shardkit`
    done = subprocess.run(["bash", "-c", "\n".join(script)], cwd=cwd, env=env, capture_output=True, text=True)
    outputs, current = [], []
    for line in done.stdout.splitlines():
        if line == MARK.format(len(outputs)):
            outputs.append(current[:-1] if current and current[-1] == "" else current)  # the mark's "\n"
            current = []
        else:
            current.append(line)
    assert len(outputs) == len(commands), done.stdout[-2000:]
    return outputs


def timings_normalised(lines: list[str]) -> list[str]:
    """``shardkit profile``'s output with its timings blanked and its column padding closed up, each paragraph's
    rows sorted."""
    out = []
    for line in lines:
        line = re.sub(r"\d+\.\d+", "#", line)
        line = re.sub(r"\d+%", "#%", line)
        line = re.sub(r"[\d,]+ samples/s", "# samples/s", line)
        line = re.sub(r"^(\d+\s+#%\s+#%\s+)\d+$", r"\1#", line)  # a worker's samples: how the mix fell
        line = re.sub(r" {2,}", " ", line)  # columns pad to the widest timing: one digit more moves them
        out.append(line)
    paragraphs = "\n".join(out).split("\n\n")
    return [line for paragraph in paragraphs for line in sorted(paragraph.splitlines())]


def test_the_page_names_its_commands_and_the_files_they_need():
    commands, files = page_blocks()
    programs = [command.split()[1] for command, _ in commands if command.startswith("shardkit ")]
    assert {"plan", "inspect", "verify", "index", "convert", "profile"} <= set(programs)
    assert "pipelines.py" in files
    assert "shardkit demo --workdir data" in PAGE.read_text()


@pytest.mark.slow
def test_every_command_on_the_cli_page_prints_what_the_page_shows(tmp_path):
    commands, files = page_blocks()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    made = subprocess.run(
        [sys.executable, "-m", "shardkit", "demo", "--workdir", "data"], cwd=tmp_path, capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    outputs = run_page(commands, tmp_path)
    for (command, shown), printed in zip(commands, outputs):
        if command.startswith("shardkit profile"):
            shown, printed = timings_normalised(shown), timings_normalised(printed)
        assert printed == shown, f"$ {command}"
