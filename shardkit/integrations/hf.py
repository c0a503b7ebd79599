"""Resume a shardkit loader through the Hugging Face ``Trainer``'s own checkpoints.

The Trainer resumes its data by re-reading: ``train(resume_from_checkpoint=...)``
skips the batches trained before the checkpoint with Accelerate's
``skip_first_batches``, which reads them again (shardkit refuses it with a
:class:`~shardkit.trainers.TrainerError`), and its ``checkpoint-N/`` folder
holds nothing of the loader. :class:`ResumeCallback`, passed in
``callbacks=[...]`` beside the subclass whose ``get_train_dataloader()``
returns the shardkit loader, makes the checkpoint hold the loader's position:

* **When the Trainer is built** (``on_init_end``) it *sets*
  ``args.ignore_data_skip = True``: the loader's own position replaces the
  Trainer's skipping, so nothing is read twice. A callback added later
  (``trainer.add_callback``) cannot set it in time; resuming then fails at
  once asking for ``ignore_data_skip=True``.
* **On every save** (``on_save``, on every rank, after the Trainer wrote
  ``checkpoint-N/``) each rank writes its loader's ``state_dict()`` to
  ``checkpoint-N/shardkit_loader_rank{r}.json``: plain JSON (never pickle),
  written under a temporary name and renamed, so a kill mid-write leaves the
  previous file or none, never half of one. The file names the global step,
  the rank and the world size it belongs to.
* **When training resumes** (``on_train_begin`` with a global step above 0:
  the Trainer has loaded a checkpoint) each rank reads its own file and loads
  it into the loader before the first batch. The Trainer does not tell
  callbacks which folder it resumed from, so the folder is the
  ``resume_from_checkpoint`` given to the running ``train()`` (read from the
  call stack, as :mod:`shardkit.trainers` reads Accelerate's frames), else
  ``output_dir/checkpoint-{global_step}``. A missing file, or one of another
  step or rank, is a :class:`~shardkit.state.StateError` naming the file:
  never a silent restart of the epoch. On another number of ranks every
  rank reads all the saved files and loads them as one ``"ranks"`` node
  (:mod:`shardkit.ranks`), which the loader merges and splits anew
  where its pipeline allows.

Each rank saves its own state (``state_dict(gather=False)`` for a shardkit
loader, which would otherwise gather every rank's into each file).

The Trainer then calls ``set_epoch`` with the checkpoint's epoch and iterates
the loader, which yields exactly the batches an uninterrupted run would have
made after the checkpoint. This module imports ``transformers``; ``import
shardkit`` does not import this module.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import sys
import uuid
from typing import Any

# From the defining modules, not the package: the same classes, but a type checker that
# resolves ``transformers/__init__.py`` binds all of its models (40 s of basedpyright's run).
from transformers.trainer_callback import TrainerCallback, TrainerControl, TrainerState
from transformers.training_args import TrainingArguments

from shardkit.errors import StateError
from shardkit.ranks import ranks_node
from shardkit.tempfiles import removed_if_exiting
from shardkit.trainers import TrainerError

__all__ = ["STATE_FILE", "ResumeCallback", "read_loader_state", "write_loader_state"]

logger = logging.getLogger("shardkit")

#: Each rank's loader state in a checkpoint folder, by rank.
STATE_FILE = "shardkit_loader_rank{rank}.json"
FORMAT, VERSION = "shardkit.integrations.hf.loader_state", 1
FORMAT_KEY, VERSION_KEY, STEP_KEY, RANK_KEY, WORLD_KEY, STATE_KEY = (
    "format", "version", "global_step", "rank", "world_size", "state",
)  # fmt: skip
_TRAINER_FILE = ("transformers", "trainer.py")
_MAX_FRAMES = 200


class ResumeCallback(TrainerCallback):
    """Saves each rank's loader position into the Trainer's checkpoints and loads
    it on ``train(resume_from_checkpoint=...)``; sets ``ignore_data_skip=True``.

    Args:
        loader: the loader ``get_train_dataloader()`` returns
            (:class:`shardkit.MixedLoader`, :class:`shardkit.EvenBatches`, a
            ``StatefulDataLoader``): anything with ``state_dict()`` and
            ``load_state_dict()`` whose state is plain data.
    """

    def __init__(self, loader: Any) -> None:
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(loader, method, None)):
                raise TypeError(
                    f"ResumeCallback needs a loader with state_dict() and load_state_dict(); {type(loader).__name__} "
                    f"has no {method}(). Pass the shardkit.MixedLoader your get_train_dataloader() returns"
                )
        self.loader = loader

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if not args.ignore_data_skip:
            logger.info("shardkit: ResumeCallback sets ignore_data_skip=True (the loader resumes by position)")
        args.ignore_data_skip = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        folder = _checkpoint_folder(args, state.global_step)
        write_loader_state(folder, _own_state(self.loader), state.global_step, args.process_index, args.world_size)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.global_step == 0:
            return  # a fresh run: nothing to resume
        if not args.ignore_data_skip:
            raise TrainerError(
                "the Trainer resumes at global step "
                f"{state.global_step} by skipping batches (ignore_data_skip=False), which would re-read them and "
                "then drop the loader's position: ResumeCallback was added after the Trainer was built, too late "
                "to set it. Fix: pass it in Trainer(callbacks=[ResumeCallback(loader)]), or set "
                "TrainingArguments(ignore_data_skip=True)"
            )
        folder = _resumed_folder(args, state)
        self.loader.load_state_dict(read_loader_state(folder, state.global_step, args.process_index, args.world_size))


def _own_state(loader: Any) -> Any:
    """This rank's state alone: each rank writes its own file, so a shardkit loader need not gather."""
    try:
        own = "gather" in inspect.signature(loader.state_dict).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        own = False
    return loader.state_dict(gather=False) if own else loader.state_dict()


