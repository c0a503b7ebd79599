"""The side group :func:`~shardkit.even_batches` agrees on: gloo, over the ranks that wrap their loaders.

It is made once per set of ranks (the default group may be NCCL; a side
group also keeps the agreement from queueing behind gradient traffic) with
the job's timeout, not gloo's default of 30 minutes, and when a wait for an
agreement fails it finds, through the job's store, which ranks stalled or
died (:class:`_Side`). The wrapper above (:mod:`shardkit.even.wrapper`)
decides what to agree on; this module only carries the agreement.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch

from shardkit.errors import EvenBatchesError


class _Side:
    """The gloo group the ranks agree on, with this process's place in it.

    It has the job's timeout (:func:`_job_timeout`), so a wait for a rank that
    stalled or died ends within it. Agreements are posted at the same steps on
    every rank, so their count (:attr:`posted`) names one agreement on every
    rank: when a wait fails, the rank marks that agreement in the job's store
    and looks, for up to :data:`GRACE` seconds, which ranks mark it too (they
    are waiting as well); those that do not are the ones that stalled or died.
    """

    def __init__(self, group: Any, rank: int, ranks: tuple[int, ...], timeout: timedelta) -> None:
        import torch.distributed as dist

        self.group, self.rank, self.size = group, rank, len(ranks)
        self.ranks, self.timeout = ranks, timeout
        self.posted = 0
        #: Seconds of one agreement waited for at once (the fastest of a few, see :func:`_new_side_group`).
        self.round_trip = 0.0
        # Posted on the group itself: dist.all_reduce's checks and lookups cost ~10 us a call here,
        # paid per batch at every=1; the options are the same for every agreement.
        self._options = dist.AllreduceOptions()
        self._options.reduceOp = dist.ReduceOp.MIN  # pyright: ignore[reportAttributeAccessIssue] - a stub says read-only

    def all_reduce_min(self, tensor: torch.Tensor) -> Any:
        """Post an asynchronous MIN all-reduce of ``tensor`` (in place); returns its work, to wait for."""
        self.posted += 1
        return self.group.allreduce([tensor], self._options)

    def lost(self, error: BaseException) -> EvenBatchesError:
        """The error for a failed wait for agreement :attr:`posted`, naming the ranks that did not reach it."""
        cause = str(error).strip().splitlines()[0] if str(error).strip() else ""
        where = f"even_batches: rank {self.rank} of {self.size} stops"
        try:
            missing = self._missing()
        except Exception as store_error:  # noqa: BLE001 - the store may be on the rank that died
            return EvenBatchesError(
                f"{where}: a rank stalled or died (agreement {self.posted} failed: {type(error).__name__}: "
                f"{cause}; the job's store, which would say which rank, failed too: {store_error})"
            )
        if not missing:
            return EvenBatchesError(
                f"{where}: agreement {self.posted} failed on every rank that reached it "
                f"({type(error).__name__}: {cause})"
            )
        names = ", ".join(map(str, missing))
        return EvenBatchesError(
            f"{where}: rank {names} stalled or died: it did not reach agreement {self.posted} within the job's "
            f"timeout ({self.timeout.total_seconds():g} s), or its connection broke ({type(error).__name__}: "
            f"{cause}). A rank that stops iterating (an exception caught outside the loop, a break, a hang) "
            "stops every rank: check that rank's log"
        )

    def _missing(self) -> list[int]:
        """Ranks (in the side group) that have not marked agreement :attr:`posted` within :data:`GRACE` seconds."""
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        prefix = f"shardkit/even_batches/{'-'.join(map(str, self.ranks))}/{self.posted}/"
        store.set(prefix + str(self.rank), "1")
        deadline = time.monotonic() + GRACE
        while True:
            missing = [rank for rank in range(self.size) if not store.check([prefix + str(rank)])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.05)


#: Seconds a rank whose wait failed looks for the other ranks that wait too.
GRACE = 2.0


def _job_timeout() -> timedelta:
    """The timeout of the default process group (``init_process_group(timeout=...)``).

    Read from the default group's backend options (torch >= 2.5 for gloo), else
    from the default store (``init_process_group`` gives it the same timeout),
    else torch's default for the backend.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            timeout = world._get_backend(torch.device(device)).options._timeout  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001, S112 - no such backend, or no options in this torch
            continue
        if isinstance(timeout, timedelta) and timeout > timedelta(0):
            return timeout
    try:
        timeout = getattr(c10d._get_default_store(), "timeout", None)
        if isinstance(timeout, timedelta) and timeout > timedelta(0):
            return timeout
    except Exception:  # noqa: BLE001, S110 - a store without a timeout
        pass
    try:
        return c10d._get_default_timeout(dist.get_backend())
    except Exception:  # noqa: BLE001 - a torch without it
        return c10d.default_pg_timeout


#: Side groups made so far, per set of ranks, valid while the default group is the one they were made under.
_SIDE_GROUPS: dict[tuple[int, ...], _Side] = {}
_SIDE_WORLD: list[Any] = [None]


def _side_group(group: Any) -> _Side | None:
    """The gloo side group over ``group``'s ranks (made once, by every rank
    of ``group``), or None when there is nothing to agree with."""
    import torch.distributed as dist

    if not _distributed():
        if group is not None:
            raise EvenBatchesError("even_batches was given a group, but torch.distributed is not initialised")
        return None
    world = dist.group.WORLD
    if _SIDE_WORLD[0] is not world:  # a new default group: groups of the old one are gone
        _SIDE_GROUPS.clear()
        _SIDE_WORLD[0] = world
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else world))
    if dist.get_rank() not in ranks:
        raise EvenBatchesError(
            f"even_batches: rank {dist.get_rank()} is not in the given group (ranks {list(ranks)}); "
            "wrap the loader with the group this rank trains in"
        )
    if len(ranks) == 1:
        return None
    side = _SIDE_GROUPS.get(ranks)
    if side is None:
        side = _SIDE_GROUPS[ranks] = _new_side_group(ranks)
    return side


def _new_side_group(ranks: tuple[int, ...]) -> _Side:
    """Make the gloo group over ``ranks`` (every one of them calls this) and
    run its first collective, which is often slower than the next ones (1-8 ms
    against 0.2-0.5 ms here): paid when the wrapper is built, not in the first batch.
    Then time :data:`ROUND_TRIPS` more, waited for at once: the fastest is the
    group's :attr:`_Side.round_trip` (the first absorbs the ranks arriving at
    different times; the fastest of the rest, other processes taking the CPU)."""
    import torch.distributed as dist

    # Only the group's ranks take part in making it (they all wrap their loaders). It has the
    # job's timeout: gloo's default (30 min) would keep the ranks waiting for a stalled one.
    timeout = _job_timeout()
    made = dist.new_group(list(ranks), backend="gloo", timeout=timeout, use_local_synchronization=True)
    # new_group returns a non-member marker (an int) or None only to ranks outside the group.
    assert isinstance(made, dist.ProcessGroup), f"rank {dist.get_rank()} got no group over its ranks {ranks}"
    side = _Side(made, dist.get_rank(made), ranks, timeout)
    flags = torch.zeros(4, dtype=torch.int64)
    try:
        side.all_reduce_min(flags).wait()
        times = []
        for _ in range(ROUND_TRIPS):
            start = time.perf_counter()
            side.all_reduce_min(flags).wait()
            times.append(time.perf_counter() - start)
    except Exception as error:
        raise side.lost(error) from None
    side.round_trip = min(times)
    return side


#: Round trips timed when a side group is made (about 0.2-0.5 ms each here).
ROUND_TRIPS = 3


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
