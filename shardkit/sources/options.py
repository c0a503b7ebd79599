"""The options every format dataset takes, declared once.

:class:`~shardkit.sources.formatted.FormatDataset` and the four named datasets take
the same eleven keywords, spelled out in each signature for users and IDEs.
:meth:`SourceOptions.of` turns them into one frozen value, and makes the
:class:`~shardkit.io.remote.RemoteOptions` from the four remote keywords here and
nowhere else. The format reads with ``storage_options`` and ``remote``; the source
plans with the rest (:meth:`SourceOptions.source`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardkit.counting import OnError
from shardkit.io.remote import RemoteOptions, RetryPolicy, remote_options
from shardkit.planning import Balance


@dataclass(frozen=True)
class SourceOptions:
    """How a format dataset splits, shuffles and reads its shards.

    Attributes:
        shuffle, seed, balance, rank, world_size, on_error: the source's, as for
            :class:`~shardkit.sources.sharded.ShardedDataset`.
        storage_options: fsspec options for listing, counting and reading the files.
        remote: how remote files are read; None when no remote keyword was given
            (the format's own, the defaults for the built-in ones).
    """

    shuffle: bool = False
    seed: int = 0
    balance: Balance = "pad"
    rank: int | None = None
    world_size: int | None = None
    on_error: OnError = "raise"
    storage_options: dict[str, Any] | None = None
    remote: RemoteOptions | None = None

    @classmethod
    def of(
        cls,
        *,
        shuffle: bool,
        seed: int,
        balance: Balance,
        rank: int | None,
        world_size: int | None,
        on_error: OnError,
        storage_options: dict[str, Any] | None,
        readahead_bytes: int | None,
        retry: RetryPolicy | None,
        cache_dir: str | None,
        cache_limit_bytes: int | None,
    ) -> SourceOptions:
        """The options from a dataset's keywords; the four remote ones become one ``remote``."""
        remote_keywords = (readahead_bytes, retry, cache_dir, cache_limit_bytes)
        remote = None if all(k is None for k in remote_keywords) else remote_options(*remote_keywords)
        return cls(shuffle, seed, balance, rank, world_size, on_error, storage_options, remote)

    def source(self) -> dict[str, Any]:
        """The keywords of the source itself: the format carries ``storage_options`` and ``remote``."""
        return {
            "shuffle": self.shuffle,
            "seed": self.seed,
            "balance": self.balance,
            "rank": self.rank,
            "world_size": self.world_size,
            "on_error": self.on_error,
        }
