"""Weighted random mixing of several pipelines: :func:`interleave`.

``interleave([a, b], weights=[3, 1])`` draws, for every sample, which input
to read next, from the cumulative weights of the inputs still live. The
draws come from a generator seeded by (seed, epoch, rank, worker) and are
drawn a block at a time (:class:`~shardkit.pipeline.Uniforms`), so a
position in them is small plain data and the mix repeats across runs.

Like every stage it is two classes: :class:`Interleave` holds the settings,
:class:`_InterleaveIterator` the cursor and everything about its state node
(``epoch``, one node per input, None for an input of weight 0, the ``live``
inputs, the draw position ``rng``, ``stopped`` and ``share``), including how
the nodes of all workers merge.

The module is named ``interleaving`` so that it never shadows the package's
``shardkit.interleave`` function (importing a submodule binds its name on the
package).
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardkit.pipeline import Pipeline, PipelineError, Uniforms
from shardkit.seeding import INTERLEAVE_STREAM, check_seed, generator
from shardkit.stateful import (
    EPOCH,
    RNG,
    SEQUENCE,
    SHARE,
    UPSTREAM,
    Resume,
    StageIterator,
    State,
    StateError,
    check_all_shares,
    check_draws,
    check_inputs_epoch,
    check_share,
    field,
    merge,
    node,
    same_value,
    share_field,
    upstream_state,
    whole_number,
)
from shardkit.topology import Topology

__all__ = ["STOP_RULES", "Interleave", "interleave"]

STOP_RULES = ("first_exhausted", "all_exhausted")


def interleave(
    datasets: Sequence[Pipeline],
    weights: Sequence[float] | None = None,
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


def _check_weights(weights: Sequence[float] | None, count: int) -> tuple[float, ...]:
    if weights is None:
        return (1.0,) * count
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


class _InterleaveIterator(StageIterator):
    """Draws an input for every sample from the cumulative weights of the live ones."""

    KIND = "interleave"
    LIVE = "live"  #: state key: increasing indices of the inputs not yet exhausted
    STOPPED = "stopped"  #: state key: a ``first_exhausted`` mix has ended

    def __init__(
        self,
        datasets: tuple[Pipeline, ...],
        weights: tuple[float, ...],
        rng: np.random.Generator,
        stop_on_first: bool,
        epoch: int,
        topology: Topology,
    ) -> None:
        self._weights = weights
        self._uniforms = Uniforms(rng)
        self._stop_on_first = stop_on_first
        self._epoch = epoch
        self._topology = topology
        self._sources = [iter(d) if w > 0 else None for d, w in zip(datasets, weights)]
        self._live = [i for i, w in enumerate(weights) if w > 0]
        self._cumulative = list(itertools.accumulate(weights[i] for i in self._live))
        self._stopped = False

    def _set_live(self, live: list[int]) -> None:
        self._live = live
        self._cumulative = list(itertools.accumulate(self._weights[i] for i in live))

    def __next__(self) -> Any:
        while self._live:
            point = self._uniforms.draw() * self._cumulative[-1]
            slot = min(bisect_right(self._cumulative, point), len(self._live) - 1)
            index = self._live[slot]
            source = self._sources[index]
            assert source is not None
            try:
                return next(source)
            except StopIteration:
                if self._stop_on_first:
                    self._live = []
                    self._stopped = True
                else:
                    self._set_live([i for i in self._live if i != index])
        raise StopIteration

    def state_dict(self) -> State:
        """Every input's state (None for weight 0), the live inputs and the draws."""
        return node(
            self.KIND,
            **{
                EPOCH: self._epoch,
                UPSTREAM: [None if s is None else upstream_state(s) for s in self._sources],
                self.LIVE: list(self._live),
                RNG: self._uniforms.state_dict(),
                self.STOPPED: self._stopped,
                SHARE: share_field(self._topology),
            },
        )

    def restore(self, resume: Resume) -> None:
        """Take the live inputs (and, for this worker's own state, the draws) from the state."""
        state = resume.state
        self._stopped = bool(state[self.STOPPED])
        self._set_live([] if self._stopped else [i for i in state[self.LIVE] if self._sources[i] is not None])
        draws = resume.draws()
        if draws is not None:
            self._uniforms.load_state_dict(draws)

    @classmethod
    def inputs_to_load(cls, stage: Any, state: State) -> list[tuple[Any, State]]:
        """Every input that is read (weight > 0) loads its node; the others have none."""
        inputs = state[UPSTREAM]
        if len(inputs) != len(stage.upstream):
            raise StateError(f"{stage!r}: the state has {len(inputs)} inputs, this interleave {len(stage.upstream)}")
        for index, (part, weight) in enumerate(zip(inputs, stage.weights)):
            if (part is None) != (weight == 0):  # every input that is read has a position
                saved = "no state" if part is None else "a state"
                raise StateError(f"{stage!r}: the state has {saved} for input {index} of weight {weight}")
        return [(dataset, part) for dataset, part in zip(stage.upstream, inputs) if part is not None]

    @classmethod
    def check_state(cls, state: State, where: str) -> None:
        whole_number(state, EPOCH, where)
        inputs = field(state, UPSTREAM, where, *SEQUENCE)
        for index, part in enumerate(inputs):
            if type(part) not in (dict, type(None)):
                raise StateError(
                    f"{where}: state['upstream'][{index}] must be a dict or None, got {type(part).__name__}"
                )
        live = field(state, cls.LIVE, where, *SEQUENCE)
        indices = all(type(i) is int for i in live) and list(live) == sorted(set(live))
        if not indices or not set(live) <= set(range(len(inputs))):
            raise StateError(
                f"{where}: state['live'] must be increasing indices of inputs below {len(inputs)}, got {live!r:.60}"
            )
        check_draws(state, where)
        field(state, cls.STOPPED, where, bool)
        check_share(state, where)
        check_inputs_epoch(state, inputs, where)

    @classmethod
    def merge(cls, states: Sequence[State]) -> State:
        """Each input's nodes merged, the live inputs united; a stopped
        ``first_exhausted`` mix cannot be split anew (where it ends depends on each worker's draws)."""
        check_all_shares(states)
        stopped = [s[cls.STOPPED] for s in states]
        if any(stopped) and not all(stopped):
            raise StateError(
                "an interleave(stop='first_exhausted') has stopped in some workers: where the mix ends "
                "depends on each worker's draws, so the state resumes only with the same number of workers"
            )
        if len({len(s[UPSTREAM]) for s in states}) != 1:
            raise StateError("cannot merge interleave() states with different numbers of inputs")
        inputs = []
        for index in range(len(states[0][UPSTREAM])):
            parts = [s[UPSTREAM][index] for s in states if s[UPSTREAM][index] is not None]
            inputs.append(merge(parts) if parts else None)
        return node(
            cls.KIND,
            **{
                EPOCH: same_value(states, EPOCH),
                UPSTREAM: inputs,
                cls.LIVE: sorted({i for s in states for i in s[cls.LIVE]}),
                RNG: None,
                cls.STOPPED: all(stopped),
                SHARE: None,
            },
        )


class Interleave(Pipeline):
    """Weighted random mixing of several pipelines; see :func:`interleave`.

    ``epoch`` and ``topology()`` come from the first dataset; ``seed`` is the
    mixing seed, which a ``.shuffle()`` chained after it also uses by default.
    """

    _iterator_type = _InterleaveIterator

    def __init__(
        self,
        datasets: Sequence[Pipeline],
        weights: Sequence[float] | None = None,
        *,
        seed: int = 0,
        stop: str = "first_exhausted",
    ) -> None:
        self.upstream = _check_datasets(datasets)
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

    def _open(self, resume: Resume | None) -> _InterleaveIterator:
        epoch, topology = self.epoch, self.topology()
        rng = generator(self.mix_seed, epoch, topology, INTERLEAVE_STREAM)
        iterator = _InterleaveIterator(
            self.upstream, self.weights, rng, self.stop == "first_exhausted", epoch, topology
        )
        if resume is not None:
            iterator.restore(resume)
        return iterator

    def __repr__(self) -> str:
        inputs = ", ".join(repr(d) for d in self.upstream)
        return f"interleave([{inputs}], weights={list(self.weights)}, seed={self.mix_seed}, stop={self.stop!r})"
