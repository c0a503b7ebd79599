"""Exceptions raised by shardkit.

A :class:`CorruptRecordError` raised in a DataLoader worker reaches the main
process rebuilt by torch from its *type and text alone*: the worker formats
the traceback and the main process calls ``CorruptRecordError(text)``. So
inside a worker the message ends with one machine-readable line (JSON: url,
record index, byte offset, reason, framing), and the one-argument
constructor reads it back: the error in the main process carries the same
attributes as the one raised in the worker, and its message keeps the
worker's traceback. Outside workers the message is the plain sentence.

Credentials in urls never reach a message: :func:`redact` replaces the
userinfo (``user:password@``) and every query value (presigned
``X-Amz-Signature``, ``X-Amz-Credential``, ``X-Amz-Security-Token``,
``Signature``, ``sig``, ``token``...) of each url in a text with ``***``.
Every :class:`ShardkitError` message is redacted when it is made, and
:func:`redact_error` scrubs an error from elsewhere (fsspec, aiohttp) and its
causes before it leaves shardkit's remote layer. Only text is redacted: the
url itself is still what is read, and a :class:`CorruptRecordError`'s ``url``
attribute is the url as given (in the process that raised it).
"""

from __future__ import annotations

import functools
import json
import re
import sys
from typing import Any, Final, NoReturn

_URL: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
_USERINFO: Final = re.compile(r"^([^:/?#]+://)[^/?#]*@")
_QUERY_VALUE: Final = re.compile(r"([?&;][^=&#;?]*=)[^&#;]*")
_TRAILING: Final = ".,:;!?)]}"
_HIDDEN: Final = "***"


@functools.lru_cache(maxsize=4096)  # called per tar sample: its shard's url, over and over
def redact_url(url: str) -> str:
    """``url`` with its userinfo and every query value replaced by ``***`` (keys, host and path kept)."""
    url = _USERINFO.sub(rf"\1{_HIDDEN}@", url, count=1)
    base, mark, rest = url.partition("?")
    if not mark:
        return url
    query, hash_mark, fragment = rest.partition("#")
    return base + _QUERY_VALUE.sub(rf"\1{_HIDDEN}", mark + query) + hash_mark + fragment


def redact(text: str) -> str:
    """``text`` with every url in it redacted by :func:`redact_url` (punctuation right after a url kept)."""

    def one(match: re.Match[str]) -> str:
        found = match.group()
        url = found.rstrip(_TRAILING)
        return redact_url(url) + found[len(url) :]

    return _URL.sub(one, text) if "://" in text else text


def reraise_redacted(error: Exception) -> NoReturn:
    """Re-raise ``error`` (being handled) redacted by :func:`redact_error`; if its own text cannot be cleaned
    (built from attributes, as aiohttp's is), a :class:`ShardkitError` with the cleaned text instead."""
    redact_error(error)
    if _scrub(error):
        raise  # noqa: PLE0704 - called from an except block: the error keeps its traceback
    raise ShardkitError(f"{type(error).__name__}: {redact(str(error))}") from None


def redact_error(error: BaseException) -> BaseException:
    """``error`` with the urls in its text redacted, in place, and so its causes and contexts; a link of the
    chain whose text cannot be cleaned (built from attributes, as aiohttp's are) is cut off. Returns ``error``."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        _scrub(link)
        nxt = link.__cause__ or link.__context__
        if nxt is not None and not _scrub(nxt):
            link.__cause__ = link.__context__ = None
            link.__suppress_context__ = True
            break
        link = nxt
    return error


def _scrub(error: BaseException) -> bool:
    """Redact ``error``'s args (and an OSError's file names) in place; whether its text is clean now."""
    error.args = tuple(redact(arg) if isinstance(arg, str) else arg for arg in error.args)
    for name in ("filename", "filename2"):
        value = getattr(error, name, None)
        if isinstance(value, str):
            setattr(error, name, redact(value))
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - a text that cannot be made cannot leak
        return True
    return redact(text) == text


class ShardkitError(Exception):
    """Base class of every error shardkit raises on purpose (its message is redacted: see :func:`redact`)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(arg) if isinstance(arg, str) else arg for arg in args))


_DETAILS = "[shardkit error details: "


