"""The iterator of ``.repeat()``: back-to-back passes over the upstream pipeline.

Pass ``k`` opens and advances the upstream iterator with the epoch offset
(:func:`shardkit.epoch.epoch_offset`) raised by ``k``, so every pass reads
its own epoch without touching the shared one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from shardkit.epoch import call_with_epoch_offset, epoch_offset
from shardkit.stateful import (
    EPOCH,
    UPSTREAM,
    Resume,
    StageIterator,
    State,
    StateError,
    combine_ranks,
    field,
    merge,
    node,
    same_value,
    upstream_state,
    whole_number,
)


class _RepeatIterator(StageIterator):
    """Runs the passes over ``upstream`` (a pipeline: each pass iterates it afresh).

    State node (kind ``"repeat"``): ``epoch``, the ``pass`` (passes finished
    before the current one), whether the pass has ``yielded`` yet (an empty
    pass ends an endless repeat), and the pass's ``upstream`` node (None once
    every pass is done).

    Merged over workers or ranks, the readers must be in the same pass: the
    pass's nodes merge (a global node's ``upstream`` is the pass's global
    node, so each rank of a new world resumes its part of that pass and
    reads the later passes afresh).
    """

    KIND = "repeat"
    PASS = "pass"  #: state key: passes finished before the current one
    YIELDED = "yielded"  #: state key: whether the current pass has yielded (an empty pass ends an endless repeat)

    def __init__(self, upstream: Iterable[Any], count: int | None, epoch: int, resume: Resume | None = None) -> None:
        self._upstream = upstream
        self._count = count
        self._epoch = epoch
        outer = epoch_offset()
        self._first_offset = outer if count is None else outer * count
        self._pass = 0
        self._yielded_this_pass = 0
        self._source: Iterator[Any] | None = None
        if resume is not None:  # before the pass is opened: the loaded upstream state resumes that pass
            self.restore(resume)
        if resume is None or resume.state[UPSTREAM] is not None:
            self._source = self._start_pass()

    def _start_pass(self) -> Iterator[Any]:
        return call_with_epoch_offset(self._first_offset + self._pass, iter, self._upstream)

    def __next__(self) -> Any:
        while self._source is not None:
            try:
                sample = call_with_epoch_offset(self._first_offset + self._pass, next, self._source)
            except StopIteration:
                empty_pass = self._yielded_this_pass == 0
                self._pass += 1
                self._yielded_this_pass = 0
                done = self._count is not None and self._pass >= self._count
                self._source = None if empty_pass or done else self._start_pass()
                continue
            self._yielded_this_pass += 1
            return sample
        raise StopIteration

    def state_dict(self) -> State:
        """The pass, whether it has yielded yet, and the pass's upstream state (None when done)."""
        upstream = None if self._source is None else upstream_state(self._source)
        return node(
            self.KIND,
            **{
                EPOCH: self._epoch,
                self.PASS: self._pass,
                self.YIELDED: self._yielded_this_pass > 0,
                UPSTREAM: upstream,
            },
        )

    def restore(self, resume: Resume) -> None:
        """Go to the saved pass; called by ``__init__`` before the pass's upstream iterator is opened."""
        self._pass = resume.state[self.PASS]
        self._yielded_this_pass = int(resume.state[self.YIELDED])

    @classmethod
    def inputs_to_load(cls, stage: Any, state: State) -> list[tuple[Any, State]]:
        passes, upstream = state[cls.PASS], state[UPSTREAM]  # upstream None: every pass is done
        count = stage.count
        if count is not None and (passes > count or (passes == count and upstream is not None)):
            raise StateError(
                f"{stage!r}: the state is in pass {passes}, but this repeat() makes {count} passes; "
                "load the state into the same pipeline that saved it"
            )
        return [] if upstream is None else [(stage.source, upstream)]

    @classmethod
    def check_state(cls, state: State, where: str) -> None:
        whole_number(state, EPOCH, where)
        passes = whole_number(state, cls.PASS, where)
        yielded = field(state, cls.YIELDED, where, bool)
        upstream = field(state, UPSTREAM, where, dict, type(None))
        # No upstream means every pass is done, which happens only right after a pass ends.
        if upstream is None and (yielded or passes == 0):
            raise StateError(
                f"{where}: a repeat() state without an upstream state must be past a finished pass "
                f"(pass >= 1, yielded False), got pass {passes}, yielded {yielded}"
            )

    @classmethod
    def merge(cls, states: Sequence[State]) -> State:
        """Workers in the same pass merge; in different passes they cannot be split anew."""
        return cls._combined(states, merge, "workers")

    @classmethod
    def merge_ranks(cls, states: Sequence[State]) -> State:
        """Ranks in the same pass: the pass's global node."""
        return cls._combined(states, combine_ranks, "ranks")

    @classmethod
    def _combined(cls, states: Sequence[State], combine: Callable[[list[State]], State], whose: str) -> State:
        passes = [s[cls.PASS] for s in states]
        if any(p != passes[0] for p in passes):
            raise StateError(
                f"the {whose} are in different repeat() passes {passes}; such a state resumes only with the "
                f"same {whose} (save where every one is in the same pass: balance='pad'/'drop' keep the ranks' "
                "counts equal)"
            )
        upstreams = [s[UPSTREAM] for s in states]
        if any(u is None for u in upstreams) != all(u is None for u in upstreams):
            raise StateError(f"cannot merge repeat() states where some {whose} have finished and others not")
        return node(
            cls.KIND,
            **{
                EPOCH: same_value(states, EPOCH),
                cls.PASS: passes[0],
                cls.YIELDED: any(s[cls.YIELDED] for s in states),
                UPSTREAM: None if upstreams[0] is None else combine(upstreams),
            },
        )
