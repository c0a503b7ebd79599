"""The ``shardkit`` command line."""

from shardkit.cli.main import EXIT_CODES, EXIT_PIPE, build_parser, main

__all__ = ["EXIT_CODES", "EXIT_PIPE", "build_parser", "main"]
