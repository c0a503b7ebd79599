"""The documentation site builds cleanly, offline, and what it shows runs.

``mkdocs build --strict`` turns every warning (a broken link, a page missing
from the nav, a docstring reference mkdocstrings cannot resolve) into a
failure, so a rename that breaks the docs breaks this test.
"""

from __future__ import annotations

import concurrent.futures
import doctest
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import shardkit
from tests.helpers import docblocks
from tests.helpers.load import hang_bound
from tests.helpers.processes import run_python

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# Modules whose docstring examples are doctests (the others show fragments).
DOCTESTED = [
    "shardkit.planning.plans",
    "shardkit.planning.ranges",
    "shardkit.planning.intervals",
    "shardkit.topology",
    "shardkit.seeding",
    "shardkit.epoch",
    "shardkit.formats.example.backend",
    "shardkit.formats.example.columns",
    "shardkit.formats.example.encode",
    "shardkit.quality",
]


def mkdocs_build(site_dir: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` into ``site_dir``, with every proxy pointing
    at a closed port so that a plugin fetching anything fails the build."""
    dead = "http://127.0.0.1:9"
    env = {
        **os.environ,
        "NO_MKDOCS_2_WARNING": "1",  # Material's end-of-life banner, printed on every build
        "HTTP_PROXY": dead,
        "HTTPS_PROXY": dead,
        "http_proxy": dead,
        "https_proxy": dead,
        "NO_PROXY": "",
        "no_proxy": "",
    }
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=hang_bound(300))


# The test runner's own caches in the checkout: a test running beside this one under xdist (the first
# hypothesis test of a fresh clone) may create one while the site builds; mkdocs writes neither.
RUNNER_CACHES = {".hypothesis", ".pytest_cache"}


def _checkout_entries() -> list[str]:
    return sorted(p.name for p in ROOT.iterdir() if p.name not in RUNNER_CACHES)


@pytest.mark.slow  # a whole mkdocs build in a new process (5-10 s)
def test_the_site_builds_in_strict_mode_with_no_warning_and_writes_only_where_told(tmp_path):
    before = _checkout_entries()
    done = mkdocs_build(tmp_path / "site")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "WARNING" not in output, output[-5000:]
    assert _checkout_entries() == before  # no site/ (or anything) in the repo
    sources = (tmp_path / "site" / "reference" / "sources" / "index.html").read_text()
    assert "TFRecordDataset" in sources and "on_error" in sources  # docstrings were rendered
    guarantees = (tmp_path / "site" / "guarantees" / "index.html").read_text()
    assert "CorruptRecordError" in guarantees
    remote = re.compile(r'<(?:script|img|iframe)[^>]+src="(?:https?:)?//|<link[^>]+href="(?:https?:)?//')
    for page in (tmp_path / "site").rglob("*.html"):  # nothing loaded from elsewhere when a page is viewed
        assert not remote.search(page.read_text()), page


@pytest.mark.slow  # a whole mkdocs build in a new process (5-10 s)
def test_a_broken_link_fails_the_build(tmp_path):
    """The check above can fail: the same config over the docs plus a page with a dead link does not build."""
    shutil.copytree(DOCS, tmp_path / "docs")
    (tmp_path / "docs" / "probe.md").write_text("# Probe\n\n[gone](no-such-page.md)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text((ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {tmp_path / 'docs'}"))
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=hang_bound(300),
    )
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


def test_the_config_enables_nothing_that_fetches_at_build_or_view_time():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    plugins = {next(iter(p)) if isinstance(p, dict) else p for p in config["plugins"]}
    assert plugins <= {"search", "mkdocstrings"}, plugins  # no social cards, privacy, blog, ...
    assert config["theme"]["font"] is False  # no Google Fonts
    assert "analytics" not in config.get("extra", {})
    mkdocstrings = next(p["mkdocstrings"] for p in config["plugins"] if isinstance(p, dict) and "mkdocstrings" in p)
    python = mkdocstrings["handlers"]["python"]
    assert "inventories" not in python and "import" not in python  # no remote objects.inv


def reference_targets() -> set[str]:
    targets = set()
    for page in (DOCS / "reference").glob("*.md"):
        targets.update(re.findall(r"^::: ([\w.]+)$", page.read_text(), flags=re.MULTILINE))
    return targets


def test_every_public_name_has_an_entry_in_the_api_reference():
    targets = reference_targets()
    missing = []
    for name in shardkit.__all__:
        if name == "__version__":
            continue
        where = f"{getattr(shardkit, name).__module__}.{name}"  # where it is defined, as the pages name it
        if where not in targets:
            missing.append(where)
    assert not missing, f"add these to a page under docs/reference/: {missing}"


@pytest.mark.parametrize("module_name", DOCTESTED)
def test_the_docstring_examples_of_the_module_run_as_shown(module_name):
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module_name} has no docstring example"
    assert result.failed == 0


def test_the_rest_of_docstrings_becomes_markdown_for_the_site():
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        from sphinx_roles import replace_roles
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    text = "see :func:`~shardkit.plan`, :class:`shardkit.Topology` and :meth:`Pipeline.map`::\n\n    code"
    assert replace_roles(text) == "see `plan`, `shardkit.Topology` and `Pipeline.map`:\n\n    code"
    assert (
        replace_roles("Sum.\n\n    Example:\n        >>> 1 + 1\n        2")
        == "Sum.\n\n    Examples:\n        >>> 1 + 1\n        2"
    )


# --------------------------------------------------------------------------- code blocks of the pages

DATA_STATEMENT = "shardkit demo --workdir data"  # each page whose examples read data/ says how it is made


def _runnable_blocks() -> list[docblocks.Block]:
    return [block for block in docblocks.blocks() if block.runnable]


def test_every_fragment_is_marked_next_to_the_complete_script_it_belongs_to():
    """A block marked ``# fragment of X above`` (or ``below``) has a complete, runnable block there."""
    runnable = _runnable_blocks()
    wrong = []
    for i, block in enumerate(runnable):
        if not block.fragment:
            continue
        first = block.code.strip().splitlines()[0].lower()
        step = -1 if first.rstrip().endswith("above") or " above" in first else 1
        j = i + step
        while 0 <= j < len(runnable) and runnable[j].page == block.page and runnable[j].fragment:
            j += step
        if not (0 <= j < len(runnable) and runnable[j].page == block.page):
            wrong.append(f"{block.name}: no complete block {'above' if step < 0 else 'below'} it on its page")
    assert wrong == []


def test_every_page_whose_examples_read_data_says_how_the_data_is_made():
    # docs/cli.md states its own dataset, from which its outputs were printed; its commands run on this one.
    pages = {block.page for block in _runnable_blocks() if '"data/' in block.code or " data/" in block.code}
    pages.discard("docs/cli.md")
    silent = sorted(page for page in pages if DATA_STATEMENT not in (ROOT / page).read_text())
    assert silent == [], f"say on these pages that the examples read what `{DATA_STATEMENT}` writes"


def test_the_block_collector_finds_code_languages_fragments_and_commands(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport shardkit\n```\n\n"
        "- a list item\n\n  ```bash\n  shardkit index 'data/*.tfrecord'  # the indexes\n  pip install x\n  ```\n\n"
        "```console\n$ shardkit verify data/a.tfrecord\nok data/a.tfrecord: 3 records\n```\n\n"
        "```python\n# fragment of page.py above\nloader = 1\n```\n\n```text\nshardkit plan\n```\n"
    )
    found = docblocks.blocks([page])
    assert [(b.language, b.line, b.fragment, b.runnable) for b in found] == [
        ("python", 1, False, True),
        ("bash", 7, False, True),
        ("console", 12, False, True),
        ("python", 17, True, True),
        ("text", 22, False, False),
    ]
    assert found[1].commands == ["shardkit index 'data/*.tfrecord'"]
    assert found[2].commands == ["shardkit verify data/a.tfrecord"]


