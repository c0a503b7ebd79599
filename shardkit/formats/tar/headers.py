"""Tar headers: their checksums, sizes and names, and the window of bytes they are read from.

Why not ``tarfile``: it builds a ``TarInfo`` object per member through a
chain of Python calls, which is most of WebDataset's time on small samples.
Here a header is sliced from a block read with one ``os.pread`` (local files)
or one ranged read (remote, gzip), its checksum checked, its name and size
parsed, and the data sliced from the same block (measured in
``benchmarks/formats.py``). Nothing here trusts a header: a size field never
sizes an allocation, and a name is read only from a header whose checksum
verifies (:func:`_guess_name` excepted, which reads a damaged one on purpose).

Its names are underscored: they are shared inside :mod:`shardkit.formats.tar` only.
"""

from __future__ import annotations

import os
import re
from typing import Any, Final

from fsspec.implementations.local import LocalFileOpener

from shardkit.io.files import BLOCK_SIZE

_BLOCK: Final = 512
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")
_REGULAR: Final = (b"0", b"\0", b"7")
_ZEROS: Final = bytes(_BLOCK)
_SKIPPED: Final = (b"1", b"2", b"3", b"4", b"5", b"6", b"g", b"V", b"M", b"N", b"S", b"D")
_EXTENDED: Final = (b"x", b"L", b"K")
_KNOWN: Final = frozenset(_REGULAR + _SKIPPED + _EXTENDED)
_EXTENDED_NAMES: Final = (b"@PaxHeader", b"PaxHeaders.", b"@LongLink")  # Python, GNU tar; GNU long names


def _checksum_ok(header: bytes) -> bool:
    """The header checksum: the sum of its bytes with the checksum field read as spaces (unsigned or signed).

    Zero bytes add nothing, so the long runs of them at the ends of the fields are stripped before summing.
    """
    field = header[148:156]
    try:
        stored = int(field.replace(b"\0", b" ") or b"x", 8)
    except ValueError:
        return False
    unsigned = sum(header[:148].rstrip(b"\0")) + sum(header[156:].rstrip(b"\0")) + 256
    if stored == unsigned:
        return True
    signed = unsigned - 2 * sum(b for b in header if b > 127) + 2 * sum(b for b in field if b > 127)
    return stored == signed


def _header_size(header: bytes) -> int:
    """The member size of a sound header: its checksum verifies and its size field is a number; else -1."""
    if not _checksum_ok(header):
        return -1
    try:
        return _size_of(header)
    except ValueError:
        return -1


def _header_problem(header: bytes) -> str:
    """Why :func:`_header_size` refused ``header``."""
    if not _checksum_ok(header):
        return f"tar header checksum mismatch (header bytes {header[:16]!r}...)"
    return f"tar header size field {header[124:136]!r} is not a number"


def _size_of(header: bytes) -> int:
    field = header[124:136]
    if field[0] & 0x80:  # GNU base-256 for sizes of 8 GB and more
        return int.from_bytes(field[1:], "big")
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _name_of(header: bytes) -> str:
    name = header[0:100].split(b"\0", 1)[0]
    if header[257:262] == b"ustar" and header[345] != 0 and header[257:265] != b"ustar  \0":
        name = header[345:500].split(b"\0", 1)[0] + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _pax_path(data: bytes) -> str | None:
    """The ``path`` record of a pax extended header, if any. Raises ValueError naming a malformed record.

    Records are ``"<length> key=value\\n"``, ``length`` counting the whole
    record. Each is checked as ``tarfile`` checks it (digits, at least 5, the
    record inside the header, a key and ``=``, the newline last), so a length
    that lies cannot stretch a value over the next record or past the header.
    A NUL byte ends the records, as in ``tarfile``.
    """
    found = None
    pos, end = 0, len(data)
    while pos < end and data[pos]:
        space = data.find(b" ", pos)
        digits = data[pos:space] if space > pos else b""
        if not digits.isdigit():
            raise ValueError(f"a record at byte {pos} has no length field")
        length = int(digits)
        last = pos + length - 1
        if length < 5 or last >= end or data[last] != 0x0A:
            raise ValueError(f"the record at byte {pos} says it is {length} bytes long, in {end} bytes of records")
        key, equals, value = data[space + 1 : last].partition(b"=")
        if not key or not equals:
            raise ValueError(f"the record at byte {pos} has no 'key='")
        if key == b"path":
            found = value.decode("utf-8", "surrogateescape")
        pos = last + 1
    return found


def _split_key(name: str) -> tuple[str, str] | None:
    """(key, lowercased extension): the path up to the first dot of the basename, and the rest.

    WebDataset's ``^((?:.*/|)[^.]+)[.]([^/]*)$``, without the regex in the
    common case; the regex decides the odd ones (a basename without a dot or
    starting with one, a newline in the name).
    """
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot <= slash + 1 or "\n" in name:
        match = _KEY.match(name)
        return None if match is None else (match.group(1), match.group(2).lower())
    return name[:dot], name[dot + 1 :].lower()


def _long_name(kind: bytes, data: bytes) -> str | None:
    """The name a pax (``x``) or GNU long-name (``L``) header gives the member after it. Raises ValueError."""
    return _pax_path(data) if kind == b"x" else data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


class _Blocks:
    """A window over the tar's bytes: ``need(n)`` makes ``n`` bytes available from ``pos``."""

    __slots__ = ("buf", "pos", "base", "_fd", "_stream", "_eof", "_opened_size")

    def __init__(self, source: Any, offset: int) -> None:
        self.buf: bytes = b""
        self.pos = 0
        self.base = offset  # stream offset of buf[0]
        self._fd: int | None = source.fileno() if isinstance(source, LocalFileOpener) else None
        self._stream: Any = None if self._fd is not None else source
        self._eof = False
        self._opened_size = os.fstat(self._fd).st_size if self._fd is not None else None

    @property
    def offset(self) -> int:
        return self.base + self.pos

    def need(self, n: int) -> bool:
        """Whether ``n`` bytes are available at ``pos`` (reading more as needed); False at the end."""
        while len(self.buf) - self.pos < n and not self._eof:
            want = max(BLOCK_SIZE, n - (len(self.buf) - self.pos))
            if self._fd is not None:  # never ask pread for more than the file holds: a size field may lie
                want = min(want, max(0, os.fstat(self._fd).st_size - self.base - len(self.buf)))
                chunk = os.pread(self._fd, want, self.base + len(self.buf)) if want else b""
            else:
                chunk = self._stream.read(min(want, BLOCK_SIZE))
            if not chunk:
                self._eof = True
                break
            self.base += self.pos
            self.buf = self.buf[self.pos :] + chunk
            self.pos = 0
        return len(self.buf) - self.pos >= n

    def shrank(self) -> int | None:
        """The file's size now, if it is a local file smaller than when it was opened."""
        if self._fd is None:
            return None
        size = os.fstat(self._fd).st_size
        return size if size < self._opened_size else None  # type: ignore[operator]


def _guess_name(header: bytes) -> tuple[str, str] | None:
    """(key, extension) a damaged header names, read despite its checksum; ``("", "")`` for an
    extended header (pax, GNU long name: it belongs to the member after it), known by its type flag
    or, when the flip hit that, by the name writers give it; None when the name gives none."""
    if header[156:157] in _EXTENDED or any(mark in header[:100] for mark in _EXTENDED_NAMES):
        return "", ""
    return _split_key(_name_of(header))
