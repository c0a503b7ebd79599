"""The state node protocol every stage shares: the node envelope, the checks
common to several kinds, and :func:`merge`, which hands each node to its kind's class.

Each kind belongs to one stage's iterator class (a :class:`StageIterator`),
which holds its keys as constants and, beside ``__next__``, how the node is
saved, restored, checked and merged; defining the class registers the kind.
:mod:`shardkit.state` imports every built-in stage, so a state merged or
checked through it knows every kind.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from shardkit.errors import StateError, check_int
from shardkit.planning import rank_span
from shardkit.seeding import DRAW_BLOCK, Uniforms
from shardkit.stateful.codec import restore_generator, same_data, short

if TYPE_CHECKING:
    from shardkit.topology import Topology

#: Version of the state format written by this shardkit. 2: records held by a stage (a shuffle buffer, a
#: MixedLoader's undelivered samples) are saved as their positions where they can be read again
#: (:mod:`shardkit.stateful.positions`). Version 1 states (held records as encoded samples) still load.
VERSION = 2
#: The versions this shardkit loads.
READABLE_VERSIONS = (1, 2)

State = dict[str, Any]

# Keys that several stages' nodes share; each stage names its own as constants on its iterator.
EPOCH = "epoch"  #: the epoch the iteration reads (inside ``repeat``, including the pass)
SHARE = "share"  #: ``[worker, num_workers]``: the DataLoader worker whose part the node is; None: the whole rank's
RNG = "rng"  #: the draw position (``seeding.Uniforms``), None after a merge
UPSTREAM = "upstream"  #: the inputs' nodes


def node(kind: str, **fields: Any) -> State:
    """A state node of ``kind`` with the current :data:`VERSION`."""
    return {"version": VERSION, "kind": kind, **fields}


def check(state: object, kind: str, owner: object) -> State:
    """Return ``state`` if it is a well-formed node of ``kind`` (version, fields,
    types, ranges; not its inputs), else raise :class:`StateError`."""
    return _check_node(state, kind, repr(owner))


def expect_equal(owner: object, what: str, saved: object, actual: object) -> None:
    """Raise :class:`StateError` naming ``what`` if the saved and actual values differ
    (in type too: a saved ``1`` does not stand for ``True``)."""
    if not same_data(saved, actual):
        raise StateError(f"{owner!r}: the state was saved with {what} {saved!r}, but here it is {actual!r}")


def applies(state: State, epoch: int, owner: object) -> bool:
    """Whether a loaded ``state`` resumes an iteration of ``epoch``.

    A state of the same epoch does. A state of an earlier epoch does not: the
    epoch has moved on (``set_epoch``), and the iteration starts afresh. A
    state of a later epoch means ``set_epoch`` was not called: raised.
    """
    saved = state[EPOCH]
    if saved == epoch:
        return True
    if saved < epoch:
        return False
    raise StateError(
        f"{owner!r}: the loaded state is of epoch {saved}, but this iteration reads epoch {epoch}; "
        f"call set_epoch({saved}) before iterating to finish that epoch"
    )


def share_field(topology: Topology) -> list[int] | None:
    """The ``share`` a stage records: ``[worker, num_workers]``, or None when the
    reader is its rank's only DataLoader worker (its part is the whole rank's)."""
    return None if topology.num_workers == 1 else [topology.worker_id, topology.num_workers]


def is_own(state: State, topology: Topology, owner: object) -> bool:
    """True if ``state`` is this worker's own part (its ``share``), False if it is
    the whole rank's (to be split among the workers); raises if it is another worker's."""
    share = state[SHARE]
    if share is None:
        return False
    if list(share) == [topology.worker_id, topology.num_workers]:
        return True
    raise StateError(
        f"{owner!r}: the state is DataLoader worker {share[0]}'s of {share[1]}, loaded into worker "
        f"{topology.worker_id} of {topology.num_workers}; restore each worker's state into the same worker "
        "(StatefulDataLoader does), or merge the states of all workers with shardkit.state.merge() to resume "
        "with any number"
    )


class Resume:
    """A loaded state node that resumes the iteration being opened, and whose it is.

    ``Pipeline.__iter__`` makes one only for a state of the epoch being read
    (:func:`applies`), so a stage never checks that again. :attr:`own` is
    worked out when first asked (a stage may check other fields first).
    """

    def __init__(self, state: State, topology: Topology, owner: object) -> None:
        self.state = state
        self.topology = topology
        self.owner = owner  # the stage loading it, named in errors
        self._own: bool | None = None

    @property
    def own(self) -> bool:
        """Whether the state is this worker's own part, not the whole rank's (see :func:`is_own`)."""
        if self._own is None:
            self._own = is_own(self.state, self.topology, self.owner)
        return self._own

    def part(self, items: list[Any]) -> list[Any]:
        """This worker's part of ``items`` saved in the state: all of them if the
        state is its own, else every ``num_workers``-th from the ``worker``-th on."""
        if self.own:
            return items
        return items[self.topology.worker_id :: self.topology.num_workers]

    def draws(self) -> State | None:
        """The saved draw position (``rng``) if it continues this reader's draws: its
        own state, or a one-worker state resumed by one worker (a merge drops it)."""
        draws = self.state[RNG]
        if self.own or (self.topology.num_workers == 1 and draws is not None):
            return draws
        return None

    def continue_draws(self, uniforms: Uniforms) -> None:
        """Move ``uniforms`` to the saved draw position if it continues this reader's draws (:meth:`draws`)."""
        draws = self.draws()
        if draws is not None:
            uniforms.seek(restore_generator(draws[Uniforms.GENERATOR]), draws[Uniforms.NEXT])


