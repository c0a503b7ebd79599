"""Saved positions: the format of ``state_dict()``, its checks, and merging.

Every shardkit pipeline has ``state_dict()`` / ``load_state_dict(state)`` (the
Stateful protocol of torchdata's ``StatefulDataLoader``). A state is a tree of
plain dicts, one node per pipeline stage, that ``json`` and ``torch.save`` can
hold. Every node has ``"version"`` (:data:`VERSION`) and ``"kind"``; nodes
with inputs hold their state under ``"upstream"``.

Each kind belongs to one stage's iterator class (a :class:`StageIterator`;
``"planned"`` and ``"stream"`` in :mod:`shardkit.sources`, ``"interleave"``
in :mod:`shardkit.interleaving`, the others in :mod:`shardkit.pipeline`),
which holds its keys as constants and, beside ``__next__``, how the node is
saved, restored, checked and merged; defining the class registers the kind.
This module holds what all stages share: the node envelope, the checks
common to several kinds, the sample encoding, and :func:`merge` /
:func:`merge_ranks`, which hand each node to its kind's class.

Kinds (version 1):

* ``"planned"`` (shard files, map-style datasets): ``epoch``, ``world_size``,
  ``rank``, a ``fingerprint`` of the dataset (shard count, record count, seed,
  shuffle, balance; no file names), ``remaining``: the ``[start, stop)``
  intervals of positions of this rank's chunk still to read (see
  :func:`shardkit.planning.plan_intervals`), and ``share``: ``[worker,
  num_workers]`` when ``remaining`` is one DataLoader worker's own part, or
  None when it is the whole rank's. Under sample-level shuffling a reader's
  state also has ``window``: ``{"from": positions from the start of the
  window it is yielding, "yielded": samples of that window yielded}`` (the
  window is read again on resume); ``remaining`` then lists the window's
  unyielded positions one by one. A merge keeps ``remaining`` only.
  Positions count records, not samples: a record skipped under
  ``on_error="skip"`` counts as read.
* ``"stream"`` (``wrap`` of a plain iterable): ``items`` the reader has
  stepped past, whether it is ``done``, and its ``reader`` slot; resuming
  iterates the iterable again and skips them (it must repeat itself).
* ``"map"``, ``"filter"``, ``"batch"``: only ``upstream`` (a batch is built
  in one step, so there is never a partial one to save).
* ``"shuffle"``: the buffered samples (``samples``, each encoded with
  :func:`encode`), the generator position (``rng``) and ``share``. The
  contents are saved rather than re-derived: exact and cheap to restore, at
  the cost of a state as large as the buffer. A merged node also has
  ``pooled``, the number of workers' buffers its samples pool: a loaded
  node holds at most ``pooled`` (1 when absent) times ``buffer_size``.
* ``"repeat"``: the ``pass``, whether it has yielded (``yielded``) and the
  pass's ``upstream`` state (None once every pass is done).
* ``"interleave"``: per-input states (None for inputs never read), the
  ``live`` inputs, the generator position, ``stopped`` and ``share``.

Every stage that draws or reads also records the ``epoch`` its iteration
reads (inside ``repeat``, including the pass). A loaded state resumes an
iteration of that epoch; an iteration of a later epoch ignores it.

Samples are kept only where they cannot be read again: shuffle buffers, and
the undelivered tail of a micro-batch in :class:`~shardkit.MixedLoader`.

States are plain data, and only ours. Samples are saved as a tagged tree of
JSON values (:func:`encode`), never pickled: tensors (dense, CPU), numpy
arrays and scalars of non-object dtypes, str, bytes, int, float, bool, None,
and lists, tuples and dicts of them; anything else (another class, a dict
subclass, a namedtuple) is refused when the state is saved, naming the type.
:func:`decode` builds only those types, so loading a state never runs code.
Every loaded node is checked (:func:`check`, :func:`validate`) before it is
used: a missing key, a wrong type, an interval out of order or out of the
rank's chunk, an unknown kind or version, a negative epoch, an int that does
not fit in 64 bits (outside samples and generator states) or a share that
does not fit is a :class:`StateError` naming the field, never a ``KeyError``
deep in an iterator or an epoch that silently ends early.

States of all DataLoader workers of one rank merge (:func:`merge`) into one
state of the rank (``share`` None) that any number of workers can resume:
each takes an even part of the remaining positions and of the buffered
samples. That is how :class:`~shardkit.MixedLoader` restores elastically.

The states of all ranks combine (:func:`merge_ranks`, or :func:`gather`
through the process group) into one *global* ``"planned"`` state: ``rank``
None, ``remaining`` in positions of the epoch's global stream (records not
delivered by any rank; repeats that ``"pad"`` planned are not owed), and
``world_size`` the world size that stream was planned for. It loads on any
world size and number of workers: each rank takes its part with
:func:`~shardkit.planning.split_remaining` (``"pad"``/``"drop"`` equalise
the counts again), and a state it saves later carries that global state as
``base`` (its positions count within its part), so it can be gathered again.
Only shard datasets with ``map``/``filter``/``batch`` stages combine over
ranks: a shuffle buffer, an interleave or a repeat keeps per-rank positions.
"""

