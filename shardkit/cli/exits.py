"""Exit codes and one-line errors: how every ``shardkit`` command ends, and what it says when it fails.

Errors are for people and scripts alike: each is one line on stderr,
``shardkit <command>: error: <what, where>``, never a traceback (the global
``--traceback`` option shows one, for bug reports), and the exit code says
what happened (:data:`EXIT_CODES`). A reader that stops reading (``| head``)
ends the command quietly with :data:`EXIT_PIPE`, as a shell tool killed by
SIGPIPE would.

This is the bottom of the command line's layers: the parser, the commands
and ``main`` all report through it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback

from shardkit.errors import CorruptRecordError, ShardkitError, redact

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool its reader stopped reading (`... | head`)

EXIT_CODES = f"""\
exit codes:
  {EXIT_OK}    success
  {EXIT_CORRUPT}    corrupt data found: a bad CRC, a truncated record, damaged compression
       (each bad file is reported with its url, record index and byte offset)
  {EXIT_USAGE}    usage error or unreadable input: bad arguments, a missing file, a
       directory, a glob matching nothing, an unreadable or malformed manifest
       or index, a file in no known format (or not the one its name says), an
       output that could overwrite an input; 2 wins over 1 when both happen
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
  {EXIT_PIPE}  the output pipe closed early (`shardkit verify ... | head`): stops quietly
errors are single lines on stderr: "shardkit <command>: error: <message>"
"""


class MismatchError(ShardkitError):
    """A file contradicts what its manifest or index file says about it."""


def one_line(text: str) -> str:
    """``text`` with its line breaks folded, so that one error stays one line. An error re-raised from a
    DataLoader worker carries the worker's traceback in its message: only its first and last lines stay."""
    lines = text.strip().splitlines()
    if any(line.startswith("Original Traceback") for line in lines):
        raised = [i for i, line in enumerate(lines) if re.match(r"[A-Za-z_][\w.]*: ", line)]
        if raised:  # the exception's own line (and the lines of its message after it)
            lines = [lines[0], re.sub(r"^[\w.]+: ", "", lines[raised[-1]]), *lines[raised[-1] + 1 :]]
    return re.sub(r"\s*[\r\n]+\s*", " | ", "\n".join(lines).strip()) or "(no message)"


_OS_REASONS: dict[type, str] = {
    FileNotFoundError: "no such file or directory",
    FileExistsError: "exists and is not a directory",
    IsADirectoryError: "is a directory; give files, or a glob such as 'dir/*.tfrecord'",
    NotADirectoryError: "a part of the path is not a directory",
    PermissionError: "permission denied",
}


def describe_error(error: BaseException, where: str | None = None) -> str:
    """One line saying what went wrong and where: the url, and for corrupt data the
    record index and byte offset the error carries."""
    if isinstance(error, OSError) and not isinstance(error, ShardkitError):
        filename = getattr(error, "filename", None)
        if filename and not (where and _same_path(str(filename), str(where))):  # where: as the user named it
            where = filename
        reason = _OS_REASONS.get(type(error)) or error.strerror or f"{type(error).__name__}: {error}"
    elif isinstance(error, ShardkitError):
        reason = str(error)
    else:
        reason = f"{type(error).__name__}: {error}"
    if where and str(where) not in reason:
        reason = f"{where}: {reason}"
    return one_line(reason)


def _same_path(a: str, b: str) -> bool:
    return a == b or ("://" not in a + b and os.path.abspath(a) == os.path.abspath(b))


def exit_code_of(error: BaseException) -> int:
    """:data:`EXIT_CORRUPT` for corrupt data or data that contradicts its manifest or
    index, :data:`EXIT_USAGE` for anything else."""
    return EXIT_CORRUPT if isinstance(error, (CorruptRecordError, MismatchError)) else EXIT_USAGE


def fail(args: argparse.Namespace, error: BaseException, where: str | None = None) -> int:
    """Report ``error`` as one line on stderr and return its exit code."""
    if getattr(args, "traceback", False):
        traceback.print_exception(type(error), error, error.__traceback__)
    print(f"shardkit {args.command}: error: {redact(describe_error(error, where))}", file=sys.stderr)
    return exit_code_of(error)


def stdout_closed() -> bool:
    """Whether a BrokenPipeError came from stdout (its reader, ``head`` say, has exited) rather than from
    a socket: the write end of a pipe without a reader polls as an error (POLLERR)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or stdout is no file
        return False


def closed_pipe() -> int:
    """End quietly after stdout's reader went away, as command-line tools do on SIGPIPE: point stdout
    at /dev/null so that flushing it at exit does not print "Exception ignored ... BrokenPipeError"."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_PIPE