# -- the stages that own a kind of state ------------------------------------------------


class StageIterator:
    """Base of the iterator of every stage whose position is saved.

    Each subclass names its node's :attr:`KIND` and keeps, beside ``__next__``,
    everything about its state: the keys (class constants), ``state_dict()``,
    ``restore(resume)`` (continue from a :class:`Resume`, right after
    ``__init__``), :meth:`check_state` (the schema of a loaded node),
    :meth:`inputs_to_load` (which input loads which part), :meth:`merge` (one
    whole-rank node from every worker's) and :meth:`merge_ranks` (one global
    node from every rank's). Defining a subclass with a ``KIND`` registers
    it: :func:`validate`, :func:`merge` and :func:`merge_ranks` look the kind
    up here.

    The loading method is ``restore``, not ``load_state_dict``: an iterator
    with both would be a torchdata ``Stateful``, and ``StatefulDataLoader``
    would load the state a second time into the iterator that already
    resumed from it (the pipeline's ``load_state_dict`` is the one it calls).
    """

    #: The ``kind`` of this stage's state node; empty for an abstract base.
    KIND: ClassVar[str] = ""
    #: Keys of the node whose ints may be of any size, which :func:`check_ints` leaves alone: encoded samples
    #: (their decoder checks them) and what is only compared with the stage's settings (a dataset's
    #: fingerprint holds its seed, any int >= 0). Every other int of the node must fit in 64 bits.
    UNBOUNDED_FIELDS: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("KIND")
        if not kind:
            return
        known = _STAGES.get(kind)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"state kind {kind!r} is already {known.__qualname__}'s; give {cls.__qualname__} another")
        _STAGES[kind] = cls

    def __iter__(self) -> StageIterator:
        return self

    def __next__(self) -> Any:
        raise NotImplementedError

    def state_dict(self) -> State:
        """This stage's node (with its inputs' under ``upstream``)."""
        raise NotImplementedError

    def restore(self, resume: Resume) -> None:
        """Continue from ``resume`` (a node of this kind, already checked); nothing by default."""

    @classmethod
    def inputs_to_load(cls, stage: Any, state: State) -> list[tuple[Any, State]]:
        """Which of ``stage``'s inputs loads which part of its loaded node ``state``
        (checked against the stage's settings): by default its one input the ``upstream``."""
        return [(stage.upstream[0], state[UPSTREAM])] if stage.upstream else []

    @classmethod
    def check_state(cls, state: State, where: str) -> None:
        """Raise :class:`StateError` naming the first field of a loaded node that is wrong."""
        raise NotImplementedError(f"{cls.__qualname__} must define check_state")

    @classmethod
    def merge(cls, states: Sequence[State]) -> State:
        """One node of the whole rank (``share`` None) from every worker's node."""
        raise NotImplementedError(f"{cls.__qualname__} must define merge")

    @classmethod
    def merge_ranks(cls, states: Sequence[State]) -> State:
        """One global node from every rank's whole-rank node; by default a stage cannot."""
        raise StateError(
            f"a {cls.KIND!r} stage keeps its position per rank and cannot be split over another world size; "
            "resume on another world size works for shard datasets with map, filter, batch, shuffle, "
            "interleave and repeat stages"
        )