from __future__ import annotations

import base64
import importlib
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from shardkit.errors import ShardkitError, check_int

if TYPE_CHECKING:
    from shardkit.topology import Topology

#: Version of the state format written by this shardkit.
VERSION = 1

State = dict[str, Any]

# Keys that several stages' nodes share; each stage names its own as constants on its iterator.
EPOCH = "epoch"  #: the epoch the iteration reads (inside ``repeat``, including the pass)
SHARE = "share"  #: ``[worker, num_workers]``: the DataLoader worker whose part the node is; None: the whole rank's
RNG = "rng"  #: the draw position (``pipeline.Uniforms``), None after a merge
UPSTREAM = "upstream"  #: the inputs' nodes


class StateError(ShardkitError, ValueError):
    """A state that cannot be saved, or that does not fit what it is loaded into."""


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
    if not _same_data(saved, actual):
        raise StateError(f"{owner!r}: the state was saved with {what} {saved!r}, but here it is {actual!r}")


def _same_data(saved: object, actual: object) -> bool:
    """Equal plain data of equal types, lists and tuples alike (JSON keeps no tuples)."""
    if isinstance(actual, np.generic):  # a numpy number computed here is saved as its Python value
        actual = actual.item()
    if isinstance(actual, (list, tuple)):
        return (
            type(saved) in (list, tuple)
            and len(saved) == len(actual)  # type: ignore[arg-type]
            and all(map(_same_data, saved, actual))  # type: ignore[call-overload]
        )
    if isinstance(actual, dict):
        return (
            type(saved) is dict
            and saved.keys() == actual.keys()
            and all(_same_data(saved[key], value) for key, value in actual.items())
        )
    return type(saved) is type(actual) and saved == actual


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
            "resume on another world size works for shard datasets with map/filter/batch stages"
        )


_STAGES: dict[str, type[StageIterator]] = {}

#: Modules whose import defines the stage iterators (a state may be merged before any is imported).
_STAGE_MODULES = ("shardkit.pipeline", "shardkit.interleaving", "shardkit.sources")


def stage_of(kind: object) -> type[StageIterator] | None:
    """The iterator class that owns state nodes of ``kind``, if any."""
    for module in _STAGE_MODULES:
        if module not in sys.modules:  # a state merged by a tool that imported only some stages
            importlib.import_module(module)
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

#: Uniform floats drawn per generator call; a saved draw position lies in [0, DRAW_BLOCK].
DRAW_BLOCK = 1024

_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "Philox", "SFC64", "MT19937")
SEQUENCE = (list, tuple)


def field(state: State, key: str, where: str, *types: type) -> Any:
    """``state[key]``, which must be present and of one of ``types`` (exactly: a bool is not an int);
    an int must fit in 64 bits (:func:`bounded`)."""
    if key not in state:
        raise StateError(f"{where}: the state has no {key!r}; it is not a state_dict() of this stage, or it was edited")
    value = state[key]
    if type(value) not in types:
        names = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise StateError(f"{where}: state[{key!r}] must be {names}, got {type(value).__name__} {_short(value)}")
    if type(value) is int:
        bounded(value, f"{where}: state[{key!r}]")
    return value


