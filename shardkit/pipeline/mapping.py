"""The iterators of ``.map()`` and ``.filter()``: one sample in, at most one out.

Neither holds anything between samples (a sample is mapped, or tested, in
the step that reads it), so each node is only ``upstream``
(:class:`~shardkit.stateful.PassThroughIterator`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from shardkit.stateful import PassThroughIterator


class _MapIterator(PassThroughIterator):
    """``fn(sample)`` for every sample.

    State node (kind ``"map"``): only ``upstream``, the input's node; a
    sample is mapped in the step that reads it.
    """

    KIND = "map"

    def __init__(self, source: Iterator[Any], fn: Callable[[Any], Any]) -> None:
        super().__init__(source)
        self._fn = fn

    def __next__(self) -> Any:
        return self._fn(next(self._source))


class _FilterIterator(PassThroughIterator):
    """The samples ``predicate`` accepts.

    State node (kind ``"filter"``): only ``upstream``, the input's node; a
    step reads until a sample is accepted.
    """

    KIND = "filter"

    def __init__(self, source: Iterator[Any], predicate: Callable[[Any], object]) -> None:
        super().__init__(source)
        self._predicate = predicate

    def __next__(self) -> Any:
        while True:
            sample = next(self._source)
            if self._predicate(sample):
                return sample
