"""Seeds derived from (seed, epoch, rank, worker), and the seed of this iteration.

Every reader (one DataLoader worker on one rank) gets its own seed per epoch:
augmentations then differ across workers and ranks, change every epoch and
repeat exactly across runs. torch's own worker seeding draws a base seed once
per DataLoader iterator, so persistent workers never reseed and ranks seeded
alike augment alike; shardkit reseeds at the start of every pass instead.

User code (a ``.map`` augmentation, say) reads the seed of the running
iteration with :func:`current_seed`.

Stages that draw (``.shuffle()``, ``interleave``) take uniform floats from
such a generator through :class:`Uniforms`, a block at a time, so that a
position in the draws is small plain data (a generator state and an index)
that a saved state can hold.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from shardkit.errors import ShardkitError, check_int
from shardkit.topology import Topology

_MAX_SEED = 2**64

# Streams of randomness derived from the same (seed, epoch, rank, worker): the
# worker seed itself, and one generator per kind of wrapper that draws numbers.
WORKER_STREAM = 0
SHUFFLE_STREAM = 1
INTERLEAVE_STREAM = 2
SCHEDULE_STREAM = 3  # the start of a scheduled interleave's low-discrepancy draws

#: Uniform floats drawn per generator call (a scalar call costs ~1 us); a saved draw position lies in [0, DRAW_BLOCK].
DRAW_BLOCK = 1024

_current_seed: int | None = None


class SeedError(ShardkitError, ValueError):
    """A seed that is not a non-negative int, or a seed read before any was set."""


def check_seed(seed: int, name: str = "seed") -> int:
    """Return ``seed`` if it is a non-negative int, else raise :class:`SeedError`."""
    value = int(seed) if isinstance(seed, np.integer) else seed  # a numpy int (from a config, an array) is an int
    return check_int(name, value, minimum=0, error=SeedError, hint="use abs() or a hash if it can be negative")


def _sequence(seed: int, epoch: int, rank: int, worker: int, stream: int) -> np.random.SeedSequence:
    key = (check_seed(epoch, "epoch"), check_seed(rank, "rank"), check_seed(worker, "worker"), stream)
    return np.random.SeedSequence(entropy=check_seed(seed), spawn_key=key)


def worker_seed(seed: int, epoch: int, rank: int, worker: int) -> int:
    """A well-mixed 64-bit seed for one reader in one epoch.

    Distinct (with overwhelming probability) for any change of any argument;
    the same arguments give the same seed on every machine and run.

    Example:
        >>> from shardkit import worker_seed
        >>> worker_seed(42, epoch=0, rank=0, worker=1) == worker_seed(42, epoch=0, rank=0, worker=1)
        True
        >>> worker_seed(42, epoch=0, rank=0, worker=1) == worker_seed(42, epoch=1, rank=0, worker=1)
        False
        >>> 0 <= worker_seed(42, 0, 0, 1) < 2**64
        True
    """
    state = _sequence(seed, epoch, rank, worker, WORKER_STREAM).generate_state(1, np.uint64)
    return int(state[0])


def generator(seed: int, epoch: int, topology: Topology, stream: int) -> np.random.Generator:
    """A numpy Generator for one reader in one epoch, independent of
    :func:`worker_seed` and of other ``stream`` values."""
    sequence = _sequence(seed, epoch, topology.rank, topology.worker_id, stream)
    return np.random.default_rng(sequence)


def generator_state(rng: np.random.Generator) -> dict[str, Any]:
    """The position of a numpy generator, as plain data."""
    return dict(rng.bit_generator.state)


class Uniforms:
    """Uniform floats in [0, 1) from ``rng``, drawn :data:`DRAW_BLOCK` at a time.

    The sequence is fixed by the generator's state, so a position in it is
    (generator state at the block's start, index in the block): that is
    :meth:`state_dict`, and :meth:`seek` continues there. Checking a saved
    position and rebuilding its generator is the state's job
    (:func:`shardkit.stateful.check_draws`, :meth:`shardkit.stateful.Resume.continue_draws`).
    """

    GENERATOR = "generator"  #: state key: the generator's state at the start of the current block
    NEXT = "next"  #: state key: the index of the next draw in the block

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self._block: list[float] = []
        self._next = 0
        self._block_start: dict[str, Any] | None = None

    def _draw_block(self) -> None:
        self._block_start = generator_state(self._rng)
        self._block = self._rng.random(DRAW_BLOCK).tolist()
        self._next = 0

    def draw(self) -> float:
        if self._next == len(self._block):
            self._draw_block()
        value = self._block[self._next]
        self._next += 1
        return value

    def state_dict(self) -> dict[str, Any]:
        """The position in the sequence: generator state at the block's start and index in it."""
        if self._block_start is None:
            return {self.GENERATOR: generator_state(self._rng), self.NEXT: 0}
        return {self.GENERATOR: self._block_start, self.NEXT: self._next}

    def seek(self, rng: np.random.Generator, next_draw: int) -> None:
        """Continue at draw ``next_draw`` of the block that starts where ``rng`` stands
        (the position :meth:`state_dict` saved, its generator rebuilt)."""
        self._rng = rng
        self._block, self._next, self._block_start = [], 0, None
        if next_draw:
            self._draw_block()
            self._next = next_draw


def seed_everything(seed: int) -> None:
    """Seed Python's :mod:`random`, numpy's global generator and torch with ``seed``.

    ``seed`` must be in ``[0, 2**64)``; numpy's legacy seeder takes all 64 bits
    as two 32-bit words.
    """
    check_seed(seed)
    if seed >= _MAX_SEED:
        raise SeedError(f"seed must be < 2**64, got {seed}")
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
    torch.manual_seed(seed)


def seed_iteration(seed: int, epoch: int, topology: Topology) -> int:
    """Start one pass of a source: derive and record this reader's seed.

    Sources call this at the start of every ``__iter__``. It records
    :func:`worker_seed` as :func:`current_seed` and, inside a DataLoader worker
    process only, seeds :mod:`random`, numpy and torch with it. The main
    process (``num_workers=0``) keeps the RNG state the user gave it: reseeding
    it would silently override the user's ``torch.manual_seed`` for the model;
    code that wants per-rank randomness there reads :func:`current_seed`.
    Returns the seed.
    """
    global _current_seed
    derived = worker_seed(seed, epoch, topology.rank, topology.worker_id)
    _current_seed = derived
    if get_worker_info() is not None:
        seed_everything(derived)
    return derived


def current_seed() -> int:
    """The seed of the pass running in this process, as set by :func:`seed_iteration`.

    Use it to seed your own generators, e.g. ``numpy.random.default_rng(current_seed())``
    once per pass. When several sources run in one process (``interleave``), it
    is the seed of the source that started most recently.

    Example:
        An augmentation that draws from its own generator, seeded per reader
        and per epoch:

        >>> import numpy as np
        >>> import shardkit
        >>> from shardkit.seeding import current_seed
        >>> def jitter(x):
        ...     return x + np.random.default_rng(current_seed()).normal()
        >>> ds = shardkit.wrap(list(range(4))).map(jitter)
        >>> len(list(ds))
        4
    """
    if _current_seed is None:
        raise SeedError(
            "no shardkit iteration has started in this process; call current_seed() "
            "from code that runs while a shardkit dataset is being iterated (e.g. a .map function)"
        )
    return _current_seed


# -- the seed of the record a .map is applied to ------------------------------------

RECORD_STREAM = 4  # the stream of record_seed, apart from the readers' streams


class RecordInMap:
    """What :func:`record_seed` reads: the seed and epoch of the ``.map`` being applied and the
    packed position of its record (:mod:`shardkit.stateful.positions`; None: not known)."""

    __slots__ = ("epoch", "position", "seed")

    def __init__(self, seed: int, epoch: int, position: int | None) -> None:
        self.seed, self.epoch, self.position = seed, epoch, position


#: The record a ``.map`` is being applied to in this process (an object with ``seed``, ``epoch`` and
#: ``position``: the map's iterator itself, or a :class:`RecordInMap` when records are read again).
mapping: Any = None


def record_seed() -> int:
    """The seed of the record the running ``.map`` function is applied to: a 64-bit int drawn from
    (seed, epoch, shard, record), the same whenever that record is mapped in that epoch, on any rank
    or worker.

    A ``.map`` is applied again to the records a saved state holds by position (a shuffle buffer's,
    a MixedLoader's undelivered samples) when they are read again on resume, so its output must be a
    function of its input and this seed: seed any random augmentation from it, e.g.
    ``numpy.random.default_rng(record_seed())``, not from a generator that runs on across records.

    Raises:
        SeedError: called outside a ``.map`` function, or for a record whose position is not known
            (a wrapped plain iterable; use :func:`current_seed` there).
    """
    current = mapping
    position = None if current is None else current.position
    if current is None or position is None:
        raise SeedError(
            "record_seed() is the seed of the record a .map function is applied to: call it inside the "
            "function, over a source whose records have positions (shard datasets, wrapped map-style "
            "datasets); elsewhere use current_seed()"
        )
    key = (check_seed(current.epoch, "epoch"), position >> 32, position & 0xFFFFFFFF, RECORD_STREAM)
    state = np.random.SeedSequence(entropy=check_seed(current.seed), spawn_key=key).generate_state(1, np.uint64)
    return int(state[0])
