"""The iterator of ``.shuffle()``: a buffer of samples, one handed out at random per step.

The draws come from :class:`~shardkit.seeding.Uniforms` over a generator
seeded by (seed, epoch, rank, worker), so the order repeats across runs and
a position in it is small plain data; the buffered samples themselves are
saved, encoded (:mod:`shardkit.stateful.codec`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from shardkit.seeding import Uniforms
from shardkit.stateful import (
    EPOCH,
    RNG,
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
    decode,
    encode,
    field,
    merge,
    node,
    same_value,
    share_field,
    upstream_state,
    whole_number,
)
from shardkit.topology import Topology


class _ShuffleIterator(StageIterator):
    """Keeps ``buffer_size`` samples; each step pulls one in and hands a random one out.

    State node (kind ``"shuffle"``): ``epoch``, the buffered ``samples``
    (each encoded with :func:`~shardkit.state.encode`), the draw position
    ``rng`` (:class:`~shardkit.seeding.Uniforms`), ``share`` and
    ``upstream``. The contents are saved rather than re-derived: exact and
    cheap to restore, at the cost of a state as large as the buffer. A
    merged node also has ``pooled``, the number of workers' buffers its
    samples pool: a loaded node holds at most ``pooled`` (1 when absent)
    times ``buffer_size`` samples.
    """

    KIND = "shuffle"
    SAMPLES = "samples"  #: state key: the buffered samples, encoded
    #: state key of a merged node only: how many workers' buffers its samples pool (absent: one)
    POOLED = "pooled"
    _PICKLED = "buffer"  # state key of shardkit <= 0.x: samples pickled, refused

    def __init__(
        self, source: Iterator[Any], buffer_size: int, rng: np.random.Generator, epoch: int, topology: Topology
    ) -> None:
        self._source = source
        self._buffer_size = buffer_size
        self._uniforms = Uniforms(rng)
        self._buffer: list[Any] = []
        self._exhausted = False
        self._epoch = epoch
        self._topology = topology

    def __next__(self) -> Any:
        buffer = self._buffer
        while not self._exhausted and len(buffer) < self._buffer_size:
            try:
                buffer.append(next(self._source))
            except StopIteration:
                self._exhausted = True
        if not buffer:
            raise StopIteration
        pick = int(self._uniforms.draw() * len(buffer))
        sample = buffer[pick]
        buffer[pick] = buffer[-1]
        buffer.pop()
        return sample

    def state_dict(self) -> State:
        """The buffered samples are saved (encoded as plain data), so a restore is exact without re-reading.

        Raises:
            StateError: a buffered sample is of a type a state cannot hold (see :func:`shardkit.state.encode`).
        """
        return node(
            self.KIND,
            **{
                EPOCH: self._epoch,
                self.SAMPLES: [encode(sample) for sample in self._buffer],
                RNG: self._uniforms.state_dict(),
                SHARE: share_field(self._topology),
                UPSTREAM: upstream_state(self._source),
            },
        )

    def restore(self, resume: Resume) -> None:
        """Refill the buffer (and, for this worker's own state, the draws) from the state.

        A whole-rank state's buffered samples are dealt out: worker ``w`` of
        ``n`` takes every ``n``-th one from the ``w``-th on.
        """
        self._buffer = resume.part([decode(sample) for sample in resume.state[self.SAMPLES]])
        resume.continue_draws(self._uniforms)

    @classmethod
    def check_state(cls, state: State, where: str) -> None:
        if cls._PICKLED in state and cls.SAMPLES not in state:
            raise StateError(
                f"{where}: this shuffle state keeps its samples pickled ('buffer', written by an earlier "
                "shardkit); it is refused because unpickling can run code. Start the epoch afresh"
            )
        whole_number(state, EPOCH, where)
        field(state, cls.SAMPLES, where, list)
        check_draws(state, where)
        check_share(state, where)
        if cls.POOLED in state and whole_number(state, cls.POOLED, where, 1) > 1 and state[SHARE] is not None:
            raise StateError(f"{where}: state['pooled'] > 1 is a merged state's, whose 'share' is None")
        check_inputs_epoch(state, [field(state, UPSTREAM, where, dict)], where)

    @classmethod
    def inputs_to_load(cls, stage: Any, state: State) -> list[tuple[Any, State]]:
        """Also checks that the samples fit the buffers they came from: a worker's
        buffer holds at most ``buffer_size``, a merge of ``pooled`` of them that many times."""
        pooled = state.get(cls.POOLED, 1)
        held, room = len(state[cls.SAMPLES]), stage.buffer_size * pooled
        if held > room:
            buffers = "the buffer" if pooled == 1 else f"{pooled} buffers"
            raise StateError(
                f"{stage!r}: state['samples'] holds {held} samples, more than {buffers} of {stage!r} hold "
                f"({room}); the state is of a larger shuffle buffer, or it was edited"
            )
        return super().inputs_to_load(stage, state)

    @classmethod
    def merge(cls, states: Sequence[State]) -> State:
        """The workers' buffers pooled; the draws start afresh."""
        check_all_shares(states)
        return node(
            cls.KIND,
            **{
                EPOCH: same_value(states, EPOCH),
                cls.SAMPLES: [sample for s in states for sample in s[cls.SAMPLES]],
                cls.POOLED: sum(s.get(cls.POOLED, 1) for s in states),
                RNG: None,
                SHARE: None,
                UPSTREAM: merge([s[UPSTREAM] for s in states]),
            },
        )
