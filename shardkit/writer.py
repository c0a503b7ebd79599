"""ShardWriter: write records into a numbered series of TFRecord shards plus a manifest."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

from shardkit.formats.io import check_compression, make_parent_dirs
from shardkit.formats.tfrecord import TFRecordWriter

if TYPE_CHECKING:
    from shardkit.shardlist import ShardList

__all__ = ["ShardWriter", "default_manifest_path"]


def default_manifest_path(pattern: str) -> str:
    """The manifest beside a shard pattern: the text before its ``%`` field + ``.manifest.arrow``.

    ``out/train-%05d.tfrecord`` -> ``out/train.manifest.arrow``;
    ``out/%05d.tfrecord`` -> ``out/manifest.arrow``.
    """
    base = pattern[: pattern.index("%")].rstrip("-_.")
    return f"{base}manifest.arrow" if not base or base.endswith("/") else f"{base}.manifest.arrow"


class ShardWriter:
    """Write records into shards ``pattern % 0``, ``pattern % 1``, ... and a manifest.

    A new shard starts when the current one holds ``max_records`` records, or
    when the next record would take it past ``max_bytes`` framed (uncompressed)
    bytes; a record larger than ``max_bytes`` gets a shard of its own. On
    :meth:`close` the manifest (see :meth:`shardkit.ShardList.to_manifest`) is
    written with every shard's url and record count, at ``manifest`` or
    :func:`default_manifest_path` ``(pattern)``::

        with ShardWriter("s3://bucket/train-%05d.tfrecord", max_records=10_000) as writer:
            for example in examples:
                writer.write(shardkit.encode_example(example))
        shards = writer.shards  # a ShardList with record counts
    """

    def __init__(
        self,
        pattern: str,
        *,
        max_records: Optional[int] = None,
        max_bytes: Optional[int] = None,
        compression: Optional[str] = None,
        manifest: Optional[str] = None,
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:
        try:
            distinct = pattern % 0 != pattern % 1
        except (TypeError, ValueError):
            distinct = False
        if not distinct:
            raise ValueError(f"pattern must contain one integer field such as %05d, got {pattern!r}")
        for name, limit in (("max_records", max_records), ("max_bytes", max_bytes)):
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be a positive integer or None, got {limit!r}")
        check_compression(compression, allow_auto=False)
        self.pattern = pattern
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.compression = compression
        self.manifest = manifest if manifest is not None else default_manifest_path(pattern)
        self.storage_options = storage_options
        self.shards: Optional[ShardList] = None  # set by close()
        self._urls: list[str] = []
        self._counts: list[int] = []
        self._current: Optional[TFRecordWriter] = None
        self._closed = False

    def write(self, record: Union[bytes, bytearray, memoryview]) -> None:
        """Append one record, starting a new shard first if a limit says so."""
        if self._closed:
            raise ValueError("write() on a closed ShardWriter")
        current = self._current
        if current is None or self._full(current, len(record)):
            current = self._next_shard()
        current.write(record)

    def _full(self, current: TFRecordWriter, size: int) -> bool:
        if self.max_records is not None and current.num_records >= self.max_records:
            return True
        return (
            self.max_bytes is not None
            and current.num_records > 0
            and current.num_bytes + size + 16 > self.max_bytes  # 16 bytes of framing per record
        )

    def _next_shard(self) -> TFRecordWriter:
        self._finish_shard()
        url = self.pattern % len(self._urls)
        self._current = TFRecordWriter(url, compression=self.compression, storage_options=self.storage_options)
        self._urls.append(url)
        return self._current

    def _finish_shard(self) -> None:
        if self._current is not None:
            self._current.close()
            self._counts.append(self._current.num_records)
            self._current = None

    def close(self) -> ShardList:
        """Close the last shard, write the manifest, and return the shards as a ShardList."""
        if self.shards is None:
            from shardkit.shardlist import ShardList

            self._closed = True
            self._finish_shard()
            self.shards = ShardList(self._urls, num_records=self._counts)
            make_parent_dirs(self.manifest, self.storage_options)
            self.shards.to_manifest(self.manifest, storage_options=self.storage_options)
        return self.shards

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:  # do not publish a manifest of a partial write
            self._closed = True
            self._finish_shard()
