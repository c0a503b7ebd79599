"""The ``shardkit`` command line: parse the arguments, run the command, turn what it
raised into one line on stderr and a documented exit code (:data:`EXIT_CODES`).

The modules below this one: :mod:`~shardkit.cli.parser` (the sub-commands and
their options), the commands (:mod:`~shardkit.cli.check`: inspect, verify,
index; :mod:`~shardkit.cli.plan`; :mod:`~shardkit.cli.convert`;
:mod:`~shardkit.cli.demo`), what they share (:mod:`~shardkit.cli.files`,
:mod:`~shardkit.cli.render`), and at the bottom :mod:`~shardkit.cli.exits`
(exit codes and the one-line format). Commands that take several files check
every one even after a failure, report each bad one on its own line, and exit
with the worst outcome.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from shardkit.cli.exits import EXIT_CODES, EXIT_INTERRUPTED, EXIT_OK, EXIT_PIPE, closed_pipe, fail, stdout_closed
from shardkit.cli.parser import build_parser, parse

__all__ = ["EXIT_CODES", "EXIT_PIPE", "build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardkit`` console script; returns the exit code (:data:`EXIT_CODES`)."""
    args = parse(argv)
    try:
        return int(args.func(args) or EXIT_OK)
    except KeyboardInterrupt:
        print(f"shardkit {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - one line, never a traceback (unless --traceback)
        if isinstance(error, BrokenPipeError) and stdout_closed():
            return closed_pipe()
        return fail(args, error)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
