"""An opt-in local disk cache of remote shards, shared by every worker and rank of a machine.

Whole objects are cached, one file each, named by a hash of the url AND of
the object's identity (ETag / version / size / modification time, see
:func:`shardkit.remote.identity_of`): a changed object has a new name, so it
is fetched again and never read stale. How it stays correct:

- **Atomic entries.** An entry is written to ``<name>.tmp.<pid>`` and renamed
  to ``<name>`` only once all of the object's bytes are in it (and their count
  is the size the store gave). A writer killed half way leaves a temp file and
  a lock, never a ``<name>``; so nothing half written is ever read as whole.
- **One filler per entry.** A writer takes ``<name>.lock`` with ``O_EXCL`` and
  writes its pid in it. Another worker wanting the same entry waits for the
  rename and then uses the winner's file. A lock whose pid is dead (a killed
  writer) is broken and its temp file removed.
- **Least recently used eviction.** Each use touches the entry's mtime; after
  an entry is added, the oldest entries are deleted until the cache is under
  ``cache_limit_bytes``. An entry still open in another process stays readable
  after it is deleted (POSIX keeps an unlinked open file). An object bigger than
  the whole limit is not cached: it is streamed.

Reading an entry is reading a local file (``os.pread`` in the TFRecord reader),
so a second epoch runs at local-disk speed; it still asks the store for the
object's identity once per open (one HEAD), which is how a changed object is
noticed.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Final

from shardkit.remote import RemoteFile, RemoteOptions, _count, identity_of

__all__ = ["Cache"]

_LOCK: Final = ".lock"
_TMP: Final = ".tmp."
_POLL: Final = 0.02


class Cache:
    """The cache in directory ``root``, kept under ``limit`` bytes (``None``: unbounded)."""

    def __init__(self, root: str, limit: int | None = None) -> None:
        self.root = root
        self.limit = limit

    def entry_path(self, url: str, info: dict[str, Any]) -> str:
        """Where the object ``url`` with metadata ``info`` is cached."""
        key = hashlib.sha256(url.encode()).hexdigest()[:32]
        version = hashlib.sha256(identity_of(info).encode()).hexdigest()[:16]
        return os.path.join(self.root, f"{key}-{version}")

    def open(self, fs: Any, path: str, url: str, info: dict[str, Any], options: RemoteOptions) -> Any:
        """The cached copy of ``url`` opened for reading (fetched into the cache first if missing),
        or ``None`` when it is too big to cache."""
        size = int(info["size"])
        if self.limit is not None and size > self.limit:
            return None
        os.makedirs(self.root, exist_ok=True)
        entry = self.entry_path(url, info)
        deadline = time.monotonic() + options.retry.max_seconds + 600
        filled = False
        while True:
            local = self._open_entry(entry, size)
            if local is not None:
                _count(cache_hits=0 if filled else 1)
                return local
            if self._try_lock(entry):
                try:
                    if not os.path.exists(entry):  # a winner may have renamed it since we looked
                        _count(cache_misses=1)
                        self._fill(entry, RemoteFile(fs, path, url, info, options), size)
                        filled = True
                        self.evict(keep=entry)
                finally:
                    _unlink(entry + _LOCK)
                continue
            if time.monotonic() > deadline:  # the other filler is stuck: read remotely instead
                return None
            time.sleep(_POLL)

    def _open_entry(self, entry: str, size: int) -> Any:
        from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

        try:
            opener = LocalFileOpener(entry, "rb", fs=LocalFileSystem())
        except FileNotFoundError:
            return None
        if os.fstat(opener.fileno()).st_size != size:  # not ours to trust: fetch it again
            opener.close()
            _unlink(entry)
            return None
        os.utime(entry)  # least recently used = oldest mtime
        return opener

    def _try_lock(self, entry: str) -> bool:
        """Take the fill lock of ``entry``; break it first if its holder is dead."""
        lock = entry + _LOCK
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if _holder_alive(lock):
                return False
            _unlink(lock)  # a killed writer's: remove it and its temp file, then race for it again
            self._remove_temps(entry)
            return False
        with os.fdopen(fd, "w") as handle:
            handle.write(str(os.getpid()))
        return True

    def _fill(self, entry: str, remote: RemoteFile, size: int) -> None:
        tmp = f"{entry}{_TMP}{os.getpid()}"
        try:
            with remote, open(tmp, "wb") as out:
                written = 0
                while chunk := remote.read(remote.options.block_size):
                    out.write(chunk)
                    written += len(chunk)
                if written != size:
                    raise OSError(f"{remote.url}: fetched {written} bytes of {size}; not caching a partial object")
                out.flush()
                os.fsync(out.fileno())
            os.rename(tmp, entry)
        except BaseException:
            _unlink(tmp)
            raise

    def _remove_temps(self, entry: str) -> None:
        prefix = os.path.basename(entry) + _TMP
        for name in os.listdir(self.root):
            if name.startswith(prefix):
                _unlink(os.path.join(self.root, name))

    def entries(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every complete entry, oldest first."""
        found = []
        if not os.path.isdir(self.root):
            return found
        for name in os.listdir(self.root):
            if name.endswith(_LOCK) or _TMP in name:
                continue
            full = os.path.join(self.root, name)
            try:
                stat = os.stat(full)
            except FileNotFoundError:
                continue
            found.append((stat.st_mtime, stat.st_size, full))
        return sorted(found)

    def evict(self, keep: str | None = None) -> None:
        """Delete the least recently used entries until the cache is within its limit."""
        if self.limit is None:
            return
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        for _, size, full in entries:
            if total <= self.limit:
                return
            if full != keep:
                _unlink(full)
                total -= size


def _holder_alive(lock: str) -> bool:
    try:
        with open(lock) as handle:
            text = handle.read().strip()
    except FileNotFoundError:
        return True  # released just now: look again
    if not text.isdigit():  # being written this instant, or garbage: judge by age
        try:
            return time.time() - os.stat(lock).st_mtime < 10
        except FileNotFoundError:
            return True
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