_STAGES: dict[str, type[StageIterator]] = {}


def stage_of(kind: object) -> type[StageIterator] | None:
    """The iterator class that owns state nodes of ``kind``, if any."""
    return _STAGES.get(kind) if type(kind) is str else None


class PassThroughIterator(StageIterator):
    """A stage that holds nothing between samples: its node is only ``upstream``."""

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source

    def state_dict(self) -> State:
        return node(self.KIND, **{UPSTREAM: upstream_state(self._source)})

    @classmethod
    def check_state(cls, state: State, where: str) -> None:
        field(state, UPSTREAM, where, dict)

    @classmethod
    def merge(cls, states: Sequence[State]) -> State:
        return node(cls.KIND, **{UPSTREAM: merge([s[UPSTREAM] for s in states])})

    @classmethod
    def merge_ranks(cls, states: Sequence[State]) -> State:
        return node(cls.KIND, **{UPSTREAM: combine_ranks([s[UPSTREAM] for s in states])})


def upstream_state(iterator: Iterator[Any]) -> State:
    """The state of an input's iterator, which must be a shardkit one."""
    state_dict = getattr(iterator, "state_dict", None)
    if state_dict is None:
        raise StateError(
            f"cannot save the position of a {type(iterator).__name__}: it has no state_dict(). "
            "Pipelines whose __iter__ returns a generator cannot be resumed; return an iterator "
            "object that keeps its cursor in attributes and implements state_dict()"
        )
    return state_dict()


# -- checking loaded states ---------------------------------------------------------
#
# A loaded state is untrusted input: every field a stage reads is checked for
# presence, type and range by its stage's check_state, so a tampered or
# truncated state is a StateError naming the field, never a KeyError or
# TypeError deep in an iterator, nor an epoch that silently ends early.

#: The range of every int in a state outside samples and generator states: a signed 64-bit int.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

SEQUENCE = (list, tuple)


def field(state: State, key: str, where: str, *types: type) -> Any:
    """``state[key]``, which must be present and of one of ``types`` (exactly: a bool is not an int);
    an int must fit in 64 bits (:func:`bounded`)."""
    if key not in state:
        raise StateError(f"{where}: the state has no {key!r}; it is not a state_dict() of this stage, or it was edited")
    value = state[key]
    if type(value) not in types:
        names = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise StateError(f"{where}: state[{key!r}] must be {names}, got {type(value).__name__} {short(value)}")
    if type(value) is int:
        bounded(value, f"{where}: state[{key!r}]")
    return value


def bounded(value: int, name: str) -> int:
    """``value`` if it fits in a signed 64-bit int, as every count, position and epoch
    must (they go through numpy and shared memory); else a :class:`StateError` naming it."""
    return check_int(
        name, value, minimum=INT64_MIN, maximum=INT64_MAX, error=StateError, hint="the state was edited or is corrupt"
    )


#: The key a numpy generator's state is saved under (its 128-bit ints are checked by ``restore_generator``).
_GENERATOR = "generator"


def check_ints(state: State, where: str, unbounded: frozenset[str] = frozenset()) -> None:
    """Raise :class:`StateError` naming the first int of the node ``state`` that does not fit in 64 bits.

    Every count, position, index and epoch of a state goes through numpy or
    shared memory, where a bigger int is an ``OverflowError`` or
    ``UFuncTypeError`` long after loading, or wraps round to a negative. So
    every int is checked here, at load, wherever it sits in the node (a
    stage's own ``check_state`` checks what else each field must be): all but
    the inputs' nodes (``upstream``: checked as nodes of their own), the keys
    in ``unbounded`` (:attr:`StageIterator.UNBOUNDED_FIELDS`) and generator states. A
    walk with a stack, not recursion: a tampered state may nest deep.
    """
    skipped = unbounded | {UPSTREAM}
    stack: list[tuple[str, Any]] = [(f"[{k!r}]", v) for k, v in state.items() if k not in skipped]
    while stack:
        path, value = stack.pop()
        if type(value) is int:
            bounded(value, f"{where}: state{path}")
        elif type(value) is dict:
            stack.extend((f"{path}[{k!r}]", v) for k, v in value.items() if k != _GENERATOR)
        elif type(value) in SEQUENCE:
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))


