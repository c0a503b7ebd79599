"""LitData optimized datasets, read in place: a shard is one chunk file, its counts from ``index.json``.

``litdata.optimize`` writes a directory of chunk files (``chunk-0-0.bin``, ...)
and an ``index.json`` naming them in order with their item counts
(``chunk_size``), the leaf serializers of a sample (``data_format``) and the
shape of the sample tree (``data_spec``). A chunk is::

    <uint32 n> <uint32 offsets[n + 1]> <items> [<Arrow IPC file> <uint32 len> b"LDARW01\\0"]

Item ``i`` is bytes ``[offsets[i], offsets[i + 1])``: one ``uint32`` size per
leaf, then the leaves, each decoded by its serializer's documented layout
(:data:`LEAVES`). A chunk of JSON-like dicts (ints, floats, strings, lists)
also ends with an Arrow IPC file holding the rows, which LitData's reader
prefers (its items may then be empty): so does this one, reading only the
record batches a range overlaps. A ``TokensLoader`` dataset's items are bare
token arrays laid end to end: each is a record ``{"input_ids": array}`` (what
:class:`~shardkit.TokenDataset` yields, so ``.pack`` applies), or with
``block_size=b`` a record is a block of ``b`` tokens of one chunk, as
``TokensLoader(block_size=b)`` cuts them (``dim // b`` per chunk, the rest of a
chunk dropped).

Counts come from ``index.json`` (no pass over the chunks) and are checked when
a chunk is read: a header count that disagrees, offsets that go backwards or
past the file's end, a footer that is cut off or holds another number of rows
are :class:`~shardkit.CorruptRecordError` with the chunk's url, the record and
the byte offset (``framing_intact`` false: under ``on_error="skip"`` the rest of
the range is skipped and counted); an item whose leaf sizes do not add up to
its length costs itself alone.

Nothing loaded runs code: a ``pickle`` leaf (LitData's fallback for any other
Python object) is refused when the index is read, as are encrypted chunks and
the in-file zstd frames (``compression_level="batch"``/``"sample"``); whole-chunk
zstd (``.zstd.bin``, ``compression_level="chunk"``) is inflated with
``zstandard``. The sample tree is rebuilt from its JSON (dicts, lists, tuples),
never by importing the types it names.

The package's modules, each importing only those listed after it:
:mod:`~shardkit.formats.litdata.format` (:class:`LitDataFormat` and the chunk reader),
:mod:`~shardkit.formats.litdata.index` (``index.json`` parsed and checked) and
:mod:`~shardkit.formats.litdata.leaves` (the leaf serializers and sample trees).
"""

from __future__ import annotations

from shardkit.formats.litdata.format import LitDataFormat
from shardkit.formats.litdata.index import INDEX_NAME, LitDataIndex, chunk_urls, index_url, parse_index
from shardkit.formats.litdata.leaves import LEAVES, leaf_decoder

__all__ = [
    "INDEX_NAME",
    "LEAVES",
    "LitDataFormat",
    "LitDataIndex",
    "chunk_urls",
    "index_url",
    "leaf_decoder",
    "parse_index",
]
