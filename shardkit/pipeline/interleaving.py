"""The iterator of ``interleave``: weighted random draws of which input to read next.

For every sample it draws from the cumulative weights of the inputs still
live. The draws come from :class:`~shardkit.seeding.Uniforms` over a
generator seeded by (seed, epoch, rank, worker), so a position in them is
small plain data and the mix repeats across runs. The module is named
``interleaving`` so that it never shadows the package's ``interleave``
function (importing a submodule binds its name on the package).
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from shardkit.pipeline.scheduling import SCHEDULE, ScheduleCursor
from shardkit.planning.schedule import scaled
from shardkit.seeding import Uniforms
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
    combine_ranks,
    field,
    merge,
    node,
    same_value,
    share_field,
    upstream_state,
    whole_number,
)
from shardkit.topology import Topology

#: How an interleave ends: when a drawn input runs out, or when every input has.
STOP_RULES = ("first_exhausted", "all_exhausted")


class _InterleaveIterator(StageIterator):
    """Draws an input for every sample from the cumulative weights of the live ones.

    State node (kind ``"interleave"``): ``epoch``, ``upstream``: one node per
    input (None for an input of weight 0, never read), the ``live`` inputs
    (increasing indices of those not yet exhausted), the draw position ``rng``
    (:class:`~shardkit.seeding.Uniforms`), whether a ``first_exhausted`` mix
    has ``stopped``, and ``share``; under a :class:`~shardkit.planning.Schedule`
    also ``schedule``, the :class:`~shardkit.pipeline.scheduling.ScheduleCursor`'s
    node (which then draws the sources instead of ``rng``).

    Merged over workers (:meth:`merge`) or ranks (:meth:`merge_ranks`),
    each input's nodes merge on their own (a global node's inputs are
    global nodes), ``live`` is every input live anywhere (one spent
    everywhere else is found spent at its first draw), and ``rng`` is None:
    the draws start afresh from (seed, epoch, rank, worker); a schedule's
    cursor sums the counts of all and goes on from the position they reached.
    """

    KIND = "interleave"
    LIVE = "live"  #: state key: increasing indices of the inputs not yet exhausted
    STOPPED = "stopped"  #: state key: a ``first_exhausted`` mix has ended

    def __init__(
        self,
        datasets: Sequence[Iterable[Any]],
        weights: tuple[float, ...],
        rng: np.random.Generator,
        stop_on_first: bool,
        epoch: int,
        topology: Topology,
        cursor: ScheduleCursor | None = None,
    ) -> None:
        self._cursor = cursor
        # Scaled by a power of two (no ratio changes) so that their sum is finite: [1e308, 1e308] summed to inf.
        self._weights = tuple(scaled(np.array(weights)).tolist()) if weights else weights
        self._uniforms = Uniforms(rng)
        self._stop_on_first = stop_on_first
        self._epoch = epoch
        self._topology = topology
        self._sources = [iter(d) if w > 0 else None for d, w in zip(datasets, weights)]
        self._live = [i for i, w in enumerate(weights) if w > 0]
        self._cumulative = list(itertools.accumulate(self._weights[i] for i in self._live))
        self._stopped = False

    def _set_live(self, live: list[int]) -> None:
        self._live = live
        self._cumulative = list(itertools.accumulate(self._weights[i] for i in live))

    def __next__(self) -> Any:
        while self._live:
            slot = self._draw() if self._cursor is None else self._cursor.draw(self._live)
            index = self._live[slot]
            source = self._sources[index]
            assert source is not None
            try:
                sample = next(source)
            except StopIteration:
                if self._stop_on_first:
                    self._live = []
                    self._stopped = True
                else:
                    self._set_live([i for i in self._live if i != index])
                continue
            if self._cursor is not None:
                self._cursor.count(index, sample)
            return sample
        raise StopIteration

    def _draw(self) -> int:
        """The slot in the live inputs to read next, drawn from the fixed weights."""
        point = self._uniforms.draw() * self._cumulative[-1]
        return min(bisect_right(self._cumulative, point), len(self._live) - 1)

    def state_dict(self) -> State:
        """Every input's state (None for weight 0), the live inputs and the draws."""
        scheduled = {} if self._cursor is None else {SCHEDULE: self._cursor.state_dict()}
        return node(
            self.KIND,
            **scheduled,
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
        resume.continue_draws(self._uniforms)
        if self._cursor is not None:
            self._cursor.restore(state[SCHEDULE], own=resume.draws() is not None)

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
        ScheduleCursor.check_state(state.get(SCHEDULE), stage.schedule, repr(stage))
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
        return cls._combined(states, merge, "workers")

    @classmethod
    def merge_ranks(cls, states: Sequence[State]) -> State:
        """Each input's rank nodes combined into its global node, the live inputs united."""
        return cls._combined(states, combine_ranks, "ranks")

    @classmethod
    def _combined(cls, states: Sequence[State], combine: Callable[[list[State]], State], whose: str) -> State:
        stopped = [s[cls.STOPPED] for s in states]
        if any(stopped) and not all(stopped):
            raise StateError(
                f"an interleave(stop='first_exhausted') has stopped in some {whose}: where the mix ends "
                f"depends on each reader's draws, so the state resumes only with the same {whose}"
            )
        if len({len(s[UPSTREAM]) for s in states}) != 1:
            raise StateError("cannot merge interleave() states with different numbers of inputs")
        inputs = []
        for index in range(len(states[0][UPSTREAM])):
            parts = [s[UPSTREAM][index] for s in states if s[UPSTREAM][index] is not None]
            inputs.append(combine(parts) if parts else None)
        cursor = ScheduleCursor.merge([s.get(SCHEDULE) for s in states])
        return node(
            cls.KIND,
            **({} if cursor is None else {SCHEDULE: cursor}),
            **{
                EPOCH: same_value(states, EPOCH),
                UPSTREAM: inputs,
                cls.LIVE: sorted({i for s in states for i in s[cls.LIVE]}),
                RNG: None,
                cls.STOPPED: all(stopped),
                SHARE: None,
            },
        )