@pytest.mark.slow  # every block of every page, in one interpreter: about 40 s on 2 busy cores
def test_every_code_block_of_the_readme_and_docs_runs_as_written_or_is_marked_a_fragment(tmp_path, capsys):
    """Every Python block and every block of ``shardkit`` commands in README.md and docs/*.md runs
    unchanged on the data the pages name (what ``shardkit demo --workdir data`` and the conversions of
    docs/formats.md's set-up block write: the fixture runs that block), or is marked as a fragment of
    the complete script next to it; at least 90% run unchanged. The count is printed:
    ``N of M blocks ran unchanged``."""
    every = _runnable_blocks()
    # docs/cli.md's console sessions (with the shell commands that damage a copy, and failing commands shown
    # with their exit codes) are run whole and compared line for line by tests/cli/test_cli_page.py.
    runnable = [b for b in every if not (b.page == "docs/cli.md" and b.language == "console")]
    setup = docblocks.setup_block(runnable)  # runs as the fixture: the data every other block reads
    to_run = [block for block in runnable if not block.fragment and block != setup]
    docblocks.write_doc_data(tmp_path)
    files = {
        page: {_title(b): b.code for b in runnable if b.page == page and _title(b)}
        for page in {b.page for b in runnable}
    }
    spec = [
        {
            "name": b.name,
            "language": b.language,
            "code": b.code,
            "title": _title(b),
            "commands": b.commands,
            "files": files[b.page],
        }
        for b in to_run
    ]
    results = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two interpreters: both cores of a 2-core machine
        for found in pool.map(lambda half: _run_blocks(spec[half::2], tmp_path, half), range(2)):
            results += found
    failed = [f"{r['name']}:\n{r['error']}" for r in results if r["error"]]
    ran = 1 + sum(r["error"] is None for r in results)  # 1: the set-up block, run by write_doc_data
    fragments = sum(block.fragment for block in runnable)
    with capsys.disabled():
        print(
            f"\n{ran} of {len(runnable)} blocks ran unchanged ({fragments} marked as fragments); "
            f"{len(every) - len(runnable)} console blocks of docs/cli.md run by tests/cli/test_cli_page.py"
        )
    assert len(results) == len(to_run)
    assert failed == [], "\n\n".join(failed)
    assert ran >= 0.9 * len(runnable), f"only {ran} of {len(runnable)} blocks run unchanged"


