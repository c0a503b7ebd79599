"""The iterators of ``.map()`` and ``.filter()``: one sample in, at most one out.

Neither holds anything between samples (a sample is mapped, or tested, in
the step that reads it), so each node is only ``upstream``
(:class:`~shardkit.stateful.PassThroughIterator`).

Both keep the position of their input's record (``position``), and both
make their items again from positions (:class:`_MappedRecords`,
:class:`_FilteredRecords`) when a stage above holds them by position in a
saved state (:mod:`shardkit.stateful.positions`): the record is read again
and mapped again. So a map's output must be a function of its input and
:func:`~shardkit.seeding.record_seed` (which :class:`_MapIterator` makes
available while ``fn`` runs). What can be detected is: a map applied to a
record read again twice gives two different samples (it draws from a
generator that runs on: a :class:`NondeterministicMapWarning`, as the record
still comes exactly once, only its sample differs from the one saved); a
record read again that a filter no longer accepts (a :class:`StateError`: it
would come once too many or too few).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from shardkit import seeding
from shardkit.stateful import PassThroughIterator, Records, StateError, encode


class NondeterministicMapWarning(UserWarning):
    """A ``.map`` gave two different samples for one record read again on resume."""


class _MapIterator(PassThroughIterator):
    """``fn(sample)`` for every sample.

    State node (kind ``"map"``): only ``upstream``, the input's node; a
    sample is mapped in the step that reads it.
    """

    KIND = "map"

    def __init__(self, source: Iterator[Any], fn: Callable[[Any], Any], seed: int = 0, epoch: int = 0) -> None:
        super().__init__(source)
        self._fn = fn
        self.seed, self.epoch = seed, epoch  # for record_seed(), with position
        self.position_log: list[int | None] | None = None  #: see :attr:`_ShuffleIterator.position_log`

    def __next__(self) -> Any:
        sample = next(self._source)
        seeding.mapping = self  # record_seed() while fn runs: this record's
        made = self._fn(sample)
        log = self.position_log
        if log is not None:  # after fn: a sample fn raised on is never returned, so never logged
            log.append(getattr(self._source, "position", None))
        return made

    @property
    def position(self) -> int | None:
        """The position of the record of the sample returned last (its input's)."""
        return getattr(self._source, "position", None)


class _FilterIterator(PassThroughIterator):
    """The samples ``predicate`` accepts.

    State node (kind ``"filter"``): only ``upstream``, the input's node; a
    step reads until a sample is accepted.
    """

    KIND = "filter"

    def __init__(self, source: Iterator[Any], predicate: Callable[[Any], object]) -> None:
        super().__init__(source)
        self._predicate = predicate
        self.position_log: list[int | None] | None = None  #: see :attr:`_ShuffleIterator.position_log`

    def __next__(self) -> Any:
        while True:
            sample = next(self._source)
            if self._predicate(sample):
                log = self.position_log
                if log is not None:
                    log.append(getattr(self._source, "position", None))
                return sample

    @property
    def position(self) -> int | None:
        """The position of the record of the sample returned last (the last one its input gave)."""
        return getattr(self._source, "position", None)


class _MappedRecords(Records):
    """A map's items made again: its input's, mapped with each record's :func:`~shardkit.seeding.record_seed`."""

    def __init__(self, inner: Records, fn: Callable[[Any], Any], seed: int, epoch: int, name: str) -> None:
        self._inner, self._fn, self._seed, self._epoch, self._name = inner, fn, seed, epoch, name

    def _apply(self, position: int, item: Any) -> Any:
        seeding.mapping = seeding.RecordInMap(self._seed, self._epoch, position)
        return self._fn(item)

    def fetch(self, positions: np.ndarray) -> list[Any]:
        items = self._inner.fetch(positions)
        out = [self._apply(position, item) for position, item in zip(positions.tolist(), items)]
        if out:
            self._check_deterministic(int(positions[0]), out[0])
        return out

    def _check_deterministic(self, position: int, made: Any) -> None:
        """Map the first record once more, from a fresh read, and warn if the sample differs."""
        again = self._apply(position, self._inner.fetch(np.array([position], dtype=np.int64))[0])
        try:
            same = encode(again) == encode(made)
        except StateError:  # a sample the codec cannot hold: not compared
            return
        if not same:
            warnings.warn(
                f"map({self._name}) gave two different samples for record {position & 0xFFFFFFFF} of shard "
                f"{position >> 32}, read again to resume a saved state: the samples a state holds by position "
                "are mapped again, so they differ from the ones saved (each record still comes exactly once). "
                "Make the map a function of its input and shardkit.record_seed(), e.g. seed a random "
                "augmentation with numpy.random.default_rng(shardkit.record_seed())",
                NondeterministicMapWarning,
                stacklevel=2,
            )

    def shard_identity(self, shard: int) -> tuple[str, str | None]:
        return self._inner.shard_identity(shard)


class _FilteredRecords(Records):
    """A filter's items made again: its input's, each of which it must still accept."""

    def __init__(self, inner: Records, predicate: Callable[[Any], object], name: str) -> None:
        self._inner, self._predicate, self._name = inner, predicate, name

    def fetch(self, positions: np.ndarray) -> list[Any]:
        items = self._inner.fetch(positions)
        for position, item in zip(positions.tolist(), items):
            if not self._predicate(item):
                raise StateError(
                    f"filter({self._name}) no longer accepts record {position & 0xFFFFFFFF} of shard "
                    f"{position >> 32}, which it accepted before the state was saved (the state holds it, read "
                    "and not yet delivered); a filter's predicate must be a function of its input (and a map's "
                    "before it of its input and shardkit.record_seed())"
                )
        return items

    def shard_identity(self, shard: int) -> tuple[str, str | None]:
        return self._inner.shard_identity(shard)
