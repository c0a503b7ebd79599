"""The README names only things that exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import shardkit

README = Path(__file__).resolve().parent.parent / "README.md"


def test_every_shardkit_name_in_the_readme_is_exported() -> None:
    names = set(re.findall(r"\bshardkit\.([A-Za-z_][A-Za-z0-9_]*)", README.read_text()))

    def exists(name: str) -> bool:  # an exported name, or a submodule the README names as a module
        return hasattr(shardkit, name) or importlib.util.find_spec(f"shardkit.{name}") is not None

    missing = sorted(name for name in names if not exists(name))
    assert names, "the README names no shardkit attribute: the pattern is wrong"
    assert missing == [], f"README names shardkit.{missing} which do not exist"


def test_every_exported_name_resolves() -> None:
    for name in shardkit.__all__:
        assert getattr(shardkit, name) is not None, name


def subcommands() -> set[str]:
    import argparse

    from shardkit.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(action.choices)


def test_the_readme_command_list_names_every_subcommand_and_no_other() -> None:
    block = README.read_text().split("## Command line", 1)[1].split("```", 2)[1]
    listed = set(re.findall(r"^shardkit (\w+)", block, re.MULTILINE))
    assert listed == subcommands()


def test_the_readme_does_not_promise_a_one_minute_suite() -> None:
    assert "about a minute" not in README.read_text()  # measured 3:52 for -m "not slow" on 2 cores


def test_the_readme_quotes_lightnings_len_warning_as_lightning_words_it() -> None:
    import ast

    import pytest

    # The installed source of has_len_all_ranks, read, not imported: importing Lightning costs
    # seconds, and the words are what is checked.
    spec = importlib.util.find_spec("pytorch_lightning")  # a top-level package: found, not run
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("pytorch_lightning is not installed (it is in the dev extras)")
    text = (Path(spec.submodule_search_locations[0]) / "utilities" / "data.py").read_text()
    (function,) = [
        node
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef) and node.name == "has_len_all_ranks"
    ]
    quoted = re.search(r'warns that "`__len__` (.*?)" for any loader', README.read_text(), re.DOTALL)
    assert quoted, "the README's Lightning note is gone"
    words = " ".join(quoted.group(1).split())
    source = " ".join(re.sub(r'"\s*"', "", ast.get_source_segment(text, function) or "").split())
    assert words in source
