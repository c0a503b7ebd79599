"""Who is reading: the (rank, world_size, worker_id, num_workers) of this process.

Detection happens when iteration starts (:meth:`Topology.current`), never when
a dataset is built: a dataset made before the launcher set up the process group,
or in the main process before DataLoader forked its workers, must still split.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from shardkit.errors import ShardkitError, check_int


class TopologyError(ShardkitError, ValueError):
    """A rank, world size, worker id or worker count that cannot be."""


def _check_slot(name: str, index: int, count_name: str, count: int) -> None:
    check_int(count_name, count, minimum=1, error=TopologyError)
    # Not check_int: the index has an upper bound too, and the message names both.
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise TopologyError(f"{name} must be an int in [0, {count_name}) = [0, {count}), got {index!r}")


@dataclass(frozen=True)
class Topology:
    """Where one reader sits: its DDP rank among ``world_size`` ranks and its
    DataLoader worker among ``num_workers`` workers of that rank.

    Example:
        >>> from shardkit import Topology
        >>> reader = Topology(rank=1, world_size=2, worker_id=2, num_workers=4)
        >>> reader.num_readers, reader.reader_index
        (8, 6)
        >>> Topology(rank=2, world_size=2)
        Traceback (most recent call last):
        ...
        shardkit.topology.TopologyError: rank must be an int in [0, world_size) = [0, 2), got 2
    """

    rank: int = 0
    world_size: int = 1
    worker_id: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        _check_slot("rank", self.rank, "world_size", self.world_size)
        _check_slot("worker_id", self.worker_id, "num_workers", self.num_workers)

    @property
    def num_readers(self) -> int:
        """Readers in the whole world: ranks times workers per rank."""
        return self.world_size * self.num_workers

    @property
    def reader_index(self) -> int:
        """This reader's place among all readers, rank-major."""
        return self.rank * self.num_workers + self.worker_id

    @classmethod
    def current(
        cls,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        worker_id: int | None = None,
        num_workers: int | None = None,
    ) -> Topology:
        """Detect the topology of the calling process; explicit values win.

        The worker comes from :func:`torch.utils.data.get_worker_info` (one
        worker in the main process). The rank comes from an initialised
        ``torch.distributed`` process group, else from the ``RANK`` and
        ``WORLD_SIZE`` environment variables that ``torchrun`` sets, else the
        process is alone (rank 0 of 1).

        Example:
            In the main process (no DataLoader worker), with the rank given:

            >>> from shardkit import Topology
            >>> Topology.current(rank=0, world_size=1)
            Topology(rank=0, world_size=1, worker_id=0, num_workers=1)
        """
        if rank is None or world_size is None:
            detected_rank, detected_world = _detect_rank()
            rank = detected_rank if rank is None else rank
            world_size = detected_world if world_size is None else world_size
        if worker_id is None or num_workers is None:
            detected_worker, detected_workers = _detect_worker()
            worker_id = detected_worker if worker_id is None else worker_id
            num_workers = detected_workers if num_workers is None else num_workers
        return cls(rank=rank, world_size=world_size, worker_id=worker_id, num_workers=num_workers)


def _detect_rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if env_rank is not None and env_world is not None:
        try:
            return int(env_rank), int(env_world)
        except ValueError:
            raise TopologyError(f"RANK={env_rank!r} and WORLD_SIZE={env_world!r} must be integers") from None
    return 0, 1


def _detect_worker() -> tuple[int, int]:
    from torch.utils.data import get_worker_info

    from shardkit.orphans import guard_worker

    info = get_worker_info()
    if info is None:
        return 0, 1
    guard_worker()  # iteration starts in a worker: stop it soon if its main process dies
    return info.id, info.num_workers
