"""The ``shardkit`` command line: :func:`main` is the console script's entry point
(``shardkit.cli:main``, and ``python -m shardkit``); :data:`EXIT_CODES`,
:data:`EXIT_PIPE` and :func:`build_parser` are what its page and tests read."""

from shardkit.cli.main import EXIT_CODES, EXIT_PIPE, build_parser, main

__all__ = ["EXIT_CODES", "EXIT_PIPE", "build_parser", "main"]
