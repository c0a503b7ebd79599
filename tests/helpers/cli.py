"""The command line in this process: ``shardkit.cli.main(argv)`` with its output captured as a process's would be.

A ``python -m shardkit`` per call costs a fresh interpreter importing torch, pyarrow and fsspec (2-3 s of
CPU each); a test about what a command prints and returns does not need it. What only a process shows
(``python -m``, exit codes through the shell, a closed pipe) is tested as a process in
tests/cli/test_cli_process.py."""

from __future__ import annotations

import contextlib
import io
import subprocess
import warnings


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    """``shardkit *argv`` as ``main(argv)``: its exit code, stdout and stderr as text.

    argparse's exits (``--help``, a usage error) are a return code, as they are for a process. A warning
    the command raises is printed to its stderr under the interpreter's default filters, as a process
    prints it, so a test that wants one error line sees a warning too. An exception ``main`` lets out
    (a process would print a traceback) fails the calling test."""
    from shardkit.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with warnings.catch_warnings(record=True) as caught:
        _interpreter_default_filters()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main(list(argv))
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    for warning in caught:
        stderr.write(warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno))
    return subprocess.CompletedProcess(["shardkit", *argv], code, stdout.getvalue(), stderr.getvalue())


def _interpreter_default_filters() -> None:
    """The warning filters of a plain ``python`` (see ``warnings.filters`` without ``-W``)."""
    warnings.resetwarnings()
    warnings.simplefilter("default")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category)
