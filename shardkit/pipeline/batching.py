"""The iterator of ``.batch()``: ``batch_size`` samples read and collated in one step."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from shardkit.stateful import PassThroughIterator


class _BatchIterator(PassThroughIterator):
    """Collated groups of ``batch_size`` samples, the last one shorter unless ``drop_last``.

    State node (kind ``"batch"``): only ``upstream``, the input's node. A
    batch is made in one step, so no partial batch is ever pending.
    """

    KIND = "batch"

    def __init__(
        self,
        source: Iterator[Any],
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any],
        drop_last: bool,
    ) -> None:
        super().__init__(source)
        self._batch_size = batch_size
        self._collate_fn = collate_fn
        self._drop_last = drop_last

    def __next__(self) -> Any:
        samples = list(itertools.islice(self._source, self._batch_size))
        if not samples or (self._drop_last and len(samples) < self._batch_size):
            raise StopIteration
        return self._collate_fn(samples)
