"""Run documentation code blocks, one after another, in this one interpreter; write a JSON line per block.

Usage: ``python doc_blocks.py BLOCKS.json DATA_FOLDER RESULTS.jsonl``. ``BLOCKS.json`` is a list of
``{"name", "language", "code", "title", "commands", "files"}``; each block runs in a fresh folder
holding a copy of ``DATA_FOLDER/data`` (what the pages' examples read) and the files its page shows
by name (``files``: the page's ```python title="pipelines.py" blocks), so blocks see the data as
the pages state it and never each other's files. One interpreter for every block: torch is imported once
(seconds of CPU), not once per block.

- A Python block is written to a file and run as ``python FILE`` runs it (``runpy``, ``__name__ ==
  "__main__"``), as a single process would be under ``torchrun --nproc_per_node=1`` (``RANK=0``,
  ``WORLD_SIZE=1``, a free ``MASTER_PORT``), so a block that joins a process group runs too; a group
  it leaves initialised is destroyed after it.
- A shell block's ``shardkit`` commands are split and their globs expanded by bash, as typed, then
  run through the CLI's ``main`` in this process; each must exit 0.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.helpers.docblocks import bash_argv  # noqa: E402
from tests.helpers.processes import free_port  # noqa: E402


def run_python(code: str, title: str | None) -> None:
    path = Path(title or "block.py").resolve()
    path.write_text(code)
    argv = sys.argv[:]
    sys.argv = [str(path)]
    sys.path.insert(0, str(path.parent))  # as `python FILE` puts the script's folder first
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exit:
        if exit.code not in (None, 0):
            raise AssertionError(f"exited with {exit.code}") from None
    finally:
        sys.argv = argv
        sys.path.remove(str(path.parent))
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_commands(commands: list[str]) -> str:
    from shardkit.cli.main import main

    printed = io.StringIO()
    for command in commands:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            code = main(bash_argv(command)[1:])
        if code != 0:
            raise AssertionError(f"`{command}` exited with {code}: {printed.getvalue()[-2000:]}")
    return printed.getvalue()


def forget_modules_of(folder: str) -> None:
    """Unload the modules a block imported from its folder: the next block's folder may hold its own."""
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(folder):
            del sys.modules[name]


CHECKOUT_DATA = ("tests/fixtures/mds", "tests/data/litdata")
"""Folders of a checkout that docs/coming-from.md reads: files Mosaic's and LitData's own writers wrote."""


def run_block(block: dict, data: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="shardkit-doc-block-") as folder:
        shutil.copytree(data / "data", Path(folder) / "data")
        for fixtures in CHECKOUT_DATA:  # what a page reads "in a shardkit checkout" (other loaders' files)
            if fixtures in block["code"]:
                shutil.copytree(REPO / fixtures, Path(folder) / fixtures)
        for name, code in block["files"].items():
            (Path(folder) / name).write_text(code)
        os.chdir(folder)
        sys.path.insert(0, folder)  # `shardkit profile module:function` imports from the working directory
        started = time.perf_counter()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                if block["language"] == "python":
                    run_python(block["code"], block["title"])
                else:
                    run_commands(block["commands"])
            error = None
        except BaseException:  # noqa: BLE001 - every failure is reported with its block
            error = traceback.format_exc()[-3000:]
        finally:
            os.chdir(REPO)
            sys.path.remove(folder)
            forget_modules_of(folder)
        return {"name": block["name"], "error": error, "seconds": round(time.perf_counter() - started, 2)}


def main() -> None:
    blocks = json.loads(Path(sys.argv[1]).read_text())
    data = Path(sys.argv[2])
    os.environ.update(
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    )
    with open(sys.argv[3], "w") as results:  # a file: DataLoader workers print to this process's stdout
        for block in blocks:
            results.write(json.dumps(run_block(block, data)) + "\n")
            results.flush()


if __name__ == "__main__":
    main()
