"""Guards for the trainers that drive a shardkit dataset: Accelerate, the
Hugging Face ``Trainer``, and any trainer that trusts ``len(DataLoader)``.

A shardkit dataset splits itself over ranks and DataLoader workers when
iteration starts. Two ways a trainer can lose data silently, and what
shardkit does about them:

* **Accelerate wraps the loader again.** ``accelerator.prepare(DataLoader(ds))``
  (and the Hugging Face ``Trainer``, which calls it) either dispatches
  (``DataLoaderDispatcher``: rank 0 alone iterates the loader, which reads rank
  0's share only, and hands slices of it to every rank: half the data on two
  ranks is never read) or wraps the dataset in ``IterableDatasetShard``, which
  splits the already split stream again. Neither can be made exact from
  inside, so the first pass fails at once with :class:`TrainerError` naming the
  trainer and the fix. Detection looks up the Python call stack when a pass
  opens (once per pass) for frames of ``accelerate/data_loader.py``: a
  forked DataLoader worker still holds its parent's frames up to the fork; a
  spawned one does not, so the dataset is also checked when it is pickled for
  a worker (``__getstate__``), which happens inside the same frames.

* **Accelerate resumes by skipping, or by a StatefulDataLoader of its own.**
  ``accelerator.skip_first_batches(loader, n)`` (and the Hugging Face
  ``Trainer`` on ``train(resume_from_checkpoint=...)`` unless
  ``ignore_data_skip=True``) builds a new DataLoader over the loader's dataset
  that reads the first ``n`` batches again and throws them away: the samples
  are read twice, and a :class:`~shardkit.MixedLoader`'s batches are not even
  the ones it would have made. ``DataLoaderConfiguration(use_stateful_dataloader=True)``
  makes ``prepare()`` wrap a DataLoader in a ``StatefulDataLoader`` and call
  its ``state_dict()`` at once, which opens a pass (and starts its workers)
  inside ``prepare()``. A shardkit loader resumes by position instead, so
  both fail with :class:`TrainerError` naming the call and the fix:
  ``accelerator.register_for_checkpointing(loader)``, or for the Trainer
  ``shardkit.integrations.hf.ResumeCallback``. Skipping is refused on one rank too: it re-reads
  there as well.

* **``len(DataLoader)`` of an IterableDataset is ``ceil(len(dataset) / batch_size)``**,
  which is wrong once several workers each yield their own last, partial
  batch. Lightning and the Hugging Face ``Trainer`` stop after ``len(loader)``
  batches, so the missing batches are dropped. When a DataLoader asks a
  shardkit source for its length (its ``__len__`` is on the stack) and the
  batches its workers will really yield differ from what it would report,
  ``len()`` raises :class:`~shardkit.pipeline.UnknownLengthError` (a
  ``TypeError``) naming the fix; trainers then run the loader to exhaustion.
  ``.batch(n)`` with ``DataLoader(batch_size=None)`` and
  :class:`~shardkit.MixedLoader` report exact lengths.

This module is a leaf below every stage: it knows nothing of pipelines or
sources. What each DataLoader worker yields from a pipeline is the
pipeline's to say (its ``reader_lengths(num_workers)`` method); the guards
here only ask.
"""

from __future__ import annotations

import math
import sys
from contextvars import ContextVar
from types import FrameType
from typing import Any

from shardkit.errors import ShardkitError, UnknownLengthError
from shardkit.planning import worker_span

__all__ = ["TrainerError", "batch_len", "check_dataloader_len", "check_not_in_accelerate", "reader_lengths"]

_ACCELERATE_MODULE = ("accelerate", "data_loader.py")
_MAX_FRAMES = 200  # a worker's stack is ~40 frames deep; bounded so the look-up stays cheap

ACCELERATE_FIX = (
    "pass only the model and optimizer to accelerator.prepare(...) and iterate the shardkit loader yourself "
    "(a DataLoader, or shardkit.MixedLoader, which prepare() also returns unchanged), moving each batch with "
    "accelerate.utils.send_to_device(batch, accelerator.device); see examples/accelerate_train.py"
)
SKIP_FIX = (
    "a shardkit loader resumes by position, not by re-reading and dropping batches: register it with "
    "accelerator.register_for_checkpointing(loader) before accelerator.load_state(...) (every rank's position is "
    "saved with save_state) and iterate the loader itself instead of accelerator.skip_first_batches(loader, n); "
    "see examples/accelerate_train.py --resume"
)
STATEFUL_FIX = (
    "leave use_stateful_dataloader for map-style data and keep the shardkit loader out of accelerator.prepare: "
    "build shardkit.MixedLoader(...) and register it with accelerator.register_for_checkpointing(loader), so "
    "save_state/load_state resume every rank exactly; see examples/accelerate_train.py --resume"
)
HF_RESUME_FIX = (
    "pass callbacks=[shardkit.integrations.hf.ResumeCallback(loader)] to the Trainer: it saves every rank's loader "
    "position into checkpoint-N/, loads it on train(resume_from_checkpoint=...) and sets ignore_data_skip=True so "
    "the Trainer skips nothing; see examples/hf_trainer.py --resume"
)
HF_TRAINER_FIX = (
    "subclass transformers.Trainer and override get_train_dataloader() to return the shardkit loader "
    "(shardkit.MixedLoader or a DataLoader) without accelerator.prepare; Trainer still moves batches to the "
    "device and sets the epoch; see examples/hf_trainer.py"
)