def whole_number(state: State, key: str, where: str, minimum: int = 0) -> int:
    """``state[key]``, an int of at least ``minimum``."""
    value = field(state, key, where, int)
    if value < minimum:
        raise StateError(f"{where}: state[{key!r}] must be >= {minimum}, got {value}")
    return value


def check_intervals(intervals: Any, where: str, what: str = "remaining") -> None:
    """Raise unless ``intervals`` are sorted, disjoint, non-empty ``[start, stop)`` int pairs from 0 on."""
    previous = 0
    for interval in intervals:
        if type(interval) not in SEQUENCE or len(interval) != 2 or any(type(v) is not int for v in interval):
            raise StateError(f"{where}: state[{what!r}] must hold [start, stop] pairs of ints, got {short(interval)}")
        start, stop = interval
        bounded(stop, f"{where}: the end of an interval in state[{what!r}]")
        if not previous <= start < stop:
            raise StateError(
                f"{where}: state[{what!r}] must hold sorted, disjoint, non-empty [start, stop) intervals "
                f"of positions >= 0; [{start}, {stop}) after position {previous} is not"
            )
        previous = stop


def check_indices(state: State, key: str, size: int, where: str) -> list[int]:
    """``state[key]``, which must be increasing indices below ``size`` (into a list of the node)."""
    indices = field(state, key, where, *SEQUENCE)
    if not all(type(i) is int for i in indices) or list(indices) != sorted(set(indices)):
        raise StateError(f"{where}: state[{key!r}] must be increasing int indices, got {short(indices)}")
    if indices and not 0 <= indices[0] <= indices[-1] < size:
        raise StateError(f"{where}: state[{key!r}] must be indices below {size}, got {short(indices)}")
    return list(indices)


def check_positions(owner: object, remaining: Sequence[Sequence[int]], size: int) -> None:
    """Raise unless the intervals of ``remaining`` lie in a chunk of ``size`` positions."""
    if remaining and remaining[-1][1] > size:
        raise StateError(
            f"{owner!r}: the state's remaining positions reach {remaining[-1][1]}, past the end of this "
            f"rank's chunk of {size} records; the state is not of this dataset, or it was edited"
        )


def check_share(state: State, where: str) -> None:
    """``state['share']`` must be None or ``[worker, num_workers]``."""
    share = field(state, SHARE, where, type(None), *SEQUENCE)
    if share is None:
        return
    if len(share) != 2 or any(type(v) is not int for v in share) or not 0 <= share[0] < share[1] <= INT64_MAX:
        raise StateError(
            f"{where}: state['share'] must be None or [worker, num_workers] with 0 <= worker < num_workers, "
            f"got {short(share)}"
        )


def check_draws(state: State, where: str) -> None:
    """``state['rng']`` must be None or a draw position: a numpy generator state and an index in its block."""
    draws = field(state, RNG, where, type(None), dict)
    if draws is None:
        return
    position = whole_number(draws, Uniforms.NEXT, f"{where} (rng)")
    if position > DRAW_BLOCK:
        raise StateError(f"{where}: state['rng']['next'] must be <= {DRAW_BLOCK}, got {position}")
    restore_generator(field(draws, Uniforms.GENERATOR, f"{where} (rng)", dict), where)


def check_inputs_epoch(state: State, inputs: Sequence[Any], where: str) -> None:
    """The inputs of a shuffle or interleave read the epoch it reads (an
    older stage state over newer inputs would drop what it held)."""
    for part in inputs:
        epoch = _first_epoch(part)
        if type(epoch) is int and 0 <= epoch <= INT64_MAX and epoch != state[EPOCH]:  # else its own check names it
            raise StateError(f"{where}: the state is of epoch {state[EPOCH]} but its inputs' of epoch {epoch}")


def _first_epoch(state: Any) -> Any:
    """The epoch of the first stage at or below ``state`` that records one."""
    while isinstance(state, dict):
        if EPOCH in state:
            return state[EPOCH]
        state = state.get(UPSTREAM)
    return None


