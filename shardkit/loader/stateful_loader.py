"""StatefulDataLoader: torchdata's ``StatefulDataLoader`` whose checkpoint holds every rank's position
and whose ``len()`` is exact, so a trainer's own checkpoints resume it exactly.

torchdata's loader saves the calling rank's state, and a trainer writes rank
0's, so every rank would resume from rank 0's position. This subclass
changes nothing but that and its length (import it instead of torchdata's;
like torchdata's it is generic in its batch type, so
``shardkit.StatefulDataLoader[list[Tensor]]`` annotates as torchdata's does):

* ``state_dict()`` under a process group of more than one rank returns every
  rank's state in one ``"ranks"`` node (:mod:`shardkit.ranks`), and
  ``load_state_dict()`` gives each rank its own entry. On another world size
  (or without a process group) the entries' dataset states (each worker's,
  as torchdata saved them) are merged into one global state
  (:func:`shardkit.state.merge_ranks`) and loaded into the dataset, so the
  next epoch's iteration resumes from it on any world size the pipeline's
  stages can be split over.
* its position outlives the iterator: a trainer that drops the loader's
  iterator when ``fit`` ends (Lightning sets ``_iterator = None`` in its
  teardown) and saves a checkpoint afterwards (``fit(max_steps=2)``, then
  ``trainer.save_checkpoint(...)``) would get torchdata's state of a fresh
  iterator, the epoch's start, and the resumed run would train the first
  batches again. The state of the dropped iterator is kept instead and is
  what ``state_dict()`` returns until the next iteration starts or a state
  is loaded (as :class:`shardkit.MixedLoader` keeps its position until its
  next epoch); the next ``iter()`` starts an epoch as torchdata's does.
* ``len()`` counts the batches the workers really yield: each worker batches
  its own share and ends with its own partial batch, so
  ``ceil(samples / batch_size)`` (DataLoader's length, which shardkit refuses
  where it is wrong) would be short. With an exact length Lightning does not
  fetch a batch ahead (``_PrefetchDataFetcher`` prefetches only a loader
  without one), so a checkpoint saves the position of the last batch
  trained on, not the one after it.

torchdata is an optional dependency: this module imports it, and
``shardkit.StatefulDataLoader`` imports this module only when first used.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torchdata.stateful_dataloader import StatefulDataLoader as _TorchdataLoader

from shardkit.errors import LoaderError
from shardkit.ranks import gather as gather_ranks
from shardkit.ranks import is_ranks, own_or_global
from shardkit.stateful import State, StateError, combine_ranks, field, merge
from shardkit.tempfiles import socket_folder_problem
from shardkit.trainers import loader_batches, reader_lengths

__all__ = ["StatefulDataLoader"]

_T_co = TypeVar("_T_co", covariant=True)  # the batch type, as torchdata's (and DataLoader's) class is generic in it

_SNAPSHOT, _WORKERS, _SINCE = "_snapshot", "_worker_snapshots", "_steps_since_snapshot"  # torchdata's state keys
_DATASET_STATE = "dataset_state"


class StatefulDataLoader(_TorchdataLoader[_T_co]):
    """torchdata's ``StatefulDataLoader``, with every rank's state in ``state_dict()``
    and an exact ``len()`` over a shardkit pipeline; see the module docstring.

    Takes torchdata's arguments, and:

    Args:
        gather_states: under a process group of more than one rank,
            ``state_dict()`` returns every rank's state (and must then be
            called on every rank, as trainers do); False returns this rank's
            alone, as torchdata's loader does.
    """

    def __init__(self, dataset: Any, *args: Any, gather_states: bool = True, **kwargs: Any) -> None:
        if not isinstance(gather_states, bool):
            raise TypeError(f"gather_states must be a bool (True or False), got {gather_states!r}")
        self._kept_state: dict[str, Any] | None = None  # the dropped iterator's state (module docstring)
        super().__init__(dataset, *args, **kwargs)
        self.gather_states = gather_states

    # A property over torchdata's attribute, so every place torchdata or a trainer sets it is seen.
    @property
    def _iterator(self) -> Any:
        """torchdata's current iterator; set to None from outside (a trainer's teardown), its state is kept."""
        return self.__dict__.get("_current_iterator")

    @_iterator.setter
    def _iterator(self, iterator: Any) -> None:  # pyright: ignore[reportIncompatibleVariableOverride]
        dropped = self.__dict__.get("_current_iterator")
        if iterator is None and dropped is not None:
            self._kept_state = dropped.state_dict()  # read from the main process's snapshot: no worker is asked
        elif iterator is not None:
            self._kept_state = None
        self.__dict__["_current_iterator"] = iterator

    def __iter__(self) -> Any:
        if self.num_workers > 0:
            problem = socket_folder_problem("StatefulDataLoader", torch.multiprocessing.get_sharing_strategy())
            if problem is not None:  # the workers could never send a batch: the loader would wait forever
                raise LoaderError(problem)
        return super().__iter__()

    def __len__(self) -> int:
        """Batches in one epoch: each worker's ``ceil`` (``floor`` with ``drop_last``) of
        its share over ``batch_size``, summed; DataLoader's own length where the
        dataset's split over workers is not known."""
        if self.batch_size is None:
            return super().__len__()
        lengths = reader_lengths(self.dataset, max(self.num_workers, 1))
        if lengths is None:
            return super().__len__()
        return loader_batches(lengths, self.batch_size, self.drop_last)

    def state_dict(self, gather: bool | None = None) -> dict[str, Any]:
        """torchdata's state of this loader; under a process group of more than one
        rank, every rank's (see :meth:`shardkit.MixedLoader.state_dict`), unless
        ``gather`` (default: ``gather_states``) is False."""
        if self.gather_states if gather is None else gather:
            return gather_ranks(self._rank_state, "StatefulDataLoader.state_dict()")
        return self._rank_state()

    def _rank_state(self) -> dict[str, Any]:
        """This rank's torchdata state: the dropped iterator's while no other has started."""
        if self._iterator is None and self._kept_state is not None:
            return self._kept_state
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict``; a state of every rank resumes each rank from its own
        entry on the same world size, else from the global state of all (module docstring)."""
        try:
            self._load(state_dict)
        finally:
            self._kept_state = None  # the loaded state replaces a dropped iterator's

    def _load(self, state_dict: dict[str, Any]) -> None:
        if not is_ranks(state_dict):
            super().load_state_dict(state_dict)
            return
        picked = own_or_global(state_dict, "StatefulDataLoader.load_state_dict()", _global_dataset_state)
        if "kind" not in picked:  # a rank's own torchdata state
            super().load_state_dict(picked)
            return
        load = getattr(self.dataset, "load_state_dict", None)  # the global state of a shardkit pipeline
        if load is None:
            raise StateError(f"{type(self.dataset).__name__} has no load_state_dict(); it cannot resume")
        super().load_state_dict({})  # the loader starts afresh; the dataset resumes from the global state
        load(picked)


def _global_dataset_state(entries: list[State]) -> State:
    """The global dataset state of every rank's torchdata state (each worker's dataset state)."""
    return combine_ranks([merge(_worker_dataset_states(entry, rank)) for rank, entry in enumerate(entries)])


def _worker_dataset_states(entry: State, rank: int) -> list[State]:
    where = f"StatefulDataLoader.load_state_dict(): state['states'][{rank}]"
    if _SNAPSHOT not in entry:  # num_workers=0: the dataset's state, taken when saved
        return [field(entry, _DATASET_STATE, where, dict)]
    if field(entry, _SINCE, where, int) != 0:
        raise StateError(
            f"{where}: the state was saved {entry[_SINCE]} batch(es) after torchdata's last snapshot, which "
            "another world size cannot replay; build the loader with snapshot_every_n_steps=1 (the default)"
        )
    workers = field(field(entry, _SNAPSHOT, where, dict), _WORKERS, where, dict)
    states = []
    for key, worker in workers.items():  # in any order: merging looks at each state's share
        if type(worker) is not dict:
            raise StateError(f"{where}: worker snapshot {key!r} must be a dict, got {type(worker).__name__}")
        states.append(field(worker, _DATASET_STATE, f"{where} ({key})", dict))
    return states
