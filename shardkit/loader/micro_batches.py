"""What runs in each DataLoader worker of a :class:`~shardkit.MixedLoader`: the dataset's
stream cut into micro-batches, each message tagged with its worker id and, now and
then, the dataset's state after it.

Saving the dataset's state is the dearest step of a resumable worker when the
state is large (a ``.shuffle(n)`` buffer, a window's unread positions: several
times the cost of reading the micro-batch, and again to send and receive it),
so a worker under a :class:`~shardkit.MixedLoader` sends it only when asked:
each iteration of a worker makes an *ask count* (a one-int64 tensor in shared
memory) and sends it with its first message; ``state_dict()`` in the main
process raises it, and the worker attaches its state to the next micro-batch
it sends after it sees the count change (and always to its first and last
message). Saving thus costs one
dataset state per worker per ``state_dict()``, not one per micro-batch; a
training loop that never saves pays nothing per batch but the positions.
Without asks (the messages made in the main process, :func:`in_process`)
a worker sends its state when the work since the last one is at least
:data:`STATE_RATIO` times what that state cost, and at least every
:data:`STATE_EVERY` micro-batches. Exactness does not depend on which
micro-batches carry one: the main process (:mod:`shardkit.loader.mixer`)
saves the loader's position as the state of the first micro-batch with a
state at or after what it delivered, and carries the undelivered samples
before it, which it holds (by position where it can), in the saved state.

Where the dataset can read its records again by position (``Pipeline.records()``,
:mod:`shardkit.stateful.positions`) a micro-batch also carries its samples' record
positions (an int64 array's bytes, 8 a sample; :class:`PositionLog` notes the root
iterator's ``position`` after each sample), so that a saved state names the
undelivered samples the main process holds by position rather than holding them.

Where they cannot, but the pipeline's sources read records again (``.pack()`` blocks), the ask
names a *point* (the worker's samples delivered, the control's second slot; its third says the
worker answers so) and the worker answers with its state at that point, made from a restart point
it kept (:mod:`shardkit.loader.restart`), wrapped in an :class:`~shardkit.loader.restart.AtPoint`.

The main process (:mod:`shardkit.loader.mixer`) learns from the first message
where a worker starts and from an empty one that it has no more data; in
between, collated micro-batches travel through the worker's
:class:`~shardkit.loader.slabs.SlabRing` rather than a new shared-memory
segment per tensor.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from shardkit.loader import slab_columns
from shardkit.loader.restart import POINT_RATIO, AtPoint, RestartPoints, restartable
from shardkit.loader.slabs import SlabRing
from shardkit.loader.timing import WorkerClock
from shardkit.stateful import State, StateError

#: ``count`` of the message a worker sends first, with its dataset's starting state.
START = -1
#: A worker sends its dataset's state once the work since the last one is this many times what it cost...
STATE_RATIO = 9.0
#: ... and at least with one micro-batch in this many (which bounds the samples a saved state carries).
STATE_EVERY = 16
#: A micro-batch of small samples grows (``micro_batch_size`` not given) to about this many collated bytes...
MESSAGE_BYTES = 1 << 19
#: ... in at most this many samples (or its first size, if more), made in at most this many ns (slow samples,
#: a remote read's, gain nothing from fewer messages and would wait longer for their batch).
MESSAGE_SAMPLES = 256
MESSAGE_NS = 20_000_000

Message = tuple[int, int, Any, Any, Any, Any]


class MicroBatches(IterableDataset):
    """Runs in each worker: sends ``(worker_id, -1, flags, state, stage names, asks)`` first, then
    the dataset's stream cut into micro-batches ``(worker_id, count, payload,
    state, figures, positions)``, and ends with ``(worker_id, 0, None, state, figures, None)``, so the main
    process knows when a worker has no more data. ``positions`` are the micro-batch's
    samples' packed record positions as an int64 array's bytes (see :class:`PositionLog`), or None; ``asks`` the
    iteration's ask count (with ``ask``; else None), ``flags`` its slab ring's (or None). ``figures`` are the worker's
    timings so far (:class:`~shardkit.loader.timing.WorkerClock`; with ``trace``,
    each micro-batch's too). ``state`` is the dataset's
    state after the message (a string saying why if it cannot save one), or None
    for a micro-batch sent without one (see the module docstring: with ``asks``, when
    asked; else ``state_ratio`` and ``state_every`` default to :data:`STATE_RATIO` and :data:`STATE_EVERY`;
    column batches, each a large micro-batch, carry a state every time). ``states``, when set, are loaded into each worker's
    dataset before its next iteration, once. With ``slots``, collated
    micro-batches travel in a new :class:`~shardkit.loader.slabs.SlabRing` per
    iteration, whose flag array goes with the first message. With ``columns``
    each of the dataset's column batches is one micro-batch
    (:mod:`shardkit.loader.slab_columns`); without workers (columns only) it runs in the
    main process as worker 0."""

    def __init__(
        self,
        dataset: IterableDataset,
        size: int,
        *,
        collate: bool,
        resumable: bool,
        slots: int = 0,
        columns: bool = False,
        trace: bool = False,
        ask: bool = False,
        grow: bool = False,
    ) -> None:
        self.dataset = dataset
        self.ask = ask
        self.grow = grow
        self.trace = trace
        self.size = size
        self.collate = collate
        self.resumable = resumable
        self.slots = slots
        self.columns = columns
        self.states: list[State] | None = None
        self.restart = not columns and restartable(dataset)  # shardkit.loader.restart
        self.state_ratio = STATE_RATIO
        # A state with one micro-batch in this many (None: only when asked, with ask).
        self.state_every: int | None = 1 if columns else None if ask else STATE_EVERY

    def __iter__(self) -> Iterator[Message]:
        info = get_worker_info()
        assert info is not None or self.columns, "MicroBatches of samples runs only in DataLoader workers"
        states, self.states = self.states, None  # now: in the main process, the caller clears them next
        return self._messages(0 if info is None else info.id, states)

    def _messages(self, worker: int, states: list[State] | None) -> Iterator[Message]:
        if states is not None:
            self.dataset.load_state_dict(states[worker])  # type: ignore[attr-defined]
        clock = WorkerClock(self.dataset, self.trace)
        samples = iter(self.dataset)
        saver = StateSaver(self.dataset, self.resumable)
        log = PositionLog.of(self.dataset, samples) if self.resumable and not self.columns else None
        if log is not None:
            samples = log.logged(samples)
        ring = SlabRing(self.slots) if self.collate and self.slots else None
        # This iteration's ask count, the point asked for and whether it answers at points (shardkit.loader.restart),
        # sent with the first message (shardkit.loader.mixer raises the count).
        control = torch.zeros(3, dtype=torch.int64).share_memory_() if self.ask and self.resumable else None
        asks, answered = (None, 0) if control is None else (control.numpy(), 0)
        points = RestartPoints(self.dataset) if asks is not None and log is None and self.restart else None
        first = saver()
        if points is not None and asks is not None:
            asks[2] = 1
            points.keep(first)
        yield worker, START, None if ring is None else ring.flags, first, tuple(clock.names), control
        # Messages grow only where the state names undelivered samples by position or not at all (restart points):
        # samples it would carry as data (a wrapped plain iterable's) stay in micro-batches of the size asked.
        grow = self.grow and (not self.resumable or log is not None or points is not None)
        chunks = self._column_chunks(samples, ring, clock) if self.columns else self._chunks(samples, ring, clock, grow)
        since = 0  # micro-batches since the latest state
        for count, payload in chunks:
            since += 1
            state = None
            if points is not None:
                points.made += count
            if asks is not None and asks[0] != answered:  # state_dict() in the main process
                answered, since = int(asks[0]), 0
                if points is None:
                    state = clock.state(saver)
                else:  # the ratio below weighs a plain state, not an answer's samples made again
                    cost, state = clock.state_ns, clock.state(lambda: answer(points, asks, saver))
                    clock.state_ns = cost or clock.state_ns
            elif self._due(since, clock, asks is not None):
                since, state = 0, clock.state(saver)
            elif points is not None and clock.busy_since_state() >= POINT_RATIO * clock.state_ns:
                points.keep(clock.state(saver))  # a restart point, kept here
            yield worker, count, payload, state, clock.figures(), None if log is None else log.take(count)
        yield worker, 0, None, saver(), clock.figures(), None

    def _due(self, since: int, clock: WorkerClock, asked: bool) -> bool:
        """Whether a state goes with this micro-batch unasked: one in ``state_every``, and, without
        asks, once the work since the last is ``state_ratio`` times what it cost."""
        if self.state_every is not None and since >= self.state_every:
            return True
        return not asked and clock.busy_since_state() >= self.state_ratio * clock.state_ns

    def _chunks(
        self, samples: Iterator[Any], ring: SlabRing | None, clock: WorkerClock, grow: bool = False
    ) -> Iterator[tuple[int, Any]]:
        size, began = self.size, time.monotonic_ns()
        while chunk := clock.take(samples, size):
            if not self.collate:
                payload = chunk
            else:
                payload = default_collate(chunk) if ring is None else ring.collate(chunk)
            clock.collated(len(chunk))
            if grow and ring is not None and ring.used:
                size = message_size(self.size, len(chunk), ring.used, time.monotonic_ns() - began)
            yield len(chunk), payload
            began = time.monotonic_ns()

    @staticmethod
    def _column_chunks(batches: Iterator[Any], ring: SlabRing | None, clock: WorkerClock) -> Iterator[tuple[int, Any]]:
        while taken := clock.take(batches, 1):
            parts = slab_columns.as_parts(taken[0])
            count = slab_columns.columns_length(parts)
            if count:  # 0 would read as the end marker
                payload = parts if ring is None else ring.put(parts)
                clock.collated(count)
                yield count, payload


def message_size(size: int, count: int, nbytes: int, ns: int) -> int:
    """Samples in the next micro-batch, after ``count`` samples took ``nbytes`` in a slab and ``ns`` to make:
    ``size`` times the whole factor that brings them near :data:`MESSAGE_BYTES`, in at most
    :data:`MESSAGE_SAMPLES` samples and :data:`MESSAGE_NS` (never fewer than ``size``). A message costs about
    0.5 ms of CPU over both processes whatever it holds (the DataLoader's queues and their threads): 8 packed
    blocks of 2,048 int32 tokens (64 KB) a message took 2.5 CPU-s an epoch of 50M tokens over 2 workers, 64
    blocks 1.06 s, 128 0.93 s, 256 0.95 s. The bytes are not more because a worker that has sent its last
    message can no longer answer a save: the blocks it made and were not delivered are then carried in the
    state as data (a few messages: the prefetched ones and those the main process holds)."""
    count = max(count, 1)
    per_sample = max(nbytes // count, 1)
    wanted = -(-MESSAGE_BYTES // per_sample)
    in_time = MESSAGE_NS * count // max(ns, 1)  # samples made in MESSAGE_NS at this pace
    return size * max(1, min(-(-wanted // size), in_time // size, MESSAGE_SAMPLES // size))


def answer(points: RestartPoints, asks: np.ndarray, saver: StateSaver) -> AtPoint:
    """A worker's answer to an ask: its state at the point asked for, else its state now (kept as a restart point)."""
    exact = points.state_at(int(asks[1]))
    if exact is not None:
        return AtPoint(int(asks[1]), exact, None)
    after = saver()
    points.keep(after)
    return AtPoint(int(asks[1]), None, after)


def in_process(dataset: IterableDataset, size: int, *, collate: bool, resumable: bool) -> Iterator[Message]:
    """The messages of :class:`MicroBatches` made in this process, as worker 0 (its dataset
    already loaded): how a MixedLoader without workers delivers the tails of a restored state."""
    return MicroBatches(dataset, size, collate=collate, resumable=resumable)._messages(0, None)


class PositionLog:
    """The record positions of the samples a worker pulled, in order, for the micro-batches that take them.

    Kept only where the samples can be read again by position (the dataset's ``records()`` is
    not None and its root iterator has a ``position``); a sample whose position is None (a record
    without one) makes its micro-batch's positions None, and the main process saves its samples
    as data instead.

    A root iterator with a ``position_log`` attribute (``.shuffle()``'s, ``.map()``'s, ``.filter()``'s)
    appends each sample's position to the log itself as it returns the sample: no Python call per
    sample around it.
    Around any other, a generator reads ``position`` after each sample (about 70 ns a sample more).
    A micro-batch's positions travel as the bytes of an int64 array (:meth:`take`): pickling a
    numpy array to send it costs about 10 us a message more, bytes nothing; the main process
    views them with :func:`positions_of`.
    """

    def __init__(self) -> None:
        self._positions: list[int | None] = []

    @classmethod
    def of(cls, dataset: Any, samples: Iterator[Any]) -> PositionLog | None:
        records = getattr(dataset, "records", None)
        if not callable(records) or not hasattr(samples, "position") or records() is None:
            return None
        return cls()

    def logged(self, samples: Iterator[Any]) -> Iterator[Any]:
        """``samples``, each one's position noted as it is pulled: by the iterator itself where it
        has a ``position_log``, else by a generator around it."""
        if hasattr(samples, "position_log"):
            samples.position_log = self._positions  # type: ignore[attr-defined]  # checked just above
            return samples
        return self._noted(samples)

    def _noted(self, samples: Iterator[Any]) -> Iterator[Any]:
        """``samples``, noting each one's position as it is pulled (a generator: cheaper per sample than a class)."""
        note = self._positions.append
        for sample in samples:
            note(samples.position)  # type: ignore[attr-defined]  # checked in of()
            yield sample

    def take(self, count: int) -> bytes | None:
        """The positions of the next ``count`` samples pulled, as the bytes of an int64 array (None if any has none)."""
        taken = self._positions[:count]
        del self._positions[:count]
        try:  # struct packs Python ints fastest (array("q", ...) parses each item; numpy makes an array first)
            return struct.pack(f"<{len(taken)}q", *taken)
        except struct.error:  # a None among them: a sample without a position
            return None


def positions_of(taken: bytes | None) -> np.ndarray | None:
    """A micro-batch's positions as :meth:`PositionLog.take` sent them, as an int64 array (read-only)."""
    return None if taken is None else np.frombuffer(taken, dtype="<i8")


class StateSaver:
    """Calls ``dataset.state_dict()``; after a failure, returns its message instead of retrying."""

    def __init__(self, dataset: IterableDataset, resumable: bool = True) -> None:
        stateful = callable(getattr(dataset, "state_dict", None)) and callable(
            getattr(dataset, "load_state_dict", None)
        )
        self._dataset = dataset
        self._failure: str | None = None
        if not stateful:
            self._failure = f"{type(dataset).__name__} has no state_dict()/load_state_dict()"
        elif not resumable:
            self._failure = "it was built with resumable=False"

    def __call__(self) -> State | str:
        if self._failure is None:
            try:
                return self._dataset.state_dict()  # type: ignore[attr-defined]
            except StateError as error:
                self._failure = str(error)
        return self._failure


def dataset_state(dataset: IterableDataset) -> State:
    state = StateSaver(dataset)()
    if isinstance(state, str):
        raise StateError(f"MixedLoader cannot save its position: {state}")
    return state