def _inputs(state: State) -> list[tuple[str, State]]:
    """The input nodes of a checked node, with their keys: one dict, or a list (None: an input never read)."""
    upstream = state.get(UPSTREAM)
    if isinstance(upstream, dict):
        return [("['upstream']", upstream)]
    if isinstance(upstream, SEQUENCE):
        return [(f"['upstream'][{i}]", part) for i, part in enumerate(upstream) if part is not None]
    return []


def validate(state: object, where: str = "state") -> State:
    """Check a whole state tree (every node's version, kind and fields) and return it.

    Stages check their own node when they load it; this checks a tree before
    it is merged or handed to DataLoader workers. What depends on the
    dataset (fingerprint, rank chunk, inputs) is checked when it is loaded.

    Raises:
        StateError: naming the first field that is missing, mistyped or out of range.
    """
    checked = _check_node(state, None, where)
    for key, part in _inputs(checked):
        validate(part, where + key)
    return checked


def _check_node(state: object, kind: str | None, where: str) -> State:
    if type(state) is not dict:
        raise StateError(f"{where}: a state must be a dict from state_dict(), got {type(state).__name__}")
    version = state.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        readable = " and ".join(map(str, READABLE_VERSIONS))
        raise StateError(
            f"{where}: state version {short(version)} is not supported; this shardkit reads versions {readable} "
            f"(it writes {VERSION}): the state was saved by a newer shardkit, or edited"
        )
    saved = state.get("kind")
    if kind is not None and saved != kind:
        raise StateError(
            f"{where}: the state is of a {short(saved)} stage but this stage is {kind!r}; "
            "load the state into the same pipeline (same stages in the same order) that saved it"
        )
    stage = stage_of(saved)
    if stage is None and kind is None:
        raise StateError(f"{where}: unknown state kind {short(saved)}; known: {', '.join(_STAGES)}")
    if stage is not None:
        check_ints(state, where, stage.UNBOUNDED_FIELDS)  # first: no stage's own check meets an int past 64 bits
        stage.check_state(state, where)
    return state


# -- merging the states of all workers of a rank --------------------------------


def merge(states: Sequence[State]) -> State:
    """One state for the whole rank from the states of all its DataLoader workers.

    The result resumes with any number of workers: every stage's ``share`` is
    None, remaining positions are united, buffered samples pooled, and
    generator positions dropped (workers restart their draws from the epoch's
    seed; which samples come is exact, their order after the restore is not
    the uninterrupted one). Each stage merges its own nodes
    (:meth:`StageIterator.merge`).

    Raises:
        StateError: for states of different pipelines, epochs or ranks, an
            incomplete set of workers, or stages that cannot be split anew
            (``wrap`` of a plain iterable, workers in different ``repeat``
            passes, a ``stop="first_exhausted"`` interleave that has stopped).
    """
    if not states:
        raise StateError("merge() needs the state of every worker, got none")
    for index, state in enumerate(states):
        validate(state, f"state of worker {index}")
    kinds = {s.get("kind") for s in states}
    if len(kinds) != 1:
        raise StateError(f"cannot merge states of different stages {sorted(map(str, kinds))}")
    stage = stage_of(states[0]["kind"])
    if stage is None:
        raise StateError(f"unknown state kind {states[0]['kind']!r}")
    if len(states) == 1:
        states = [_whole(states[0])]
    return stage.merge(states)


def _whole(state: State) -> State:
    """A one-worker state: its share (if it has one) is the whole rank."""
    share = state.get(SHARE)
    if share is not None and share[1] != 1:
        raise StateError(
            f"this state is worker {share[0]}'s of {share[1]}; merge needs the states of all {share[1]} workers"
        )
    return state


def same_value(states: Sequence[State], key: str) -> Any:
    """``key``'s value, which every worker's (or rank's) node must share."""
    values = [s[key] for s in states]
    if any(v != values[0] for v in values):
        raise StateError(f"cannot merge worker states with different {key}: {values}")
    return values[0]