class TrainerError(ShardkitError, RuntimeError):
    """A trainer wraps a shardkit dataset in a way that would lose or repeat data."""


def _frames(frame: FrameType | None) -> list[FrameType]:
    out = []
    while frame is not None and len(out) < _MAX_FRAMES:
        out.append(frame)
        frame = frame.f_back
    return out


def _accelerate_frames(frames: list[FrameType]) -> list[FrameType]:
    """The frames of Accelerate's ``data_loader.py`` on the stack, innermost first. A forked
    DataLoader worker's stack goes on below its worker loop with its parent's frames up to the fork."""
    found = []
    for frame in frames:
        parts = frame.f_code.co_filename.replace("\\", "/").split("/")
        if tuple(parts[-2:]) == _ACCELERATE_MODULE:
            found.append(frame)
    return found


def _stateful_init(frames: list[FrameType]) -> FrameType | None:
    """The frame of a ``DataLoaderAdapter.__init__`` building a ``StatefulDataLoader``
    (``use_stateful_dataloader=True``), which calls its ``state_dict()`` and so starts its workers."""
    for frame in frames:
        if frame.f_code.co_name == "__init__" and _owner_attribute(frame, "use_stateful_dataloader") is True:
            return frame
    return None


def _wrapper_name(frame: FrameType) -> str:
    """The Accelerate class whose method ``frame`` runs (the function's name outside a class)."""
    owner = frame.f_locals.get("self")
    return type(owner).__name__ if owner is not None else frame.f_code.co_name


def _owner_attribute(frame: FrameType, name: str) -> Any:
    """``getattr(self, name)`` of the frame's Accelerate object, None if it has none yet
    (its ``__getattr__`` delegates to a loader that ``__init__`` may not have made)."""
    try:
        return getattr(frame.f_locals.get("self"), name, None)
    except Exception:  # noqa: BLE001  (a half-built wrapper: treat as unset)
        return None


def _called_by_hf_trainer(frames: list[FrameType]) -> bool:
    return any(f.f_code.co_filename.replace("\\", "/").endswith("transformers/trainer.py") for f in frames)


def _single_rank(dataset: object) -> bool:
    topology = getattr(dataset, "topology", None)
    try:
        return topology is not None and topology().world_size == 1
    except ShardkitError:
        return False


def check_not_in_accelerate(dataset: object) -> None:
    """Raise :class:`TrainerError` if Accelerate's data loading drives ``dataset``.

    Called when a pass opens and when the dataset is pickled for a worker.
    """
    if "accelerate" not in sys.modules:  # cheap exit: nothing to look for
        return
    frames = _frames(sys._getframe(1))
    wrappers = _accelerate_frames(frames)
    if not wrappers:
        return
    hf_trainer = _called_by_hf_trainer(frames)
    skip = _owner_attribute(wrappers[0], "skip_batches")
    if isinstance(skip, int) and skip > 0:  # re-reads on any number of ranks
        raise _skip_error(dataset, _wrapper_name(wrappers[0]), skip, hf_trainer)
    if _single_rank(dataset):
        return  # one rank: the wrappers pass every sample on
    stateful = _stateful_init(wrappers)
    if stateful is not None:
        raise TrainerError(
            f"accelerator.prepare(DataLoader(...)) under DataLoaderConfiguration(use_stateful_dataloader=True) "
            f"wraps {dataset!r} in Accelerate's {_wrapper_name(stateful)}, whose StatefulDataLoader is asked for "
            f"its state_dict() inside prepare(), starting its workers there; the wrapper would lose data on "
            f"several ranks and its state would be rank 0's alone. Fix: {HF_TRAINER_FIX if hf_trainer else STATEFUL_FIX}"
        )
    raise _wrapper_error(dataset, _wrapper_name(wrappers[0]), hf_trainer)


def _skip_error(dataset: object, wrapper: str, skip: int, hf_trainer: bool) -> TrainerError:
    if hf_trainer:
        return TrainerError(
            f"the Hugging Face Trainer resumes {dataset!r} with Accelerate's skip_first_batches "
            f"({wrapper}, skip_batches={skip}): it reads the first {skip} batches again and drops them, which "
            f"re-reads every sample trained before the checkpoint and does not restore the loader's position. "
            f"Fix: {HF_RESUME_FIX}"
        )
    return TrainerError(
        f"accelerator.skip_first_batches(loader, {skip}) over {dataset!r} ({wrapper}) builds a new DataLoader "
        f"that reads the first {skip} batches again and drops them: every sample trained before the checkpoint "
        f"is read twice, and a shardkit.MixedLoader's batches would not be the ones it makes. Fix: {SKIP_FIX}"
    )


