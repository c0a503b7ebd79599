"""MixedLoader: DataLoader batches that mix every worker's stream in equal shares.

A plain :class:`~torch.utils.data.DataLoader` over an ``IterableDataset`` builds
each batch inside one worker, so a batch holds samples from that worker's one or
two shards only. :class:`MixedLoader` keeps the workers but has each of them
ship *micro-batches* tagged with its worker id; the main process keeps one
queue of pending samples per worker and cuts every output batch from all
workers that still have data, in equal shares.

How a batch is made:

* Shares are water-filled: with ``k`` workers that still have data each gives
  ``floor`` or ``ceil`` of ``batch_size / k``; a worker that has fewer samples
  left gives all of them and the others fill the rest. Every batch is full
  except the last one of the epoch, so an epoch of ``n`` samples has
  ``ceil(n / batch_size)`` batches (``floor`` with ``drop_last``) whatever the
  workers' counts: ranks that read the same number of samples yield the same
  number of batches.
* Which workers give the ``ceil`` share, and the order of the workers' blocks
  inside the batch, come from a hash of ``(seed, epoch, batch_index, worker)``.
  Assembly depends only on what each worker yields, never on arrival timing,
  so the same seed and data give the same batches.
* Without ``collate_fn``, workers apply ``default_collate`` to each
  micro-batch and the main process re-collates by slicing the micro-batches
  along the batch dimension and concatenating (:mod:`shardkit.loader.collate`: one
  copy per batch, none per sample). The micro-batches travel through a ring
  of reusable shared-memory slabs per worker (:mod:`shardkit.loader.slabs`) instead
  of DataLoader's new segment per tensor per batch. A custom ``collate_fn``
  may depend on the whole batch (padding to the longest sample, custom batch
  classes), so micro-batches then travel as lists of samples and
  ``collate_fn`` is called once per output batch, in the main process,
  exactly as DataLoader would call it.
* Over a dataset that yields column batches (its ``column_batches`` is true:
  ``TFRecordDataset(features=..., batch_size=...)``,
  ``ParquetDataset(batch_size=...)``), each of the dataset's
  batches is one micro-batch: the worker writes its columns into a slab
  (bytes as a values buffer and offsets) and the main process cuts every
  batch from row ranges of them (:mod:`shardkit.loader.slab_columns`), with no work per
  sample anywhere. Batches are dicts of a tensor per numeric column and a
  ``pyarrow.LargeBinaryArray`` per bytes column (a Parquet column of strings,
  bytes or lists comes as the numpy array the dataset made, sent with the
  message rather than through the slab); the dataset's batch_size
  sets the micro-batch (1024 records is a good start for small records).
  Without workers the same assembly runs in the main process.

Resuming (:meth:`MixedLoader.state_dict` / :meth:`MixedLoader.load_state_dict`):
a worker's messages carry their samples' record positions, and its dataset's
state after them when ``state_dict()`` asked for it (see
:mod:`shardkit.loader.micro_batches`), and the main process knows which
samples went out in batches. The saved state holds, per worker, the first
dataset state at or past what was delivered, and the undelivered samples
before it (the tail of a micro-batch cut part-way, and the micro-batches
received before that state; samples still waiting in whole micro-batches after
it are read again instead): by their records' positions where the dataset can
read records again (a shardkit pipeline over shards, through its maps, filters
and shuffles: a worker sends its micro-batches' positions beside them, and the
samples are read again in the main process on restore), else as encoded
samples (a wrapped plain iterable, column batches);
``stats().carried_as`` says which (:mod:`shardkit.loader.loader_state`).
Where the records cannot be read again but the pipeline's sources can
(``.pack()`` blocks, a ``.batch`` or ``interleave`` over shard datasets),
nothing is carried: ``state_dict()`` asks each worker for its dataset's state
at the delivered point, which it makes in a copy of its dataset from a
restart point it kept a few micro-batches back (:mod:`shardkit.loader.restart`;
the pipeline must make the same samples again given its state), and the
samples are made again from that state on resume (``carried_as`` is
``"restart"``; a worker that has sent its last micro-batch carries them). Restored with the same number of
workers, each worker resumes its own state and the batches are the ones the
uninterrupted run would have made. With another number, the worker states
are merged (:func:`shardkit.state.merge`) and split anew: exactly the samples
not yet delivered follow, in another order. Under a process group of more
than one rank the state holds every rank's (:mod:`shardkit.ranks`), so
the one copy a trainer writes from rank 0 resumes every rank.

The modules below this one: :mod:`shardkit.loader.mixer` (one epoch of
assembly in the main process), :mod:`shardkit.loader.micro_batches` (what runs
in each worker), :mod:`shardkit.loader.loader_state` (the saved state and its
checks), then the slabs and collation they share. Over 600 lines: one module because
changing the worker count mid-epoch (``num_workers="auto"``, :mod:`shardkit.loader.autotune`)
restarts the epoch through the loader's own state, DataLoader and epoch start, which another
module would have to reach into.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from shardkit.epoch import resume_at
from shardkit.errors import LoaderError, check_int
from shardkit.loader.autotune import AUTO, Autotune, check_prefetch, prefetch_for, tuner_for
from shardkit.loader.loader_state import check_loader_state, combine_loader_ranks, loader_state, records_of
from shardkit.loader.micro_batches import MicroBatches, dataset_state, in_process
from shardkit.loader.mixer import Mixer
from shardkit.loader.restart import restartable
from shardkit.loader.slabs import SPARE_SLOTS
from shardkit.loader.stalls import GATHER_TIMEOUT, GatheredStats, LoaderStats, StallMeter, chrome_trace
from shardkit.loader.stalls import gather as gather_stats
from shardkit.ranks import gather as gather_ranks
from shardkit.ranks import is_ranks, own_or_global
from shardkit.stateful import State, StateError, applies, check, merge
from shardkit.tempfiles import socket_folder_problem

__all__ = ["LoaderError", "MixedLoader"]

#: DataLoader arguments that MixedLoader hands to its DataLoader unchanged.
PASSTHROUGH_KWARGS = frozenset(
    {
        "pin_memory",
        "pin_memory_device",
        "persistent_workers",
        "prefetch_factor",
        "multiprocessing_context",
        "timeout",
        "worker_init_fn",
        "generator",
    }
)


class MixedLoader:
    """Batches over an ``IterableDataset`` in which every worker still holding
    data contributes an equal share.

    Args:
        dataset: the ``IterableDataset`` to read; each DataLoader worker
            iterates its own copy, as with a plain DataLoader.
        batch_size: samples per batch.
        num_workers: DataLoader worker processes; 0 reads in the main process
            and batches the stream plainly. ``"auto"`` reads the first
            batches in the main process, starts the workers they show it
            needs (none when making a batch costs less than taking it from a
            worker), then adds workers while the loop waits for data and CPU
            and memory allow (:mod:`shardkit.loader.autotune`; settings in ``autotune``).
            A change is made between two batches: the loader's state is
            taken, the workers stopped and the new count started from it, so
            every sample still comes exactly once (without ``resumable``,
            changes wait for the next epoch). The count is kept across
            epochs, saved in :meth:`state_dict` and shown in :meth:`stats`.
        collate_fn: called once per output batch with its list of samples, in
            the main process (not for column batches: see the module docstring). ``None`` collates with ``default_collate`` in the
            workers and joins micro-batches in the main process.
        drop_last: drop the last batch of an epoch if it is not full.
        seed: seeds the placement of the workers' shares in each batch.
        micro_batch_size: samples per message from a worker (with workers);
            None: ``batch_size`` for the first, then, without ``collate_fn``, as
            many times ``batch_size`` as bring a message of small samples near
            512 KB, at most 256 samples and 20 ms of making them
            (:func:`~shardkit.loader.micro_batches.message_size`: a message costs about
            0.5 ms of CPU whatever it holds; 8 blocks of 2,048 int32 tokens are 64 KB),
            except where a saved state would carry the
            undelivered samples as data (a wrapped plain iterable). For column batches, the dataset's
            batch_size is the micro-batch and this must stay None. The main process holds one or two
            micro-batches per worker; smaller values shorten that and the
            wait for the first batch, at the cost of more messages, which
            cost most when samples are small. Without ``collate_fn`` each
            worker keeps ``prefetch_factor + 3`` shared-memory slabs the size
            of one collated micro-batch for the epoch (5 x 4.8 MB for 32
            3x224x224 uint8 images).
        resumable: track the position for :meth:`state_dict`. Each worker
            then sends its micro-batches' record positions beside them, and
            its dataset's state when :meth:`state_dict` asks for it (with its
            next micro-batch: see :mod:`shardkit.loader.micro_batches`), so
            saving costs one dataset state per worker per call, nothing per
            batch (a ``.shuffle(n)`` buffer inside the dataset is saved as its
            records' positions where they can be read again, else encoded).
            The undelivered samples of cut micro-batches are saved as their
            records' positions likewise, or, where they cannot be read again
            (packed blocks), not at all: each worker's state is made at the
            delivered point (``stats().carried_as``, the module docstring). Saved samples are plain data, never pickled (see
            :func:`shardkit.state.encode` for the types a state holds);
            ``state_dict()`` raises :class:`~shardkit.state.StateError` for
            samples of other types.
        prefetch: micro-batches each worker keeps in flight (DataLoader's
            ``prefetch_factor``); ``"auto"`` sets it from the worker count
            (:func:`shardkit.loader.autotune.prefetch_for`). None: 2, or the
            ``prefetch_factor`` given.
        autotune: an :class:`~shardkit.loader.autotune.Autotune` with the settings of
            ``num_workers="auto"`` (bounds, thresholds, window); None: the defaults.
        gather_states: under a process group of more than one rank,
            ``state_dict()`` returns every rank's state (and must then be
            called on every rank, as trainers do); False returns this
            rank's alone. See :meth:`state_dict`.
        **dataloader_kwargs: passed to the underlying DataLoader; any of
            ``pin_memory``, ``pin_memory_device``, ``persistent_workers``,
            ``prefetch_factor`` (counted in micro-batches),
            ``multiprocessing_context``, ``timeout``, ``worker_init_fn``,
            ``generator``. With workers, pinning applies to the assembled
            batches in the main process. (``in_order`` is not offered: batches
            need every worker's share, so letting fast workers run ahead
            would only grow the samples held in the main process.)
    """

    def __init__(
        self,
        dataset: IterableDataset,
        batch_size: int,
        *,
        num_workers: int | str = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        seed: int = 0,
        micro_batch_size: int | None = None,
        resumable: bool = True,
        prefetch: int | str | None = None,
        autotune: Autotune | None = None,
        gather_states: bool = True,
        **dataloader_kwargs: Any,
    ) -> None:
        _check_arguments(dataset, batch_size, num_workers, collate_fn, drop_last, seed, micro_batch_size, resumable)
        mid_epoch = resumable and callable(getattr(dataset, "state_dict", None))  # a count can change mid-epoch
        self._tuner = tuner_for(num_workers, autotune, LoaderError, mid_epoch)
        workers = num_workers if self._tuner is None else self._tuner.workers
        assert isinstance(workers, int)  # checked above: an int, or "auto"
        num_workers = workers
        self._auto_prefetch = check_prefetch(prefetch, dataloader_kwargs, LoaderError)
        if isinstance(prefetch, int) and num_workers:
            dataloader_kwargs["prefetch_factor"] = prefetch
        elif self._auto_prefetch and num_workers:
            dataloader_kwargs["prefetch_factor"] = prefetch_for(num_workers)
        self._dataloader_kwargs = dict(dataloader_kwargs)  # to start another worker count with
        if self._tuner is not None and not num_workers:  # the opening: DataLoader refuses these without workers
            for name in ("prefetch_factor", "persistent_workers"):
                dataloader_kwargs.pop(name, None)
        self._switch: int | None = None  # a worker count decided, made at the next step
        self._deferred: int | None = None  # a worker count decided, made at the next epoch
        if not isinstance(gather_states, bool):
            raise LoaderError(f"gather_states must be a bool (True or False), got {gather_states!r}")
        self._columns = _column_batches(dataset, collate_fn, micro_batch_size)
        unknown = sorted(set(dataloader_kwargs) - PASSTHROUGH_KWARGS)
        if unknown:
            raise TypeError(
                f"MixedLoader got unexpected keyword argument(s) {', '.join(unknown)}; "
                f"it passes only {', '.join(sorted(PASSTHROUGH_KWARGS))} to DataLoader "
                "and does its own batching, so sampler, shuffle and batch_sampler do not apply"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.seed = seed
        self.micro_batch_size = batch_size if micro_batch_size is None else micro_batch_size
        self._grow = micro_batch_size is None  # small samples' micro-batches grow (micro_batches.message_size)
        self.resumable = resumable
        self.gather_states = gather_states
        # What DataLoader would hold: wrappers that copy a loader's settings
        # (Accelerate's skip_first_batches) must not pass a prefetch_factor without workers.
        self.prefetch_factor = dataloader_kwargs.get("prefetch_factor", 2 if num_workers else None)
        self.epoch = 0
        self._pin = False
        self._meter = StallMeter()
        self._micro_batches: MicroBatches | None = None
        if num_workers == 0 and not self._columns:
            self._loader = DataLoader(
                dataset, batch_size=batch_size, drop_last=drop_last, collate_fn=collate_fn, **dataloader_kwargs
            )
        else:
            self._loader = self._worker_loader(dataloader_kwargs)

    def _worker_loader(self, dataloader_kwargs: dict[str, Any]) -> DataLoader:
        """The DataLoader whose workers send micro-batches. Pinning is done here, on
        assembled batches: DataLoader's pin thread would pin micro-batches that are
        then copied out again."""
        pin = bool(dataloader_kwargs.pop("pin_memory", False))
        dataloader_kwargs.pop("pin_memory_device", None)
        self._pin = pin and _accelerator_available()
        if pin and not self._pin:
            warnings.warn(
                "MixedLoader: pin_memory=True but no accelerator is available; batches will not be pinned",
                stacklevel=3,
            )
        collate = self.collate_fn is None
        slots = SPARE_SLOTS + (dataloader_kwargs.get("prefetch_factor") or 2) if collate and self.num_workers else 0
        self._micro_batches = MicroBatches(
            self.dataset,
            self.micro_batch_size,
            collate=collate,
            resumable=self.resumable,
            slots=slots,
            columns=self._columns,
            ask=True,  # each worker sends its state when state_dict() asks
            grow=self._grow,
        )
        return DataLoader(
            self._micro_batches, batch_size=None, num_workers=self.num_workers, collate_fn=_as_is, **dataloader_kwargs
        )

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch for the next iteration and forward it to
        ``dataset.set_epoch`` when the dataset has one."""
        check_int("epoch", epoch, minimum=0, error=LoaderError)
        self.epoch = epoch
        self._epoch_set = True
        set_dataset_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_dataset_epoch):
            set_dataset_epoch(epoch)

    def __len__(self) -> int:
        """Batches in one epoch, from ``len(dataset)`` (samples this rank reads; for
        column batches the dataset's ``num_samples()``)."""
        count = getattr(self.dataset, "num_samples", None) if self._columns else None
        if callable(count):
            samples: int = count()  # pyright: ignore[reportAssignmentType]  (TFRecordDataset.num_samples)
        elif self._columns:  # its len() counts column batches, not samples
            raise TypeError(
                f"MixedLoader has no len(): {type(self.dataset).__name__} yields column batches and has no "
                "num_samples() (the number of samples this rank reads); drive training by a number of steps"
            )
        elif not hasattr(self.dataset, "__len__"):
            raise TypeError(
                f"MixedLoader has no len(): {type(self.dataset).__name__} does not define "
                "__len__ (the number of samples this rank reads)"
            )
        else:
            samples = len(self.dataset)  # type: ignore[arg-type]
        if self.drop_last:
            return samples // self.batch_size
        return math.ceil(samples / self.batch_size)

    _resume: State | None = None
    _tails: tuple[Any, ...] = ()  # the loaded state's carried tails, decoded
    _mixer: Mixer | None = None
    _iterated = False
    _epoch_set = False  # until set_epoch, iteration k is epoch k, like the dataset's passes (shardkit.epoch)
    _passes = 0
    _stateless = False  # the dataset could not save its position: no change of workers mid-epoch

    def __iter__(self) -> Iterator[Any]:
        """Iterate one epoch of batches, resuming a state given to :meth:`load_state_dict`.

        The epoch starts at its first batch: ``iter()`` alone starts no worker and counts no
        pass, so a trainer that calls ``iter()`` to check the loader before it loads a state
        (Lightning does) neither moves the epoch on nor locks persistent workers out of the state.
        """
        return _Epoch(self)

    def _start_epoch(self) -> Iterator[Any]:
        """Begin the epoch :meth:`__iter__` stands for: count the pass, start the workers, resume."""
        resume, self._resume = self._resume, None
        self._meter.fold(self._mixer)  # the last epoch's worker figures
        self._mixer = None
        if not self._epoch_set:
            self.epoch, self._passes = self._passes, self._passes + 1
        if resume is not None and not applies(resume, self.epoch, self):
            resume = None
        self._iterated = True
        if self._switch is None:
            self._switch = self._deferred
        if self._switch is not None:  # decided at the end of the last epoch, or deferred to this one
            self._start_workers(self._switch)
        return self._open(resume)

    def _open(self, resume: State | None) -> Iterator[Any]:
        """Start the workers (or the main process's reading) at ``resume`` (None: the epoch's start)."""
        micro_batches = self._micro_batches
        if micro_batches is not None:
            micro_batches.trace = self._meter.trace
        if micro_batches is None:  # no workers, samples
            self._mixer = None
            if resume is not None:
                self._resume_in_process(resume)
                if resume["carry"]:  # tails of cut micro-batches: assembled as with workers, in this process
                    size, collate = self.micro_batch_size, self.collate_fn is None
                    messages = in_process(self.dataset, size, collate=collate, resumable=self.resumable)
                    self._mixer = Mixer(self, messages, resume, self._tails)
                    return self._mixer
            return iter(self._loader)
        problem = self.num_workers and socket_folder_problem(
            "MixedLoader", torch.multiprocessing.get_sharing_strategy()
        )
        if problem:  # the workers could never send a batch: the loader would wait forever
            raise LoaderError(problem)
        if resume is not None:
            saved = resume["workers"]
            same = resume["num_workers"] == self.num_workers
            micro_batches.states = list(saved) if same else [merge(saved)] * max(self.num_workers, 1)
        try:
            with warnings.catch_warnings():
                if self._tuner is not None:  # a count it measured: more than the CPUs when they sit idle
                    warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
                source = iter(self._loader)  # starts the workers, each with its copy of the states
        finally:
            micro_batches.states = None
        self._mixer = Mixer(self, source, resume, self._tails if resume is not None else ())
        return self._mixer

    # -- num_workers="auto" (shardkit.loader.autotune) ---------------------------------

    def _tune(self) -> None:
        """After a batch: give the tuner the step's figures; a new count is made at the next step."""
        assert self._tuner is not None
        if self._switch is not None:  # decided, not made yet (it waits for the next epoch)
            return
        meter = self._meter
        decision = self._tuner.step(meter.steps, meter.wait_ns, meter.compute_ns, self._probe)
        if decision is not None and decision.deferred:
            self._deferred = decision.workers
        elif decision is not None:
            self._switch = decision.workers

    def _probe(self) -> tuple[list[int], float | None]:
        """The running workers' pids and their busy seconds so far (for the tuner, once a window)."""
        source = None if self._mixer is None else self._mixer._source
        pids = [process.pid for process in getattr(source, "_workers", None) or ()]
        if not self.num_workers:
            return pids, None
        workers = self._meter.stats(0, self._mixer).workers
        return pids, sum(worker.busy_seconds for worker in workers)

    def _switch_mid_epoch(self) -> Iterator[Any] | None:
        """Make the decided worker count now, between two batches: save the position, stop the
        workers, start the new count from the position. None when it must wait for the next
        epoch (no state to restart from: ``resumable=False``, a dataset that cannot save its
        position, or the epoch has ended)."""
        mixer = self._mixer
        if not self.resumable or self._stateless:
            return None
        try:
            if mixer is None:  # no workers: the dataset's own position, past every batch returned
                state = self._rank_state()
            elif mixer._finished or mixer._source is None:
                return None
            else:
                state = mixer.state_dict()  # this rank's, never gathered: the other ranks go on
        except StateError:  # a dataset that cannot save its position: changes wait for the next epoch
            self._stateless = True
            return None
        if mixer is not None:
            mixer._stop_workers()
            self._meter.fold(mixer)
        assert self._switch is not None
        self._start_workers(self._switch)
        self._tails = tuple(check_loader_state(state, self))
        return self._open(state)

    def _start_workers(self, workers: int) -> None:
        """Replace the DataLoader with one of ``workers`` workers (the running ones shut down)."""
        self._switch = self._deferred = None
        running = getattr(self._loader, "_iterator", None)
        if running is not None:  # persistent workers
            running._shutdown_workers()
            self._loader._iterator = None
        kwargs = dict(self._dataloader_kwargs)
        if self._auto_prefetch and workers:
            kwargs["prefetch_factor"] = prefetch_for(workers)
        elif not workers:  # DataLoader refuses these without workers
            for name in ("prefetch_factor", "persistent_workers"):
                kwargs.pop(name, None)
        self.num_workers = workers
        self.prefetch_factor = kwargs.get("prefetch_factor", 2 if workers else None)
        self._micro_batches = None
        if workers == 0 and not self._columns:
            self._loader = DataLoader(
                self.dataset, batch_size=self.batch_size, drop_last=self.drop_last, collate_fn=self.collate_fn, **kwargs
            )
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
                self._loader = self._worker_loader(kwargs)
        if self._tuner is not None:
            self._tuner.restart(workers)

    def stats(self, gather: bool = False, timeout: float = GATHER_TIMEOUT) -> LoaderStats | GatheredStats:
        """Where the time went: the loop's wait for batches and its compute between them,
        in total and over the last 100 steps, and the workers' time per stage.

        A :class:`~shardkit.loader.stalls.LoaderStats` (``wait_ratio``, ``stages``,
        ``slowest_stage``, ``workers``); see :mod:`shardkit.loader.stalls` for what each
        figure measures. Always on: a few clock reads per batch and per micro-batch;
        how a worker's time splits over its stages is sampled in one micro-batch of 64.
        Without workers, only the main process's figures are known.

        ``gather=True`` returns every rank's (a :class:`~shardkit.loader.stalls.GatheredStats`,
        whose ``straggler`` is the rank that waited most and ``summary()`` names it and its
        slowest stage); call it on every rank at the same step. A rank that does not answer
        within ``timeout`` seconds is reported missing; it never hangs the others longer.
        """
        stats = dataclasses.replace(self._meter.stats(_rank(), self._mixer), carried_as=self._carried_as())
        if self._tuner is not None:
            stats = dataclasses.replace(stats, autotune=self._tuner.summary(self.prefetch_factor))
        if not gather:
            return stats
        return gather_stats(stats, self._meter.gather_tag(self.epoch), timeout)

    def _carried_as(self) -> str | None:
        """How a saved state holds the undelivered samples (``LoaderStats.carried_as``)."""
        if not self.resumable:
            return None
        if self._columns:
            return "data"
        if records_of(self.dataset) is not None:
            return "positions"
        return "restart" if self.num_workers and restartable(self.dataset) else "data"

    def record_timeline(self) -> None:
        """Keep every step and micro-batch from the next epoch on, for :meth:`timeline`.

        Every worker micro-batch then has its stages timed (not one in 64) and its
        figures travel to the main process: for profiling (``shardkit profile --trace``),
        not for a training run. Call it before the epoch starts its workers (persistent
        workers keep what they were started with).
        """
        self._meter.trace = True

    def timeline(self) -> dict[str, Any]:
        """What :meth:`record_timeline` kept, as a Chrome trace / Perfetto JSON object
        (see :func:`shardkit.loader.stalls.chrome_trace`)."""
        self._meter.fold_events(self._mixer)
        return chrome_trace(self._meter)

    def state_dict(self, gather: bool | None = None) -> State:
        """What the batches returned so far have delivered, as plain data.

        Call it between batches (in the training loop, with the model's
        checkpoint). It holds the epoch, the batch index, each worker's
        dataset state and, per worker, the undelivered samples before it
        (one tail), by their records' positions where the dataset can read
        them again, else encoded (``stats().carried_as`` says which); where
        the records cannot be read again but the sources can (packed blocks),
        each worker's state is made at the delivered point instead and
        nothing is carried; see the module docstring. The dataset must
        be Stateful (every shardkit pipeline is).

        Under an initialised process group of more than one rank it returns
        every rank's state, the same on every rank (a ``"ranks"`` node, see
        :mod:`shardkit.ranks`), so a trainer that writes rank 0's
        copy saves them all; every rank must then call it, as trainers do.
        ``gather=False`` (or ``gather_states=False`` when building the
        loader) returns this rank's state alone.

        Raises:
            StateError: before any iteration (and no state loaded), when
                the dataset cannot save its position, or when another rank
                did not call ``state_dict()`` within the job's timeout.
        """
        if self.gather_states if gather is None else gather:
            return gather_ranks(self._rank_state, "MixedLoader.state_dict()")
        return self._rank_state()

    def _rank_state(self) -> State:
        """This rank's state (see :meth:`state_dict`)."""
        if not self._iterated:
            if self._resume is not None:
                return self._resume
            raise StateError("MixedLoader.state_dict(): nothing has been iterated yet, so there is no position to save")
        if not self.resumable:
            raise StateError("MixedLoader cannot save its position: it was built with resumable=False")
        if self._micro_batches is None and self._mixer is None:
            workers = [dataset_state(self.dataset)]
            return loader_state(self, batch_index=-1, finished=False, workers=workers, carry=[])
        assert self._mixer is not None
        return self._mixer.state_dict()

    def load_state_dict(self, state: State) -> None:
        """Resume from ``state`` (from :meth:`state_dict`) at the next iteration.

        Sets the epoch to the state's (and the dataset's, through
        ``set_epoch``) when ``set_epoch`` was called before; iterate, then go
        on with ``set_epoch(epoch + 1)``. Without ``set_epoch`` the next
        iteration reads the state's epoch and later ones count on from it.
        ``num_workers`` may differ from the saving loader's: the remaining
        samples are then split anew (exactly once; in another order).
        Call it before the first iteration: persistent workers that are
        already running cannot be given a state.

        A state of every rank (from :meth:`state_dict` under a process
        group) resumes each rank from its own entry when the world size is
        the same; on another world size, or without a process group, from
        the global state of all entries (:func:`shardkit.state.merge_ranks`).

        Raises:
            StateError: a state of another kind or version, of a dataset it
                does not fit (see :meth:`shardkit.pipeline.Pipeline.load_state_dict`),
                or given after persistent workers started.
        """
        if is_ranks(state):
            state = own_or_global(state, "MixedLoader.load_state_dict()", combine_loader_ranks)
        check(state, "mixed_loader", self)
        tails = check_loader_state(state, self)
        if self.num_workers and getattr(self._loader, "_iterator", None) is not None:
            raise StateError(
                "MixedLoader.load_state_dict() after persistent workers have started; "
                "build a new MixedLoader and load the state before iterating it"
            )
        if self._epoch_set:
            self.set_epoch(state["epoch"])
        else:  # counted epochs: the next iteration reads the state's, the one after it the next
            self._passes = state["epoch"]
            resume_at(self.dataset, state["epoch"])
        self._resume = state
        self._tails = tuple(tails)
        if self._tuner is not None and 0 < state["num_workers"] != self.num_workers:
            # The saved choice: the count the saving loader had reached (a global state's is 0).
            self._start_workers(min(state["num_workers"], self._tuner.limits.max_workers))

    def _resume_in_process(self, state: State) -> None:
        saved = state["workers"]
        load = getattr(self.dataset, "load_state_dict", None)
        if load is None:
            raise StateError(f"{type(self.dataset).__name__} has no load_state_dict(); it cannot resume")
        load(saved[0] if len(saved) == 1 else merge(saved))


