"""Ranged GETs on S3 that say which version answered: open without a HEAD, pin every block by ETag.

``s3fs.S3FileSystem.cat_file`` returns the bytes only, so reading through it
needs a HEAD to learn an object's size and version, and on a bucket without
versioning nothing tied the blocks of one read to one version: an object
replaced between two blocks went unnoticed unless a request failed. Here a
block is one ``GetObject`` through s3fs's own client (its credentials,
endpoint and retries), and the answer's ``ContentRange``, ``ETag``,
``VersionId`` and ``LastModified`` come back with the bytes:

- the first block's answer gives the size and identity, so opening a shard
  costs no HEAD (one round trip less per shard);
- every later block is asked for with ``IfMatch=<ETag>`` (and the version id
  on a versioned bucket): a replaced object is refused by the store
  (``PreconditionFailed``) and reported by the caller as changed.
"""

from __future__ import annotations

from typing import Any

from shardkit.io.http import PreconditionFailed, Response, Unsupported

__all__ = ["S3Getter", "usable"]

#: Answers after which the caller reads through s3fs as before: a range past the end (an empty object), and
#: what an S3-compatible store that does not implement conditional reads may answer to ``IfMatch``.
_FALL_BACK = frozenset({"InvalidRange", "NotImplemented", "InvalidArgument"})


def usable(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem whose client this module can call."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("s3", "s3a") and hasattr(fs, "_call_s3") and hasattr(fs, "split_path")


class S3Getter:
    """Ranged ``GetObject`` calls on one object through s3fs's client."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path = fs, path

    def get(self, start: int, stop: int, info: dict[str, Any] | None = None, *, timeout: float) -> Response:
        """Bytes ``[start, stop)`` of the version ``info`` names (its ETag and version id; any when None).

        The call, botocore's own retries within it included, gets ``timeout`` seconds; then it is
        cancelled and a :class:`TimeoutError` raised, for the caller's retry policy."""
        from fsspec.asyn import sync

        bucket, key, version = self.fs.split_path(self.path)
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{stop - 1}"}
        pinned = info or {}
        if pinned.get("VersionId") or version:
            kwargs["VersionId"] = pinned.get("VersionId") or version
        if pinned.get("ETag"):
            kwargs["IfMatch"] = pinned["ETag"]

        async def call() -> tuple[dict[str, Any], bytes]:
            answer = await self.fs._call_s3("get_object", **kwargs)
            try:
                return answer, await answer["Body"].read()
            finally:
                answer["Body"].close()

        try:
            result: Any = sync(self.fs.loop, call, timeout=timeout)  # (fsspec's sync is not annotated)
            answer, body = result
        except TimeoutError as error:
            if str(error):  # botocore's or aiohttp's own, which says what ran out
                raise
            raise TimeoutError(f"s3://{bucket}/{key}: no answer in {timeout:g} s") from error
        except Exception as error:
            code = _code_in_chain(error)
            if code == "PreconditionFailed":
                raise PreconditionFailed(f"s3://{bucket}/{key}: {error}") from error
            if code in _FALL_BACK:  # an empty object (a HEAD says so), or a store that refuses IfMatch
                raise Unsupported(f"s3://{bucket}/{key}: {error}") from error
            raise
        headers = {"content-range": answer.get("ContentRange") or "", "etag": answer.get("ETag") or ""}
        identity = {name: answer.get(name) for name in ("ETag", "LastModified", "VersionId") if answer.get(name)}
        return Response(206 if headers["content-range"] else 200, headers, body, identity)


def _code_in_chain(error: BaseException | None) -> str | None:
    """The S3 error code of ``error`` or of an error it wraps (s3fs translates botocore's errors)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        response = getattr(error, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if isinstance(code, str):
                return code
        if "PreconditionFailed" in str(error):
            return "PreconditionFailed"
        error = error.__cause__ or error.__context__
    return None
