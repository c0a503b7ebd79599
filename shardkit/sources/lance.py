"""``LanceDataset``: a Lance dataset read in place, its fragments the shards, at one pinned version.

The version is fixed when the dataset is built (the latest, or ``version=``),
and with it the fragments and their row counts, from that version's manifest:
the shards are fragment urls naming the version (see
:mod:`shardkit.formats.lance`), with those counts. Under a process group the
first rank to build the dataset looks the latest version up and the others
take its answer (:func:`~shardkit.jobstore.once_per_job`), so a version
committed between two ranks' start-ups does not split the job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardkit.counting import OnError
from shardkit.errors import ShardkitError
from shardkit.formats.lance import LanceFormat, fragment_url
from shardkit.io.remote import RetryPolicy
from shardkit.jobstore import group_store, job_key, once_per_job
from shardkit.planning import Balance
from shardkit.shardlist import ShardList
from shardkit.sources.formatted import FormatDataset
from shardkit.sources.options import SourceOptions

__all__ = ["LanceDataset"]


class LanceDataset(FormatDataset):
    """An IterableDataset over a Lance dataset, its fragments split over ranks and workers.

    A record is a row, a dict of column to value (as ``to_pylist`` gives it), or with
    ``batch_size`` up to that many rows of one fragment as a dict of column to numpy
    array (plans, exactly-once and resuming then count batches), as for
    :class:`~shardkit.ParquetDataset`.

    Args:
        path: the dataset's uri (a directory, ``s3://bucket/table.lance``, ...).
        columns: the columns to read (all by default).
        batch_size: rows per record, or None for one row per record.
        version: the version to read (an int or a tag); None: the latest when built.
        storage_options: Lance's object store options, handed to ``lance.dataset``.

    The other arguments are those of :class:`~shardkit.ShardedDataset`; ``readahead_bytes``,
    ``retry``, ``cache_dir`` and ``cache_limit_bytes`` are refused: Lance reads its object store itself.
    """

    def __init__(
        self,
        path: str,
        *,
        columns: Sequence[str] | None = None,
        batch_size: int | None = None,
        version: int | str | None = None,
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
        if any(v is not None for v in (readahead_bytes, retry, cache_dir, cache_limit_bytes)):
            raise ShardkitError(
                "LanceDataset reads through Lance's own object store: readahead_bytes, retry, cache_dir and "
                "cache_limit_bytes do not apply (give Lance's options in storage_options)"
            )
        options = SourceOptions.of(
            shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size, on_error=on_error,
            storage_options=storage_options, readahead_bytes=None, retry=None, cache_dir=None, cache_limit_bytes=None,
        )  # fmt: skip
        fmt = LanceFormat(columns=columns, batch_size=batch_size, storage_options=options.storage_options)
        uri = str(path).rstrip("/")
        pinned = fmt.dataset(uri, None) if version is None else fmt.dataset(uri, None).checkout_version(version)
        if version is None:
            pinned = fmt.dataset(uri, _shared_version(uri, int(pinned.version), options.storage_options))
        urls = [fragment_url(uri, f.fragment_id, int(pinned.version)) for f in pinned.get_fragments()]
        self.version = int(pinned.version)
        self._build(ShardList(urls, num_records=[fmt.count(url) for url in urls]), fmt, options)

    @property
    def column_batches(self) -> bool:
        """Whether this dataset yields column batches (``batch_size`` given)."""
        return self.format.batch_size is not None  # pyright: ignore[reportAttributeAccessIssue]


def _shared_version(uri: str, latest: int, storage_options: dict[str, Any] | None) -> int:
    """``latest``, or under a process group the latest version the first rank found, for every rank."""
    store = group_store()
    key = job_key("lance-version", [uri, dict(storage_options or {})]) if store is not None else None
    if store is None or key is None:
        return latest
    return once_per_job(
        store,
        key,
        lambda: (latest, str(latest).encode()),
        lambda answer: int(answer),
        lambda error: ShardkitError(f"another rank could not open the Lance dataset {uri}: {error}"),
    )
