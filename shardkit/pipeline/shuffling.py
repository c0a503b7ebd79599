"""The iterator of ``.shuffle()``: a buffer of samples, one handed out at random per step.

The draws come from :class:`~shardkit.seeding.Uniforms` over a generator
seeded by (seed, epoch, rank, worker), so the order repeats across runs and
a position in it is small plain data. The buffered samples are saved by the
*positions* of their records (:mod:`shardkit.stateful.positions`) where the
pipeline below can make them again (``Pipeline.records()``: shard sources,
through maps, filters and other shuffles), and read again on restore: about
11 bytes per buffered sample whatever its size, and saving costs a copy of
an int array. Elsewhere (a wrapped plain iterable, a batch or interleave
below) the samples themselves are saved, encoded
(:mod:`shardkit.stateful.codec`).
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
    Records,
    Resume,
    StageIterator,
    State,
    StateError,
    check_all_shares,
    check_balance,
    check_draws,
    check_identities,
    check_identities_field,
    check_indices,
    check_inputs_epoch,
    check_share,
    combine_ranks,
    deal,
    decode,
    decode_positions,
    encode,
    encode_positions,
    field,
    held_identities,
    merge,
    merge_identities,
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

    State node (kind ``"shuffle"``): ``epoch``, the buffered samples as
    ``positions`` (an encoded ``[n, 2]`` array of (shard, record), see
    :mod:`shardkit.stateful.positions`) with ``identities`` (a digest of the
    identity of each shard they name, checked before they are read again),
    or, where the input cannot make its items again, as ``samples`` (each
    encoded with :func:`~shardkit.state.encode`; the only form of version 1
    states); the draw position ``rng`` (:class:`~shardkit.seeding.Uniforms`),
    ``share`` and ``upstream``. Below, the *held* items are the positions or
    the samples, whichever the node has.

    Optional keys (absent in states of earlier shardkits, read as their
    defaults):

    * ``pooled``: how many buffers' worth of held items the node may hold (1):
      a merge of the workers' nodes pools their buffers, and a worker that
      resumed its part of a gathered pool may hold more than its buffer;
      a loaded node holds at most ``pooled`` times ``buffer_size``.
    * ``repeats``: increasing indices into the held items of those that
      are ``"pad"`` repeats ([]): delivered to keep the ranks' counts equal,
      owed to no later gather, so :meth:`merge_ranks` leaves them out.
    * ``balance``: only in a *global* node (:meth:`merge_ranks`: every
      rank's buffer pooled, ``share`` None, no ``repeats``): the balance of
      the stream below, by which each rank of the new world takes its part
      of the pool (:func:`~shardkit.state.deal`), then each of its workers
      every ``num_workers``-th of that part.
    """

    KIND = "shuffle"
    SAMPLES = "samples"  #: state key: the buffered samples, encoded (where they cannot be read again)
    POSITIONS = "positions"  #: state key: the buffered samples' record positions, an encoded [n, 2] array
    IDENTITIES = "identities"  #: state key (with positions): the identities of the shards they name
    UNBOUNDED_FIELDS = frozenset({SAMPLES, POSITIONS})
    #: state key (optional): how many buffers' worth of held items the node may hold (absent: one)
    POOLED = "pooled"
    REPEATS = "repeats"  #: state key (optional): indices into the held items of ``"pad"`` repeats
    BALANCE = "balance"  #: state key of a global node only: the balance its pool is dealt to new ranks by
    _PICKLED = "buffer"  # state key of shardkit <= 0.x: samples pickled, refused

    def __init__(
        self,
        source: Iterator[Any],
        buffer_size: int,
        rng: np.random.Generator,
        epoch: int,
        topology: Topology,
        records: Records | None = None,
    ) -> None:
        self._source = source
        self._buffer_size = buffer_size
        self._uniforms = Uniforms(rng)
        self._buffer: list[Any] = []
        # By position: the records' packed positions beside the buffer (held[i] is buffer[i]'s), and how to
        # read them again. None: the input gives no positions, so the samples are saved, encoded.
        positional = records is not None and hasattr(type(source), "position")
        self._records = records if positional else None
        self._held: np.ndarray | None = np.empty(buffer_size, np.int64) if positional else None
        # By data: each buffered sample's encoded form, made the first time a state holds it (None until then):
        # MixedLoader's workers save states often (up to one per micro-batch), and encoding the whole buffer each time
        # cost 20x the reading (256 samples re-encoded per 64 read); now each sample is encoded once.
        self._encoded: list[Any] = []
        self._repeats: list[bool] | None = None  # per buffered sample: a "pad" repeat; None: none is
        self._pooled = 1
        self._exhausted = False
        self._epoch = epoch
        self._topology = topology
        self.position: int | None = None  # the record position of the sample returned last (None: by data)
        #: Where set (a list), the ``position`` of each sample returned is appended to it as it is returned: how
        #: a MixedLoader worker logs its samples' positions in bulk (``shardkit.loader.micro_batches.PositionLog``),
        #: without a Python call per sample around this iterator (``.map()``'s and ``.filter()``'s have one too).
        self.position_log: list[int | None] | None = None

    def __next__(self) -> Any:
        buffer, held = self._buffer, self._held
        while not self._exhausted and len(buffer) < self._buffer_size:
            try:
                sample = next(self._source)
            except StopIteration:
                self._exhausted = True
                continue
            if held is not None:
                position = self._source.position  # type: ignore[attr-defined]  # checked in __init__
                if position is None:  # a record without a position: the samples are saved from now on
                    held = self._by_data()
                else:
                    held[len(buffer)] = position
            if held is None:
                self._encoded.append(None)
            buffer.append(sample)
        if not buffer:
            raise StopIteration
        pick = int(self._uniforms.draw() * len(buffer))
        sample = buffer[pick]
        buffer[pick] = buffer[-1]
        buffer.pop()
        if held is not None:
            self.position = int(held[pick])
            held[pick] = held[len(buffer)]
        else:
            encoded = self._encoded
            encoded[pick] = encoded[-1]
            encoded.pop()
        log = self.position_log
        if log is not None:
            log.append(self.position)
        if self._repeats is not None:  # only after a resume that dealt "pad" repeats
            self._drop_flag(pick)
        return sample

    def _by_data(self) -> None:
        """Give up positions for this iteration: the buffer is saved as samples."""
        self._records = self._held = None
        self._encoded = [None] * len(self._buffer)
        self.position = None

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
        """The buffered samples' positions (or, where there are none, the samples, encoded) and the draws.

        Raises:
            StateError: a buffered sample saved as data is of a type a state cannot hold
                (see :func:`shardkit.state.encode`).
        """
        flags = self._repeats or []
        optional: dict[str, Any] = {self.POOLED: self._pooled} if self._pooled > 1 else {}
        if any(flags):
            optional[self.REPEATS] = [index for index, repeat in enumerate(flags) if repeat]
        return node(
            self.KIND,
            **{EPOCH: self._epoch},
            **self._held_fields(),
            **{
                RNG: self._uniforms.state_dict(),
                SHARE: share_field(self._topology),
                UPSTREAM: upstream_state(self._source),
            },
            **optional,
        )

    def _held_fields(self) -> dict[str, Any]:
        """The buffer as saved: positions and identities, or samples, each encoded once (the first time)."""
        if self._held is not None and self._records is not None:
            positions = self._held[: len(self._buffer)]
            identities = held_identities(self._records, positions)
            return {self.POSITIONS: encode_positions(positions), self.IDENTITIES: identities}
        encoded = self._encoded
        for index, form in enumerate(encoded):
            if form is None:
                encoded[index] = encode(self._buffer[index])
        return {self.SAMPLES: list(encoded)}

    def restore(self, resume: Resume) -> None:
        """Refill the buffer (and, for this worker's own state, the draws) from the state.

        A whole-rank state's held items are dealt out: worker ``w`` of ``n``
        takes every ``n``-th one from the ``w``-th on. A global state's are
        first dealt to the ranks (see the class docstring). Positions are
        read again through the input's records, after their shards'
        identities are checked.
        """
        state = resume.state
        held = _held_items(state, repr(resume.owner))
        repeats = set(state.get(self.REPEATS, ()))
        flags = [index in repeats for index in range(len(held))]
        if self.BALANCE in state:  # a global node: this rank's part of every rank's pool
            pool, topology = len(held), self._topology
            indices = deal(pool, topology.world_size, topology.rank, state[self.BALANCE])
            held = [held[i % pool] for i in indices]
            flags = [i >= pool for i in indices]  # dealt a second time: a "pad" repeat
        held, flags = resume.part(held), resume.part(flags)
        if self.POSITIONS in state:
            self._refetch(np.array(held, dtype=np.int64), state[self.IDENTITIES], resume.owner)
        else:
            self._by_data()
            self._buffer = [decode(sample) for sample in held]
            self._encoded = [None] * len(self._buffer)
        self._repeats = flags if any(flags) else None
        self._pooled = max(1, -(-len(self._buffer) // self._buffer_size))
        resume.continue_draws(self._uniforms)

    def _refetch(self, positions: np.ndarray, identities: dict[str, Any], owner: object) -> None:
        """Fill the buffer with the samples at ``positions``, read again."""
        records = self._records
        if records is None:
            raise StateError(
                f"{owner!r}: the state holds the shuffle buffer's records by position, but the input of this "
                "shuffle cannot read records again; load the state into the pipeline that saved it"
            )
        check_identities(records, identities, owner)
        self._buffer = records.fetch(positions)
        self._held = np.empty(max(self._buffer_size, len(positions)), np.int64)
        self._held[: len(positions)] = positions

    @classmethod
    def check_state(cls, state: State, where: str) -> None:
        if cls._PICKLED in state and cls.SAMPLES not in state:
            raise StateError(
                f"{where}: this shuffle state keeps its samples pickled ('buffer', written by an earlier "
                "shardkit); it is refused because unpickling can run code. Start the epoch afresh"
            )
        whole_number(state, EPOCH, where)
        held = len(_held_items(state, where))
        check_draws(state, where)
        check_share(state, where)
        if cls.POOLED in state:
            whole_number(state, cls.POOLED, where, 1)
        if cls.REPEATS in state:
            check_indices(state, cls.REPEATS, held, where)
        if cls.BALANCE in state:
            check_balance(state, cls.BALANCE, where)
            if state[SHARE] is not None or state[RNG] is not None or state.get(cls.REPEATS):
                raise StateError(f"{where}: a global shuffle state (with 'balance') has no share, rng or repeats")
        check_inputs_epoch(state, [field(state, UPSTREAM, where, dict)], where)

    @classmethod
    def inputs_to_load(cls, stage: Any, state: State) -> list[tuple[Any, State]]:
        """Also checks that the held items fit the buffers they came from: a worker's
        buffer holds at most ``buffer_size``, a merge of ``pooled`` of them that many times."""
        pooled = state.get(cls.POOLED, 1)
        held, room = len(_held_items(state, repr(stage))), stage.buffer_size * pooled
        if held > room:
            buffers = "the buffer" if pooled == 1 else f"{pooled} buffers"
            key = cls.POSITIONS if cls.POSITIONS in state else cls.SAMPLES
            raise StateError(
                f"{stage!r}: state[{key!r}] holds {held} samples, more than {buffers} of {stage!r} hold "
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
            offset += len(_held_items(s, "merge()"))
        balance = balances.pop()
        return node(
            cls.KIND,
            **{EPOCH: same_value(states, EPOCH)},
            **_pooled_fields(states, [list(range(len(_held_items(s, "merge()")))) for s in states]),
            **{
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
        kept = []
        for s in states:
            repeats = set(s.get(cls.REPEATS, ()))
            kept.append([index for index in range(len(_held_items(s, "merge_ranks()"))) if index not in repeats])
        return node(
            cls.KIND,
            **{EPOCH: same_value(states, EPOCH)},
            **_pooled_fields(states, kept),
            **{
                cls.POOLED: sum(s.get(cls.POOLED, 1) for s in states),
                RNG: None,
                SHARE: None,
                cls.BALANCE: stream_balance(upstream),
                UPSTREAM: upstream,
            },
        )


def _held_items(state: State, where: str) -> list[Any]:
    """A checked-or-being-checked shuffle node's held items: its positions (packed ints) or encoded samples."""
    by_position = _ShuffleIterator.POSITIONS in state
    if by_position == (_ShuffleIterator.SAMPLES in state):
        raise StateError(f"{where}: a shuffle state holds either 'positions' or 'samples' (one of them)")
    if not by_position:
        return field(state, _ShuffleIterator.SAMPLES, where, list)
    check_identities_field(field(state, _ShuffleIterator.IDENTITIES, where, dict), where)
    return decode_positions(state[_ShuffleIterator.POSITIONS], where).tolist()


def _pooled_fields(states: Sequence[State], kept: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The held items ``kept`` (indices, per state) of every state, pooled in order, in the states' one form."""
    forms = {_ShuffleIterator.POSITIONS in s for s in states}
    if len(forms) != 1:
        raise StateError("cannot merge shuffle states of which some hold positions and some samples")
    if forms.pop():
        pooled = [p for s, keep in zip(states, kept) for p in np.asarray(_held_items(s, "merge()"))[keep].tolist()]
        return {
            _ShuffleIterator.POSITIONS: encode_positions(np.array(pooled, dtype=np.int64)),
            _ShuffleIterator.IDENTITIES: merge_identities([s[_ShuffleIterator.IDENTITIES] for s in states]),
        }
    return {_ShuffleIterator.SAMPLES: [s[_ShuffleIterator.SAMPLES][i] for s, keep in zip(states, kept) for i in keep]}
