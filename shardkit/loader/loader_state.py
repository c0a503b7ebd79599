"""A :class:`~shardkit.MixedLoader`'s saved state: how it is made, and every check a
loaded one goes through before a worker is started with it.

A state holds the epoch, the batch index, each worker's dataset state just
past what was delivered, and the undelivered tail of at most one micro-batch
per worker, as plain data (see the :mod:`shardkit.loader.mixed` docstring).
Both the loader and its :class:`~shardkit.loader.mixer.Mixer` make states,
so what they read of a loader is the :class:`LoaderSettings` protocol rather
than the class, which sits above this module.
"""

from __future__ import annotations

from typing import Any, Protocol

from shardkit.loader import slab_columns
from shardkit.loader.collate import collated_length
from shardkit.pipeline import Pipeline
from shardkit.stateful import State, StateError, check, decode, field, node, validate, whole_number


class RecordedSettings(Protocol):
    """What a saved state records of the MixedLoader (or Mixer) that made it."""

    epoch: int
    num_workers: int
    batch_size: int


class LoaderSettings(RecordedSettings, Protocol):
    """What a loaded state is checked against."""

    dataset: Any
    collate_fn: Any
    _columns: bool


def loader_state(loader: RecordedSettings, **fields: Any) -> State:
    return node(
        "mixed_loader",
        epoch=loader.epoch,
        num_workers=loader.num_workers,
        batch_size=loader.batch_size,
        **fields,
    )


def check_loader_state(state: State, loader: LoaderSettings) -> list[Any]:
    """Check every field of a loaded MixedLoader state; returns its carried tails, decoded.

    The workers' dataset states are checked as whole trees when the dataset is
    a shardkit pipeline (the dataset checks what depends on its files when a
    worker loads them); a carried tail must decode to ``count`` samples of
    the form this loader makes (collated, or a list for a ``collate_fn``).
    """
    where = "MixedLoader.load_state_dict()"
    whole_number(state, "epoch", where)
    num_workers = whole_number(state, "num_workers", where)
    whole_number(state, "batch_size", where, 1)
    whole_number(state, "batch_index", where, -1)
    field(state, "finished", where, bool)
    workers = field(state, "workers", where, list, tuple)
    if len(workers) != max(num_workers, 1):
        raise StateError(f"{where}: the state has {len(workers)} worker states for num_workers={num_workers}")
    for index, worker_state in enumerate(workers):
        if isinstance(loader.dataset, Pipeline):
            validate(worker_state, f"{where}: state['workers'][{index}]")
            check(worker_state, loader.dataset._state_kind, loader.dataset)
        elif not isinstance(worker_state, dict):
            raise StateError(f"{where}: state['workers'][{index}] must be a dict, got {type(worker_state).__name__}")
    carry = field(state, "carry", where, list, tuple)
    if state["finished"] and carry:
        raise StateError(
            f"{where}: state['finished'] is true, but state['carry'] holds {len(carry)} tail(s) of undelivered "
            "samples; a finished epoch has delivered everything. The state was edited or is corrupt"
        )
    tails = [_check_tail(tail, index, num_workers, loader) for index, tail in enumerate(carry)]
    owners = [tail["worker"] for tail in carry if tail["worker"] is not None]
    if len(owners) != len(set(owners)):
        raise StateError(
            f"{where}: state['carry'] holds more than one tail of worker(s) {owners}; a worker has at most one"
        )
    return tails


def _check_tail(tail: Any, index: int, num_workers: int, loader: LoaderSettings) -> Any:
    where = f"MixedLoader.load_state_dict(): state['carry'][{index}]"
    if not isinstance(tail, dict):
        raise StateError(f"{where} must be a dict, got {type(tail).__name__}")
    worker = field(tail, "worker", where, int, type(None))
    if worker is not None and not 0 <= worker < max(num_workers, 1):
        raise StateError(f"{where}: worker {worker} is not one of the saving loader's {num_workers} workers")
    count = whole_number(tail, "count", where, 1)
    if "payload" not in tail:
        raise StateError(f"{where} has no 'payload'")
    samples = decode(tail["payload"])
    if loader._columns:
        samples = slab_columns.from_plain(samples)
        length, form = slab_columns.columns_length(samples), "a column batch"
    elif loader.collate_fn is not None:
        length, form = (len(samples) if type(samples) is list else None), "a list of samples (for collate_fn)"
    else:
        length, form = collated_length(samples), "a collated micro-batch"
    if length != count:
        raise StateError(
            f"{where}: the carried samples must be {form} of {count} samples; got {_describe(samples, length)}"
        )
    return samples


def _describe(samples: Any, length: int | None) -> str:
    return f"a {type(samples).__name__}" + ("" if length is None else f" of {length}")
