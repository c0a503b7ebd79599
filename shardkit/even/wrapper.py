"""even_batches: every rank of a process group yields the same number of batches.

DDP hangs at the end of an epoch when one rank has more batches than another:
its next gradient all-reduce waits for ranks that have already left the loop.
``balance="pad"``/``"drop"`` equalises counts planned up front; counts that
change while reading (a rank-dependent ``.filter``, records skipped as
corrupt, unknown counts with ``balance="none"``, packing, any iterable of
uneven length) still differ. :func:`even_batches` wraps any iterable of
batches and makes the ranks agree, as they go, whether each has a next one.

How the ranks agree:

* Each rank fetches batches *ahead* of the ones it yields, then posts a small
  ``all_reduce`` (MIN over ``[have, -have, -empty, -failed]``, where
  ``empty``/``failed`` are the rank's index plus one or 0) on a gloo side
  group made once per set of ranks (the default group may be NCCL; a side
  group also keeps the agreement from queueing behind gradient traffic). The
  all-reduce runs asynchronously and is waited for only when its batches are
  due, so it overlaps the training step on the batch before.
* Batches go in *windows*: the ranks agree on a whole window of up to
  ``every`` batches at once. The first window has one batch (the first batch
  waits for one round trip, its own fetch and the next window's), later ones
  double up to ``every``; under ``every="auto"`` they are 2, 16, then
  measured (:mod:`shardkit.even.auto`). A rank holds at most the rest of its window plus
  the next window's batches. ``every="auto"`` sizes each window from the side
  group's round trip and the first steps' time, so that the epoch's
  agreements cost at most 0.5% of its steps, the same on every rank
  (:mod:`shardkit.even.auto`).
* ``at_end="stop"``: a window yields ``min(have)`` batches; when a rank ran
  short, every rank stops after it. Batches left on the longer ranks are
  dropped: counted exactly when the loader has ``len()``, else those fetched
  and not yielded (a lower bound).
  ``at_end="pad"``: a window yields ``max(have)``; a rank that ran out
  repeats the first batch it yielded this epoch, as
  ``DistributedSampler(drop_last=False)`` repeats samples from the start. It
  is the same object again: a training step must not change batches in place.
  A rank that has no batch at all cannot repeat one: every rank raises
  :class:`EvenBatchesError` at the same step instead of hanging.
* An exception from the wrapped loader on one rank is announced in the next
  agreement: that rank re-raises it and the others raise
  :class:`EvenBatchesError` at the same step, so no rank waits forever. That
  holds for ``iter(loader)`` and for loading its state too: they run after
  the side group is known, and their error goes in the epoch's first agreement.
* The side group has the job's timeout (the default group's, from
  ``init_process_group(timeout=...)``), not gloo's default of 30 minutes. A
  rank that stops iterating (alive) or dies leaves the others' wait for the
  agreement to end within that timeout (a death: at once); every rank whose
  wait fails raises :class:`EvenBatchesError` naming the rank(s) that did not
  reach the agreement, found through the job's store (see :mod:`shardkit.even.group`).
* Agreements are posted at the same steps on every rank whatever the data,
  so ranks that leave an epoch early (``break``) at the same step stay
  matched for the next one.

Resuming: ``state_dict()`` saves the wrapped loader's state, which already
counts the batches fetched ahead, together with those batches themselves
(as plain data, :func:`shardkit.state.encode`; every field is checked when a
state is loaded), the window position and the counts; a loaded state yields
the saved batches first, so a resumed epoch yields what
the uninterrupted one would have and ends at the same step on every rank,
provided every rank saved at the same step (as a checkpoint does).

The batches fetched ahead differ from rank to rank, and trainers write the
state of rank 0 only: under a process group, ``state_dict()`` therefore
holds every rank's state (a ``"ranks"`` node, :mod:`shardkit.ranks`, with
each rank's own state of the wrapped loader inside), and each rank resumes
from its own entry. On another world size the held batches cannot be dealt
out again, so such a state loads only where no rank held any (saved at an
epoch's start or end); the wrapped loaders' states are then merged.

With no process group, or a group of one rank, ``iter()`` returns the wrapped
loader's own iterator: no agreement, no cost.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from shardkit.errors import EvenBatchesError, check_int
from shardkit.even.auto import MEASURED, batch_bytes, first_window, next_window, proposal
from shardkit.even.group import _distributed, _Side, _side_group
from shardkit.even.saved import checked, inner_state, load_inner, merged, state_of
from shardkit.ranks import gather as gather_ranks
from shardkit.ranks import is_ranks, own_or_global
from shardkit.stateful import State, applies, encode

__all__ = ["EvenBatches", "EvenBatchesError", "EvenStats", "even_batches"]

AtEnd = Literal["stop", "pad"]
AT_END = ("stop", "pad")
Every = int | Literal["auto"]

#: Padded or dropped batches per epoch above which a warning names them.
WARN_ABOVE = 3


@dataclass(frozen=True)
class EvenStats:
    """What one epoch of :class:`EvenBatches` did on this rank.

    ``batches`` were yielded (the same number on every rank; None when no
    agreement ran: no process group or one rank), ``padded`` of them were
    repeats, and ``dropped`` batches of the wrapped loader were left unread
    or unyielded at a ``"stop"``. ``dropped_exact`` is False when the loader
    has no ``len()`` and ``dropped`` counts only the batches fetched ahead.
    ``window`` is the most batches one agreement covers: ``every``, or under
    ``every="auto"`` the largest window the ranks agreed on from measured
    steps (None until they measured one).
    """

    epoch: int
    batches: int | None
    padded: int = 0
    dropped: int = 0
    dropped_exact: bool = True
    window: int | None = None


def even_batches(
    loader: Iterable[Any], *, at_end: AtEnd = "stop", group: Any = None, every: Every = 1, gather_states: bool = True
) -> EvenBatches:
    """Wrap ``loader`` so that every rank of ``group`` yields the same number of batches.

    Args:
        loader: any iterable of batches: a DataLoader, a
            :class:`~shardkit.MixedLoader`, torchdata's StatefulDataLoader, a
            generator. Each ``iter()`` is one epoch.
        at_end: ``"stop"``: every rank stops when the first runs out (the
            rest are dropped and counted). ``"pad"``: every rank goes on
            until the last runs out; ranks that ran out repeat the first
            batch they yielded this epoch (counted).
        group: the ranks that must agree (a ``torch.distributed`` process
            group); default: the whole world. Its ranks must all iterate
            their wrapped loaders in step. With a process group initialised,
            building the wrapper makes the gloo side group (once per set of
            ranks), so every rank of ``group`` builds one.
        every: agree once per this many batches. 1 costs one small
            all-reduce per batch, overlapped with the training step, and
            holds one batch ahead; larger values divide that cost and hold
            up to ``2 * every - 1`` batches ahead (benchmarks/even_batches.py
            measures both). ``"auto"``: windows (powers of two, 2, 16,
            then up to 256) sized so that the epoch's agreements, the first
            one's round trip included, cost at most 0.5% of its steps'
            time, from the side group's round trip and the median of each
            epoch's first steps, the same on every rank (see
            :mod:`shardkit.even.auto`; the largest window is in
            :meth:`EvenBatches.stats`). It holds up to 511 batches ahead, at most
            256 MiB of them once a window is measured (:func:`shardkit.even.auto.held_limit`).
        gather_states: under a process group of more than one rank (and
            ``group`` the whole world), ``state_dict()`` returns every rank's
            state, so the copy a trainer writes from rank 0 resumes every
            rank; it must then be called on every rank, as trainers do.
            False returns this rank's alone (as it is with a ``group`` of
            some ranks only).

    See the module docstring for the protocol, :meth:`EvenBatches.stats` for
    the counts, and :meth:`EvenBatches.state_dict` for resuming.
    """
    return EvenBatches(loader, at_end=at_end, group=group, every=every, gather_states=gather_states)


class EvenBatches:
    """The wrapper :func:`even_batches` returns; iterate it like the loader."""

    def __init__(
        self,
        loader: Iterable[Any],
        *,
        at_end: AtEnd = "stop",
        group: Any = None,
        every: Every = 1,
        gather_states: bool = True,
    ) -> None:
        if not isinstance(gather_states, bool):
            raise EvenBatchesError(f"gather_states must be a bool (True or False), got {gather_states!r}")
        if at_end not in AT_END:
            raise EvenBatchesError(f"at_end must be one of {AT_END}, got {at_end!r}")
        if not (isinstance(every, str) and every == "auto"):
            check_int("every", every, minimum=1, error=EvenBatchesError, hint='or every="auto"')
        if not isinstance(loader, Iterable):
            raise EvenBatchesError(f"even_batches wraps an iterable of batches, got {type(loader).__name__}")
        self.loader = loader
        self.at_end: AtEnd = at_end
        self.group = group
        self.every: Every = every
        self.gather_states = gather_states
        self.epoch = 0
        self._iterator: _Agreed | None = None
        self._resume: State | None = None  # as loaded, for state_dict() before iterating
        self._loaded: State | None = None  # checked, its batches decoded
        self._stats = EvenStats(epoch=0, batches=None)
        if _distributed():
            _side_group(group)  # made now, so that the first epoch's first batch waits one round trip only

    def __len__(self) -> int:
        """``len(loader)`` on this rank. Under ``"stop"`` an epoch may be
        shorter (another rank ran out first), under ``"pad"`` longer."""
        return len(self.loader)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch and pass it on: to ``loader.set_epoch`` if the loader
        has one, else to its ``dataset`` and ``sampler`` where they have one."""
        check_int("epoch", epoch, minimum=0, error=EvenBatchesError)
        self._epoch_set = True
        self._forward(epoch)

    def _forward(self, epoch: int) -> None:
        self.epoch = self._forwarded = epoch
        targets = (
            [self.loader]
            if callable(getattr(self.loader, "set_epoch", None))
            else [
                getattr(self.loader, "dataset", None),
                getattr(self.loader, "sampler", None),
            ]
        )
        for target in targets:
            set_target_epoch = getattr(target, "set_epoch", None)
            if callable(set_target_epoch):
                set_target_epoch(epoch)

    def stats(self) -> EvenStats:
        """Counts of the current epoch, or of the last one once it ended."""
        iterator = self._iterator
        return self._stats if iterator is None else iterator.stats()

    # Until set_epoch, iteration k is epoch k, as shardkit loaders count their
    # own (shardkit.epoch); once an epoch was passed on (loading a state), the
    # counted ones are passed on too, so the wrapped loader does not stay on it.
    _epoch_set = False
    _passes = 0
    _forwarded: int | None = None

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume, self._loaded = self._loaded, None, None
        if not self._epoch_set:
            self.epoch, self._passes = self._passes, self._passes + 1
            if self._forwarded is not None and self._forwarded != self.epoch:
                self._forward(self.epoch)
        if resume is not None and not applies(resume, self.epoch, self):
            resume = None
        self._iterator = None
        side = _side_group(self.group)
        if side is None:  # nothing to agree with
            if resume is not None:
                load_inner(self.loader, resume["inner"])
            self._stats = EvenStats(epoch=self.epoch, batches=None)
            held = [] if resume is None else [*resume["window"], *resume["next"]]
            return iter(self.loader) if not held else _chain(held, self.loader)
        self._iterator = _Agreed(self, side, resume)
        return self._iterator

    def state_dict(self, gather: bool | None = None) -> State:
        """Where this epoch stands, including batches fetched ahead.

        Call it between batches, on every rank at the same step. The state
        holds the wrapped loader's ``state_dict()`` and, as plain data
        (:func:`shardkit.state.encode`: tensors, arrays, str, bytes, numbers
        and lists, tuples and dicts of them), the batches fetched ahead but
        not yet yielded (fewer than ``2 * every``) and, under ``"pad"``, the
        batch kept for repeats: a state a few batches large.

        Under a process group of more than one rank it holds every rank's
        state (see the module docstring), unless ``gather`` (default:
        ``gather_states``, and False with a ``group`` of some ranks) is False.

        Raises:
            StateError: the wrapped loader has no ``state_dict()``, a batch
                holds a type a state cannot hold (named), or another rank did
                not call ``state_dict()`` within the job's timeout.
        """
        if gather is None:
            gather = self.gather_states and self.group is None  # a subgroup's ranks alone cannot gather the world's
        if gather:
            return gather_ranks(self._rank_state, "even_batches.state_dict()")
        return self._rank_state()

    def _rank_state(self) -> State:
        """This rank's state, with the wrapped loader's own (not every rank's) inside."""
        if self._iterator is None and self._resume is not None:
            return self._resume
        inner = inner_state(self.loader)
        if self._iterator is None:
            return state_of(self, inner=inner)
        return self._iterator.state_dict(inner)

    def load_state_dict(self, state: State) -> None:
        """Resume from ``state`` (from :meth:`state_dict`) at the next ``iter()``.

        Sets the epoch to the state's (and passes it on, see :meth:`set_epoch`).
        The wrapped loader's part is loaded when iteration starts. A state of
        every rank resumes each rank from its own entry on the same world
        size; on another one, see the module docstring.

        Raises:
            StateError: a state of another kind or version, of other
                settings, or with a field missing, mistyped or out of range
                (named); on another world size, a state in which a rank
                held batches.
        """
        if is_ranks(state):
            state = own_or_global(state, f"{self!r}.load_state_dict()", lambda entries: merged(entries, self))
        loaded = checked(state, self)
        if self._epoch_set:
            self.set_epoch(state["epoch"])
        else:
            self._passes = state["epoch"]
            self._forward(state["epoch"])
        self._resume, self._loaded = state, loaded

    def _finished(self, stats: EvenStats) -> None:
        """Called by the epoch's iterator when it ends: keep the counts, warn if large."""
        self._stats = stats
        if stats.padded > WARN_ABOVE or stats.dropped > WARN_ABOVE:
            what = f"repeated {stats.padded}" if self.at_end == "pad" else f"dropped {stats.dropped}"
            bound = "" if stats.dropped_exact else " at least"
            warnings.warn(
                f"even_batches: epoch {stats.epoch}: this rank{bound} {what} of its batches so that every rank "
                f"yields {stats.batches}; ranks read very different amounts (a rank-dependent filter, skipped "
                "records, balance='none'?). Balance the data (balance='pad' or 'drop'), or accept the loss",
                stacklevel=3,
            )

    def __repr__(self) -> str:
        return f"even_batches({type(self.loader).__name__}, at_end={self.at_end!r}, every={self.every!r})"


