"""The code blocks of README.md and docs/*.md, and what running one means.

A block is a fenced code block. Its language decides what the doc test does with it:

- ``python``: a script, run as ``python block.py`` would run it (``__name__ == "__main__"``) in a
  folder holding the data the pages name (:func:`write_doc_data`);
- ``bash`` / ``console``: its ``shardkit ...`` commands are run (a ``console`` block's after its
  ``$`` prompt; the lines after a command are its output, which this test does not compare).
  A shell block with no ``shardkit`` command (``pip install``, ``bash scripts/test.sh``,
  ``torchrun``) sets up or launches and is not run;
- anything else (``text``, no language) is output or a diagram, not code.

A block that is not meant to run alone says so on its first line, visibly, as a comment:
``# fragment of quickstart.py above`` (or ``below``): a piece of the complete script right above
or below it, which runs. Every other Python block and shardkit shell block runs unchanged.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
FRAGMENT = re.compile(r"^#\s*fragment of [\w./ -]+ (above|below)\b", re.I)
SHELLS = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language and its text (dedented)."""

    page: str  # relative to the repository: README.md, docs/formats.md
    line: int  # of the opening fence, 1-based
    language: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def fragment(self) -> bool:
        """Marked, on its first line, as a piece of the complete script above or below it."""
        first = next((line for line in self.code.splitlines() if line.strip()), "")
        return bool(FRAGMENT.match(first.strip()))

    @property
    def commands(self) -> list[str]:
        """The ``shardkit ...`` commands of a shell block, as typed (a console block: after ``$``)."""
        if self.language not in SHELLS:
            return []
        found = []
        for line in self.code.splitlines():
            if self.language == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            command = line.split(" #", 1)[0].strip()
            if command.startswith("shardkit "):
                found.append(command)
        return found

    @property
    def runnable(self) -> bool:
        """Code the doc test runs (or would, were it not marked a fragment): Python, or shardkit commands."""
        return self.language == "python" or bool(self.commands)


def blocks(pages: list[Path] = PAGES) -> list[Block]:
    """Every fenced block of ``pages``, in order."""
    found = []
    for page in pages:
        text = page.read_text()
        for match in FENCE.finditer(text):
            indent = len(match["indent"])
            code = "".join(line[indent:] for line in match["body"].splitlines(keepends=True))
            language = (match["info"].split() or [""])[0]
            line = text.count("\n", 0, match.start()) + 1
            where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
            found.append(Block(str(where), line, language, code))
    return found


DEMO = "shardkit demo --workdir data"


def setup_block(found: list[Block] | None = None) -> Block:
    """The block that makes the data every page's examples read: on docs/formats.md, it begins with
    ``shardkit demo --workdir data`` and converts the demo's shards into the other formats."""
    return next(b for b in (found or blocks()) if b.commands and b.commands[0] == DEMO)


def bash_argv(command: str) -> list[str]:
    """A command split, and its unquoted globs expanded, by bash, as typed in the working directory."""
    import subprocess

    script = f"set -- {command}; printf '%s\\0' \"$@\""
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split("\0")[:-1]


def write_doc_data(folder: Path) -> None:
    """The data the pages' examples read, in ``folder/data``, made by the commands of
    :func:`setup_block`, run in ``folder``.

    ``shardkit demo --workdir data`` is done by the demo's own writer (the same files: the demo's
    checks, 20 s of DataLoader workers, are ``tests/cli/test_cli_demo.py``'s); the other commands by
    the CLI, in this process.
    """
    import contextlib
    import io

    from shardkit.cli.demo import _write_dataset
    from shardkit.cli.main import main

    commands = setup_block().commands
    (folder / "data").mkdir(parents=True)
    _write_dataset(folder / "data")
    here = os.getcwd()
    os.chdir(folder)
    try:
        for command in commands[1:]:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                assert main(bash_argv(command)[1:]) == 0, command
    finally:
        os.chdir(here)