def bounded(value: int, name: str) -> int:
    """``value`` if it fits in a signed 64-bit int, as every count, position and epoch
    must (they go through numpy and shared memory); else a :class:`StateError` naming it."""
    return check_int(
        name, value, minimum=INT64_MIN, maximum=INT64_MAX, error=StateError, hint="the state was edited or is corrupt"
    )


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
            raise StateError(f"{where}: state[{what!r}] must hold [start, stop] pairs of ints, got {_short(interval)}")
        start, stop = interval
        bounded(stop, f"{where}: the end of an interval in state[{what!r}]")
        if not previous <= start < stop:
            raise StateError(
                f"{where}: state[{what!r}] must hold sorted, disjoint, non-empty [start, stop) intervals "
                f"of positions >= 0; [{start}, {stop}) after position {previous} is not"
            )
        previous = stop


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
            f"got {_short(share)}"
        )


def check_draws(state: State, where: str) -> None:
    """``state['rng']`` must be None or a draw position: a numpy generator state and an index in its block."""
    draws = field(state, RNG, where, type(None), dict)
    if draws is None:
        return
    position = whole_number(draws, "next", f"{where} (rng)")
    if position > DRAW_BLOCK:
        raise StateError(f"{where}: state['rng']['next'] must be <= {DRAW_BLOCK}, got {position}")
    restore_generator(field(draws, "generator", f"{where} (rng)", dict), where)


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
    if type(version) is not int or version != VERSION:
        raise StateError(
            f"{where}: state version {_short(version)} is not supported; this shardkit reads version {VERSION}"
        )
    saved = state.get("kind")
    if kind is not None and saved != kind:
        raise StateError(
            f"{where}: the state is of a {_short(saved)} stage but this stage is {kind!r}; "
            "load the state into the same pipeline (same stages in the same order) that saved it"
        )
    stage = stage_of(saved)
    if stage is None and kind is None:
        raise StateError(f"{where}: unknown state kind {_short(saved)}; known: {', '.join(_STAGES)}")
    if stage is not None:
        stage.check_state(state, where)
    return state


# -- samples as plain data --------------------------------------------------------
#
# Samples are saved as a tagged tree of JSON values, never pickled: decoding
# builds only the types below, so loading a state cannot run code. str, int,
# bool, None and finite floats stand for themselves; everything else is a
# list whose first item names the type.

#: Deepest nesting of lists, tuples and dicts in a saved sample.
MAX_DEPTH = 64

_ARRAY_KINDS = "biufcSUmM"  # numpy dtype kinds with no Python objects inside
_NUMPY_DTYPE = re.compile(r"[<>|=][biufcSUmM]\d{1,6}(\[[A-Za-z0-9]{1,6}\])?")
_TENSOR_DTYPES = {
    name: dtype
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}  # fmt: skip
_KEY_TYPES = (str, int, float, bool, bytes, type(None))
_ALLOWED = (
    "tensors, numpy arrays and scalars (not of object or structured dtype), str, bytes, int, float, "
    "bool, None, and lists, tuples and dicts of them"
)


