"""The house habits are checked, not hoped for: ruff lint and format over the tree, pyright over the package."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    found = Path(sys.executable).with_name(name)
    if found.exists():
        return str(found)
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (it is in the dev extras)")
    return path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_tree_passes_ruff_lint():
    done = _run(_tool("ruff"), "check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_tree_is_ruff_formatted():
    done = _run(_tool("ruff"), "format", "--check", ".")
    assert done.returncode == 0, "run `.venv/bin/ruff format .`:\n" + done.stdout + done.stderr


@pytest.mark.slow  # 10-25 s of type analysis: the biggest single cost of -m "not slow"; CI runs it
def test_the_package_has_no_basedpyright_errors():
    # pyright's standard mode over shardkit/ (pyproject.toml); the interpreter is this one, so
    # torch, numpy and pyarrow resolve to what the tests run against.
    done = _run(_tool("basedpyright"), "--pythonpath", sys.executable)
    assert done.returncode == 0 and re.search(r"^0 errors", done.stdout, re.M), done.stdout[-4000:] + done.stderr
