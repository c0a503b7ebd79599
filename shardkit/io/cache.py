"""An opt-in local disk cache of remote shards, shared by every worker and rank of a machine.

Whole objects are cached, one file each, named by a hash of the url AND of
the object's identity (ETag / version / size / modification time, see
:func:`shardkit.io.identity.describe`): a changed object has a new name, so it
is fetched again and never read stale. How it stays correct:

- **Atomic entries.** An entry is written to ``<name>.tmp.<pid>.<random>`` and renamed
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
  after it is deleted (POSIX keeps an unlinked open file): a read that has
  opened an entry completes from it, one that finds it gone fetches it
  again. An object bigger than the whole limit is not cached: it is streamed.
- **Nothing planted is followed or trusted.** The cache directory is made
  ``0700`` (a ``cache_dir`` others can write to is warned about), temporaries
  are made by ``mkstemp`` (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode ``0600``),
  and an entry is opened with ``O_NOFOLLOW`` and used only if it is a regular
  file owned by this user of the object's size: anything else at an entry's
  name is deleted and the object fetched again. So a symlink planted at a
  temporary's or an entry's name never makes shardkit write through it or read
  its target as a shard.

Reading an entry is reading a local file (``os.pread`` in the TFRecord reader),
so a second epoch runs at local-disk speed; it still asks the store for the
object's identity once per open (one HEAD), which is how a changed object is
noticed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import tempfile
import time
import warnings
from typing import Any, Final

from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

from shardkit.io.counters import count
from shardkit.io.identity import describe
from shardkit.io.options import RemoteOptions
from shardkit.io.reader import RemoteFile
from shardkit.tempfiles import removed_if_exiting

__all__ = ["Cache"]

_LOCK: Final = ".lock"
_TMP: Final = ".tmp."
_POLL: Final = 0.02
_warned_roots: set[str] = set()


class _Unusable(Exception):
    """Something not ours sits at an entry's name and cannot be removed: read the object remotely."""


class Cache:
    """The cache in directory ``root``, kept under ``limit`` bytes (``None``: unbounded)."""

    def __init__(self, root: str, limit: int | None = None) -> None:
        self.root = root
        self.limit = limit

    def entry_path(self, url: str, info: dict[str, Any]) -> str:
        """Where the object ``url`` with metadata ``info`` is cached."""
        key = hashlib.sha256(url.encode()).hexdigest()[:32]
        # named by describe(), not identity(): entries cached by earlier versions keep their names
        pinned = hashlib.sha256(describe(info).encode()).hexdigest()[:16]
        return os.path.join(self.root, f"{key}-{pinned}")

    def open(self, fs: Any, path: str, url: str, info: dict[str, Any], options: RemoteOptions) -> Any:
        """The cached copy of ``url`` opened for reading (fetched into the cache first if missing),
        or ``None`` when it is too big to cache."""
        size = int(info["size"])
        if self.limit is not None and size > self.limit:
            return None
        _make_private_dir(self.root)
        entry = self.entry_path(url, info)
        deadline = time.monotonic() + options.retry.max_seconds + 600
        filled = False
        while True:
            try:
                local = self._open_entry(entry, size)
            except _Unusable:
                return None
            if local is not None:
                count(cache_hits=0 if filled else 1)
                return local
            if self._try_lock(entry):
                try:
                    with removed_if_exiting(entry + _LOCK):  # also by an orphaned worker's sudden stop
                        if not os.path.lexists(entry):  # a winner may have renamed it since we looked
                            count(cache_misses=1)
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
        """``entry`` opened for reading, or None when there is none (or what was there is refused and gone)."""
        try:
            opened = _EntryFile(entry)
        except FileNotFoundError:
            return None
        except OSError as error:
            # ELOOP: a symlink planted at the entry's name; EACCES: another user's file we may not read
            if error.errno not in (errno.ELOOP, errno.EACCES):
                raise
            return _refuse(entry)
        found = os.fstat(opened.fileno())
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid() or found.st_size != size:
            opened.close()  # not ours to trust: fetch it again
            return _refuse(entry)
        # Least recently used = oldest mtime. Touched through the descriptor: another process may evict the
        # entry right after our open, and the read goes on from the open file (POSIX keeps it) all the same.
        os.utime(opened.fileno())
        return opened

    def _try_lock(self, entry: str) -> bool:
        """Take the fill lock of ``entry``; break it first if its holder is dead."""
        lock = entry + _LOCK
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
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
        # mkstemp: O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600, so nothing planted at the name is written through
        fd, tmp = tempfile.mkstemp(prefix=f"{os.path.basename(entry)}{_TMP}{os.getpid()}.", dir=self.root)
        try:
            with removed_if_exiting(tmp), remote, os.fdopen(fd, "wb") as out:
                written = 0
                while chunk := remote.read(remote.options.block_size):
                    out.write(chunk)
                    written += len(chunk)
                if written != size:
                    raise OSError(f"{remote.url}: fetched {written} bytes of {size}; not caching a partial object")
                out.flush()
                os.fsync(out.fileno())
            os.rename(tmp, entry)  # replaces whatever is at the name, a symlink included, never its target
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
                found_stat = os.lstat(full)
            except FileNotFoundError:
                continue
            found.append((found_stat.st_mtime, found_stat.st_size, full))
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


class _EntryFile(LocalFileOpener):
    """An entry opened read-only without following a symlink at its name (the readers take a
    ``LocalFileOpener`` as a local file: they ``pread`` its descriptor)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, "rb", fs=LocalFileSystem())

    def _open(self) -> None:
        if self.f is None or self.f.closed:
            self.f = open(self.path, "rb", opener=_open_no_follow)  # noqa: SIM115 - closed with the opener
            self.size = self.f.seek(0, 2)
            self.f.seek(0)


def _open_no_follow(path: str, flags: int) -> int:
    # O_NONBLOCK: a FIFO planted at the name must not block the open (no effect on a regular file)
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


def _refuse(entry: str) -> None:
    """Delete what is at ``entry`` (not a file of ours); raise :class:`_Unusable` if it cannot be deleted."""
    try:
        _unlink(entry)
    except PermissionError as error:
        raise _Unusable(entry) from error


def _make_private_dir(root: str) -> None:
    """Create ``root`` as ``0700``; warn (once per process) if an existing one is writable by other users."""
    os.makedirs(os.path.dirname(root) or ".", exist_ok=True)
    try:
        os.mkdir(root, 0o700)
        os.chmod(root, 0o700)  # whatever the umask
        return
    except FileExistsError:
        pass
    mode = os.stat(root).st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and root not in _warned_roots:
        _warned_roots.add(root)
        warnings.warn(
            f"cache_dir {root!r} is writable by other users (mode {stat.filemode(mode)}): they can plant files "
            "in it. shardkit refuses entries that are symlinks or not yours, but use a directory only you can "
            f"write to (chmod 700 {root})",
            stacklevel=4,
        )


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