class CorruptRecordError(ShardkitError):
    """A shard's bytes do not match their framing, checksums or planned record count.

    The message names the url, the record index, the byte offset (or says it
    is unknown) and the check that failed; the same facts are kept as
    attributes. ``framing_intact`` is true when only this record is bad and
    the records after it can still be found (a data checksum mismatch, a
    record that does not decode), false when the framing itself is lost (a
    bad length, a truncated file, a shard ending before its planned count).
    ``offset`` and ``record_index`` are -1 when unknown. In a GZIP/ZLIB
    file ``offset`` is in the uncompressed stream, and ``compressed_offset``
    is the byte of the compressed file where inflating failed, when the
    stream itself is damaged (None otherwise, and for plain files).
    ``records`` is how many consecutive records from ``record_index`` the
    fault costs when ``framing_intact``: 1 for one bad record, more when one
    fault spoils several (a Parquet row group that does not decode costs its
    rows), so that under ``on_error="skip"`` they are skipped, warned and
    counted as one error instead of one per record.
    """

    def __init__(
        self,
        url: str,
        record_index: int = -1,
        offset: int = -1,
        reason: str = "",
        *,
        framing_intact: bool = False,
        compressed_offset: int | None = None,
        records: int = 1,
    ) -> None:
        text = url
        details = _parse_details(text) if not reason else None
        if details is not None:  # re-raised by DataLoader from a worker: the text carries the facts
            url, record_index, offset, reason, framing_intact, compressed_offset, records = details
        check_int("records", records, minimum=1, error=ValueError)  # how many records the fault costs
        self.url = url
        self.record_index = record_index
        self.offset = offset
        self.reason = reason
        self.framing_intact = framing_intact
        self.compressed_offset = compressed_offset
        self.records = records
        self._rebuilt = details is not None
        if not reason or self._rebuilt:  # a bare message, or a worker's traceback text: keep it whole
            super().__init__(text)
            return
        super().__init__(_sentence(url, record_index, offset, reason, records))

    def __str__(self) -> str:
        text = super().__str__()
        if self._rebuilt or not self.reason or not _in_dataloader_worker():
            return text
        facts = {
            "url": redact_url(self.url),
            "record_index": self.record_index,
            "offset": self.offset,
            "reason": self.reason,
            "framing_intact": self.framing_intact,
            "compressed_offset": self.compressed_offset,
            "records": self.records,
        }
        return f"{text}\n{_DETAILS}{json.dumps(facts)}]"

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_corrupt_record_error,
            (
                self.url,
                self.record_index,
                self.offset,
                self.reason,
                self.framing_intact,
                self.compressed_offset,
                self.records,
            ),
        )


def _sentence(url: str, record_index: int, offset: int, reason: str, records: int = 1) -> str:
    record = f"record {record_index}" if record_index >= 0 else "record index unknown"
    if records > 1 and record_index >= 0:
        record = f"records {record_index} to {record_index + records - 1} ({records} records)"
    where = f"at byte offset {offset}" if offset >= 0 else "(byte offset unknown)"
    return f"{url}: {record} {where}: {reason}"


def _parse_details(text: str) -> tuple[str, int, int, str, bool, int | None, int] | None:
    """The facts in the last details line of ``text``, or None if it has none (or a broken one)."""
    at = text.rfind(_DETAILS)
    if at < 0:
        return None
    try:
        facts: Any = json.JSONDecoder().raw_decode(text, at + len(_DETAILS))[0]
        return (
            str(facts["url"]),
            int(facts["record_index"]),
            int(facts["offset"]),
            str(facts["reason"]),
            bool(facts["framing_intact"]),
            None if facts.get("compressed_offset") is None else int(facts["compressed_offset"]),
            int(facts.get("records", 1)),
        )
    except (ValueError, KeyError, TypeError):
        return None


def _in_dataloader_worker() -> bool:
    """True in a DataLoader worker process (without importing torch where it is not loaded)."""
    worker = sys.modules.get("torch.utils.data._utils.worker")
    return worker is not None and worker.get_worker_info() is not None


def _rebuild_corrupt_record_error(
    url: str,
    record_index: int,
    offset: int,
    reason: str,
    framing_intact: bool,
    compressed_offset: int | None = None,
    records: int = 1,
) -> CorruptRecordError:
    return CorruptRecordError(
        url,
        record_index,
        offset,
        reason,
        framing_intact=framing_intact,
        compressed_offset=compressed_offset,
        records=records,
    )


class StateError(ShardkitError, ValueError):
    """A state that cannot be saved, or that does not fit what it is loaded into."""


class LoaderError(ShardkitError, ValueError):
    """A loader argument or setting that cannot work: a MixedLoader argument, or a
    temporary folder too long for DataLoader workers to pass tensors through."""


class WorkerDiedError(ShardkitError, RuntimeError):
    """A DataLoader worker of :class:`~shardkit.MixedLoader` died while the main process
    was receiving its micro-batches: the message names the worker, its pid, how it
    ended, and the dataset it was reading. What it had not delivered is lost from this
    iteration; a state saved before (``state_dict()``) resumes it."""


class UnknownLengthError(ShardkitError, TypeError):
    """``len()`` of a stream whose length is unbounded or not known in advance.

    A :class:`TypeError`, as Python expects from ``__len__``, so ``list(ds)``
    and ``operator.length_hint`` still work.
    """


class EvenBatchesError(ShardkitError, RuntimeError):
    """The ranks of :func:`~shardkit.even_batches` cannot go on together: an argument that
    cannot work, a rank with nothing to repeat under ``at_end="pad"``, another rank's
    failure, or a rank that stalled or died (named) while the ranks agreed whether all
    of them still have a batch."""


def check_int(
    name: str,
    value: object,
    *,
    minimum: int,
    maximum: int | None = None,
    error: type[Exception] = ShardkitError,
    hint: str = "",
) -> int:
    """``value`` if it is an int (a bool is not) of at least ``minimum`` (and at most
    ``maximum``, if given); else ``error`` naming the argument, the value given and
    what it must be (then ``hint``, the fix when it is not just "pass such an int")."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bounds = f">= {minimum}" if maximum is None else f">= {minimum} and <= {maximum}"
        fix = f"; {hint}" if hint else ""
        raise error(f"{name} must be an int {bounds}, got {value!r} ({type(value).__name__}){fix}")
    return value