def _wrapper_error(dataset: object, wrapper: str, hf_trainer: bool) -> TrainerError:
    why = (
        "rank 0 alone iterates the loader, which reads rank 0's share only, and hands slices of it to every rank"
        if "Dispatcher" in wrapper
        else "its IterableDatasetShard splits shardkit's already split stream again"
    )
    if hf_trainer:
        return TrainerError(
            f"the Hugging Face Trainer drives {dataset!r} through Accelerate's {wrapper}: {why}, so data would be "
            f"lost silently. Fix: {HF_TRAINER_FIX}"
        )
    return TrainerError(
        f"Accelerate's {wrapper} drives {dataset!r} (accelerator.prepare(DataLoader(...))): {why}, so data would "
        f"be lost silently. Fix: {ACCELERATE_FIX}"
    )


def worker_lengths(total: int, num_workers: int) -> list[int]:
    """How :func:`shardkit.planning.share` splits ``total`` samples over ``num_workers`` workers."""
    return [worker_span(total, num_workers, w)[1] for w in range(num_workers)]


def loader_batches(lengths: list[int], batch_size: int, drop_last: bool) -> int:
    """Batches a DataLoader yields when its workers yield ``lengths`` samples and batch them each."""
    per_worker = (length // batch_size if drop_last else math.ceil(length / batch_size) for length in lengths)
    return sum(per_worker)


def calling_dataloader() -> Any:
    """The ``torch.utils.data.DataLoader`` whose ``__len__`` is on the stack, or None."""
    from torch.utils.data import DataLoader

    target = DataLoader.__len__.__code__
    for frame in _frames(sys._getframe(1)):
        if frame.f_code is target:
            return frame.f_locals.get("self")
    return None


_CHECKING: ContextVar[bool] = ContextVar("shardkit_checking_loader_len", default=False)


def reader_lengths(pipeline: Any, num_workers: int) -> list[int] | None:
    """Samples each of ``num_workers`` DataLoader workers yields from ``pipeline``
    per pass, or None where the split is not known here.

    Each shardkit stage answers for itself (``Pipeline.reader_lengths``):
    sources split their rank's samples as :func:`shardkit.planning.share`
    does; ``.map``/``.shuffle`` keep each worker's count, ``.batch`` batches
    it, ``.repeat(count)`` multiplies it and ``interleave(stop="all_exhausted")``
    adds its inputs'. A dataset that is not a shardkit pipeline (a DataLoader's
    dataset can be anything) has no known split.
    """
    lengths = getattr(pipeline, "reader_lengths", None)
    return None if lengths is None else lengths(num_workers)


def _loader_workers() -> int:
    loader = calling_dataloader()
    return max(1, loader.num_workers) if loader is not None else 1


def batch_len(batch: Any) -> int | None:
    """``len()`` of a ``.batch(n)`` stage: the sum of every worker's batches,
    with the workers of the DataLoader asking (one outside a DataLoader)."""
    token = _CHECKING.set(True)
    try:
        lengths = reader_lengths(batch, _loader_workers())
    finally:
        _CHECKING.reset(token)
    return None if lengths is None else sum(lengths)


def check_dataloader_len(source: Any) -> None:
    """Raise :class:`~shardkit.pipeline.UnknownLengthError` when a DataLoader
    is asking for its length and would report fewer or more batches than its
    workers yield from ``source``'s pipeline."""
    if _CHECKING.get():
        return
    loader = calling_dataloader()
    if loader is None or loader.batch_size is None or loader.num_workers < 2:
        return  # batch_size=None: the pipeline's own len(); 0 or 1 worker: ceil(n / batch_size) is exact
    token = _CHECKING.set(True)
    try:
        lengths = reader_lengths(loader.dataset, loader.num_workers)
    finally:
        _CHECKING.reset(token)
    size, drop = loader.batch_size, loader.drop_last
    if lengths is not None:
        total = sum(lengths)
        reported = total // size if drop else math.ceil(total / size)
        if reported == loader_batches(lengths, size, drop):
            return
    yielded = "an unknown number of" if lengths is None else str(loader_batches(lengths, size, drop))
    raise UnknownLengthError(
        f"len(DataLoader(batch_size={size}, num_workers={loader.num_workers})) over {source!r} would be "
        f"ceil(samples / batch_size), but its workers yield {yielded} batches (each worker batches its own "
        "share, ending with its own partial batch), so a trainer that stops after len(loader) batches would "
        f"drop data. For an exact len, batch in the pipeline with .batch({size}) and DataLoader(batch_size=None), "
        f"or use shardkit.MixedLoader(dataset, batch_size={size}, num_workers={loader.num_workers}); without a "
        "len, trainers run the loader to exhaustion. len(dataset) is the number of samples this rank reads"
    )