def _resumed_folder(args: TrainingArguments, state: TrainerState) -> str:
    """The checkpoint folder the running ``train()`` resumes from: its ``resume_from_checkpoint``
    argument (the Trainer passes it to no callback), else ``output_dir/checkpoint-{global_step}``."""
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        parts = frame.f_code.co_filename.replace("\\", "/").split("/")
        resumed = frame.f_locals.get("resume_from_checkpoint") if tuple(parts[-2:]) == _TRAINER_FILE else None
        if isinstance(resumed, (str, os.PathLike)):
            return os.fspath(resumed)
        frame = frame.f_back
    return _checkpoint_folder(args, state.global_step)


def _checkpoint_folder(args: TrainingArguments, global_step: int) -> str:
    """Where the Trainer saves the checkpoint of ``global_step`` (``output_dir`` None: its default)."""
    return os.path.join(args.output_dir or "trainer_output", f"checkpoint-{global_step}")


def write_loader_state(folder: str, state: Any, global_step: int, rank: int, world_size: int) -> str:
    """Write ``state`` as rank ``rank``'s loader state of the checkpoint in ``folder``
    (atomically: a temporary name, then a rename); returns the file's path.

    Raises:
        StateError: the state is not plain JSON data (it would not load back as saved).
    """
    record = {
        FORMAT_KEY: FORMAT, VERSION_KEY: VERSION, STEP_KEY: global_step, RANK_KEY: rank, WORLD_KEY: world_size,
        STATE_KEY: state,
    }  # fmt: skip
    try:
        text = json.dumps(record, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise StateError(
            f"the loader's state_dict() at global step {global_step} is not plain JSON data ({error}); "
            "ResumeCallback saves states as JSON, never pickle: give a loader whose state is plain data "
            "(every shardkit loader's is)"
        ) from error
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE.format(rank=rank))
    partial = f"{path}.{uuid.uuid4().hex}.partial"
    try:
        with removed_if_exiting(partial), open(partial, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
    return path


def read_loader_state(folder: str, global_step: int, rank: int, world_size: int) -> Any:
    """Rank ``rank``'s loader state in the checkpoint ``folder`` of ``global_step``, checked to
    belong to that step and rank. Saved by another number of ranks, every rank's file is read
    and checked, and the states come as one ``"ranks"`` node for the loader to merge.

    Raises:
        StateError: a file is missing, not this format, or of another checkpoint or rank.
    """
    record = _read_record(folder, global_step, rank)
    saved_world = record[WORLD_KEY]
    if saved_world == world_size:
        return record[STATE_KEY]
    if not isinstance(saved_world, int) or saved_world < 1:
        raise StateError(f"{_path(folder, rank)} gives world size {saved_world!r}, not a number of ranks")
    records = [_read_record(folder, global_step, r, saved_world) for r in range(saved_world)]
    return ranks_node([r[STATE_KEY] for r in records])


def _path(folder: str, rank: int) -> str:
    return os.path.join(folder, STATE_FILE.format(rank=rank))


def _read_record(folder: str, global_step: int, rank: int, world_size: int | None = None) -> dict[str, Any]:
    path = _path(folder, rank)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        raise StateError(
            f"{path} is missing: checkpoint {folder} holds no loader state for rank {rank}, so the loader would "
            "start its epoch again and train on samples twice. It was saved without ResumeCallback (or by fewer "
            "ranks). Fix: resume from a checkpoint saved with callbacks=[ResumeCallback(loader)], or to restart "
            "the data on purpose, leave ResumeCallback out"
        ) from None
    except ValueError as error:
        raise StateError(f"{path} is not a loader state written by ResumeCallback: {error}") from error
    _check_record(path, record, global_step, rank, world_size)
    return record


def _check_record(path: str, record: Any, global_step: int, rank: int, world_size: int | None) -> None:
    """``record`` is a ResumeCallback file of ``global_step`` and ``rank`` (and ``world_size``, if given)."""
    if not isinstance(record, dict) or record.get(FORMAT_KEY) != FORMAT or STATE_KEY not in record:
        raise StateError(f"{path} is not a loader state written by ResumeCallback (no {FORMAT!r} record)")
    if record.get(VERSION_KEY) != VERSION:
        raise StateError(f"{path} has version {record.get(VERSION_KEY)!r}; this shardkit reads version {VERSION}")
    expected = {
        STEP_KEY: global_step,
        RANK_KEY: rank,
        WORLD_KEY: record.get(WORLD_KEY) if world_size is None else world_size,
    }
    found = {key: record.get(key) for key in expected}
    if found != expected:
        raise StateError(
            f"{path} is the loader state of global step {found[STEP_KEY]}, rank {found[RANK_KEY]} of "
            f"{found[WORLD_KEY]}, but the Trainer resumes global step {global_step} and this file must be rank "
            f"{rank}'s of {expected[WORLD_KEY]}: it was copied from another checkpoint or run. Fix: resume from "
            "the checkpoint folder as it was saved"
        )
