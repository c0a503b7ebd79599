"""When a remote request is tried again, and the errors a remote read ends with.

A transient failure (connection reset or refused, timeout, an incomplete body,
HTTP 408/429/500/502/503/504, S3 SlowDown / throttling / internal errors) is
retried with exponential backoff and full jitter, bounded by
:attr:`RetryPolicy.attempts` and :attr:`RetryPolicy.max_seconds`; anything
else fails at once.

Each try is bounded too: :attr:`RetryPolicy.timeout` seconds for an answer.
A store's own client may wait far longer (aiohttp, under fsspec's HTTP
filesystem, 5 minutes for a listing; botocore 60 s per request, retried
inside s3fs several times over), and a server that keeps a connection open
without answering would hold a dataset's construction or a worker that long,
silently. :func:`call_bounded` runs one call of an fsspec filesystem under
that bound (on an async filesystem, the call's coroutine is cancelled when
it runs out, its connection with it), and a try that runs out is a
:class:`TimeoutError`: transient, so tried again. :func:`retried_call` is the
two together, for a metadata call anywhere in the package (a size, an
identity, a directory listing): one line at the call site, a
:class:`RemoteReadError` naming the url when the bound is spent.

Whether an error is transient is read from the error and every error it wraps (s3fs and aiohttp wrap the one that says), by status,
S3 error code, errno or type name, so no store's client library is imported
here. A read that ends raises :class:`RemoteReadError`, or
:class:`ObjectChangedError` when the object changed under the reader: that is
never retried, since reading on would mix two versions.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from shardkit.errors import ShardkitError, redact_url
from shardkit.io.counters import count

__all__ = [
    "ObjectChangedError",
    "RemoteReadError",
    "RetryPolicy",
    "call_bounded",
    "code_of",
    "is_transient",
    "retried_call",
    "status_of",
    "with_retries",
]

_TRANSIENT_STATUS: Final = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_CODES: Final = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "RequestLimitExceeded",
        "TooManyRequests",
    }
)
_TRANSIENT_ERRNOS: Final = frozenset(
    {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT}
)
_TRANSIENT_NAMES: Final = frozenset(
    {
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ClientConnectionError",
        "ClientOSError",
        "ServerTimeoutError",
        "ConnectionTimeoutError",
        "SocketTimeoutError",
        "ContentLengthError",
        "IncompleteRead",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "EndpointConnectionError",
        "ResponseStreamingError",
        "_ShortRead",
        "SSLEOFError",  # a TLS stream cut without its close_notify
    }
)
T = TypeVar("T")


class RemoteReadError(ShardkitError):
    """A remote read failed for good: not transient, or still failing after the retry budget."""


class ObjectChangedError(ShardkitError):
    """An object changed while it was being read (its ETag, version or size differs from when it was opened).

    Reading on would mix two versions of the shard; restart the epoch (or pin
    versions) instead.
    """

    def __init__(self, url: str, opened: str, now: str) -> None:
        super().__init__(
            f"{url}: the object changed while it was being read (opened as {opened}, now {now}); "
            "its records would mix two versions, so the read stops here: restart the epoch, or do not "
            "overwrite shards while a job reads them"
        )
        self.url = url
        self.opened = opened
        self.now = now

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.url, self.opened, self.now))


DEFAULT_TIMEOUT: Final = 30.0
"""Seconds one try of a remote request (a ranged GET, a HEAD, a listing) waits for its answer.

