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
    check_balance,
    check_draws,
    check_indices,
    check_inputs_epoch,
    check_share,
    combine_ranks,
    deal,
    decode,
    encode,
    field,
    merge,
    node,
    same_value,
    share_field,
    stream_balance,
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
    cheap to restore, at the cost of a state as large as the buffer.

    Optional keys (absent in states of earlier shardkits, read as their
    defaults):

    * ``pooled``: how many buffers' worth of samples the node may hold (1):
      a merge of the workers' nodes pools their buffers, and a worker that
      resumed its part of a gathered pool may hold more than its buffer;
      a loaded node holds at most ``pooled`` times ``buffer_size`` samples.
    * ``repeats``: increasing indices into ``samples`` of the samples that
      are ``"pad"`` repeats ([]): delivered to keep the ranks' counts equal,
      owed to no later gather, so :meth:`merge_ranks` leaves them out.
    * ``balance``: only in a *global* node (:meth:`merge_ranks`: every
      rank's buffer pooled, ``share`` None, no ``repeats``): the balance of
      the stream below, by which each rank of the new world takes its part
      of the pool (:func:`~shardkit.state.deal`), then each of its workers
      every ``num_workers``-th of that part.
    """

    KIND = "shuffle"
    SAMPLES = "samples"  #: state key: the buffered samples, encoded
    UNBOUNDED_FIELDS = frozenset({SAMPLES})
    #: state key (optional): how many buffers' worth of samples the node may hold (absent: one)
    POOLED = "pooled"
    REPEATS = "repeats"  #: state key (optional): indices into ``samples`` of ``"pad"`` repeats
    BALANCE = "balance"  #: state key of a global node only: the balance its pool is dealt to new ranks by
    _PICKLED = "buffer"  # state key of shardkit <= 0.x: samples pickled, refused

    def __init__(
        self, source: Iterator[Any], buffer_size: int, rng: np.random.Generator, epoch: int, topology: Topology
    ) -> None:
        self._source = source
        self._buffer_size = buffer_size
        self._uniforms = Uniforms(rng)
        self._buffer: list[Any] = []
        # Each buffered sample's encoded form, made the first time a state holds it (None until then):
        # MixedLoader's workers save states often (up to one per micro-batch), and encoding the whole buffer each time
        # cost 20x the reading (256 samples re-encoded per 64 read); now each sample is encoded once.
        self._encoded: list[Any] = []
        self._repeats: list[bool] | None = None  # per buffered sample: a "pad" repeat; None: none is
        self._pooled = 1
        self._exhausted = False
        self._epoch = epoch
        self._topology = topology

    def __next__(self) -> Any:
        buffer, encoded = self._buffer, self._encoded
        while not self._exhausted and len(buffer) < self._buffer_size:
            try:
                buffer.append(next(self._source))
            except StopIteration:
                self._exhausted = True
            else:
                encoded.append(None)
        if not buffer:
            raise StopIteration
        pick = int(self._uniforms.draw() * len(buffer))
        sample = buffer[pick]
        buffer[pick], encoded[pick] = buffer[-1], encoded[-1]
        buffer.pop()
        encoded.pop()
        if self._repeats is not None:  # only after a resume that dealt "pad" repeats
            self._drop_flag(pick)
        return sample

    def _drop_flag(self, pick: int) -> None:
        """Keep the repeat flags beside the buffer: samples pulled since are not repeats."""
        flags = self._repeats
        assert flags is not None
        flags.extend([False] * (len(self._buffer) + 1 - len(flags)))
        flags[pick] = flags[-1]
        flags.pop()
        if not any(flags):
            self._repeats = None

    def state_dict(self) -> State:
        """The buffered samples are saved (encoded as plain data), so a restore is exact without re-reading.

        Raises:
            StateError: a buffered sample is of a type a state cannot hold (see :func:`shardkit.state.encode`).
        """
        flags = self._repeats or []
        optional: dict[str, Any] = {self.POOLED: self._pooled} if self._pooled > 1 else {}
        if any(flags):
            optional[self.REPEATS] = [index for index, repeat in enumerate(flags) if repeat]
        return node(
            self.KIND,
            **{
                EPOCH: self._epoch,
                self.SAMPLES: self._encoded_samples(),
                RNG: self._uniforms.state_dict(),
                SHARE: share_field(self._topology),
                UPSTREAM: upstream_state(self._source),
            },
            **optional,
        )

    def _encoded_samples(self) -> list[Any]:
        """The buffered samples, encoded; each is encoded once, the first time a state holds it."""
        encoded = self._encoded
        for index, form in enumerate(encoded):
            if form is None:
                encoded[index] = encode(self._buffer[index])
        return list(encoded)

    def restore(self, resume: Resume) -> None:
        """Refill the buffer (and, for this worker's own state, the draws) from the state.

        A whole-rank state's buffered samples are dealt out: worker ``w`` of
        ``n`` takes every ``n``-th one from the ``w``-th on. A global state's
        are first dealt to the ranks (see the class docstring).
        """
        state = resume.state
        samples = [decode(sample) for sample in state[self.SAMPLES]]
        repeats = set(state.get(self.REPEATS, ()))
        flags = [index in repeats for index in range(len(samples))]
        if self.BALANCE in state:  # a global node: this rank's part of every rank's pool
            pool, topology = len(samples), self._topology
            indices = deal(pool, topology.world_size, topology.rank, state[self.BALANCE])
            samples = [samples[i % pool] for i in indices]
            flags = [i >= pool for i in indices]  # dealt a second time: a "pad" repeat
        self._buffer, flags = resume.part(samples), resume.part(flags)
        self._encoded = [None] * len(self._buffer)
        self._repeats = flags if any(flags) else None
        self._pooled = max(1, -(-len(self._buffer) // self._buffer_size))
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
        if cls.POOLED in state:
            whole_number(state, cls.POOLED, where, 1)
        if cls.REPEATS in state:
            check_indices(state, cls.REPEATS, len(state[cls.SAMPLES]), where)
        if cls.BALANCE in state:
            check_balance(state, cls.BALANCE, where)
            if state[SHARE] is not None or state[RNG] is not None or state.get(cls.REPEATS):
                raise StateError(f"{where}: a global shuffle state (with 'balance') has no share, rng or repeats")
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
        """The workers' buffers pooled (repeats still marked); the draws start afresh."""
        check_all_shares(states)
        balances = {s.get(cls.BALANCE) for s in states}
        if len(balances) != 1:
            raise StateError("cannot merge a global shuffle state with a rank's")
        repeats, offset = [], 0
        for s in states:
            repeats += [offset + index for index in s.get(cls.REPEATS, ())]
            offset += len(s[cls.SAMPLES])
        balance = balances.pop()
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
            **({cls.REPEATS: repeats} if repeats else {}),
            **({} if balance is None else {cls.BALANCE: balance}),
        )

    @classmethod
    def merge_ranks(cls, states: Sequence[State]) -> State:
        """Every rank's buffer pooled into one global node, its ``"pad"`` repeats left out
        (owed to no one); each rank of the new world takes its part by the stream's balance."""
        if any(cls.BALANCE in s for s in states):
            raise StateError("merge_ranks() takes the states of the ranks, not a global state gathered already")
        upstream = combine_ranks([s[UPSTREAM] for s in states])
        samples = []
        for s in states:
            repeats = set(s.get(cls.REPEATS, ()))
            samples += [sample for index, sample in enumerate(s[cls.SAMPLES]) if index not in repeats]
        return node(
            cls.KIND,
            **{
                EPOCH: same_value(states, EPOCH),
                cls.SAMPLES: samples,
                cls.POOLED: sum(s.get(cls.POOLED, 1) for s in states),
                RNG: None,
                SHARE: None,
                cls.BALANCE: stream_balance(upstream),
                UPSTREAM: upstream,
            },
        )
