"""Name a file from its first bytes, for errors about a file handed to the wrong reader.

A Parquet file, a manifest or an index read as TFRecord fails the first
record's length CRC, which on its own reads as corrupt data. The TFRecord
reader calls :func:`describe_file` only on that failure path (a good file
costs nothing), and the CLI calls :func:`not_a_shard` to skip index and
manifest files that a glob such as ``data/*`` picks up. Compressed streams
are recognised by :func:`shardkit.io.files.sniff_compression`, whose hint
(``compression='gzip'``) the reader already gives.
"""

from __future__ import annotations

from typing import Any, Final

from shardkit.io.files import open_raw

__all__ = ["SNIFF_BYTES", "describe_file", "describe_head", "kind_of", "not_a_shard"]

SNIFF_BYTES: Final = 512  # a tar header block: its "ustar" magic sits at byte 257

_INDEX_MAGICS: Final = (b"SKTFIDX1", b"SKTARIX1", b"SKJSLIX1")  # formats/index.py, tar.py, jsonl.py
_MEGATRON_MAGIC: Final = b"MMIDIDX\x00\x00"  # formats/megatron/index.py: half of a shard, not an index of one
_INDEX_ADVICE: Final = "read the data file it indexes (the same name without .idx)"


def kind_of(head: bytes) -> tuple[str, str] | None:
    """(what a file starting with ``head`` is, how to read it), or None when no magic matches."""
    if head[:4] == b"PAR1":
        return "a Parquet file", "use ParquetDataset"
    if head[:6] == b"ARROW1":
        return "an Arrow IPC file (a shard manifest?)", "use ShardList.from_manifest"
    if head[:8] in _INDEX_MAGICS:
        return "a shardkit index file", _INDEX_ADVICE
    if head[:9] == _MEGATRON_MAGIC:
        return "a Megatron-LM index (.idx)", "use TokenDataset on the pair's prefix or .bin"
    if head[257:262] == b"ustar":
        return "a tar file", "use TarDataset"
    if head.lstrip()[:1] in (b"{", b"[") and b"\n" in head and _text(head):
        return "a JSON lines file", "use JsonlDataset"
    return None


def _text(head: bytes) -> bool:
    """Whether ``head`` is UTF-8 text (perhaps cut inside a character): a TFRecord whose first length
    byte happens to be ``{`` has NULs in the rest of its length field."""
    if b"\x00" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        return error.start >= len(head) - 3  # only the last character was cut
    return True


def describe_head(head: bytes) -> str | None:
    """``"this is a Parquet file; use ParquetDataset"`` and the like, or None."""
    kind = kind_of(head)
    if kind is None:
        return None
    what, advice = kind
    verb = "looks like" if what.startswith("a JSON") else "is"
    return f"this {verb} {what}; {advice}"


def describe_file(url: str, storage_options: dict[str, Any] | None = None) -> str | None:
    """:func:`describe_head` of ``url``'s first bytes; None when they cannot be read (a failure path
    must not fail differently)."""
    try:
        with open_raw(url, "rb", storage_options) as f:
            return describe_head(f.read(SNIFF_BYTES))
    except Exception:  # noqa: BLE001 - the hint is optional; the reader's own error stands
        return None


def not_a_shard(url: str, head: bytes) -> str | None:
    """What ``url`` is when it is an index or manifest file rather than shard data, else None."""
    kind = kind_of(head)
    if head[:9] == _MEGATRON_MAGIC:
        return None  # the .idx names its Megatron pair, which the commands read
    if url.endswith(".idx") or (kind is not None and kind[0] == "a shardkit index file"):
        return f"a shardkit index file; {_INDEX_ADVICE}"
    if kind is not None and kind[0].startswith("an Arrow IPC"):
        return f"{kind[0]}; plan and verify --manifest read manifests"
    return None
