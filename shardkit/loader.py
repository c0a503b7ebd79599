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
  along the batch dimension and concatenating (one copy per batch, none per
  sample). A custom ``collate_fn`` may depend on the whole batch (padding to
  the longest sample, custom batch classes), so micro-batches then travel as
  lists of samples and ``collate_fn`` is called once per output batch, in the
  main process, exactly as DataLoader would call it.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

from shardkit.errors import ShardkitError

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


class LoaderError(ShardkitError, ValueError):
    """A MixedLoader argument that cannot work."""


class MixedLoader:
    """Batches over an ``IterableDataset`` in which every worker still holding
    data contributes an equal share.

    Args:
        dataset: the ``IterableDataset`` to read; each DataLoader worker
            iterates its own copy, as with a plain DataLoader.
        batch_size: samples per batch.
        num_workers: DataLoader worker processes; 0 reads in the main process
            and batches the stream plainly.
        collate_fn: called once per output batch with its list of samples, in
            the main process. ``None`` collates with ``default_collate`` in the
            workers and joins micro-batches in the main process.
        drop_last: drop the last batch of an epoch if it is not full.
        seed: seeds the placement of the workers' shares in each batch.
        micro_batch_size: samples per message from a worker (with workers);
            defaults to ``batch_size``. The main process holds one or two
            micro-batches per worker; smaller values shorten that and the
            wait for the first batch, at the cost of more messages, which
            cost most when samples are small.
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
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        seed: int = 0,
        micro_batch_size: int | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        if not isinstance(dataset, IterableDataset):
            raise LoaderError(
                f"MixedLoader mixes the streams of an IterableDataset's workers; got "
                f"{type(dataset).__name__}. For a map-style dataset use "
                "torch.utils.data.DataLoader(dataset, shuffle=True)."
            )
        _check_int("batch_size", batch_size, minimum=1)
        _check_int("num_workers", num_workers, minimum=0)
        _check_int("seed", seed, minimum=0)
        if micro_batch_size is not None:
            _check_int("micro_batch_size", micro_batch_size, minimum=1)
        if collate_fn is not None and not callable(collate_fn):
            raise LoaderError(f"collate_fn must be callable or None, got {collate_fn!r}")
        if not isinstance(drop_last, bool):
            raise LoaderError(f"drop_last must be a bool, got {drop_last!r}")
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
        self.epoch = 0

        if num_workers == 0:
            self._pin = False
            self._loader = DataLoader(
                dataset,
                batch_size=batch_size,
                drop_last=drop_last,
                collate_fn=collate_fn,
                **dataloader_kwargs,
            )
            return
        pin = bool(dataloader_kwargs.pop("pin_memory", False))
        dataloader_kwargs.pop("pin_memory_device", None)
        self._pin = pin and _accelerator_available()
        if pin and not self._pin:
            warnings.warn(
                "MixedLoader: pin_memory=True but no accelerator is available; "
                "batches will not be pinned",
                stacklevel=2,
            )
        self._loader = DataLoader(
            _MicroBatches(dataset, self.micro_batch_size, collate=collate_fn is None),
            batch_size=None,
            num_workers=num_workers,
            collate_fn=_as_is,
            **dataloader_kwargs,
        )

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch for the next iteration and forward it to
        ``dataset.set_epoch`` when the dataset has one."""
        _check_int("epoch", epoch, minimum=0)
        self.epoch = epoch
        set_dataset_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_dataset_epoch):
            set_dataset_epoch(epoch)

    def __len__(self) -> int:
        """Batches in one epoch, from ``len(dataset)`` (samples this rank reads)."""
        if not hasattr(self.dataset, "__len__"):
            raise TypeError(
                f"MixedLoader has no len(): {type(self.dataset).__name__} does not define "
                "__len__ (the number of samples this rank reads)"
            )
        samples = len(self.dataset)  # type: ignore[arg-type]
        if self.drop_last:
            return samples // self.batch_size
        return math.ceil(samples / self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        """Iterate one epoch of batches."""
        if self.num_workers == 0:
            return iter(self._loader)
        return _Mixer(self, iter(self._loader))


class _MicroBatches(IterableDataset):
    """Runs in each worker: cuts the dataset's stream into micro-batches tagged
    ``(worker_id, count, payload)`` and ends with ``(worker_id, 0, None)``, so
    the main process knows when a worker has no more data."""

    def __init__(self, dataset: IterableDataset, size: int, *, collate: bool) -> None:
        self.dataset = dataset
        self.size = size
        self.collate = collate

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        info = get_worker_info()
        assert info is not None, "_MicroBatches runs only in DataLoader workers"
        worker = info.id
        samples = iter(self.dataset)
        while chunk := list(islice(samples, self.size)):
            yield worker, len(chunk), default_collate(chunk) if self.collate else chunk
        yield worker, 0, None


def _accelerator_available() -> bool:
    """Whether pinned memory can be used, as DataLoader decides it."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is None:
        return torch.cuda.is_available()
    return bool(accelerator.is_available())


def _as_is(message: Any) -> Any:
    """DataLoader collate_fn for ready-made messages (module level so spawn can pickle it)."""
    return message


class _Mixer(Iterator[Any]):
    """One epoch of assembly. All state lives here (pending micro-batches per
    worker, which workers are done, the batch index) so that it can be saved
    and restored."""

    def __init__(self, loader: MixedLoader, source: Iterator[tuple[int, int, Any]]) -> None:
        self._source: Iterator[tuple[int, int, Any]] | None = source
        self._batch_size = loader.batch_size
        self._collate_fn = loader.collate_fn
        self._drop_last = loader.drop_last
        self._pin = loader._pin
        self._epoch_key = _mix64(_mix64(loader.seed) ^ loader.epoch)
        workers = loader.num_workers
        # Per worker: deque of [payload, offset, count] and samples left in it.
        self._pending: list[deque[list[Any]]] = [deque() for _ in range(workers)]
        self._available = [0] * workers
        self._done = [False] * workers
        self.batch_index = 0
        self._finished = False

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        shares = self._allocate()
        size = sum(shares.values())
        if size == 0 or (self._drop_last and size < self._batch_size):
            self._finished = True
            self._source = None  # lets the DataLoader shut its workers down
            for queue in self._pending:  # a dropped last batch
                queue.clear()
            raise StopIteration
        parts = [part for worker, share in shares.items() for part in self._take(worker, share)]
        if self._collate_fn is None:
            batch = _join(parts)
        else:
            batch = self._collate_fn([s for payload, a, b in parts for s in payload[a:b]])
        self.batch_index += 1
        return _pin_memory(batch) if self._pin else batch

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
            shares = _water_fill(self._batch_size, active, caps)
            if all(shares[w] <= self._available[w] for w in active):
                return shares
            self._pull()

    def _pull(self) -> None:
        """Receive one message from the workers."""
        try:
            worker, count, payload = next(self._source)  # type: ignore[arg-type]
        except StopIteration:
            # Every worker ends with an end marker; this only guards against a hang.
            self._done = [True] * len(self._done)
            return
        if count == 0:
            self._done[worker] = True
        else:
            self._pending[worker].append([payload, 0, count])
            self._available[worker] += count

    def _take(self, worker: int, share: int) -> list[tuple[Any, int, int]]:
        """Remove ``share`` samples from a worker's queue as (payload, start, stop) slices."""
        parts = []
        queue = self._pending[worker]
        self._available[worker] -= share
        while share:
            entry = queue[0]
            payload, start, count = entry
            stop = min(count, start + share)
            parts.append((payload, start, stop))
            share -= stop - start
            if stop == count:
                queue.popleft()
            else:
                entry[1] = stop
        return parts


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


def _join(parts: list[tuple[Any, int, int]]) -> Any:
    """Join slices ``payload[start:stop]`` of ``default_collate`` outputs along
    the batch dimension, into what ``default_collate`` makes of all samples."""
    first = parts[0][0]
    if isinstance(first, torch.Tensor):
        if len(parts) == 1:
            tensor, start, stop = parts[0]
            return tensor if start == 0 and stop == len(tensor) else tensor[start:stop]
        return _concat([tensor[start:stop] for tensor, start, stop in parts])
    if isinstance(first, Mapping):
        joined = {key: _join([(p[key], a, b) for p, a, b in parts]) for key in first}
        if isinstance(first, MutableMapping):
            clone = copy.copy(first)
            clone.update(joined)
            return clone
        return joined
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*_join_fields(parts))
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], (str, bytes)):
        # default_collate keeps strings and bytes as they come, along the batch:
        # a list at the top, a tuple inside a sequence (from zip).
        return type(first)(item for p, a, b in parts for item in p[a:b])
    if isinstance(first, list):
        # Any other list holds one collated value per field of the samples.
        return _join_fields(parts)
    raise TypeError(f"cannot join micro-batches of type {type(first).__name__}")