def _run_blocks(spec: list[dict], folder: Path, part: int) -> list[dict]:
    """Run blocks in one interpreter (``tests/scripts/doc_blocks.py``): each block's result."""
    (folder / f"blocks{part}.json").write_text(json.dumps(spec))
    results = folder / f"results{part}.jsonl"
    script = ROOT / "tests" / "scripts" / "doc_blocks.py"
    run_python(str(script), str(folder / f"blocks{part}.json"), str(folder), str(results), timeout=600, cwd=ROOT)
    return [json.loads(line) for line in results.read_text().splitlines()]


def _title(block: docblocks.Block) -> str | None:
    """The file name a page gives a script (```python title="quickstart.py"), if any."""
    fence = (ROOT / block.page).read_text().splitlines()[block.line - 1]
    titled = re.search(r'title="([\w.-]+\.py)"', fence)
    return titled.group(1) if titled else None


def test_the_cli_page_lists_every_subcommand_in_its_summary_and_has_a_section_for_each():
    from tests.test_readme import subcommands

    text = (DOCS / "cli.md").read_text()
    summary = text.split("```text", 1)[1].split("```", 1)[0]
    assert set(re.findall(r"^shardkit (\w+)", summary, re.MULTILINE)) == subcommands()
    assert set(re.findall(r"^## shardkit (\w+)", text, re.MULTILINE)) == subcommands()


def test_the_cli_page_shows_output_the_cli_prints_and_every_exit_code():
    from shardkit.cli import EXIT_CODES

    text = (DOCS / "cli.md").read_text()
    assert "CORRUPT " not in text and "framing only" not in text  # verify prints "error:" lines; inspect checks CRCs
    for code in re.findall(r"^  (\d+) ", EXIT_CODES, re.MULTILINE):
        assert f"| {code} |" in text, code


def test_the_cli_help_does_not_say_tfrecord_only_for_commands_that_read_every_format():
    from shardkit.cli import build_parser

    text = build_parser().format_help()
    assert "TFRecord files" not in text and "tar, Parquet" in text


def test_code_comments_and_docstrings_carry_no_process_notes():
    """ "issue 7" means nothing to a reader of the code: say what the target is, not which ticket asked."""
    notes = re.compile(r"\(issue \d+|\bissue \d+:")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("shardkit", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if notes.search(line)
    ]
    assert found == []


def test_the_architecture_page_names_every_module_of_the_package():
    # docs/ARCHITECTURE.md is the map of the layers: a module added, moved or renamed is named there,
    # a top-level module as `name.py`, a subpackage as `name/`, a module inside one by its `name`.
    page = (DOCS / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`([\w./]+)`", page))
    package = ROOT / "shardkit"
    missing = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if relative.name == "__init__.py":
            wanted = f"{relative.parent.name}/" if relative.parent.name else None
        elif relative.name.startswith("_"):
            wanted = None  # __main__, _version: named with the entry points, not one by one
        else:
            wanted = relative.name if len(relative.parts) == 1 else path.stem
        if wanted is not None and wanted not in named:
            missing.append(str(relative))
    assert not missing, f"docs/ARCHITECTURE.md does not name: {missing}"
