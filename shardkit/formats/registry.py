"""The registry of shard formats: find the format of a file by its name or its first bytes.

It sits above every format, built-in or not: a format knows nothing of the
registry, and the registry knows the built-in formats only to register
them. They are registered on the first lookup, not at import, so that a format
registered before it under a built-in name keeps its place and that name, and
the sniffing order stays: formats registered first are asked first.
"""

from __future__ import annotations

from typing import Any

from shardkit.formats.array_record import ArrayRecordFormat
from shardkit.formats.base import HEAD_BYTES, FormatError, ShardFormat, check_interface
from shardkit.formats.jsonl import JsonlFormat
from shardkit.formats.mds import MDSFormat
from shardkit.formats.megatron import MegatronFormat
from shardkit.formats.parquet import ParquetFormat
from shardkit.formats.tar import TarFormat
from shardkit.formats.tfrecord import TFRecordFormat
from shardkit.io.files import open_raw

__all__ = ["format_for", "formats", "register_format"]

_REGISTRY: dict[str, ShardFormat] = {}


def register_format(fmt: ShardFormat) -> ShardFormat:
    """Make ``fmt`` known to :func:`format_for` (and the CLI) under ``fmt.name``; return it."""
    _REGISTRY[fmt.name] = check_interface(fmt)
    return fmt


def formats() -> dict[str, ShardFormat]:
    """The registered formats by name (the built-in ones are registered on first use)."""
    _builtins()
    return dict(_REGISTRY)


def format_for(url: str, head: bytes | None = None, *, storage_options: dict[str, Any] | None = None) -> ShardFormat:
    """The format of the file at ``url``: by its suffix, else by its first bytes.

    ``head`` is the file's first bytes when the caller has them; otherwise
    they are read only when no suffix matches.

    Raises:
        FormatError: no registered format matches.
    """
    registered = formats()
    name = url.lower()
    by_suffix = [(len(s), fmt) for fmt in registered.values() for s in fmt.suffixes if name.endswith(s)]
    if by_suffix:
        return max(by_suffix, key=lambda pair: pair[0])[1]
    if head is None:
        with open_raw(url, "rb", storage_options) as f:
            head = f.read(HEAD_BYTES)
    for fmt in registered.values():
        if fmt.sniff(head):
            return fmt
    known = ", ".join(f"{fmt.name} ({' '.join(fmt.suffixes)})" for fmt in registered.values())
    raise FormatError(f"{url}: neither its name nor its first bytes match a known shard format: {known}")


def _builtins() -> None:
    if {"tar", "parquet", "jsonl", "tfrecord", "megatron", "array_record", "mds"} <= _REGISTRY.keys():
        return
    # Sniffed in this order: checksummed magic first, JSON's weak "starts with { or [" last. Megatron's
    # .idx magic is nine exact bytes; its .bin has none and is known by its suffix alone.
    for fmt in (
        TFRecordFormat(),
        ParquetFormat(),
        MegatronFormat(),
        ArrayRecordFormat(),
        TarFormat(),
        JsonlFormat(),
        MDSFormat(),
    ):
        _REGISTRY.setdefault(fmt.name, fmt)