def check_all_shares(states: Sequence[State]) -> None:
    """The nodes must be every worker's exactly once (or all whole-rank ones)."""
    shares = [s.get(SHARE) for s in states]
    if all(share is None for share in shares):
        return
    if any(share is None for share in shares):
        raise StateError("cannot merge a whole-rank state with per-worker states")
    count = shares[0][1]  # type: ignore[index]  # not None: checked above
    if sorted(tuple(s) for s in shares if s is not None) != [(w, count) for w in range(count)]:
        raise StateError(f"merge needs the states of all {count} workers exactly once, got shares {shares}")


# -- samples held in memory, dealt to the ranks of a new world ---------------------
#
# What a stage holds in memory (a shuffle buffer's samples, a MixedLoader's cut
# micro-batches) has already been read: no position owes it. Gathered over the
# ranks, those samples are pooled, and each rank of the new world takes its
# part of the pool by the balance of the stream, so that "pad"/"drop" give
# every new rank the same count of held samples, as split_remaining gives it
# the same count of positions: the two add up to equal counts per rank.

#: The balances a gathered pool of held samples is dealt by (the sources' ``balance``).
BALANCES = ("none", "pad", "drop")


def deal(count: int, world_size: int, rank: int, balance: str) -> list[int]:
    """Which of ``count`` pooled held samples rank ``rank`` of ``world_size`` takes, in order.

    A contiguous run of the pool, cut as :func:`~shardkit.planning.rank_span`
    cuts a stream: ``"none"`` as evenly as possible, ``"pad"``
    ``ceil(count / world_size)`` per rank (an index at or past ``count`` is a
    repeat of index ``- count``, delivered again and owed to no later gather),
    ``"drop"`` ``floor(count / world_size)`` (the last ``count mod world_size``
    are left out, as the stream leaves out its last records).

    Example:
        >>> [deal(5, 2, rank, "pad") for rank in (0, 1)]
        [[0, 1, 2], [3, 4, 5]]
        >>> [deal(5, 2, rank, "drop") for rank in (0, 1)]
        [[0, 1], [2, 3]]
    """
    if count == 0 or (balance == "drop" and count < world_size):
        return []
    start, size = rank_span(count, world_size, rank, balance)  # type: ignore[arg-type]
    return list(range(start, start + size))


def stream_balance(state: Any) -> str:
    """The ``balance`` of the stream below a node: that of the first source node found
    down its first inputs (its ``fingerprint``), ``"none"`` when none records one."""
    while isinstance(state, dict):
        fingerprint = state.get("fingerprint")
        if isinstance(fingerprint, dict) and fingerprint.get("balance") in BALANCES:
            return str(fingerprint["balance"])
        upstream = state.get(UPSTREAM)
        if isinstance(upstream, SEQUENCE):
            upstream = next((part for part in upstream if part is not None), None)
        state = upstream
    return "none"


def check_balance(state: State, key: str, where: str) -> str:
    """``state[key]``, which must be one of :data:`BALANCES`."""
    balance = field(state, key, where, str)
    if balance not in BALANCES:
        raise StateError(f"{where}: state[{key!r}] must be one of {BALANCES}, got {short(balance)}")
    return balance


def combine_ranks(states: Sequence[State]) -> State:
    """One global node from every rank's whole-rank node (checked, of one kind each):
    each stage combines its own (:meth:`StageIterator.merge_ranks`)."""
    kinds = {s["kind"] for s in states}
    if len(kinds) != 1:
        raise StateError(f"cannot merge rank states of different stages {sorted(kinds)}")
    stage = stage_of(states[0]["kind"])
    if stage is None:
        raise StateError(f"unknown state kind {states[0]['kind']!r}")
    return stage.merge_ranks(states)


__all__ = [
    "BALANCES", "DRAW_BLOCK", "EPOCH", "INT64_MAX", "PassThroughIterator", "RNG", "Resume", "SEQUENCE", "SHARE",
    "READABLE_VERSIONS", "StageIterator", "State", "UPSTREAM", "VERSION", "applies", "bounded", "check", "check_all_shares",
    "check_balance", "check_draws", "check_indices", "check_inputs_epoch", "check_ints", "check_intervals",
    "check_positions", "check_share", "combine_ranks", "deal", "expect_equal", "field", "is_own", "merge", "node",
    "same_value", "share_field", "stage_of", "stream_balance", "upstream_state", "validate", "whole_number",
]  # fmt: skip
