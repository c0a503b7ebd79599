"""DataLoader workers that outlive their main process stop within a second, and clean up when killed.

torch's own watchdog in a worker looks at the parent only between fetches
(every 5 s when idle, or after a whole batch), so workers whose main process
was SIGKILLed kept reading, decoding and filling the cache for seconds. The
first time shardkit iterates in a worker, :func:`guard_worker` starts a daemon
thread that waits on the main process's sentinel and checks every
:data:`POLL_SECONDS` that the worker was not re-parented; when the main
process is gone, the worker deletes what it created (its temporary files, its
``pymp-*`` dir) and exits.

Why polling and not ``prctl(PR_SET_PDEATHSIG)``: Linux sends that signal when
the *thread* that started the worker ends, not its process, so persistent
workers started from a short-lived thread would be killed while their loader
lives; and it is Linux only. The watchdog costs a ``getppid`` every 0.2 s.

DataLoader also SIGTERMs workers that do not exit within 5 s of being told to
(after a worker's error, the iterator left to the garbage collector), and so
does multiprocessing, at exit, to the workers of loaders still alive: a
SIGTERM skips every exit hook, so those workers left their temporary files. A
worker with the default SIGTERM action gets a handler that deletes them and
then exits with status 0. Not by dying of the signal again: the cleanup makes
the death a moment late, so the exiting parent's SIGCHLD handler (DataLoader's)
runs before it reaps the worker, sees "killed by signal: Terminated" and fails
the parent's exit. A worker that ends with status 0 while its loader still
waits for it is reported by DataLoader all the same ("exited unexpectedly").
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import threading
from typing import Any, Final

from shardkit.tempfiles import remove_all_owned

POLL_SECONDS: Final = 0.2
_guarded_pid = -1


def guard_worker() -> None:
    """Start this worker process's orphan watchdog (once per process; a no-op in a process without a parent)."""
    global _guarded_pid
    if _guarded_pid == os.getpid():
        return
    _guarded_pid = os.getpid()
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _clean_up_then_exit)
    watchdog = threading.Thread(
        target=_watch, args=(parent, os.getppid()), name="shardkit-orphan-watchdog", daemon=True
    )
    watchdog.start()


def _watch(parent: Any, started_under: int) -> None:
    """Two signs, as either alone can miss: the parent's sentinel pipe closes (any start method; but a
    sibling forked later holds its write end too), and this process is re-parented (under forkserver the
    parent process is the fork server, which exits with the main process)."""
    while os.getppid() == started_under and parent.is_alive():
        parent.join(POLL_SECONDS)
    _exit_orphaned()


def _exit_orphaned() -> None:
    """Delete what this process made, then end it now (its main thread may be busy for seconds more)."""
    try:
        _remove_what_this_process_made()
    finally:
        os._exit(1)


def _clean_up_then_exit(signum: int, frame: object) -> None:
    try:
        _remove_what_this_process_made()
    finally:
        os._exit(0)


def _remove_what_this_process_made() -> None:
    """Its temporary files and cache fills (:mod:`shardkit.tempfiles`) and its ``pymp-*`` dir: what its
    exit hooks would have deleted."""
    remove_all_owned()
    tempdir = getattr(multiprocessing.current_process(), "_config", {}).get("tempdir")  # where pymp-* lives
    if tempdir:
        shutil.rmtree(tempdir, ignore_errors=True)
