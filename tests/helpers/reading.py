"""Reading a dataset the way the tests check it: samples per rank and worker, and comparisons.

Module level, so that DataLoader workers and ranks started with spawn can unpickle them."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info


def pandas_is_loaded(sample: object) -> bool:
    """Whether this process has imported pandas (pyarrow does on its first conversion to or from Python)."""
    import sys

    return "pandas" in sys.modules


def tag_worker(sample: object) -> tuple[int, object]:
    info = get_worker_info()
    return (-1 if info is None else info.id), sample


class CountingStream(torch.utils.data.IterableDataset):
    """A plain IterableDataset yielding 0..n-1 (no __len__, no __getitem__)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def assert_same(got: Any, expected: Any, where: str = "batch") -> None:
    """Equal types, dtypes, shapes and bytes, all the way down."""
    assert type(got) is type(expected), f"{where}: {type(got).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        assert got.view(-1).view(torch.uint8).tolist() == expected.view(-1).view(torch.uint8).tolist(), where
    elif isinstance(expected, dict):
        assert list(got) == list(expected), where
        for key in expected:
            assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{where}[{i}]")
    else:
        assert got == expected, where


def sample_id(sample: object) -> str:
    """The identity of a sample of any built-in format: a tar sample's key, a row's or line's ``id``."""
    if isinstance(sample, dict) and "__key__" in sample:
        return str(sample["__key__"])
    if isinstance(sample, dict):
        return str(sample["id"])
    raise TypeError(f"no id in {sample!r}")


def ids_per_rank(
    make,
    *,
    world_size: int,
    num_workers: int,
    batch_size: int = 4,
    env: bool = False,
    monkeypatch=None,
    context: str = "fork",
):
    """Sample ids each rank's DataLoader yields, as lists of batches; ``make(rank, world)`` builds a rank's dataset
    (``rank``/``world`` are None with ``env``: then RANK/WORLD_SIZE are set for each rank); workers start by
    ``context``."""
    from torch.utils.data import DataLoader

    ranks = []
    for rank in range(world_size):
        if env:
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WORLD_SIZE", str(world_size))
            dataset = make(None, None)
        else:
            dataset = make(rank, world_size)
        kwargs = {"multiprocessing_context": context} if num_workers else {}
        loader = DataLoader(dataset.map(sample_id), batch_size=batch_size, num_workers=num_workers, **kwargs)
        ranks.append([list(batch) for batch in loader])
    return ranks


def assert_split(ranks: list, everything: list[str], balance: str) -> None:
    """Exactly once over the ranks with ``"none"``; equal batch and sample counts with ``"pad"``/``"drop"``
    (``"pad"`` repeats, ``"drop"`` leaves out, fewer samples than there are ranks)."""
    import collections

    seen = collections.Counter(s for batches in ranks for batch in batches for s in batch)
    total, world = len(everything), len(ranks)
    assert set(seen) <= set(everything)
    if balance == "none":
        assert sorted(seen.elements()) == sorted(everything)
        return
    assert len({len(batches) for batches in ranks}) == 1, "ranks yield different numbers of batches"
    per_rank = -(-total // world) if balance == "pad" else total // world
    assert {sum(len(b) for b in batches) for batches in ranks} == {per_rank}
    if balance == "pad":
        assert set(seen) == set(everything)
        assert sum(seen.values()) == per_rank * world
    else:
        assert max(seen.values()) == 1 and len(set(everything) - set(seen)) == total % world


def rank_factory(dataset_class, urls, **kwargs):
    """``make(rank, world_size)`` building ``dataset_class(urls, rank=..., world_size=..., **kwargs)`` (for ids_per_rank)."""

    def make(rank, world):
        return dataset_class(urls, rank=rank, world_size=world, **kwargs)

    return make


def read_all(loader: Iterable[Any]) -> list[Any]:
    """``list(loader)``, but a DataLoader worker's error shuts the workers down before it propagates.

    DataLoader re-raises a worker's error with a traceback that holds its
    iterator. Kept by ``pytest.raises``, the iterator is freed by the cycle
    collector, which finalizes its queues first: the workers never get their
    exit message and DataLoader waits 5 s per worker before terminating them.
    (MixedLoader shuts its own workers down; a plain DataLoader needs this.)
    The error may also come out of ``iter(loader)``: a StatefulDataLoader that
    loaded a state hands it to its workers while its iterator starts, and no
    caller holds that iterator yet; its workers are found through the
    traceback (:func:`shut_down_workers`).
    """
    try:
        return list(loader)
    except BaseException as error:
        shut_down_workers(error.__traceback__)
        raise


def shut_down_workers(traceback: Any) -> None:
    """Shut down the workers of every DataLoader iterator that a frame of ``traceback`` holds as ``self``
    (a started or half-started one), before the cycle collector would: it finalizes their queues first,
    and DataLoader then waits 5 s per worker for an exit message that never comes."""
    while traceback is not None:
        holder = traceback.tb_frame.f_locals.get("self")
        shutdown = getattr(holder, "_shutdown_workers", None)
        if callable(shutdown) and hasattr(holder, "_workers"):
            shutdown()
        traceback = traceback.tb_next


@contextlib.contextmanager
def as_worker(worker: int, workers: int) -> Iterator[None]:
    """Run in this process as DataLoader worker ``worker`` of ``workers``: ``torch.utils.data.get_worker_info``
    answers as it does inside that worker, which is where shardkit learns its share."""
    from types import SimpleNamespace
    from unittest import mock

    info = SimpleNamespace(id=worker, num_workers=workers, seed=0, dataset=None)
    with mock.patch.object(torch.utils.data, "get_worker_info", lambda: info):
        yield


def run_as_worker(worker: int, workers: int, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` as DataLoader worker ``worker`` of ``workers`` would, in this process (sources then seed
    the global generators: they are put back afterwards)."""
    from torch.utils.data._utils import worker as worker_module

    saved = random.getstate(), np.random.get_state()
    worker_module._worker_info = worker_module.WorkerInfo(id=worker, num_workers=workers, seed=0, dataset=None)
    try:
        with torch.random.fork_rng():
            return fn()
    finally:
        worker_module._worker_info = None
        random.setstate(saved[0])
        np.random.set_state(saved[1])


def batches_as_workers(dataset: Any, num_workers: int, batch_size: int) -> list[list[Any]]:
    """The batches a DataLoader with ``num_workers`` workers yields, read in this process: each worker's
    share from its own copy of the dataset (as a forked worker has), cut into batches as each worker cuts
    its own; worker after worker rather than interleaved, the same batches in another order.

    For matrices of worker counts: the share of each worker is planned by the code a real worker runs,
    without starting ``num_workers`` processes per cell; a real DataLoader covers the process path once."""
    import copy

    batches = []
    for worker in range(num_workers):
        with as_worker(worker, num_workers):
            samples = list(copy.deepcopy(dataset))
        batches += [samples[i : i + batch_size] for i in range(0, len(samples), batch_size)]
    return batches
