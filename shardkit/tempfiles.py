"""Temporary files owned by the process that made them.

Datasets hand workers the *path* of a temporary file (a memory-mapped shard
list, the private copy of a loaded manifest, a lock file). The file must outlive every worker and be deleted exactly
once, by its maker: a forked child inherits the maker's finalizers but must not
run them, and an unpickled copy never owns the file.
"""

from __future__ import annotations

import contextlib
import os
import weakref


def delete_with(owner: object, path: str) -> weakref.finalize:
    """Delete ``path`` when ``owner`` is garbage collected or at exit, in this process only."""
    return weakref.finalize(owner, _remove_owned, path, os.getpid())


def _remove_owned(path: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
