"""The ``shardkit`` command line: one sub-command per job.

Each sub-command is a ``_cmd_<name>(args) -> int`` function registered in
:func:`build_parser`; heavy imports happen inside the function so that
``shardkit --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_demo(args: argparse.Namespace) -> int:
    from shardkit.demo import run_demo

    return run_demo(workdir=args.workdir)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``shardkit`` console script."""
    parser = argparse.ArgumentParser(prog="shardkit", description=__doc__.splitlines()[0])
    from shardkit._version import __version__

    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="write a small dataset to a temp dir and show shardkit at work")
    demo.add_argument("--workdir", default=None, help="where to write the data (default: a temp dir)")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardkit`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
