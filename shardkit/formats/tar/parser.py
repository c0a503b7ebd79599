"""The walk over a tar's headers that groups members into samples, and what it does with damage.

Trust nothing: every header's checksum is checked; a bad one, a size field
that is not a number or runs past the end of the file (it never sizes an
allocation), a malformed pax record, or a file that ends inside a member or
without the end-of-archive marker raises :class:`~shardkit.CorruptRecordError`
naming the sample index and the header's byte offset. How a damaged run is
blamed on one sample, and how the sample numbering stays that of a scan, is
told in :mod:`shardkit.formats.tar`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from shardkit.errors import CorruptRecordError, redact_url
from shardkit.formats.tar.headers import (
    _BLOCK,
    _KNOWN,
    _META,
    _REGULAR,
    _SKIPPED,
    _ZEROS,
    _Blocks,
    _checksum_ok,
    _guess_name,
    _header_problem,
    _header_size,
    _long_name,
    _name_of,
    _size_of,
    _split_key,
)
from shardkit.io.files import CompressedStreamError


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
