"""Temporary files owned by the process that made them.

Datasets hand workers the *path* of a temporary file (a memory-mapped shard
list, the private copy of a loaded manifest, a lock file). The file must outlive every worker and be deleted exactly
once, by its maker: a forked child inherits the maker's finalizers but must not
run them, and an unpickled copy never owns the file.

A file is deleted when its owner object is garbage collected, or when its
process ends while the owner is still alive. A DataLoader worker ends through
``multiprocessing`` (``os._exit`` after its target returns), which skips
``atexit`` and so ``weakref.finalize``'s exit hook: each process therefore also
registers one ``multiprocessing`` exit finalizer, which workers do run, that
deletes the files the process still owns.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import threading
import weakref
from collections.abc import Iterator

_owned: dict[str, int] = {}  # path -> pid of the process that made it (a forked child inherits the parent's)
_hooked_pid = -1
_lock = threading.Lock()


def delete_with(owner: object, path: str) -> weakref.finalize:
    """Delete ``path`` when ``owner`` is garbage collected or at exit, in this process only."""
    _own(path)
    return weakref.finalize(owner, _remove_owned, path, os.getpid())


def _own(path: str) -> None:
    """Have this process's exit delete ``path`` (if it is still this process's then)."""
    global _hooked_pid
    with _lock:
        _owned[path] = os.getpid()
        if _hooked_pid != os.getpid():  # a worker's registry starts empty: hook this process once
            multiprocessing.util.Finalize(None, remove_all_owned, exitpriority=0)
            _hooked_pid = os.getpid()


@contextlib.contextmanager
def removed_if_exiting(path: str) -> Iterator[None]:
    """While the block runs, this process's end (a worker's exit, an orphaned worker's stop) deletes ``path``;
    after it, ``path`` is the caller's again (left alone)."""
    _own(path)
    try:
        yield
    finally:
        _owned.pop(path, None)


def remove_all_owned() -> None:
    """Delete every file this process made that is still alive (never a parent's): at its exit."""
    for path, pid in list(_owned.items()):
        _remove_owned(path, pid)


def _remove_owned(path: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        _owned.pop(path, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # one held by another thread of the parent at fork time is never released


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
