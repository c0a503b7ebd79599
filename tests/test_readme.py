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