class _Unsavable(Exception):
    """A value :func:`encode` cannot hold; ``path`` grows as the error unwinds."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.path = ""


def encode(value: Any) -> Any:
    """``value`` (a sample) as plain data: JSON-able and loadable by
    ``torch.load(weights_only=True)``; :func:`decode` turns it back.

    Holds tensors (CPU, dense; values, dtype and shape), numpy arrays and
    scalars of non-object dtypes, str, bytes, int, float, bool, None and lists,
    tuples and dicts (exactly these types; dict keys scalars) of them.

    Raises:
        StateError: for anything else (another class, a dict subclass or
            namedtuple, an object array), naming the type and where it is.
    """
    try:
        return _encode(value, 0)
    except _Unsavable as error:
        where = f" at sample{error.path}" if error.path else ""
        raise StateError(
            f"cannot save a sample in a state: {error.reason}{where}. A state holds only {_ALLOWED}, "
            "so that loading it never runs code. Map samples to such types before .shuffle() "
            "(or before MixedLoader batches them), or pass resumable=False to MixedLoader "
            "when you do not resume"
        ) from None


def _encode(value: Any, depth: int) -> Any:
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is float:
        return value if math.isfinite(value) else ["float", repr(value)]
    if kind is bytes:
        return ["bytes", _b64(value)]
    if kind is list or kind is tuple or kind is dict:
        if depth >= MAX_DEPTH:
            raise _Unsavable(f"samples nest deeper than {MAX_DEPTH} lists, tuples and dicts")
        return _encode_container(value, depth + 1)
    if kind is np.ndarray or isinstance(value, np.generic):
        return _encode_array(value)
    if kind is torch.Tensor:
        return _encode_tensor(value)
    raise _Unsavable(f"{_type_name(value)} is not one of these types")


def _encode_container(value: Any, depth: int) -> list[Any]:
    items = value.items() if type(value) is dict else enumerate(value)
    out: list[Any] = [type(value).__name__]
    for key, item in items:
        try:
            if type(value) is dict:
                if type(key) not in _KEY_TYPES:
                    raise _Unsavable(
                        f"a dict key of type {_type_name(key)} (keys must be str, int, float, bool, bytes or None)"
                    )
                out.append(_encode(key, depth))
            out.append(_encode(item, depth))
        except _Unsavable as error:
            error.path = f"[{key!r}]{error.path}"
            raise
    return out


def _encode_array(value: np.ndarray | np.generic) -> list[Any]:
    dtype = value.dtype
    if dtype.kind not in _ARRAY_KINDS or dtype.hasobject or not _NUMPY_DTYPE.fullmatch(dtype.str):
        raise _Unsavable(
            f"a numpy {type(value).__name__} of dtype {dtype} (object and structured dtypes can hold code)"
        )
    data = _b64(np.ascontiguousarray(value).tobytes())
    if isinstance(value, np.generic):
        return ["numpy", dtype.str, data]
    return ["ndarray", dtype.str, list(value.shape), data]


def _encode_tensor(value: torch.Tensor) -> list[Any]:
    name = str(value.dtype).removeprefix("torch.")
    if name not in _TENSOR_DTYPES or value.layout != torch.strided or value.device.type != "cpu":
        raise _Unsavable(
            f"a tensor of dtype {name}, layout {value.layout}, device {value.device} "
            "(only dense CPU tensors of plain dtypes are saved)"
        )
    flat = value.detach().resolve_conj().resolve_neg().contiguous().view(-1)
    # Raw bytes in this machine's order; every platform torch supports is little-endian.
    return ["tensor", name, list(value.shape), _b64(flat.view(torch.uint8).numpy().tobytes())]


def _type_name(value: object) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode(data: Any) -> Any:
    """The sample :func:`encode` made ``data`` from. Builds only the types
    :func:`encode` holds, so a crafted state cannot run code.

    Raises:
        StateError: ``data`` is not such an encoding (naming what is wrong and where).
    """
    try:
        return _decode(data, 0)
    except (ValueError, RuntimeError) as error:  # a reshape numpy or torch refuses
        raise StateError(f"the state holds a sample that cannot be read: {error}") from None
    except _Unsavable as error:
        where = f" at sample{error.path}" if error.path else ""
        raise StateError(f"the state holds a sample that cannot be read: {error.reason}{where}") from None


def _decode(data: Any, depth: int) -> Any:
    kind = type(data)
    if kind is str or kind is int or kind is bool or kind is float or data is None:
        return data
    if kind is not list or not data or type(data[0]) is not str:
        raise _Unsavable(f"{_type_name(data)} {_short(data)} is not an encoded sample")
    tag = data[0]
    if tag in ("list", "tuple", "dict"):
        if depth >= MAX_DEPTH:
            raise _Unsavable(f"lists, tuples and dicts nest deeper than {MAX_DEPTH}")
        return _decode_container(data, depth + 1)
    decoder = _DECODERS.get(tag)
    if decoder is None:
        raise _Unsavable(f"unknown type tag {_short(tag)}")
    return decoder(data)


def _decode_container(data: list[Any], depth: int) -> Any:
    tag, items = data[0], data[1:]
    if tag != "dict":
        values = []
        for index, item in enumerate(items):
            try:
                values.append(_decode(item, depth))
            except _Unsavable as error:
                error.path = f"[{index}]{error.path}"
                raise
        return values if tag == "list" else tuple(values)
    if len(items) % 2:
        raise _Unsavable("a dict with a key but no value")
    out = {}
    for index in range(0, len(items), 2):
        key = _decode(items[index], depth)
        if type(key) not in _KEY_TYPES:
            raise _Unsavable(f"a dict key of type {_type_name(key)}")
        try:
            out[key] = _decode(items[index + 1], depth)
        except _Unsavable as error:
            error.path = f"[{key!r}]{error.path}"
            raise
    return out


def _decode_float(data: list[Any]) -> float:
    if data[1:] not in (["nan"], ["inf"], ["-inf"]):
        raise _Unsavable(f"a float {_short(data[1:])} (only 'nan', 'inf' and '-inf' are tagged)")
    return float(data[1])


def _decode_bytes(data: list[Any]) -> bytes:
    _expect_fields(data, str)
    return _unb64(data[1])


def _decode_numpy(data: list[Any]) -> Any:
    _expect_fields(data, str, str)
    dtype = _numpy_dtype(data[1])
    raw = _unb64(data[2])
    if len(raw) != dtype.itemsize:
        raise _Unsavable(f"a numpy scalar of dtype {dtype} with {len(raw)} bytes")
    return np.frombuffer(raw, dtype)[0]


def _decode_ndarray(data: list[Any]) -> np.ndarray:
    _expect_fields(data, str, list, str)
    dtype, shape, raw = _numpy_dtype(data[1]), _shape(data[2]), _unb64(data[3])
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise _Unsavable(f"an array of shape {shape} and dtype {dtype} with {len(raw)} bytes")
    return np.frombuffer(bytearray(raw), dtype).reshape(shape)


def _decode_tensor(data: list[Any]) -> torch.Tensor:
    _expect_fields(data, str, list, str)
    dtype = _TENSOR_DTYPES.get(data[1])
    if dtype is None:
        raise _Unsavable(f"a tensor of unknown dtype {_short(data[1])}")
    shape, raw = _shape(data[2]), _unb64(data[3])
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise _Unsavable(f"a tensor of shape {shape} and dtype {data[1]} with {len(raw)} bytes")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _expect_fields(data: list[Any], *types: type) -> None:
    if len(data) != len(types) + 1 or any(type(v) is not t for v, t in zip(data[1:], types)):
        expected = ", ".join(t.__name__ for t in types)
        raise _Unsavable(f"a {data[0]!r} entry must hold ({expected}), got {_short(data[1:])}")


def _numpy_dtype(text: str) -> np.dtype:
    if not _NUMPY_DTYPE.fullmatch(text):
        raise _Unsavable(f"numpy dtype {_short(text)} (only plain numbers, strings and dates)")
    try:
        dtype = np.dtype(text)
    except TypeError:
        raise _Unsavable(f"numpy dtype {_short(text)}") from None
    if dtype.itemsize == 0 or dtype.hasobject:
        raise _Unsavable(f"numpy dtype {_short(text)}")
    return dtype


def _shape(shape: list[Any]) -> tuple[int, ...]:
    if len(shape) > 32 or any(type(n) is not int or n < 0 for n in shape):
        raise _Unsavable(f"shape {_short(shape)} (up to 32 non-negative ints)")
    return tuple(shape)


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise _Unsavable(f"invalid base64 {_short(text)}") from None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_DECODERS: dict[str, Callable[[list[Any]], Any]] = {
    "float": _decode_float,
    "bytes": _decode_bytes,
    "numpy": _decode_numpy,
    "ndarray": _decode_ndarray,
    "tensor": _decode_tensor,
}


def generator_state(rng: np.random.Generator) -> dict[str, Any]:
    """The position of a numpy generator, as plain data."""
    return dict(rng.bit_generator.state)


def restore_generator(state: dict[str, Any], where: str = "state") -> np.random.Generator:
    """A numpy generator at the position :func:`generator_state` saved.

    Raises:
        StateError: ``state`` is not the state of a numpy bit generator.
    """
    name = state.get("bit_generator")
    if name not in _BIT_GENERATORS:
        known = ", ".join(_BIT_GENERATORS)
        raise StateError(f"{where}: unknown bit generator {_short(name)} in the state; known: {known}")
    bit_generator = getattr(np.random, name)()
    try:
        bit_generator.state = state
    except (TypeError, ValueError, KeyError, IndexError, OverflowError) as error:
        raise StateError(f"{where}: the saved {name} generator state is not valid: {error}") from None
    if not _same_data(state, bit_generator.state):  # numpy accepts some stand-ins (True for 1, extra keys)
        raise StateError(f"{where}: the saved {name} generator state is not one numpy writes: {_short(state)}")
    return np.random.Generator(bit_generator)


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


# -- combining the states of all ranks -----------------------------------------


def merge_ranks(states: Sequence[State | Sequence[State]]) -> State:
    """One global state from the states of every rank (rank order not needed).

    Each item is one rank's state: a whole-rank state (``share`` None, as
    :func:`merge` makes), the list of its workers' states (merged here), or
    a :class:`~shardkit.MixedLoader` state without cut micro-batches.
    The result holds, in global stream positions, exactly the records no
    rank has delivered yet (``rank`` None, ``world_size`` the world size the
    epoch's stream was planned for), and loads into the same pipeline on
    any world size and number of workers: each rank takes its part with
    :func:`~shardkit.planning.split_remaining`, so ``"pad"``/``"drop"``
    give every new rank the same count again. Repeats that ``"pad"`` had
    planned and not yet delivered are not owed: they are left out.

    Raises:
        StateError: states of different pipelines or epochs, a rank missing
            or given twice, positions two ranks both hold, or stages whose
            state cannot be split over ranks (a ``.shuffle()`` buffer, an
            interleave, a ``repeat``, a ``wrap`` of a plain iterable).
    """
    if not states:
        raise StateError("merge_ranks() needs the state of every rank, got none")
    wholes = [merge(list(s)) if isinstance(s, (list, tuple)) else merge([_dataset_part(s)]) for s in states]
    return combine_ranks(wholes)


def _dataset_part(state: Any) -> Any:
    """A rank's dataset state; from a MixedLoader state, its workers' states (merged)."""
    if not isinstance(state, dict) or state.get("kind") != "mixed_loader":
        return state
    if state.get("carry"):
        raise StateError(
            "this MixedLoader state holds samples cut out of micro-batches (its 'carry'), which cannot be "
            "dealt to the ranks of another world yet; save where every batch is made of whole micro-batches "
            "(batch_size a multiple of micro_batch_size), or resume on the same world size"
        )
    return merge(state["workers"])


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


def gather(state: State | Sequence[State], group: Any = None) -> State:
    """The global state of all ranks, on every rank, through the process group.

    ``state`` is this rank's pipeline state (or the list of its DataLoader
    workers' states, or a :class:`~shardkit.MixedLoader` state); the states travel as JSON-able objects with
    ``all_gather_object``. Without an initialised process group, the state
    of this one rank is made global. Save the result (one file suffices, any
    rank) and load it with ``load_state_dict`` on any world size; see
    :func:`merge_ranks` for what it holds and raises.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return merge_ranks([state])
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, state, group=group)
    return merge_ranks(gathered)


__all__ = ["VERSION", "State", "StateError", "decode", "encode", "gather", "merge", "merge_ranks", "validate"]
