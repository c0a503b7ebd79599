"""One epoch of a :class:`~shardkit.MixedLoader`'s batches, assembled in the main process
from the micro-batches its workers send (:mod:`shardkit.loader.micro_batches`).

:class:`Mixer` keeps a queue of pending micro-batches per worker and cuts every
batch from the workers that still have data, in water-filled shares placed by
a hash of ``(seed, epoch, batch_index, worker)`` (the design is in the
:mod:`shardkit.loader.mixed` docstring). It also notices a worker that died
while its message was read, and names it.
"""

from __future__ import annotations

import pickle
import signal
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

from shardkit.errors import WorkerDiedError
from shardkit.loader import slab_columns
from shardkit.loader.collate import Part, join, tail
from shardkit.loader.loader_state import (
    IDENTITIES,
    PAYLOAD,
    POSITIONS,
    REPEAT,
    RUNS,
    Carried,
    HeldTail,
    LoaderSettings,
    deal_carry,
    loader_state,
    read_again,
    records_of,
)
from shardkit.loader.micro_batches import START, Message, positions_of
from shardkit.loader.restart import AtPoint
from shardkit.loader.slabs import SlabBatch, from_slab, view
from shardkit.loader.timing import now
from shardkit.stateful import Records, State, StateError, encode, encode_positions, encode_runs, held_identities


class MixerSettings(LoaderSettings, Protocol):
    """What a Mixer reads of its MixedLoader, beyond what its state records."""

    seed: int
    drop_last: bool
    _loader: Any
    _pin: bool


@dataclass(slots=True)
class _Pending:
    """A micro-batch in a queue of the main process, of which ``start:count`` is left."""

    payload: Any  # collated, or a list of samples (with a collate_fn)
    count: int
    state: Any  # the worker's dataset state after this micro-batch; None: sent without one
    start: int = 0
    carried: bool = False  # a restored tail: saved again even when nothing of it was taken
    repeat: bool = False  # a restored tail of "pad" repeats: owed to no later gather
    slot: int | None = None  # the slab slot it lies in, freed once the batch holds copies of it
    positions: np.ndarray | None = None  # its samples' record positions; None: it is saved as data


