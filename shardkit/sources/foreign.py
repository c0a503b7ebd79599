"""Iterables of other libraries that split themselves by worker or rank, read exactly once by ``wrap``.

An iterable that reads :func:`torch.utils.data.get_worker_info` when iterated (Hugging Face
``datasets.IterableDataset``, WebDataset's ``split_by_worker``, the ``IterableDataset`` of the
PyTorch documentation's example) keeps only its worker's share; ``wrap``'s readers then keep
every ``n``-th item of that share, and most of the data is lost without a sound. So every call
into a wrapped iterable runs as if outside any worker (:class:`OutsideWorker`): it yields the
same sequence in every reader and ``wrap`` alone splits it. That is the generic fix; it needs no
knowledge of the library, and holds for any iterable that asks torch which worker it is in.

A split by *rank* cannot be undone that way (the rank comes from ``torch.distributed`` or the
environment), so the iterables known to split by rank themselves are refused when ``wrap``
splits over more than one rank (:func:`refuse_self_split`), with the library named and the fix.

Hugging Face ``datasets`` gets its own glue (:func:`hf_reader_items`), without importing
``datasets`` unless the object is one of its datasets (detected by its type's module): under
``balance="none"``, when the dataset has at least as many shards as there are readers, each
reader iterates a copy with its own whole shards (``IterableDataset.shard(readers, slot,
contiguous=False)``), so no item is read and thrown away; otherwise every reader iterates the
whole dataset and keeps its items. The copy is given shardkit's epoch (``set_epoch``), so an
HF ``shuffle`` reshuffles per epoch and resuming an epoch replays the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import get_worker_info
from torch.utils.data._utils import worker as _torch_worker  # pyright: ignore[reportPrivateUsage]

from shardkit.planning import Balance
from shardkit.sources.errors import DatasetError
from shardkit.topology import Topology


class OutsideWorker:
    """Iterates ``iterable`` with :func:`torch.utils.data.get_worker_info` answering ``None``
    inside every call into it (``iter`` and each ``next``), so it does not split itself by worker.

    ``get_worker_info`` reads one module global of torch's worker loop; it is set to ``None``
    for the call and restored after it (a DataLoader worker runs the dataset in one thread).
    """

    def __init__(self, iterable: Iterable[Any]) -> None:
        saved = _torch_worker._worker_info  # pyright: ignore[reportPrivateUsage]
        _torch_worker._worker_info = None  # pyright: ignore[reportPrivateUsage]
        try:
            self._iterator: Iterator[Any] = iter(iterable)
        finally:
            _torch_worker._worker_info = saved  # pyright: ignore[reportPrivateUsage]

    def __iter__(self) -> OutsideWorker:
        return self

    def __next__(self) -> Any:
        saved = _torch_worker._worker_info  # pyright: ignore[reportPrivateUsage]
        if saved is None:  # not in a worker: nothing to hide
            return next(self._iterator)
        _torch_worker._worker_info = None  # pyright: ignore[reportPrivateUsage]
        try:
            return next(self._iterator)
        finally:
            _torch_worker._worker_info = saved  # pyright: ignore[reportPrivateUsage]


def _type_modules(obj: object) -> set[str]:
    """The top-level packages of the classes ``obj`` is an instance of (no import needed)."""
    return {cls.__module__.split(".")[0] for cls in type(obj).__mro__}


def _is_type(obj: object, package: str, name: str) -> bool:
    """Whether ``obj`` is an instance of a class ``name`` defined in ``package`` (by its module, no import)."""
    return any(cls.__name__ == name and cls.__module__.split(".")[0] == package for cls in type(obj).__mro__)


def is_hf_iterable(obj: object) -> bool:
    """Whether ``obj`` is a Hugging Face ``datasets.IterableDataset`` (streaming or not)."""
    return _is_type(obj, "datasets", "IterableDataset")


def refuse_self_split(iterable: object, topology: Topology) -> None:
    """Raise if ``iterable`` splits itself by rank while ``wrap`` splits over ``topology.world_size > 1`` ranks.

    Raises:
        DatasetError: naming the library and the fix.
    """
    if is_hf_iterable(iterable) and getattr(iterable, "_distributed", None) is not None:
        raise DatasetError(
            "this Hugging Face datasets.IterableDataset was split by datasets.distributed.split_dataset_by_node, "
            "and wrap() splits it by rank again: wrap the dataset from before split_dataset_by_node"
        )
    if topology.world_size == 1:
        return
    if _is_type(iterable, "litdata", "StreamingDataset"):
        raise DatasetError(
            "LitData's StreamingDataset splits itself by rank and worker, and wrap() would split it again: "
            "use it directly with litdata.StreamingDataLoader, or wrap the files it reads (shardkit.ShardedDataset)"
        )
    if type(iterable).__name__ == "IterableDatasetShard" and getattr(iterable, "num_processes", 1) > 1:
        raise DatasetError(
            f"{type(iterable).__module__}.IterableDatasetShard already keeps one process's share "
            f"(num_processes={iterable.num_processes}), and wrap() would split it again: wrap its .dataset instead"  # type: ignore[attr-defined]
        )
    if "webdataset" in _type_modules(iterable) and _webdataset_splits_by_node(iterable):
        raise DatasetError(
            "this WebDataset pipeline splits its shards by rank itself (split_by_node), and wrap() splits by rank "
            "too: build it without split_by_node (WebDataset(urls, nodesplitter=None)) and let wrap() split it"
        )


def _webdataset_splits_by_node(pipeline: object) -> bool:
    """Whether a WebDataset ``DataPipeline`` has a ``split_by_node`` stage."""
    stages = getattr(pipeline, "pipeline", None) or []
    names = {getattr(getattr(stage, "func", stage), "__name__", None) for stage in stages}  # a partial too
    return "split_by_node" in names


def hf_reader_items(dataset: Any, topology: Topology, balance: Balance, epoch: int) -> tuple[Any, bool]:
    """What reader ``topology.reader_index`` of a Hugging Face ``IterableDataset`` iterates, and whether it
    is its whole share (its own shards) rather than the whole dataset to keep every ``n``-th item of."""
    readers, slot = topology.num_readers, topology.reader_index
    whole_shards = balance == "none" and dataset.n_shards >= readers  # n_shards: every datasets version
    if whole_shards:  # shards slot, slot + readers, ...: no item read by two readers
        copy = dataset.shard(num_shards=readers, index=slot, contiguous=False)
    else:  # the same sequence in every reader, each keeping its items
        copy = dataset.shard(num_shards=1, index=0)
    copy.set_epoch(epoch)  # a copy starts at HF epoch 0; the user's dataset keeps its own
    if get_worker_info() is not None:
        import fsspec.asyn  # as datasets does in a worker: fsspec's lock may be held by the forked parent

        fsspec.asyn.reset_lock()
    return copy, whole_shards
