"""``LitDataDataset``: a LitData optimized dataset (``litdata.optimize``'s output) read in place.

The dataset's ``index.json`` is read once, when the dataset is built: it
names the chunk files in order and holds each one's record count, so the
shards are the chunk urls with those counts (a :class:`~shardkit.ShardList`
with ``num_records``): record-level splits over ranks and workers, shuffling,
pad/drop and resuming need no pass over the chunks. Each chunk's header is
checked against its count when the chunk is read (see
:mod:`shardkit.formats.litdata`).
"""

from __future__ import annotations

import posixpath
from typing import Any

from shardkit.counting import OnError
from shardkit.formats.litdata import INDEX_NAME, LitDataFormat, chunk_urls
from shardkit.io.remote import RetryPolicy
from shardkit.planning import Balance
from shardkit.shardlist import ShardList
from shardkit.sources.formatted import FormatDataset
from shardkit.sources.options import SourceOptions

__all__ = ["LitDataDataset"]


class LitDataDataset(FormatDataset):
    """An IterableDataset over a LitData optimized dataset, split over ranks and workers.

    A record is a sample as LitData's ``StreamingDataset`` returns it (the dict,
    list or value ``optimize``'s function returned, each leaf decoded by its
    serializer); in a ``TokensLoader`` dataset, an item ``{"input_ids": array}``
    (``TokenDataset``'s record, so ``.pack`` applies) or, with ``block_size``, a
    block of that many tokens as ``TokensLoader(block_size=...)`` yields them.

    Args:
        path: the dataset's directory (local or remote: ``s3://bucket/optimized``,
            ``https://host/optimized``), or its ``index.json``.
        images: ``"bytes"`` (JPEG and other encoded images as their bytes) or ``"pil"``
            (decoded with Pillow).
        block_size: for a ``TokensLoader`` dataset, tokens per record (see above).
        readahead_bytes, retry, cache_dir, cache_limit_bytes: how remote chunks are
            read, as for :class:`~shardkit.TFRecordDataset`.

    The other arguments are those of :class:`~shardkit.ShardedDataset`.

    Raises:
        ShardkitError: ``index.json`` is not a LitData index, or its samples hold a leaf
            shardkit does not read (``pickle``: unpickling runs code) or encrypted chunks.
    """

    def __init__(
        self,
        path: str,
        *,
        images: str = "bytes",
        block_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        balance: Balance = "pad",
        rank: int | None = None,
        world_size: int | None = None,
        on_error: OnError = "raise",
        storage_options: dict[str, Any] | None = None,
        readahead_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        cache_dir: str | None = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        options = SourceOptions.of(
            shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size, on_error=on_error,
            storage_options=storage_options, readahead_bytes=readahead_bytes, retry=retry, cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )  # fmt: skip
        fmt = LitDataFormat(
            images=images, block_size=block_size, storage_options=options.storage_options, remote=options.remote
        )
        path = str(path)
        index = fmt.index(path if path.endswith(INDEX_NAME) else posixpath.join(path.rstrip("/"), INDEX_NAME))
        urls = chunk_urls(index)
        self._build(ShardList(urls, num_records=[fmt.stored_count(url) for url in urls]), fmt, options)
