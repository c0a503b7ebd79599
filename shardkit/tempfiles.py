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
import multiprocessing.process
import multiprocessing.util
import os
import tempfile
import threading
import uuid
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


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary name beside it, flushed to disk,
    then renamed into place (a kill mid-write leaves the previous file or none, never half of one)."""
    partial = f"{path}.{uuid.uuid4().hex}.partial"
    try:
        with removed_if_exiting(partial), open(partial, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


#: The longest path a Unix socket may have on Linux (``sun_path`` is 108 bytes with its NUL).
SOCKET_PATH_MAX = 107

# What multiprocessing adds under the temporary folder for the socket through which a worker
# passes a tensor's file descriptor: its ``pymp-XXXXXXXX`` folder, then ``listener-XXXXXXXX``.
_PYMP, _LISTENER = len("/pymp-") + 8, len("/listener-") + 8


def probe_writable(path: str) -> None:
    """Create and remove a file beside ``path``: whether a temporary file renamed to ``path`` can be written
    there, tried for real (permissions alone do not say, for root or on a read-only mount).

    Raises:
        OSError: the folder does not take a new file (the OS's reason).
    """
    probe = f"{path}.probe-{os.getpid()}"
    with open(probe, "x"):
        pass
    os.remove(probe)


def socket_folder_problem(who: str, sharing_strategy: str) -> str | None:
    """Why DataLoader workers of this process could not pass tensors, or None.

    Under torch's ``file_descriptor`` sharing strategy (Linux's default) a worker sends each
    tensor's file descriptor through a Unix socket under the temporary folder. When that path is
    longer than :data:`SOCKET_PATH_MAX`, binding it fails in the worker's queue thread, which
    prints the error and drops the batch, and the loader waits for it forever. A long ``TMPDIR``
    (a deep job folder) does this to every DataLoader; shardkit's loaders raise this instead,
    beginning with ``who``.
    """
    if sharing_strategy != "file_descriptor":
        return None
    config = getattr(multiprocessing.process.current_process(), "_config", {})
    made = config.get("tempdir")  # multiprocessing's folder, made already: forked workers inherit it
    folder = made if made else tempfile.gettempdir()
    length = len(os.fsencode(folder)) + (0 if made else _PYMP) + _LISTENER
    if length <= SOCKET_PATH_MAX:
        return None
    return (
        f"{who}: the temporary folder {folder!r} is too long for DataLoader workers: they pass tensors "
        f"through a Unix socket under it, whose path would be {length} bytes (at most {SOCKET_PATH_MAX}), "
        "so the workers could not send a batch and the loader would wait forever. Set TMPDIR to a shorter "
        "folder (e.g. TMPDIR=/tmp), or call torch.multiprocessing.set_sharing_strategy('file_system')"
    )


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # one held by another thread of the parent at fork time is never released


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