#: Copies below this many elements run on one thread in torch too (its grain size).
_SERIAL_COPY_ELEMENTS = 32768


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` along dim 0, large copies done by numpy where the dtype allows.

    The main process shares the CPU with busy workers; torch's intra-op
    threads then spin and wait for each other, which made ``torch.cat`` of
    3x224x224 images 2-3x slower than numpy's single-threaded copy in
    ``benchmarks/mixing.py``.
    """
    if sum(t.numel() for t in tensors) < _SERIAL_COPY_ELEMENTS:
        return torch.cat(tensors)
    rows = sum(len(t) for t in tensors)
    out = torch.empty((rows, *tensors[0].shape[1:]), dtype=tensors[0].dtype)
    try:
        np.concatenate([t.numpy() for t in tensors], out=out.numpy())
    except TypeError:  # a dtype numpy lacks, such as bfloat16
        torch.cat(tensors, out=out)
    return out


def _join_fields(parts: list[tuple[Any, int, int]]) -> list[Any]:
    return [_join([(p[i], a, b) for p, a, b in parts]) for i in range(len(parts[0][0]))]


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """SplitMix64 finaliser: a fast, well-spread 64-bit hash of an integer."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LoaderError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise LoaderError(f"{name} must be >= {minimum}, got {value}")
