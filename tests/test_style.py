"""The house habits are checked, not hoped for: ruff lint and format over the tree, pyright over the package."""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.load import hang_bound

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    found = Path(sys.executable).with_name(name)
    if found.exists():
        return str(found)
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (it is in the dev extras)")
    return path


def _run(*args: str, bounded: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a tool from the checkout. Its bound only catches a hang (stretched by the machine's load);
    ``bounded=False`` leaves it to pytest-timeout's per-test bound, itself stretched by load."""
    timeout = hang_bound(120) if bounded else None
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# --no-cache: the suite writes nothing into the checkout (a .ruff_cache appearing mid-run also broke
# test_docs' check that the site build writes only where told, when the two ran at once under xdist).
def test_the_tree_passes_ruff_lint():
    done = _run(_tool("ruff"), "check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_tree_is_ruff_formatted():
    done = _run(_tool("ruff"), "format", "--check", "--no-cache", ".")
    assert done.returncode == 0, "run `.venv/bin/ruff format .`:\n" + done.stdout + done.stderr


@pytest.mark.slow  # 10-25 s of type analysis: the biggest single cost of -m "not slow"; CI runs it
@pytest.mark.timeout(900)  # a hang catcher only (stretched by load): 69 s alone, 120 s was reached at load 6-10
def test_the_package_has_no_basedpyright_errors():
    # pyright's standard mode over shardkit/ (pyproject.toml); the interpreter is this one, so
    # torch, numpy and pyarrow resolve to what the tests run against. No wall-clock bound of its
    # own: a type check passes or fails on the code, never on how busy the machine is.
    done = _run(_tool("basedpyright"), "--pythonpath", sys.executable, bounded=False)
    assert done.returncode == 0 and re.search(r"^0 errors", done.stdout, re.M), done.stdout[-4000:] + done.stderr


def test_the_package_keeps_its_import_layers():
    # The contracts in pyproject.toml: every module imports only from layers below it (no cycles).
    done = _run(_tool("lint-imports"), "--no-cache")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr


def test_an_upward_import_breaks_the_layers_contract(tmp_path: Path):
    # The check above can fail: a copy of the package whose lowest layer imports the CLI is refused.
    shutil.copytree(ROOT / "shardkit", tmp_path / "shardkit", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    errors = tmp_path / "shardkit" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _upward() -> None:\n    import shardkit.cli  # noqa: F401\n")
    done = subprocess.run(
        [_tool("lint-imports"), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=hang_bound(120),
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode != 0
    assert "shardkit.errors is not allowed to import shardkit.cli" in done.stdout, done.stdout[-2000:]


MAX_MODULE_LINES = 600


def test_no_module_is_over_600_lines_unless_its_docstring_says_why():
    # A longer module must say in its docstring why it is one module ("... lines: one module because ...").
    too_long = []
    for path in sorted((ROOT / "shardkit").rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES and "one module because" not in (
            ast.get_docstring(ast.parse(text)) or ""
        ):
            too_long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert not too_long, too_long