class Mixer(Iterator[Any]):
    """One epoch of assembly. All state lives here (pending micro-batches per
    worker, which workers are done, the batch index, each worker's dataset
    state past what was delivered) so that it can be saved and restored.

    A restored state's undelivered tails go first: into their worker's queue
    when the worker count is the same, else into extra queues of their own
    (one per tail, already done) that the water-filling drains like workers.
    Of a global state (all ranks'), this rank takes its part of the tails
    (:func:`~shardkit.loader.loader_state.deal_carry`).
    """

    def __init__(
        self,
        loader: MixerSettings,
        source: Iterator[Message],
        resume: State | None = None,
        tails: Sequence[Any] = (),
    ) -> None:
        self.epoch, self.num_workers, self.batch_size = loader.epoch, loader.num_workers, loader.batch_size
        self._source: Iterator[Message] | None = source
        self._dataloader = loader._loader
        self._dataset = loader.dataset  # named when a worker dies, read again by position
        self._records: Records | None | bool = False  # the dataset's records, once asked for (False: not yet)
        self._collate_fn = loader.collate_fn
        self._columns = loader._columns
        self._drop_last = loader.drop_last
        self._pin = loader._pin
        self._epoch_key = _mix64(_mix64(loader.seed) ^ loader.epoch)
        self._workers = workers = max(loader.num_workers, 1)  # without workers, columns come from worker 0
        # Per queue: its micro-batches and the samples left in them. Queues past
        # the workers' hold restored tails.
        self._pending: list[deque[_Pending]] = [deque() for _ in range(workers)]
        self._available = [0] * workers
        self._done = [False] * workers
        # Per worker: its slab ring's busy flags and buffers by slot; slots to free
        # once the batch being made is copied out of them.
        self._flags: list[Any] = [None] * workers
        self._slabs: list[dict[int, torch.Tensor]] = [{} for _ in range(workers)]
        self._release: list[tuple[int, int]] = []
        # Per worker: the ask count of its iteration (micro_batches), raised to have it send its state; None: none.
        self._asks: list[Any] = [None] * workers
        # Per worker: its dataset state past the entries that left its queue (None until
        # its first message; _UNKNOWN after an entry sent without a state), and after its last message.
        self._base: list[Any] = [None] * workers
        self._final: list[Any] = [None] * workers
        # Per worker: whether it answers an ask with its state at a point (shardkit.loader.restart), the samples
        # of its own stream delivered (the point), and its latest answer.
        self._points = [False] * workers
        self._delivered = [0] * workers
        self._answers: list[AtPoint | None] = [None] * workers
        # Stall accounting (shardkit.loader.stalls): each worker's stage names and latest
        # figures, traced micro-batches, and the time spent receiving messages.
        self.names: list[Any] = [None] * workers
        self.figures: list[Any] = [None] * workers
        self.events: dict[int, list[Any]] = {}
        self.receive_ns = 0
        self.batch_index = 0
        self._finished = False
        self._unconfirmed = False  # a restored finished state, not yet read to its end
        if resume is not None:
            # The loader is not kept: a loader -> mixer -> loader cycle.
            self._restore(resume, deal_carry(resume, tails, loader), loader)

    def _restore(self, state: State, carried: Sequence[Carried], loader: LoaderSettings) -> None:
        """Resume the position of ``state``, whose carried samples (this rank's) ``carried`` holds decoded;
        those held by position are read again through ``loader``'s dataset."""
        self.batch_index = state["batch_index"]
        # A finished state's workers resume past their last sample: they are read
        # to their end markers to prove it (_confirm_finished) rather than trusted.
        self._unconfirmed = state["finished"]
        same = state["num_workers"] == self.num_workers
        for saved, samples in carried:
            positions = None
            if isinstance(samples, HeldTail):  # read again now, in this process
                positions, samples = samples.positions, read_again(samples, loader)
            worker = saved["worker"] if same and saved["worker"] is not None else None
            if worker is None:
                worker = len(self._pending)
                self._pending.append(deque())
                self._available.append(0)
                self._done.append(True)
            dataset_state = state["workers"][worker] if worker < self._workers else None
            entry = _Pending(samples, saved["count"], dataset_state, carried=True, repeat=saved.get(REPEAT, False))
            entry.positions = positions
            self._pending[worker].appendleft(entry)
            self._available[worker] += saved["count"]

    def _confirm_finished(self) -> None:
        """Read a restored finished state's workers to their end; any sample is a :class:`StateError`."""
        self._unconfirmed = False
        while self._source is not None and not all(self._done[: self._workers]):
            self._pull()
            holding = [worker for worker, left in enumerate(self._available) if left]
            if holding:
                self._stop_workers()
                raise StateError(
                    f"MixedLoader.load_state_dict(): state['finished'] is true, but worker {holding[0]} still "
                    "holds samples: its dataset state resumes before the end of the epoch. The state was edited "
                    "or is corrupt; load a state saved by state_dict()"
                )
        self._finish()

    def state_dict(self) -> State:
        """The loader's state: see :meth:`MixedLoader.state_dict`.

        A worker sends its dataset's state with some micro-batches only
        (:mod:`shardkit.loader.micro_batches`), so each worker's saved state is
        the first one known at or after what the batches delivered, and the
        undelivered samples before it, which this process holds, travel in the
        saved state as the worker's tail (messages are received until that
        state has arrived).
        """
        if self._unconfirmed:
            self._confirm_finished()
        while self._source is not None and any(base is None for base in self._base):
            self._pull()  # every worker's starting state, for those that delivered nothing yet
        self._ask()
        workers: list[Any] = []
        carry: list[dict[str, Any]] = []
        for worker, queue in enumerate(self._pending):
            if worker >= self._workers:  # a restored tail of another worker count: carried on if untouched
                if queue and (queue[0].start > 0 or queue[0].carried):
                    carry.append(self._carried([queue[0]], None))
                continue
            state, entries = self._position(worker)
            if entries:
                carry.append(self._carried(entries, worker))
            if not isinstance(state, dict):
                reason = state if isinstance(state, str) else "a worker sent no state"
                raise StateError(f"MixedLoader cannot save its position: {reason}")
            workers.append(state)
        return loader_state(self, batch_index=self.batch_index, finished=self._finished, workers=workers, carry=carry)

    def _ask(self) -> None:
        """Have every worker whose state past the delivered samples is not here yet send it with its next
        micro-batch (:mod:`shardkit.loader.micro_batches`); :meth:`_position` then receives up to it.
        A worker that answers at points is asked for its state at the delivered point instead
        (:mod:`shardkit.loader.restart`), whatever states its queued micro-batches came with."""
        if self._source is None:
            return
        for worker in range(self._workers):
            queue, base, asks = self._pending[worker], self._base[worker], self._asks[worker]
            if asks is None or self._done[worker]:
                continue
            if base is not _UNKNOWN and (not queue or (queue[0].start == 0 and not queue[0].carried)):
                continue
            if self._restartable(worker):
                if self._answer(worker) is not None:
                    continue
                asks[1] = self._delivered[worker]  # written before the count, which the worker reads first
            elif any(entry.state is not None for entry in queue):
                continue
            asks[0] += 1

    def _restartable(self, worker: int) -> bool:
        """Whether the worker answers at points and its queue holds none of a restored state's tail."""
        return self._points[worker] and not any(entry.carried for entry in self._pending[worker])

    def _answer(self, worker: int) -> AtPoint | None:
        """The worker's answer for the point delivered now, if it has come."""
        answer = self._answers[worker]
        return answer if answer is not None and answer.point == self._delivered[worker] else None

    def _position(self, worker: int) -> tuple[Any, list[_Pending]]:
        """A worker's dataset state to save, and the queued micro-batches (the first maybe cut
        part-way) whose undelivered samples come before it."""
        while True:
            queue = self._pending[worker]
            if not queue and self._done[worker]:
                return self._final[worker], []
            base = self._base[worker]
            if base is not _UNKNOWN and (not queue or (queue[0].start == 0 and not queue[0].carried)):
                return base, []  # the queued micro-batches are read again from ``base``
            answer = self._answer(worker) if self._restartable(worker) else None
            if answer is not None and answer.state is not None:
                return answer.state, []  # the worker's state at the delivered point: nothing carried
            waiting = answer is None and self._restartable(worker) and not self._done[worker]
            for index, entry in enumerate([] if waiting else queue):
                if entry.state is not None:
                    return entry.state, list(islice(queue, index + 1))
            if self._done[worker] and not waiting:
                return self._final[worker], list(queue)
            if self._source is None:
                raise StateError(
                    f"MixedLoader cannot save its position: worker {worker} stopped before it sent the state "
                    "past the samples delivered (the epoch was ended by an error); load the last saved state"
                )
            self._pull()

    def _carried(self, entries: list[_Pending], worker: int | None) -> dict[str, Any]:
        """The saved form of the undelivered rest of queued micro-batches, as one tail: their
        samples' positions where every one has a position and the dataset reads records
        again, else the samples, encoded."""
        count = sum(entry.count - entry.start for entry in entries)
        saved: dict[str, Any] = {"worker": worker, "count": count}
        if entries[0].repeat:  # only restored tails of worker None are repeats
            saved[REPEAT] = True
        records = self._held_records() if all(entry.positions is not None for entry in entries) else None
        if records is not None:
            held = np.concatenate([entry.positions[entry.start : entry.count] for entry in entries])  # type: ignore[index]
            runs = encode_runs(held)
            saved.update({RUNS: runs} if runs is not None else {POSITIONS: encode_positions(held)})
            saved[IDENTITIES] = held_identities(records, held)
        else:
            saved[PAYLOAD] = encode(self._rest(entries))
        return saved

    def _held_records(self) -> Records | None:
        """The dataset's records (``Pipeline.records()``), made once per epoch; None: it cannot read them again."""
        if self._records is False:
            self._records = None if self._columns else records_of(self._dataset)
        return self._records  # type: ignore[return-value]  # not False now

    def _rest(self, entries: list[_Pending]) -> Any:
        """The undelivered samples of queued micro-batches as one payload, in the form the mixer cuts from."""
        parts = [(entry.payload, entry.start, entry.count) for entry in entries]
        if self._columns:
            return slab_columns.plain(
                slab_columns.tail(*parts[0])
                if len(parts) == 1
                else slab_columns.as_parts(slab_columns.join_columns(parts))
            )
        if self._collate_fn is not None:
            return [sample for payload, start, stop in parts for sample in payload[start:stop]]
        return tail(*parts[0], collated=True) if len(parts) == 1 else join(parts, copy=True)

    def __next__(self) -> Any:
        if self._unconfirmed:
            self._confirm_finished()
        if self._finished:
            raise StopIteration
        shares = self._allocate()
        size = sum(shares.values())
        if size == 0 or (self._drop_last and size < self.batch_size):
            self._finish()
            raise StopIteration
        parts = [part for worker, share in shares.items() for part in self._take(worker, share)]
        if self._columns:
            batch = slab_columns.join_columns(parts)  # copies: the slabs are released below
        elif self._collate_fn is None:
            batch = join(parts, copy=any(flags is not None for flags in self._flags))
        else:
            batch = self._collate_fn([s for payload, a, b in parts for s in payload[a:b]])
        for worker, slot in self._release:  # the batch holds copies now
            self._flags[worker][slot] = 0
        self._release.clear()
        self.batch_index += 1
        return _pin_memory(batch) if self._pin else batch

    def _finish(self) -> None:
        self._finished = True
        self._source = None  # lets the DataLoader shut its workers down
        for queue in self._pending:  # a dropped last batch
            queue.clear()
        self._slabs = [{} for _ in self._slabs]  # unmaps the workers' rings now, not with the loader
        self._flags = [None] * len(self._flags)
        self._asks = [None] * len(self._asks)

    def _stop_workers(self) -> None:
        """Shut the workers down now: one of them raised.

        The error's traceback holds the DataLoader iterator. Left to the cycle
        collector (a caught error kept in a variable, a test's ``raises``), the
        iterator's queues are finalized before the iterator itself, so its
        workers never receive their exit message and DataLoader waits 5 s per
        worker before terminating them. Persistent workers are started anew
        next epoch.
        """
        shutdown = getattr(self._source, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        if getattr(self._dataloader, "_iterator", None) is self._source:
            self._dataloader._iterator = None
        self._finish()  # drops the source too

    def _died_worker(self, error: BaseException) -> WorkerDiedError | None:
        """The error naming the worker that died, if ``error`` comes from a worker's death.

        A worker killed while its message is read shows as whatever the read met: a
        stream or connection cut short (``EOFError``, ``ConnectionError``, a truncated
        pickle), or DataLoader's ``RuntimeError`` naming a pid. The dead process may not
        be reaped yet, so it is waited for a moment.
        """
        if not _may_be_a_death(error):
            return None
        processes = list(getattr(self._source, "_workers", None) or ())
        deadline = time.monotonic() + _DEATH_WAIT
        while True:
            dead = [(worker, process) for worker, process in enumerate(processes) if not process.is_alive()]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        if not dead:
            return None
        worker, process = dead[0]
        return WorkerDiedError(
            f"MixedLoader: DataLoader worker {worker} (pid {process.pid}) died, {_ending(process.exitcode)}, "
            f"while reading {self._dataset!r} (the main process was receiving its micro-batches and met "
            f"{type(error).__name__}: {error}). What it had not delivered is lost from this iteration; "
            "load the last state_dict() to resume. A worker killed by SIGKILL was often killed for memory"
        )

    def _allocate(self) -> dict[int, int]:
        """Shares of the next batch per worker, in placement order, pulling
        messages until every worker's share is known to be available.

        A worker that may still send data counts as unlimited, so shares only
        change when a worker is known to run dry. Workers are ordered by a
        per-worker key, which leaves the relative order of the others alone
        whether or not a finished worker's end marker has arrived yet: the
        result depends on what each worker yields, not on arrival order.
        """
        while True:
            key = _mix64(self._epoch_key ^ self.batch_index)
            active = [w for w, left in enumerate(self._available) if left or not self._done[w]]
            active.sort(key=lambda w: _mix64(key ^ w))
            caps = {w: self._available[w] if self._done[w] else None for w in active}
            shares = _water_fill(self.batch_size, active, caps)
            if all(shares[w] <= self._available[w] for w in active):
                return shares
            self._pull()

    def _pull(self) -> None:
        """Receive one message from the workers."""
        assert self._source is not None, "a finished epoch pulls no messages"
        start = now()
        try:
            worker, count, payload, state, timing, positions = next(self._source)
        except StopIteration:
            # Every worker ends with an end marker; this only guards against a hang.
            self._done = [True] * len(self._done)
            self._source = None
            return
        except BaseException as error:
            died = self._died_worker(error)
            self._stop_workers()
            if died is not None:
                raise died from error
            raise
        self.receive_ns += now() - start
        if count == START:
            self.names[worker] = timing
            self._base[worker] = state
            if payload is not None:  # the busy flags of the worker's slab ring
                self._flags[worker] = payload.numpy()
            # Its ask count, the point asked for, and whether it answers at points.
            self._asks[worker] = None if positions is None else positions.numpy()
            self._points[worker] = positions is not None and len(positions) > 2 and bool(positions[2])
            return
        self._timed(worker, timing)
        if count == 0:
            self._done[worker] = True
            self._final[worker] = state
        else:
            self._queue(worker, count, payload, state, positions_of(positions))

    def _timed(self, worker: int, figures: tuple[Any, ...]) -> None:
        """Keep a worker's latest figures; traced micro-batches come as a list at their end."""
        if figures and type(figures[-1]) is list:
            self.events.setdefault(worker, []).extend(figures[-1])
            figures = figures[:-1]
        self.figures[worker] = figures

    def _queue(self, worker: int, count: int, payload: Any, state: Any, positions: Any = None) -> None:
        """Queue a micro-batch; one in a slab becomes views of the slab, mapped once per slot."""
        slot = None
        if isinstance(payload, SlabBatch):
            slot = payload.slot
            if payload.slab is not None:
                self._slabs[worker][slot] = payload.slab
            slab = self._slabs[worker][slot]
            if self._columns:
                payload = slab_columns.from_slab(payload.skeleton, lambda place: view(slab, place))
            else:
                payload = from_slab(payload.skeleton, slab)
        if isinstance(state, AtPoint):  # an answer to an ask (shardkit.loader.restart)
            self._answers[worker], state = state, state.after
        self._pending[worker].append(_Pending(payload, count, state, slot=slot, positions=positions))
        self._available[worker] += count

    def _take(self, worker: int, share: int) -> list[Part]:
        """Remove ``share`` samples from a worker's queue as (payload, start, stop) slices."""
        parts: list[Part] = []
        queue = self._pending[worker]
        self._available[worker] -= share
        while share:
            entry = queue[0]
            stop = min(entry.count, entry.start + share)
            parts.append((entry.payload, entry.start, stop))
            share -= stop - entry.start
            if not entry.carried and worker < self._workers:
                self._delivered[worker] += stop - entry.start
            entry.start = stop
            if stop == entry.count:
                queue.popleft()
                if worker < self._workers:
                    self._base[worker] = _UNKNOWN if entry.state is None else entry.state
                if entry.slot is not None:
                    self._release.append((worker, entry.slot))
        return parts


#: A worker's dataset state past the delivered micro-batches when the last of them came without one.
_UNKNOWN = "unknown: the delivered micro-batch came without a state"

#: Seconds to wait for a worker that broke off a message to be seen dead.
_DEATH_WAIT = 2.0


def _may_be_a_death(error: BaseException) -> bool:
    """Whether ``error``, met receiving a message, may come from its worker's death; not an
    error a worker raised (DataLoader raises it again with "Caught ... in DataLoader worker process")."""
    text = str(error)
    if "in DataLoader worker process" in text:
        return False
    if isinstance(error, (EOFError, OSError, pickle.UnpicklingError)):
        return True
    return isinstance(error, RuntimeError) and "DataLoader worker (pid" in text


def _ending(exitcode: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal)."""
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _water_fill(total: int, order: list[int], caps: dict[int, int | None]) -> dict[int, int]:
    """Split ``total`` over ``order`` as evenly as possible without exceeding a
    worker's cap (``None``: unlimited); the first workers in ``order`` get the
    larger shares. Returns shares keyed in ``order``."""
    shares = dict.fromkeys(order, 0)
    open_workers = list(order)
    remaining = total
    while open_workers:
        low, extra = divmod(remaining, len(open_workers))
        capped = [w for w in open_workers if (cap := caps[w]) is not None and cap <= low]
        if not capped:
            for rank, w in enumerate(open_workers):
                shares[w] = low + (rank < extra)
            break
        for w in capped:
            shares[w] = caps[w]  # type: ignore[assignment]
            remaining -= shares[w]
        open_workers = [w for w in open_workers if w not in capped]
    return shares


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """SplitMix64 finaliser: a fast, well-spread 64-bit hash of an integer."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)
