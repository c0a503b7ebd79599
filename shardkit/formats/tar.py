"""WebDataset tar shards: samples grouped by key, read with our own header parser.

A tar file is a sequence of 512-byte headers, each followed by its member's
data padded to 512 bytes, ended by two zero blocks. As in WebDataset, the
regular files whose paths share everything up to the first dot of the
basename form one sample, ``{"__key__": key, "__url__": url, ext: bytes, ...}``
(extensions lowercased; ``__*__`` meta members, directories and links are
skipped); a sample is a record. Tars written by ``webdataset.TarWriter``,
``tarfile`` (ustar, GNU and pax formats) and GNU ``tar`` are read, and
:class:`TarWriter` writes ustar tars those read back byte-for-byte.

Why not ``tarfile``: it builds a ``TarInfo`` object per member through a
chain of Python calls, which is most of WebDataset's time on small samples.
Here a header is sliced from a block read with one ``os.pread`` (local files)
or one ranged read (remote, gzip), its checksum checked, its name and size
parsed, and the data sliced from the same block (measured in
``benchmarks/formats.py``).

Trust nothing: every header's checksum is checked; a bad one, a size field
that is not a number or runs past the end of the file (it never sizes an
allocation), a malformed pax record, or a file that ends inside a member or
without the end-of-archive marker raises :class:`~shardkit.CorruptRecordError`
naming the sample index and the header's byte offset.

A bad header costs exactly the sample it belongs to (``framing_intact``
true, so ``on_error="skip"`` skips that sample and counts it). With an index
(``shardkit index``: the byte offset of each sample's first header and the
tar's size, checked when used: size, ascending offsets, a valid header at the
last offset, no index boundary inside a sample) the index says where the next
sample starts; counts need no scan and a range starts with a seek. Without
one the reader *resyncs*: it scans on at 512-byte boundaries for the next
header whose checksum verifies and whose size and type parse, and blames the
damaged run on one sample (:func:`_blame`: the one its name names, else the
one around it by the neighbours' keys and extensions); that sample's members
after the run are dropped. Record numbering: the damaged sample keeps its
index and every later sample keeps its own, so a count from an index built
before the damage, a count from a scan after it (which counts the lost
sample, as :meth:`TarFormat.scan` does) and the reader agree. Where they
cannot (a run that destroyed several whole samples counts as one, a header
turned to garbage over a pax header may count as one sample more, a tar
stored inside a member can fake a header) the source reports the difference
against the planned count (missing or extra records): never silently. The
retry after a damaged sample seeks to the next one (a :class:`ResumeHint`);
gzip-compressed tars are streamed, so their counts and ranges come from a
scan and a retry reads the stream again from its start. A file cut short
loses the rest of the range (``framing_intact`` false): nothing follows. A
member whose size runs past the end of the file is told apart from a cut by
what follows its header: sound headers, or the end-of-archive marker, mean
the size field lies, and it costs its sample like any bad header.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
import time
from collections.abc import Iterator
from typing import Any, Final, NamedTuple

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileOpener

from shardkit.errors import CorruptRecordError, ShardkitError, redact_url
from shardkit.formats.base import FormatBase, RecordBound, ResumeHint, file_record_bound
from shardkit.formats.offsets import IndexFileError, index_path_for, load_offsets, write_offsets
from shardkit.io.files import BLOCK_SIZE, CompressedStreamError, open_input, open_raw
from shardkit.io.remote import RemoteOptions

__all__ = ["TarFormat", "TarWriter"]

INDEX_MAGIC: Final = b"SKTARIX1"
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


class _Parser:
    """Walks the headers of one tar from a sample boundary and yields samples."""

    def __init__(self, url: str, blocks: _Blocks, first: int, compressed: bool) -> None:
        self.url = url
        self.blocks = blocks
        self.index = first  # index of the next sample
        self.compressed = compressed
        self.damage = ""  # what was wrong with the last damaged run members() yielded

    def error(self, offset: int, reason: str) -> CorruptRecordError:
        return CorruptRecordError(self.url, self.index, offset, self._note(reason))

    def _note(self, reason: str) -> str:
        return reason + " (offset in the uncompressed gzip stream)" if self.compressed else reason

    def members(self, resync: bool = False) -> Iterator[tuple[str | None, int, bytes]]:
        """(name, offset of its first header, data) of each regular member, to the end-of-archive marker.

        A bad header raises, or with ``resync`` yields ``(None, offset, header)``
        for the damaged run and goes on at the next header that verifies.
        Every sample's path runs through this loop, hence the locals and the
        inline checks of what is in the window before calling ``need``.
        """
        blocks = self.blocks
        long_name: str | None = None
        start = -1
        while True:
            pos = blocks.pos
            if len(blocks.buf) - pos < _BLOCK:
                self._need(_BLOCK, blocks.offset, "the file ends without the end-of-archive marker")
                pos = blocks.pos
            buf = blocks.buf
            header = buf[pos : pos + _BLOCK]
            at = blocks.base + pos
            if header == _ZEROS:
                return
            try:  # inline: every member's path (see _header_size)
                size = _size_of(header) if _checksum_ok(header) else -1
            except ValueError:
                size = -1
            if size < 0:
                if not resync:
                    raise self.error(at, _header_problem(header))
                ended = self._resync(pos)
                self.damage = _header_problem(header)
                yield None, at, header  # a damaged run from `at` to the window's position
                long_name, start = None, -1
                if ended:
                    return
                continue
            padded = _BLOCK + -(-size // _BLOCK) * _BLOCK
            if len(buf) - pos < padded:
                if not self._fits(padded, at):  # the size field runs past the end of the file
                    self.damage, ended = self._past_end(pos, at, header, size)
                    if not resync:
                        raise self.error(at, self.damage)
                    yield None, at, header
                    long_name, start = None, -1
                    if ended:
                        return
                    continue
                pos, buf = blocks.pos, blocks.buf
            data = buf[pos + _BLOCK : pos + _BLOCK + size]
            blocks.pos = pos + padded
            kind = header[156:157]
            if start < 0:
                start = at
            if kind == b"x" or kind == b"L":
                try:
                    long_name = _long_name(kind, data)
                except ValueError as problem:
                    what = "pax" if kind == b"x" else "GNU long name"
                    self.damage = f"malformed {what} header {data[:40]!r}: {problem}"
                    if not resync:
                        raise self.error(at, self.damage) from None
                    yield None, at, header  # the run is this extended header: it belongs to the next member
                    long_name, start = None, -1
                continue
            name = long_name or _name_of(header)
            long_name = None
            if kind in _REGULAR:
                yield name, start, data
            elif kind not in _SKIPPED and kind != b"K":
                raise self.error(at, f"unknown tar member type {kind!r} for {name!r}")
            start = -1

    def _need(self, n: int, at: int, reason: str) -> None:
        """Make ``n`` bytes available at the window's position, or raise the located error ``reason``."""
        if not self._fits(n, at):
            raise self._truncated(at, reason)

    def _fits(self, n: int, at: int) -> bool:
        """Whether ``n`` bytes are available at the window's position (reading more as needed).

        A damaged compressed stream raises the located error for the header at ``at``.
        """
        try:
            return self.blocks.need(n)
        except CompressedStreamError as error:
            failure = self.error(at, error.reason)
            failure.compressed_offset = error.compressed_offset if error.compressed_offset >= 0 else None
            raise failure from None

    def _past_end(self, pos: int, at: int, header: bytes, size: int) -> tuple[str, bool]:
        """The member at ``pos`` (header at byte ``at``) says it is ``size`` bytes, more than the file holds.

        Either its size field lies, and then the headers after it are sound:
        the window resyncs at the next one, or the archive ends (its zero
        blocks are there) and only this member's sample is lost. Or the file
        was cut inside the member: that raises, as nothing after it can be read.
        Returns (what is wrong, whether the archive ends at the damage).
        """
        name, buf = _name_of(header), self.blocks.buf  # the window holds the rest of the file
        marker = len(buf) - pos >= 3 * _BLOCK and buf[-2 * _BLOCK :] == _ZEROS * 2
        ended = self._resync(pos)
        if ended and not marker:
            raise self._truncated(at, f"the file ends inside the member {name!r} of {size} bytes")
        return f"tar header size field says the member {name!r} has {size} bytes, past the end of the file", ended

    def _resync(self, pos: int) -> bool:
        """Move the window from the bad header at ``pos`` to the next 512-byte block that is a sound header.

        Returns True when none is left: the damage runs to the end of the file
        (through an end-of-archive marker, or a file cut short). Zero blocks are
        passed over: a member's data may hold them, and the marker is only the
        end when no header follows. At the end the window sits on the zero
        blocks that end the file, if any, so that a read from there finds the
        marker (the retry after the damaged sample), not a file without one.
        """
        blocks = self.blocks
        blocks.pos = pos + _BLOCK
        zeros = -1  # the stream offset where the run of zero blocks being passed over began
        try:
            while True:
                if len(blocks.buf) - blocks.pos < _BLOCK and not blocks.need(_BLOCK):
                    end = zeros if zeros >= 0 else blocks.base + len(blocks.buf)
                    blocks.buf, blocks.base, blocks.pos = b"", end, 0  # nothing more is read: the window is empty
                    return True
                header = blocks.buf[blocks.pos : blocks.pos + _BLOCK]
                if header == _ZEROS:
                    zeros = blocks.offset if zeros < 0 else zeros
                elif _header_size(header) >= 0 and header[156:157] in _KNOWN:
                    return False
                else:
                    zeros = -1
                blocks.pos += _BLOCK
        except CompressedStreamError as error:
            raise self.error(blocks.offset, error.reason) from None

    def _truncated(self, offset: int, reason: str) -> CorruptRecordError:
        shrank = self.blocks.shrank()
        if shrank is not None:
            reason += f" (the file shrank to {shrank} bytes while being read)"
        return self.error(offset, reason)

    def _next_key(self) -> str | None:
        """The key of the next regular member, if its headers are already in the window and sound; else None.

        A look ahead without raising: a bad header is reported when it is read, on its own sample.
        """
        buf, pos = self.blocks.buf, self.blocks.pos
        long_name = None
        while len(buf) - pos >= _BLOCK:
            header = buf[pos : pos + _BLOCK]
            if header == _ZEROS or not _checksum_ok(header):
                return None
            kind = header[156:157]
            if kind not in (b"x", b"L"):
                split = _split_key(long_name or _name_of(header)) if kind in _REGULAR else None
                return None if split is None else split[0]
            try:
                size = _size_of(header)
                long_name = _long_name(kind, buf[pos + _BLOCK : pos + _BLOCK + size])
            except ValueError:
                return None
            pos += _BLOCK + -(-size // _BLOCK) * _BLOCK
        return None

    def samples(self, ends: np.ndarray | None = None) -> Iterator[tuple[int, dict[str, Any] | _Bad]]:
        """(offset of its first header, sample) for each sample, grouped as WebDataset does.

        With ``ends`` (the index's sample offsets) a sample is handed out as
        soon as its last member ends where the index says the next sample
        starts, before the next header is read: a bad header is then blamed
        on its own sample. A key that goes on past an index boundary is an error.

        Without ``ends`` a bad header does not end the walk: the damaged run is
        blamed on one sample (:func:`_blame`), which comes as a :class:`_Bad`
        in its place (its members after the damage are dropped), and the
        samples after it follow with their indices one higher, as a scan counts them.
        """
        sample: dict[str, Any] | None = None
        sample_at = -1
        last_key = None
        damage: tuple[int, bytes, str] | None = None  # a damaged run not yet blamed on a sample
        bad: _Bad | None = None  # a bad sample whose members are being dropped
        previous: dict[str, Any] | None = None  # the last sample handed out, for _blame
        for name, at, data in self.members(resync=ends is None):
            if name is None:
                if bad is None and damage is None:  # a second run before the next good member counts with the first
                    damage = (at, data, self.damage)
                continue
            if name.startswith("__") and ("/" not in name and name.endswith("__") or _META.match(name)):
                continue
            split = _split_key(name)
            if split is None:
                continue
            key, ext = split
            if damage is not None:
                settled, bad, previous = self._settle(damage, sample, sample_at, split, at, previous)
                sample = damage = None
                for item in settled:
                    yield item
                    self.index += 1
            if bad is not None:
                if key == bad.key:
                    continue
                yield bad.error.offset, bad._replace(resume=at)
                self.index += 1
                bad = None
            if sample is None or key != sample["__key__"]:
                if sample is not None:
                    last_key = sample["__key__"]
                    yield sample_at, sample
                    self.index += 1
                    previous = sample
                elif key == last_key:
                    raise self.error(
                        at, f"the index file puts a sample boundary inside the sample {key!r} (rebuild it)"
                    )
                sample, sample_at = {"__key__": key, "__url__": redact_url(self.url)}, at
            if ext in sample:
                raise self.error(at, f"duplicate member {name!r} in the sample {key!r}")
            sample[ext] = data
            if ends is not None and self.index + 1 < len(ends) and self.blocks.offset >= ends[self.index + 1]:
                if self._next_key() == key:
                    raise self.error(
                        self.blocks.offset,
                        f"the index file puts a sample boundary inside the sample {key!r} (rebuild it)",
                    )
                last_key = key
                yield sample_at, sample
                self.index += 1
                previous, sample = sample, None
        yield from self._last(sample, sample_at, damage, bad, previous)

    def _last(
        self,
        sample: dict[str, Any] | None,
        sample_at: int,
        damage: tuple[int, bytes, str] | None,
        bad: _Bad | None,
        previous: dict[str, Any] | None,
    ) -> Iterator[tuple[int, dict[str, Any] | _Bad]]:
        """The samples left at the end of the archive: the open one, and a damaged run not yet blamed."""
        if damage is not None:
            settled, bad, previous = self._settle(damage, sample, sample_at, None, self.blocks.offset, previous)
            sample = None
            for item in settled:
                yield item
                self.index += 1
        if bad is not None:
            yield bad.error.offset, bad._replace(resume=self.blocks.offset)
            self.index += 1
        elif sample is not None:
            yield sample_at, sample
            self.index += 1

    def _settle(
        self,
        damage: tuple[int, bytes, str],
        sample: dict[str, Any] | None,
        sample_at: int,
        following: tuple[str, str] | None,
        resume: int,
        previous: dict[str, Any] | None,
    ) -> tuple[list[tuple[int, dict[str, Any] | _Bad]], _Bad | None, dict[str, Any] | None]:
        """Blame a damaged run once the first sound member after it is known (``following``, starting at
        ``resume``; None at the end of the archive).

        Returns what to hand out now, in order (the open sample if the run is not
        its, a lost sample of its own), the lost sample whose members are still
        being dropped (blamed on the open or the next sample), and the new ``previous``.
        """
        blame = _blame(_guess_name(damage[1]), sample, following, previous)
        settled: list[tuple[int, dict[str, Any] | _Bad]] = []
        key = None
        if sample is not None and blame == "current":
            key = sample["__key__"]
        elif sample is not None:
            settled.append((sample_at, sample))
            previous = sample
        if blame == "next" and following is not None:
            key = following[0]
        at, _, problem = damage
        what = f"sample {key!r}" if key is not None else "the sample there"
        reason = (
            f"{problem}: {what} is lost; the next header that verifies starts the next sample "
            "(scanned at 512-byte boundaries)"
        )
        error = CorruptRecordError(self.url, self.index + len(settled), at, self._note(reason), framing_intact=True)
        if blame == "own":  # it ends where the following member starts
            settled.append((at, _Bad(error, None, resume)))
            return settled, None, previous
        return settled, _Bad(error, key, -1), previous


class _Bad(NamedTuple):
    """A sample lost to a damaged run, in its place in :meth:`_Parser.samples`.

    ``key``: members with this key after the damage belong to it and are
    dropped; ``resume``: the byte offset where the next sample starts (-1 until known).
    """

    error: CorruptRecordError
    key: str | None
    resume: int


def _guess_name(header: bytes) -> tuple[str, str] | None:
    """(key, extension) a damaged header names, read despite its checksum; ``("", "")`` for an
    extended header (pax, GNU long name: it belongs to the member after it), known by its type flag
    or, when the flip hit that, by the name writers give it; None when the name gives none."""
    if header[156:157] in _EXTENDED or any(mark in header[:100] for mark in _EXTENDED_NAMES):
        return "", ""
    return _split_key(_name_of(header))


def _blame(
    guess: tuple[str, str] | None,
    current: dict[str, Any] | None,
    following: tuple[str, str] | None,
    previous: dict[str, Any] | None,
) -> str:
    """Which sample a damaged run between two sound members belongs to.

    ``guess`` is the damaged header's (key, extension) (:func:`_guess_name`),
    ``current`` the sample open before the run, ``following`` the (key,
    extension) of the first sound member after it, ``previous`` the sample
    before ``current``. ``"current"`` when the run sits inside the open sample
    (the member after it has its key) or names it; ``"next"`` when it names the
    following member's key or is an extended header. A name that matches
    neither (a flip in the key, or a sample of its own) is decided by its
    extension when the samples around have it (they share extensions, as
    WebDataset's do): one the open sample lacks makes it ``"current"``, one
    other than the following member's makes it ``"next"``. With no usable
    name (garbage), by the shape: an open sample with fewer members than the
    one before is ``"current"``, a following member that is not a sample's
    first is ``"next"``. Else ``"own"``: a sample of its own between the two.
    """
    key = None if current is None else current["__key__"]
    if key is not None and (guess is not None and key == guess[0] or following is not None and key == following[0]):
        return "current"
    if following is not None and guess is not None and guess[0] in (following[0], ""):
        return "next"
    if guess is not None and (previous is None or guess[1] in previous or following and guess[1] == following[1]):
        if current is not None and guess[1] not in current:
            return "current"
        if following is not None and guess[1] != following[1]:
            return "next"
        return "own"
    # No name, or an extension no sample around has (a flip in it): the shape of the samples decides.
    if previous is not None and current is not None and len(current) < len(previous):
        return "current"  # the open sample has fewer members than the one before
    first = _first_extension(previous if previous is not None else current or {})
    if following is not None and first is not None and following[1] != first:
        return "next"  # the member after the run is not a sample's first
    return "own"


def _first_extension(sample: dict[str, Any]) -> str | None:
    """The extension of a sample's first member (keys after ``__key__`` and ``__url__`` keep member order)."""
    return next((ext for ext in sample if not ext.startswith("__")), None)


def _located_by_index(error: CorruptRecordError, offsets: np.ndarray | None) -> CorruptRecordError:
    """``error``, marked ``framing_intact`` when the index holds the bad sample and the next one's offset,
    or says it is the last (the index was checked against the file's size, so the file is not cut short)."""
    i = error.record_index
    if error.framing_intact or offsets is None or not 0 <= i < len(offsets):
        return error
    end = int(offsets[i + 1]) if i + 1 < len(offsets) else None
    if error.offset < offsets[i] or end is not None and error.offset >= end:
        return error
    where = "says it is the last sample" if end is None else f"locates the next sample at byte {end}"
    reason = f"{error.reason}; the index {where}"
    return CorruptRecordError(error.url, i, error.offset, reason, framing_intact=True)


class TarFormat(FormatBase):
    """WebDataset tar shards (``.tar``, ``.tar.gz``/``.tgz``): a record is a sample.

    Args:
        compression: ``"auto"`` (gzip when the file starts with its magic),
            ``None`` or ``"gzip"``.
        index: use a tar index beside the shard (``shardkit index``) to count
            and to seek to a range's first sample.
        storage_options: fsspec options.
        remote: how remote shards are read (:class:`~shardkit.io.remote.RemoteOptions`: readahead,
            retries, the local cache); local files ignore it.
    """

    name = "tar"
    suffixes = (".tar.gz", ".tgz", ".tar")

    def __init__(
        self,
        *,
        compression: str | None = "auto",
        index: bool = True,
        storage_options: dict[str, Any] | None = None,
        remote: RemoteOptions | None = None,
    ) -> None:
        if compression not in ("auto", None, "gzip"):
            raise ShardkitError(f"tar compression must be 'auto', None or 'gzip', got {compression!r}")
        self.compression = compression
        self.index = index
        self.storage_options = storage_options
        self.remote = remote
        self._hint: ResumeHint | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_hint": None}

    def __repr__(self) -> str:
        return f"TarFormat(compression={self.compression!r}, index={self.index})"

    def sniff(self, head: bytes) -> bool:
        if head[:2] == b"\x1f\x8b":
            return False  # any gzip stream: decided by the suffix
        return len(head) >= _BLOCK and head[257:262] == b"ustar" and _checksum_ok(head[:_BLOCK])

    def read(self, url: str, start: int = 0, stop: int | None = None) -> Iterator[dict[str, Any]]:
        """Samples ``[start, stop)`` of the tar at ``url``."""
        if start < 0 or (stop is not None and stop < start):
            raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
        return self._read(url, start, stop)

    def _read(self, url: str, start: int, stop: int | None) -> Iterator[dict[str, Any]]:
        if stop is not None and stop <= start:
            return
        raw = open_raw(url, "rb", self.storage_options, remote=self.remote)
        try:
            compressed = self._compressed(raw)
            hint = self._hint if not compressed else None
            if hint is not None and (hint.url, hint.record) == (url, start):  # the retry after a damaged sample
                offsets, first, offset = None, start, hint.offset
            else:
                offsets = None if compressed else self._index_for(url, start)
                first = start if offsets is not None and start else 0
                if first and start >= len(offsets):  # type: ignore[arg-type]  # the index says there is no sample `start`
                    return
                offset = int(offsets[start]) if first else 0  # type: ignore[index]
            self._hint = None
            if offset:
                raw.seek(offset)
            source = open_input(url, "gzip", raw=raw) if compressed else raw
            parser = _Parser(url, _Blocks(source, offset), first, compressed)
            try:
                for _, sample in parser.samples(offsets):
                    index = parser.index
                    if index < start:
                        continue
                    if isinstance(sample, _Bad):
                        raise self._lost(url, sample, compressed)
                    yield sample
                    if stop is not None and index + 1 >= stop:
                        return
            except CorruptRecordError as error:
                raise _located_by_index(error, offsets) from None
        finally:
            raw.close()

    def _lost(self, url: str, bad: _Bad, compressed: bool) -> CorruptRecordError:
        """The error for a damaged sample; the retry for the next one seeks where it starts (plain files)."""
        if not compressed:
            self._hint = ResumeHint(url, bad.error.record_index + 1, bad.resume)
        return bad.error

    def _index_for(self, url: str, start: int) -> np.ndarray | None:
        """The checked index, to seek to ``start`` and to find the sample after a bad one.

        Reading from the start needs no index: one that does not fit the file is then not used.
        """
        if not start:
            try:
                return self.index_offsets(url)
            except IndexFileError:
                return None
        return self.index_offsets(url)

    def _compressed(self, raw: Any) -> bool:
        if self.compression != "auto":
            return self.compression == "gzip"
        compressed = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        return compressed

    min_record_bytes: Final = _BLOCK
    """A sample is at least one member, and a member at least its 512-byte header (empty data)."""

    def record_bound(self, url: str) -> RecordBound:
        """The most samples ``url`` can hold by its size (see :func:`~shardkit.formats.base.max_records`)."""
        return file_record_bound(url, self.min_record_bytes, self.compression, self.storage_options)

    def index_offsets(self, url: str) -> np.ndarray | None:
        """The record offsets of ``url`` from its index file, checked against the file; None without one.

        Raises:
            IndexFileError: the index does not fit the file (stale, damaged, of another format).
        """
        if not self.index or self.compression == "gzip" or url.lower().endswith((".gz", ".tgz")):
            return None
        offsets = load_offsets(url, INDEX_MAGIC, self.storage_options)
        if offsets is not None and len(offsets):
            with open_raw(url, "rb", self.storage_options, remote=self.remote) as f:
                f.seek(int(offsets[-1]))
                header = f.read(_BLOCK)
            if len(header) < _BLOCK or not _checksum_ok(header):
                raise IndexFileError(url, index_path_for(url), f"no tar header at its last offset {int(offsets[-1])}")
        return offsets

    def count(self, url: str) -> int:
        """Samples in ``url``: from its index when there is a valid one, else a header scan."""
        try:
            offsets = self.index_offsets(url)
        except IndexFileError as error:
            import warnings

            warnings.warn(f"{error}; counting its samples by a scan instead", stacklevel=2)
            offsets = None
        if offsets is not None:
            return len(offsets)
        return len(self.scan(url))

    def scan(self, url: str, *, strict: bool = False) -> np.ndarray:
        """Byte offset of each sample's first header (in the uncompressed stream), checking every header.

        A sample lost to a damaged header counts as one sample at the damage's
        offset, as the reader numbers it; ``strict`` raises its error instead.
        """
        raw = open_raw(url, "rb", self.storage_options, remote=self.remote)
        try:
            compressed = self._compressed(raw)
            source = open_input(url, "gzip", raw=raw) if compressed else raw
            parser = _Parser(url, _Blocks(source, 0), 0, compressed)
            starts = []
            for at, sample in parser.samples():
                if strict and isinstance(sample, _Bad):
                    raise sample.error
                starts.append(at)
            return np.array(starts, dtype=np.int64)
        finally:
            raw.close()

    def build_index(self, url: str) -> str | None:
        """Write the tar index of ``url`` beside it (``url + ".idx"``) and return its path."""
        with open_raw(url, "rb", self.storage_options, remote=self.remote) as f:
            if f.read(2) == b"\x1f\x8b":
                raise ShardkitError(
                    f"{url}: a gzip-compressed tar cannot seek, so it gets no index; its samples are counted by a scan"
                )
        offsets = self.scan(url, strict=True)  # an index never records damage: it would seek into it
        fs, path = fsspec.core.url_to_fs(url, **(self.storage_options or {}))
        index_url = index_path_for(url)
        write_offsets(index_url, INDEX_MAGIC, offsets, int(fs.info(path)["size"]), self.storage_options)
        return index_url

    def writer(self, url: str, *, name: str | None = None) -> TarWriter:
        """A writer of samples to ``url`` (``name``: the name it will be renamed to; unused)."""
        return TarWriter(url, storage_options=self.storage_options)


class TarWriter:
    """Write WebDataset samples (``{"__key__": key, ext: bytes | str, ...}``) to a tar at any fsspec URL.

    Members are ``<key>.<ext>`` in ustar format (with a pax header for long
    names), mode 0o444 and mtime fixed, so the same samples make the same bytes.
    """

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None, mtime: float | None = None) -> None:
        self.url = url
        self.num_records = 0
        self.num_bytes = 0
        self._mtime = time.time() if mtime is None else mtime
        self._raw = open_raw(url, "wb", storage_options)
        self._tar: tarfile.TarFile | None = tarfile.open(fileobj=self._raw, mode="w|", format=tarfile.PAX_FORMAT)

    def write(self, sample: dict[str, Any]) -> None:
        if self._tar is None:
            raise ShardkitError(f"{self.url}: write() on a closed TarWriter")
        key = sample.get("__key__")
        if not isinstance(key, str) or not key or "." in key.rsplit("/", 1)[-1]:
            raise ShardkitError(f"a tar sample needs a '__key__' string without a dot in its basename, got {key!r}")
        for ext, value in sample.items():
            if ext.startswith("__"):
                continue
            data = value.encode() if isinstance(value, str) else bytes(value)
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mode, info.mtime = len(data), 0o444, int(self._mtime)
            self._tar.addfile(info, io.BytesIO(data))
            self.num_bytes += 512 + -(-len(data) // 512) * 512  # header and padded data
        self.num_records += 1

    def close(self) -> None:
        if self._tar is not None:
            tar, self._tar = self._tar, None
            try:
                tar.close()
            finally:
                self._raw.close()

    def __enter__(self) -> TarWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
