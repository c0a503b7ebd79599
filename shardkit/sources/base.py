"""What every source shares: the seed, the balance, an explicit rank, the shared epoch.

Nothing about the topology is read in ``__init__``: every source, in every DataLoader
worker of every rank, detects its :class:`~shardkit.Topology` at the start of ``__iter__``
(:meth:`_Source._start`), reads the epoch from shared memory and seeds
``random``/numpy/torch for its reader. So a dataset built before the process group
exists still splits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardkit.epoch import SharedEpoch, check_epoch
from shardkit.io.retry import RetryPolicy
from shardkit.pipeline import Pipeline
from shardkit.planning import BALANCES, Balance
from shardkit.seeding import check_seed, seed_iteration
from shardkit.shardlist import ShardList
from shardkit.sources.errors import DatasetError
from shardkit.topology import Topology


class _Source(Pipeline):
    """What every source shares: seed, balance, explicit rank, the shared epoch."""

    def __init__(self, *, shuffle: bool, seed: int, balance: Balance, rank: int | None, world_size: int | None) -> None:
        if balance not in BALANCES:
            raise DatasetError(f"balance must be one of {BALANCES}, got {balance!r}")
        if (rank is None) != (world_size is None):
            raise DatasetError(
                f"give rank and world_size together or neither (got rank={rank!r}, world_size={world_size!r}); "
                "with neither, they are detected from torch.distributed or RANK/WORLD_SIZE"
            )
        if rank is not None:
            Topology(rank=rank, world_size=world_size)  # type: ignore[arg-type]  # validates
        self.shuffled = bool(shuffle)  # the plan shuffles: the shards, and samples within a window of blocks
        self.balance: Balance = balance
        self.rank = rank
        self.world_size = world_size
        self._seed = check_seed(seed)
        self._epoch = SharedEpoch()  # counts passes until set_epoch is called

    def set_epoch(self, epoch: int) -> None:
        self._epoch.set(check_epoch(epoch))

    @property
    def epoch(self) -> int:
        return self._epoch.effective()

    @property
    def seed(self) -> int:
        return self._seed

    def topology(self) -> Topology:
        if self.rank is None and self._process_group is not None:
            return Topology.current(rank=self._process_group[0], world_size=self._process_group[1])
        return Topology.current(rank=self.rank, world_size=self.world_size)

    _process_group: tuple[int, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for DataLoader workers (spawn, forkserver): carry this
        process's torch.distributed rank, which a fresh worker process cannot see."""
        state = super().__getstate__()
        if self.rank is None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                state["_process_group"] = (dist.get_rank(), dist.get_world_size())
        return state

    def _start(self) -> tuple[Topology, int]:
        """Detect the reader and seed it for this pass; returns (topology, epoch)."""
        topology, epoch = self.topology(), self.epoch
        seed_iteration(self.seed, epoch, topology)
        return topology, epoch


def as_shard_list(
    shards: ShardList | str | Sequence[str],
    storage_options: dict[str, Any] | None = None,
    retry: RetryPolicy | None = None,
) -> ShardList:
    """A :class:`ShardList` from a ShardList, a glob pattern or a list of urls; a glob is listed with its
    requests bounded and retried under ``retry`` (default :class:`~shardkit.io.retry.RetryPolicy`)."""
    if isinstance(shards, ShardList):
        return shards
    if isinstance(shards, str):
        from shardkit.listing import shared_listing

        # Once per job: the first rank to get here lists, the others read its listing from the
        # process group's store (not a collective: a rank-0-only build does not wait).
        return shared_listing(shards, storage_options, retry)
    if isinstance(shards, Sequence):
        return ShardList(list(shards))
    raise DatasetError(f"shards must be a ShardList, a glob pattern or a list of urls, got {type(shards).__name__}")
