"""The ``shardkit`` command line."""

from shardkit.cli.main import main

__all__ = ["main"]