def _check_arguments(
    dataset: Any,
    batch_size: Any,
    num_workers: Any,
    collate_fn: Any,
    drop_last: Any,
    seed: Any,
    micro_batch_size: Any,
    resumable: Any,
) -> None:
    """Raise :class:`LoaderError` naming the first MixedLoader argument that cannot work."""
    if not isinstance(dataset, IterableDataset):
        raise LoaderError(
            f"MixedLoader mixes the streams of an IterableDataset's workers; got "
            f"{type(dataset).__name__}. For a map-style dataset use "
            "torch.utils.data.DataLoader(dataset, shuffle=True)."
        )
    if num_workers != AUTO or not isinstance(num_workers, str):
        check_int("num_workers", num_workers, minimum=0, error=LoaderError, hint='or pass "auto" to have it tuned')
    for name, value, minimum in (("batch_size", batch_size, 1), ("seed", seed, 0)):
        check_int(name, value, minimum=minimum, error=LoaderError)
    if micro_batch_size is not None:
        check_int("micro_batch_size", micro_batch_size, minimum=1, error=LoaderError)
    if collate_fn is not None and not callable(collate_fn):
        raise LoaderError(f"collate_fn must be callable or None, got {collate_fn!r}")
    for name, flag in (("drop_last", drop_last), ("resumable", resumable)):
        if not isinstance(flag, bool):
            raise LoaderError(f"{name} must be a bool (True or False), got {flag!r}")


