"""``wrap``: an existing dataset as a shardkit source, split over ranks and workers, exactly once.

A map-style dataset (``__len__`` and ``__getitem__``, a Hugging Face ``datasets.Dataset`` among
them) becomes a planned source over its indices (:class:`MapSource`): plans, shuffling and
resuming work as for shards. Any other iterable becomes a :class:`StreamSource`, whose readers
each keep every ``n``-th item (:class:`_StrideIterator`): the only split possible without random
access, so a state of it saves how many items its reader stepped past and resumes into the same
reader slot only.

An iterable may split itself by worker (it reads ``get_worker_info()``): it is iterated as if
outside any worker, so that ``wrap`` alone splits it; one that splits itself by rank is refused
when ``wrap`` splits over ranks; a Hugging Face ``IterableDataset`` gives each reader its own
whole shards where it can (see :mod:`shardkit.sources.foreign`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset, IterableDataset

from shardkit.pipeline import Pipeline
from shardkit.planning import Balance
from shardkit.sources.base import _Source
from shardkit.sources.errors import DatasetError
from shardkit.sources.foreign import OutsideWorker, hf_reader_items, is_hf_iterable, refuse_self_split
from shardkit.sources.planned import _PlannedSource
from shardkit.stateful import (
    EPOCH,
    SEQUENCE,
    Resume,
    StageIterator,
    State,
    StateError,
    expect_equal,
    field,
    node,
    whole_number,
)
from shardkit.topology import Topology


def wrap(
    dataset: Dataset | IterableDataset | Iterable[Any],
    *,
    shuffle: bool = False,
    seed: int = 0,
    balance: Balance = "pad",
    rank: int | None = None,
    world_size: int | None = None,
) -> Pipeline:
    """Make an existing dataset a shardkit source, split over ranks and workers, every item once.

    * A map-style dataset (``__len__`` and ``__getitem__``; a Hugging Face
      ``datasets.Dataset``) becomes a source over its indices, split by
      :func:`plan` exactly like shards of one record each: ``shuffle=True``
      permutes every index from ``(seed, epoch)``; ``"pad"``/``"drop"`` give
      every rank ``ceil``/``floor`` of ``len / world_size`` items.
    * A Hugging Face ``datasets.IterableDataset`` (``load_dataset(...,
      streaming=True)``, ``Dataset.to_iterable_dataset(num_shards=k)``): under
      ``balance="none"``, when it has at least as many shards (``num_shards``)
      as there are readers (ranks x DataLoader workers), each reader iterates
      its own whole shards (``shard(readers, reader, contiguous=False)``) and no
      item is read twice; otherwise, as any iterable below. Its own split by
      worker is not applied (it would split a second time), it is given
      shardkit's epoch (``set_epoch``, so its ``shuffle`` changes per epoch),
      and a dataset already split by ``split_dataset_by_node`` is refused:
      wrap the one from before the split.
    * Any other iterable (an ``IterableDataset``, a WebDataset pipeline, a
      generator factory's result) becomes a source in which reader ``k`` of
      ``n`` keeps items ``k, k + n, ...``. Every reader still iterates past the
      others' items, so the cost of producing an item is paid ``n`` times:
      prefer a map-style dataset or shards when producing items is expensive.
      Under ``"pad"``/``"drop"`` every reader keeps ``ceil``/``floor`` of
      ``items / n``; ``shuffle`` is not available (chain ``.shuffle(buffer)``).
      The iterable is iterated as if outside any DataLoader worker
      (``torch.utils.data.get_worker_info()`` answers ``None`` inside it), so
      one that splits itself by worker (WebDataset's ``split_by_worker``) yields
      every item and is split once, by ``wrap``. Every reader must see the same
      sequence: its order may not depend on the worker or the rank.

    An iterable that splits itself by rank cannot be split again without loss:
    over more than one rank, a WebDataset pipeline with ``split_by_node``,
    LitData's ``StreamingDataset`` and an ``IterableDatasetShard`` of more than
    one process raise :class:`DatasetError` at the first item, naming the fix.

    Resuming (``state_dict``): a map-style source saves the positions left; an
    iterable's reader saves how many items it stepped past, and resuming
    iterates it again and skips them (exact, as long as the iterable yields the
    same sequence again), into the same reader slot only.
    """
    if isinstance(dataset, Pipeline):
        raise DatasetError(f"{dataset!r} is already a shardkit pipeline; use it directly")
    is_map_style = (
        not isinstance(dataset, IterableDataset) and hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    )
    if is_map_style:
        return MapSource(dataset, shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size)
    if not isinstance(dataset, Iterable):
        raise DatasetError(
            f"wrap() takes a map-style dataset (__len__ and __getitem__) or an iterable, got {type(dataset).__name__}"
        )
    if shuffle:
        raise DatasetError(
            "wrap(shuffle=True) needs a map-style dataset (__len__ and __getitem__) to permute; "
            "for an iterable, chain .shuffle(buffer_size) after wrap()"
        )
    return StreamSource(dataset, seed=seed, balance=balance, rank=rank, world_size=world_size)


class MapSource(_PlannedSource):
    """A map-style dataset as a source over its indices; see :func:`wrap`."""

    shuffle_window = 0  # shuffled, every index is a block of its own: already a uniform permutation

    def __init__(
        self, dataset: Any, *, shuffle: bool, seed: int, balance: Balance, rank: int | None, world_size: int | None
    ) -> None:
        super().__init__(shuffle=shuffle, seed=seed, balance=balance, rank=rank, world_size=world_size)
        self.dataset = dataset

    def _record_counts(self, topology: Topology, *, required: bool) -> Any:
        # Shuffled: every index is a shard of one record, so the plan permutes
        # them all; otherwise one shard of len(dataset) records.
        size = len(self.dataset)
        return np.ones(size, dtype=np.int64) if self.shuffled else np.array([size], dtype=np.int64)

    def _read(self, shard: int, start: int, stop: int | None) -> Iterator[Any]:
        if self.shuffled:
            start, stop = shard, shard + 1
        return map(self.dataset.__getitem__, range(start, len(self.dataset) if stop is None else stop))

    def _shard_count(self) -> int:
        return len(self.dataset) if self.shuffled else 1

    def _read_again(self, shard: int, start: int, stop: int) -> Iterator[Any]:
        if not self.shuffled and stop > len(self.dataset):
            raise StateError(
                f"{self!r}: the state holds index {stop - 1}, past the dataset's {len(self.dataset)} items; "
                "the state is not of this dataset, or it was edited"
            )
        return super()._read_again(shard, start, stop)

    def __repr__(self) -> str:
        return f"wrap({type(self.dataset).__name__} of {len(self.dataset)}, shuffle={self.shuffled}, balance={self.balance!r})"


class _StrideIterator(StageIterator):
    """Keeps item ``slot`` of every group of ``readers`` consecutive items.

    The last, incomplete group: ``"none"`` keeps the item if there is one;
    ``"drop"`` keeps nothing of it; ``"pad"`` keeps an item of it in every
    reader (wrapping round the group), so all readers yield the same number.

    Its node (``"stream"``): ``epoch``, the ``items`` stepped past, whether it
    is ``done``, and its ``reader`` slot; resuming iterates the iterable again
    and skips them, so it resumes only into the same reader slot.
    """

    KIND = "stream"
    READER = "reader"  #: state key: ``[slot, readers]``, the reader slot (rank-major) and how many there are
    ITEMS = "items"  #: state key: items stepped past
    DONE = "done"  #: state key: the last group was handled

    def __init__(
        self, items: Iterator[Any], slot: int, readers: int, balance: Balance, epoch: int, *, own: bool = False
    ) -> None:
        self._items = items
        self._slot = slot
        self._readers = readers
        # ``own``: ``items`` are this reader's alone (its whole shards), every one of them kept
        self._group, self._pick = (1, 0) if own else (readers, slot)
        self._balance = balance
        self._done = False
        self._epoch = epoch
        self.items_seen = 0

    @property
    def reader(self) -> list[int]:
        """``[slot, readers]``: which reader this is."""
        return [self._slot, self._readers]

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        group = []
        for item in self._items:
            self.items_seen += 1
            group.append(item)
            if len(group) == self._group:
                return group[self._pick]
        self._done = True
        if group and self._balance == "pad":
            return group[self._pick % len(group)]
        if group and self._balance == "none" and self._pick < len(group):
            return group[self._pick]
        raise StopIteration

    def state_dict(self) -> State:
        """How many items this reader has stepped past; resuming replays them."""
        fields = {EPOCH: self._epoch, self.READER: self.reader, self.ITEMS: self.items_seen, self.DONE: self._done}
        return node(self.KIND, **fields)

    def restore(self, resume: Resume) -> None:
        """Step past the items the saved reader had stepped past (they are read again); same slot only."""
        state = resume.state
        expect_equal(
            resume.owner, "reader slot [rank * num_workers + worker, readers]", state[self.READER], self.reader
        )
        items = state[self.ITEMS]
        for _ in itertools.islice(self._items, items):
            self.items_seen += 1
        if self.items_seen < items:
            raise StateError(
                f"the state says {items} items were read, but the iterable has only {self.items_seen}; "
                "it must yield the same items every time it is iterated"
            )
        self._done = state[self.DONE]

    @classmethod
    def check_state(cls, state: State, where: str) -> None:
        whole_number(state, EPOCH, where)
        reader = field(state, cls.READER, where, *SEQUENCE)
        if len(reader) != 2 or any(type(v) is not int for v in reader) or not 0 <= reader[0] < reader[1]:
            raise StateError(f"{where}: state['reader'] must be [slot, readers] with 0 <= slot < readers, got {reader}")
        whole_number(state, cls.ITEMS, where)
        field(state, cls.DONE, where, bool)

    @classmethod
    def merge(cls, states: Sequence[State]) -> State:
        """Only one reader's node merges (into itself): readers keep every n-th item."""
        if len(states) == 1:
            return states[0]
        raise StateError(
            "a wrap() of a plain iterable resumes only into the same reader slot (same num_workers): "
            "its readers keep every n-th item, so their positions cannot be split anew. "
            "Wrap a map-style dataset or use shard files to resume with another number of workers"
        )


class StreamSource(_Source):
    """An iterable as a source: reader ``k`` of ``n`` keeps items ``k, k + n, ...``; see :func:`wrap`."""

    _iterator_type = _StrideIterator

    def __init__(
        self, iterable: Iterable[Any], *, seed: int, balance: Balance, rank: int | None, world_size: int | None
    ) -> None:
        super().__init__(shuffle=False, seed=seed, balance=balance, rank=rank, world_size=world_size)
        self.iterable = iterable

    def _open(self, resume: Resume | None) -> Iterator[Any]:
        topology, epoch = self._start()
        refuse_self_split(self.iterable, topology)
        iterable, own = self.iterable, False
        if is_hf_iterable(iterable):
            iterable, own = hf_reader_items(iterable, topology, self.balance, epoch)
        items = OutsideWorker(iterable)  # the iterable does not split itself by worker: wrap splits it
        iterator = _StrideIterator(items, topology.reader_index, topology.num_readers, self.balance, epoch, own=own)
        if resume is not None:
            iterator.restore(resume)
        return iterator

    def __repr__(self) -> str:
        return f"wrap({type(self.iterable).__name__}, balance={self.balance!r})"
