"""Weighted random mixing of several pipelines: :func:`interleave`.

``interleave([a, b], weights=[3, 1])`` draws, for every sample, which input
to read next, from the cumulative weights of the inputs still live.

Like every stage it is two classes: :class:`Interleave` (here) holds and
checks the settings, :class:`~shardkit.pipeline.interleaving._InterleaveIterator`
the cursor and everything about its state node, including how the nodes of
all workers merge. It sits above :mod:`.stages` because it is a
:class:`~shardkit.pipeline.Pipeline` with several inputs that no fluent
method builds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shardkit.pipeline.interleaving import STOP_RULES, _InterleaveIterator
from shardkit.pipeline.scheduling import ScheduleCursor
from shardkit.pipeline.stages import Pipeline, PipelineError
from shardkit.planning.schedule import Schedule
from shardkit.seeding import INTERLEAVE_STREAM, SCHEDULE_STREAM, check_seed, generator
from shardkit.stateful import Resume

__all__ = ["Interleave", "interleave"]


def interleave(
    datasets: Sequence[Pipeline],
    weights: Sequence[float] | Schedule | None = None,
    *,
    seed: int = 0,
    stop: str = "first_exhausted",
) -> Pipeline:
    """Mix several pipelines, drawing the next source at random by ``weights``.

    Draws are seeded from (``seed``, epoch, rank, worker): deterministic for a
    given topology and epoch, different per epoch. ``weights=None`` mixes
    evenly; weights need not sum to 1. A source with weight 0 is never read.
    ``stop="first_exhausted"`` ends when a drawn source runs out, so the mix
    follows the weights to the end; ``"all_exhausted"`` keeps drawing from the
    others, reweighted, until every source is spent. ``set_epoch`` reaches
    every source.

    ``weights`` may be a :class:`~shardkit.Schedule`: weights that change
    with the mixture's global position (samples, or tokens of a key, yielded
    by all ranks and workers together), e.g. ``Schedule([(0, [0.9, 0.1]),
    (10_000, [0.5, 0.5])])``. Sources are then drawn with a low-discrepancy
    sequence, so every window of the mix follows the schedule closely;
    resuming, also on another world size, continues the schedule where the
    mixture had got to. :func:`~shardkit.pipeline.mixture_shares` of a saved
    state gives the realised and the scheduled share of each source.

    Example:
        >>> import shardkit
        >>> text, code = shardkit.wrap(["t1", "t2", "t3"]), shardkit.wrap(["c1"])
        >>> mixed = shardkit.interleave([text, code], weights=[3, 1], seed=0, stop="all_exhausted")
        >>> sorted(mixed)  # every sample of both, in an order drawn by the weights
        ['c1', 't1', 't2', 't3']
    """
    return Interleave(datasets, weights, seed=seed, stop=stop)


def _check_datasets(datasets: Sequence[Pipeline]) -> tuple[Pipeline, ...]:
    if isinstance(datasets, Pipeline) or not isinstance(datasets, Sequence):
        raise PipelineError(
            f"interleave(datasets) takes a list of pipelines, got {type(datasets).__name__}; "
            "write interleave([a, b], ...)"
        )
    if not datasets:
        raise PipelineError("interleave(datasets) needs at least one dataset, got an empty list")
    for position, dataset in enumerate(datasets):
        if not isinstance(dataset, Pipeline):
            raise PipelineError(
                f"interleave(datasets[{position}]) is a {type(dataset).__name__}, not a shardkit Pipeline; "
                "turn it into one with shardkit.wrap(...)"
            )
    return tuple(datasets)


def _check_weights(weights: Sequence[float] | Schedule | None, count: int) -> tuple[float, ...]:
    """One weight per dataset; under a schedule, each dataset's largest (0: never read)."""
    if weights is None:
        return (1.0,) * count
    if isinstance(weights, Schedule):
        if weights.sources != count:
            raise PipelineError(
                f"interleave got {count} datasets but the Schedule weighs {weights.sources}; "
                "give every point one weight per dataset"
            )
        return tuple(float(w) for w in weights.weights.max(axis=0))
    try:
        values = [float(w) for w in weights]
    except (TypeError, ValueError):
        raise PipelineError(f"interleave(weights) must be a sequence of numbers, got {weights!r}") from None
    if len(values) != count:
        raise PipelineError(
            f"interleave got {count} datasets but {len(values)} weights; "
            "pass one weight per dataset, or weights=None to mix evenly"
        )
    for position, value in enumerate(values):
        if not math.isfinite(value) or value < 0:
            raise PipelineError(f"interleave(weights[{position}]) must be finite and >= 0, got {value}")
    if sum(values) == 0:
        raise PipelineError("interleave(weights) are all zero; give at least one dataset a positive weight")
    return tuple(values)


class Interleave(Pipeline):
    """Weighted random mixing of several pipelines; see :func:`interleave`.

    ``epoch`` and ``topology()`` come from the first dataset; ``seed`` is the
    mixing seed, which a ``.shuffle()`` chained after it also uses by default.
    """

    _iterator_type = _InterleaveIterator

    def __init__(
        self,
        datasets: Sequence[Pipeline],
        weights: Sequence[float] | Schedule | None = None,
        *,
        seed: int = 0,
        stop: str = "first_exhausted",
    ) -> None:
        self.upstream = _check_datasets(datasets)
        self.schedule = weights if isinstance(weights, Schedule) else None
        self.weights = _check_weights(weights, len(self.upstream))
        self.mix_seed = check_seed(seed, "interleave(seed)")
        if stop not in STOP_RULES:
            raise PipelineError(f"interleave(stop) must be one of {STOP_RULES}, got {stop!r}")
        self.stop = stop

    @property
    def seed(self) -> int:
        """The mixing seed given to :func:`interleave`."""
        return self.mix_seed

    def __len__(self) -> int:
        if self.stop == "first_exhausted":
            raise self._unknown_length(
                "with stop='first_exhausted' it ends when a randomly drawn source runs out; "
                "stop='all_exhausted' has a length"
            )
        return sum(len(d) for d, w in zip(self.upstream, self.weights) if w > 0)

    def reader_lengths(self, num_workers: int) -> list[int] | None:
        """With ``stop="all_exhausted"`` each worker reads all of its part of every
        input that is read, so its count is theirs added; ``first_exhausted`` ends at random."""
        if self.stop != "all_exhausted":
            return None
        parts = [d.reader_lengths(num_workers) for d, w in zip(self.upstream, self.weights) if w > 0]
        if any(p is None for p in parts):
            return None
        return [sum(column) for column in zip(*parts)]  # type: ignore[misc]

    def _open(self, resume: Resume | None) -> _InterleaveIterator:
        epoch, topology = self.epoch, self.topology()
        rng = generator(self.mix_seed, epoch, topology, INTERLEAVE_STREAM)
        cursor = None
        if self.schedule is not None:
            start = float(generator(self.mix_seed, epoch, topology, SCHEDULE_STREAM).random())
            cursor = ScheduleCursor(self.schedule, start, topology.num_readers)
        iterator = _InterleaveIterator(
            self.upstream, self.weights, rng, self.stop == "first_exhausted", epoch, topology, cursor
        )
        if resume is not None:
            iterator.restore(resume)
        return iterator

    def __repr__(self) -> str:
        inputs = ", ".join(repr(d) for d in self.upstream)
        weights = self.schedule if self.schedule is not None else list(self.weights)
        return f"interleave([{inputs}], weights={weights!r}, seed={self.mix_seed}, stop={self.stop!r})"