class _Agreed(Iterator[Any]):
    """One epoch of agreed batches; all its state lives here so it can be saved."""

    def __init__(self, owner: EvenBatches, side: _Side, resume: State | None) -> None:
        self._owner = owner
        self._side = side
        self._pad_mode = owner.at_end == "pad"
        self._auto_mode = not isinstance(owner.every, int)  # "auto"
        self._every: int = owner.every if isinstance(owner.every, int) else 0  # 0: "auto"
        self._chosen = 0  # under "auto": the largest window the ranks agreed on from measured steps (0: none yet)
        self._agreements = 0  # posted this epoch
        self._probing = self._auto_mode  # measuring the steps' time for the proposals
        self._gaps: list[float] = []  # seconds between handing a batch over and being asked for the next
        self._nbytes: int | None = None  # a batch's bytes under "auto" (shardkit.even.auto.held_limit)
        self._handed = 0.0  # when the last batch was handed over (while probing)
        self.epoch = owner.epoch
        self._inner: Iterator[Any] | None = None
        self._window: deque[Any] = deque()  # agreed, fetched, not yielded yet
        self._next: list[Any] = []  # fetched for the next window, agreement maybe in flight
        self._quota = 0  # batches the current window still yields
        self._target = first_window(owner.every)  # size of the next window
        self._pad: tuple[Any] | None = None  # (batch,) to repeat
        self._exhausted = False
        self._error: BaseException | None = None
        self._work: Any = None
        # One agreement is in flight at a time, so one buffer serves them all (and
        # writing it through numpy costs less than building a tensor per window).
        self._flags = torch.zeros(5, dtype=torch.int64)
        self._flag_values = self._flags.numpy()
        self._last = False  # the current window is the epoch's last
        self.done = False
        self.batches = self.padded = self.from_inner = 0
        self._dropped_ahead = 0  # fetched for a window that stopped short of them
        if resume is not None:
            self._restore(resume)
        self._start(resume)
        if not (self.done or self._last) and self._quota == 0:
            self._complete()  # the first window (one batch): one fetch and one round trip, overlapping nothing

    def _start(self, resume: State | None) -> None:
        """Resume the wrapped loader and start its epoch. An error here is
        announced in the first agreement like one from a batch: raised before
        it, the other ranks would wait for this rank's first agreement until
        the job's timeout."""
        try:
            if resume is not None:
                load_inner(self._owner.loader, resume["inner"])
            if not (self.done or self._exhausted):
                self._inner = iter(self._owner.loader)
        except Exception as error:  # noqa: BLE001 - re-raised at the agreement, on every rank at once
            self._error = error
            self._inner = None

    def _restore(self, state: State) -> None:
        """Take up a checked state (see :func:`_checked`), its batches decoded."""
        self._window = deque(state["window"])
        self._next = list(state["next"])
        self._quota, self._target, self._last = state["quota"], state["target"], state["last"]
        self._pad = state["pad"]
        self._exhausted, self.done = state["exhausted"], state["finished"]
        self.batches, self.padded, self.from_inner = state["batches"], state["padded"], state["from_inner"]
        self._dropped_ahead = state["dropped_ahead"]
        self._agreements, self._chosen = state["agreements"], state["auto"]
        self._gaps = list(state["steps"])
        self._probing = self._auto_mode and len(self._gaps) < MEASURED

    def __next__(self) -> Any:
        if self._probing and self._handed:
            self._gaps.append(time.perf_counter() - self._handed)
            self._probing = len(self._gaps) < MEASURED
        if self.done:
            raise StopIteration
        if self._quota == 0:
            if self._last:
                self._finish()
                raise StopIteration
            self._settle()
        self._quota -= 1
        if self._window:
            batch = self._window.popleft()
            self.from_inner += 1
            if self._pad is None and self._pad_mode:
                self._pad = (batch,)
        else:
            assert self._pad is not None, "a rank without a batch to repeat raises in _settle"
            batch = self._pad[0]
            self.padded += 1
        self.batches += 1
        # Fetch ahead before handing the batch over, so the agreement overlaps its step. Agreements
        # are posted at the same steps on every rank (the start, and each window's last batch)
        # whatever the data, so ranks that leave an epoch early together stay matched.
        if self._quota == 0 and not self._last:
            self._complete()
        else:
            self._fetch(-(-(self._target - len(self._next)) // (self._quota + 1)))
        if self._probing:
            self._handed = time.perf_counter()
        return batch

    def _complete(self) -> None:
        """Fetch the rest of the next window and post its agreement."""
        self._fetch(self._target - len(self._next))
        self._post()

    def _fetch(self, count: int) -> None:
        """Fetch up to ``count`` batches of the next window from the loader."""
        if self._last or self.done:
            return
        for _ in range(count):
            if self._exhausted or self._error is not None:
                return
            try:
                self._next.append(next(self._inner))  # type: ignore[arg-type]
            except StopIteration:
                self._exhausted = True
                self._inner = None
            except Exception as error:  # announced to the other ranks, re-raised at the agreement
                self._error = error
                self._inner = None

    def _post(self) -> None:
        have = len(self._next)
        me = self._side.rank + 1  # flags carry the rank, so every rank can name one that failed
        empty = me if have == 0 and self._pad is None and not self._window else 0
        self._agreements += 1
        proposed = self._proposal() if self._auto_mode else 0
        self._flag_values[:] = (have, -have, -empty, -me if self._error is not None else 0, -proposed)
        self._work = self._side.all_reduce_min(self._flags)

    def _proposal(self) -> int:
        """This rank's proposal under "auto" for the window after the next, from its own measurements
        (0: none yet); the ranks take the largest (:func:`shardkit.even.auto.proposal`)."""
        held = self._next or self._window
        if self._nbytes is None and held:  # the epoch's first batch seen sizes what a window may hold
            self._nbytes = batch_bytes(held[0])
        return proposal(
            self._side.round_trip,
            self._gaps,
            agreements=self._agreements,
            batches=self.batches,
            current=self._target,
            nbytes=self._nbytes or 0,
        )

    def _settle(self) -> None:
        """Wait for the next window's agreement and make it the current window."""
        work, self._work = self._work, None
        try:
            work.wait()
        except Exception as error:  # the side group's timeout passed, or a peer's connection broke
            self._finish()
            raise self._side.lost(error) from None
        low, high, empty, failed, agreed = self._flag_values.tolist()
        # empty, failed: a rank index plus one, or 0; agreed: the largest proposal (0: no rank measured a step yet)
        high, empty, failed, agreed = -high, -empty, -failed, -agreed
        self._chosen = max(self._chosen, agreed)
        if failed:
            self._abort(self._error, f"the loader of rank {failed - 1} raised (see that rank's error)")
        size = high if self._pad_mode else low
        if self._pad_mode and empty and size > 0:
            self._abort(
                None,
                f"rank {empty - 1} has no batch this epoch, so under at_end='pad' it has nothing to repeat "
                "while other ranks still have batches; use at_end='stop', or give every rank data",
            )
        self._window.extend(self._next[:size])
        self._dropped_ahead = len(self._next) - min(size, len(self._next))
        self._next = []
        self._quota = size
        self._last = size < self._target
        self._target = next_window(self._target, agreed, self._every)
        if size == 0:
            self._finish()
            raise StopIteration

    def _abort(self, own: BaseException | None, why: str) -> None:
        self._finish()
        # The error's traceback holds the frames of _fetch (so this iterator: a cycle) and of the
        # wrapped loader's next() (a DataLoader iterator and its worker processes). Held here, they
        # would live until the cyclic GC ran; dropped, they go when the caller lets the error go.
        self._error = None
        if own is not None:
            raise own
        raise EvenBatchesError(f"even_batches: rank {self._side.rank} of {self._side.size} stops: {why}")

    def _finish(self) -> None:
        if self.done:
            return
        self.done = True
        inner, self._inner = self._inner, None
        del inner  # lets a DataLoader shut its workers down
        self._owner._finished(self.stats())

    def stats(self) -> EvenStats:
        dropped, exact = self._dropped_ahead, True
        if self.done and not self._pad_mode and not self._exhausted:
            try:
                total = len(self._owner.loader)  # type: ignore[arg-type]
            except TypeError:
                total = None
            fetched = self.from_inner + self._dropped_ahead
            if total is not None and total >= fetched:
                dropped = total - self.from_inner
            else:
                exact = False
        window = (self._chosen or None) if self._auto_mode else self._every
        return EvenStats(self.epoch, self.batches, self.padded, dropped, exact, window)

    def state_dict(self, inner: Any) -> State:
        pad = [] if self._pad is None or not self._pad_mode else [encode(self._pad[0])]
        return state_of(
            self._owner,
            inner=inner,
            window=[encode(b) for b in self._window],
            next=[encode(b) for b in self._next],
            quota=self._quota,
            target=self._target,
            last=self._last,
            pad=pad,
            exhausted=self._exhausted,
            finished=self.done,
            batches=self.batches,
            padded=self.padded,
            from_inner=self.from_inner,
            dropped_ahead=self._dropped_ahead,
            # an agreement in flight is posted again on resuming (see __init__): counted once
            agreements=self._agreements - (self._work is not None),
            auto=self._chosen,
            steps=list(self._gaps),
        )


def _chain(held: list[Any], loader: Iterable[Any]) -> Iterator[Any]:
    yield from held
    yield from loader