An object store that is up answers in well under a second, and a 4 MiB block
arrives in 30 s down to about 140 KB/s; 30 s without an answer is a
connection that will not answer. Within the default 60 s of
:attr:`RetryPolicy.max_seconds` that leaves room for a second try."""


@dataclass(frozen=True)
class RetryPolicy:
    """How a remote request is bounded and retried: each try waits at most ``timeout`` seconds for its
    answer; transient failures are tried again, at most ``attempts`` tries within ``max_seconds``.

    The wait before try *n* (n >= 2) is uniform in ``[0, min(max_backoff, backoff * 2**(n-2))]``
    ("full jitter"), so many workers throttled at once do not retry in step. A request gives up
    after at most ``max_seconds + timeout``: a try is never cut short by the budget, only not started.
    ``timeout`` bounds the silence on a plain-HTTP ranged read (seconds without a byte; a body that goes
    quiet half-way is given up to twice that), and the whole call elsewhere (fsspec's HTTP listing, a
    HEAD, a GET through fsspec, an S3 ``GetObject``).
    """

    attempts: int = 8
    max_seconds: float = 60.0
    backoff: float = 0.1
    max_backoff: float = 5.0
    timeout: float = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.max_seconds < 0 or self.backoff < 0 or self.max_backoff < 0:
            raise ValueError(f"RetryPolicy needs attempts >= 1 and non-negative times, got {self}")
        if not self.timeout > 0:
            raise ValueError(f"RetryPolicy needs timeout > 0 (seconds a try waits for an answer), got {self.timeout}")

    def wait(self, attempt: int) -> float:
        """Seconds to wait before try ``attempt + 1`` (``attempt`` >= 1 tries made)."""
        return random.uniform(0, min(self.max_backoff, self.backoff * 2 ** (attempt - 1)))


def status_of(error: BaseException) -> int | None:
    """The HTTP status ``error`` carries (aiohttp's ``status``, botocore's response metadata), if any."""
    status = getattr(error, "status", None)
    if isinstance(status, int):
        return status
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code if isinstance(code, int) else None
    return None


def code_of(error: BaseException) -> str | None:
    """The S3 error code ``error`` carries (``SlowDown``, ``PreconditionFailed``...), if any."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return code if isinstance(code, str) else None
    return None


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` is worth retrying: a dropped connection, a timeout, throttling or a server error."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:  # look through the causes s3fs and aiohttp wrap
        seen.add(id(error))
        if status_of(error) in _TRANSIENT_STATUS or code_of(error) in _TRANSIENT_CODES:
            return True
        if isinstance(error, (TimeoutError, ConnectionError)) or type(error).__name__ in _TRANSIENT_NAMES:
            return True
        if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
            return True
        if any(code in str(error) for code in ("SlowDown", "Please reduce your request rate")):
            return True
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return False


def with_retries(
    call: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    on_retry: Callable[[], None] | None = None,
    abandoned: Callable[[], bool] | None = None,
) -> T:
    """``call()``, retried on transient errors under ``policy``; waits and retries are counted.

    ``on_retry`` runs before each retry (to check the object did not change).
    ``abandoned`` is asked after a transient error: if it says nobody waits for the answer any
    more (a readahead block of a file closed or read past), the error is raised as it is, neither
    retried nor counted, so a reader that is gone neither keeps asking the store nor adds its
    retries to the stats of whatever dataset this process reads next.
    Raises :class:`RemoteReadError` naming ``what``, the tries and the last error.
    """
    began = time.monotonic()
    deadline = began + policy.max_seconds
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except (ObjectChangedError, FileNotFoundError):
            raise
        except Exception as error:
            if not is_transient(error) or (abandoned is not None and abandoned()):
                raise
            wait = policy.wait(attempt)
            if attempt >= policy.attempts or time.monotonic() + wait > deadline:
                raise RemoteReadError(
                    f"{what}: still failing after {attempt} tries in {time.monotonic() - began:.1f} s "
                    f"({type(error).__name__}: {error}); each try waits {policy.timeout:g} s for an answer, "
                    f"all of them {policy.max_seconds:g} s: raise RetryPolicy(timeout=, attempts=, max_seconds=) "
                    "if the store is just slow"
                ) from error
            count(retries=1, retry_wait_seconds=wait)
            time.sleep(wait)
            if on_retry is not None:
                on_retry()


def call_bounded(fs: Any, method: str, *args: Any, timeout: float, **kwargs: Any) -> Any:
    """``fs.<method>(*args, **kwargs)``, given at most ``timeout`` seconds; else a :class:`TimeoutError`.

    On an async fsspec filesystem (HTTP, S3, GCS) the bound is fsspec's own
    ``timeout=`` of its blocking wrapper: the call's coroutine is cancelled on
    the filesystem's loop, so nothing is left waiting on the connection. A
    blocking filesystem (the local disk, memory) is called as it is.
    """
    call = getattr(fs, method)
    if not getattr(fs, "async_impl", False) or getattr(fs, "asynchronous", False):
        return call(*args, **kwargs)
    try:
        return call(*args, timeout=timeout, **kwargs)
    except TimeoutError as error:  # fsspec's FSTimeoutError says nothing: say what ran out
        if str(error):
            raise
        raise TimeoutError(f"no answer in {timeout:g} s") from error


_MANY_REQUESTS: Final = frozenset({"ls", "glob", "find", "walk", "du"})
"""Calls that may take many requests on an object store (S3 lists 1,000 keys per request): not cut short as
a whole there, each request is bounded by the store's client. Over HTTP(S) each is one GET of a page."""


def retried_call(fs: Any, method: str, path: str, *args: Any, retry: RetryPolicy | None = None, **kwargs: Any) -> Any:
    """``fs.<method>(path, *args, **kwargs)``, each try bounded by ``retry.timeout`` (:func:`call_bounded`), tried
    again under ``retry`` (default :class:`RetryPolicy`) on transient errors (:func:`with_retries`).

    For the metadata calls outside the reader (``info``, ``size``, ``ls``, ``isfile``): a server that never
    answers costs ``retry.max_seconds + retry.timeout`` at most, then a :class:`RemoteReadError` naming the
    url. A listing that may take many requests (``ls``, ``glob`` off HTTP) is not cut short as a whole, only
    retried. :class:`FileNotFoundError` passes through at once.
    """
    policy = retry or RetryPolicy()
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    whole = method not in _MANY_REQUESTS or bool({"http", "https"} & set(protocols))

    def once() -> Any:
        if not whole:
            return getattr(fs, method)(path, *args, **kwargs)
        return call_bounded(fs, method, path, *args, timeout=policy.timeout, **kwargs)

    what = "listing" if method in _MANY_REQUESTS else "looking up"
    return with_retries(once, policy, f"{what} {redact_url(fs.unstrip_protocol(path))}")