def _column_batches(dataset: Any, collate_fn: Any, micro_batch_size: Any) -> bool:
    """Whether ``dataset`` yields column batches (its ``column_batches`` is true), checking
    the arguments that do not apply to them."""
    if not getattr(dataset, "column_batches", False):
        return False
    if collate_fn is not None:
        raise LoaderError(
            f"{type(dataset).__name__} yields column batches, which MixedLoader cuts into batches itself; "
            "collate_fn applies to samples: pass collate_fn=None, or build the dataset without features"
        )
    if micro_batch_size is not None:
        raise LoaderError(
            f"{type(dataset).__name__} yields column batches: each of them is one micro-batch, so set their "
            f"size with the dataset's batch_size (now {getattr(dataset, 'batch_size', None)}), not micro_batch_size"
        )
    return True


def _accelerator_available() -> bool:
    """Whether pinned memory can be used, as DataLoader decides it."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is None:
        return torch.cuda.is_available()
    return bool(accelerator.is_available())


def _rank() -> int:
    """This process's rank in the initialised process group, else 0."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _as_is(message: Any) -> Any:
    """DataLoader collate_fn for ready-made messages (module level so spawn can pickle it)."""
    return message


class _Epoch:
    """One epoch of a :class:`MixedLoader`, begun at its first ``next()`` (see ``MixedLoader.__iter__``)."""

    def __init__(self, loader: MixedLoader) -> None:
        self._loader = loader
        self._batches: Iterator[Any] | None = None

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        loader = self._loader
        meter = loader._meter
        start = meter.entered()
        if loader._tuner is not None:
            loader._tuner.entered()
        try:
            if self._batches is None:
                self._batches = loader._start_epoch()
            elif loader._switch is not None:
                switched = loader._switch_mid_epoch()  # (a DataLoader iterator has a len(): no `or`)
                if switched is not None:
                    self._batches = switched
            batch = next(self._batches)
        except StopIteration:
            meter.left(start, ended=True)
            raise
        meter.left(start)
        if loader._tuner is not None:
            loader._tune()
        return batch
