"""Writing WebDataset tars that :class:`~shardkit.formats.tar.format.TarFormat` (and WebDataset) read back."""

from __future__ import annotations

import io
import tarfile
import time
from typing import Any

from shardkit.errors import ShardkitError
from shardkit.io.files import open_raw

__all__ = ["TarWriter"]


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
