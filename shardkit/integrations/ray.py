"""Resume a shardkit loader through Ray Train's own checkpoints.

Ray Train (``ray.train.torch.TorchTrainer``) runs ``train_func`` on each of
its workers inside a torch process group it sets up itself (gloo on CPU), so
a shardkit dataset finds its rank and world size there, as under
``torchrun``. After a failure (``FailureConfig(max_failures=...)``) Ray
starts the worker group again and ``ray.train.get_checkpoint()`` hands each
worker the last checkpoint reported; what the loader had delivered is in it
only if it was put there. These two functions put it there and take it back:

* :func:`save_loader_state` is called on **every** rank at a checkpoint:
  ``loader.state_dict()`` gathers every rank's state through the job's store
  (:mod:`shardkit.ranks`; a rank that does not call it makes the others wait
  for the job's timeout). The rank given a folder (rank 0, the one that
  reports the checkpoint) writes it to ``folder/shardkit_loader.json``:
  plain JSON (never pickle), under a temporary name and renamed, so a kill
  mid-write leaves no file rather than half of one. The file names the run
  that saved it (Ray Train's experiment name by default), the step, the
  world size and a new identity for this save.
* :func:`load_loader_state` is called on every rank when
  ``ray.train.get_checkpoint()`` returns a checkpoint (or a folder), before
  the first batch. It checks the file (format, version, fields, the step and
  run it must be of when given) and, under a process group, that every rank
  loaded the same save (a rank handed another checkpoint would resume from
  another position: a ``StateError`` on every rank). On the world size that
  saved it each rank takes its own entry; on another (Ray Train restarted on
  fewer workers, ``ScalingConfig(num_workers=(min, max))``) the entries merge
  into one global state and split anew (:func:`shardkit.state.merge_ranks`):
  exactly the samples not yet delivered follow.

The model's state goes beside it in the same folder, saved by the same rank,
so one checkpoint holds both of one step. This module imports ``ray``;
``import shardkit`` does not import this module.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

import ray.train

from shardkit.errors import StateError
from shardkit.integrations.state_files import read_record, write_record
from shardkit.ranks import check_ranks, gather, is_ranks

__all__ = ["STATE_FILE", "SavedLoader", "load_loader_state", "save_loader_state"]

#: The loader state's file in a checkpoint folder.
STATE_FILE = "shardkit_loader.json"
FORMAT, VERSION = "shardkit.integrations.ray.loader_state", 1
FORMAT_KEY, VERSION_KEY, RUN_KEY, SAVE_KEY, STEP_KEY, WORLD_KEY, STATE_KEY = (
    "format", "version", "run", "save", "step", "world_size", "state",
)  # fmt: skip
_WHERE = "shardkit.integrations.ray.load_loader_state()"


@dataclass(frozen=True)
class SavedLoader:
    """What a checkpoint's loader state is of: the run that saved it, its step, the world size that
    saved it and the save's own identity (a new one per :func:`save_loader_state`)."""

    run: str
    step: int
    world_size: int
    save: str


def save_loader_state(
    loader: Any, folder: str | os.PathLike[str] | None, *, step: int, run: str | None = None
) -> str | None:
    """Save every rank's ``loader`` state as the checkpoint of ``step`` in ``folder``.

    Call it on every rank (it gathers); give the folder on the rank that reports the checkpoint and
    None on the others, which then write nothing. ``run`` names the run (default: Ray Train's
    experiment name, ``ray.train.get_context().get_experiment_name()``). Returns the file's path, or
    None where ``folder`` is None.

    Raises:
        StateError: the state is not plain JSON data, or another rank did not call this in time.
    """
    _check_step(step, "save_loader_state()")
    state = loader.state_dict()  # every rank's, the same on every rank, under a process group
    if folder is None:
        return None
    if run is None:
        run = _ray_train_run()
    if not isinstance(run, str) or not run:
        raise TypeError(f"run must be a non-empty str naming the run, got {run!r}")
    world_size = len(state["states"]) if is_ranks(state) else 1
    record = {
        FORMAT_KEY: FORMAT, VERSION_KEY: VERSION, RUN_KEY: run, SAVE_KEY: uuid.uuid4().hex, STEP_KEY: step,
        WORLD_KEY: world_size, STATE_KEY: state,
    }  # fmt: skip
    return write_record(folder, STATE_FILE, record, when=f"step {step}", saver="save_loader_state()")


def load_loader_state(loader: Any, checkpoint: Any, *, step: int | None = None, run: str | None = None) -> SavedLoader:
    """Load the loader state saved in ``checkpoint`` (a ``ray.train.Checkpoint`` or a folder) into
    ``loader``, before its first batch; call it on every rank. ``step`` and ``run``, when given, are
    what the file must be of (the model's checkpoint step beside it, the run to resume).

    Returns:
        What the loaded state is of.

    Raises:
        StateError: no loader state in the checkpoint, a file of another format, version, step or run,
            or ranks that loaded different saves.
    """
    if step is not None:
        _check_step(step, "load_loader_state()")
    records: list[dict[str, Any]] = []

    def read_own() -> dict[str, Any]:  # inside the gather: an error here reaches every rank at once
        records.append(_read_checkpoint(checkpoint, step, run))
        return {key: records[0][key] for key in (RUN_KEY, STEP_KEY, SAVE_KEY)}

    _check_one_save(gather(read_own, _WHERE))
    record = records[0]
    loader.load_state_dict(record[STATE_KEY])
    return SavedLoader(record[RUN_KEY], record[STEP_KEY], record[WORLD_KEY], record[SAVE_KEY])


def _read_checkpoint(checkpoint: Any, step: int | None, run: str | None) -> dict[str, Any]:
    """The checked record in ``checkpoint`` (a folder, or anything with ``as_directory()``)."""
    if isinstance(checkpoint, (str, os.PathLike)):
        return _read(os.path.join(os.fspath(checkpoint), STATE_FILE), step, run)
    with checkpoint.as_directory() as folder:
        return _read(os.path.join(folder, STATE_FILE), step, run)


def _ray_train_run() -> str:
    """The name of the Ray Train run this worker is in (its experiment name)."""
    try:
        return ray.train.get_context().get_experiment_name()
    except RuntimeError as error:  # not inside a function trainer.fit() launched
        raise TypeError(
            "save_loader_state(run=None) names the run after Ray Train's experiment, but this process is not "
            f"a Ray Train worker ({error}). Pass run='...' to name it"
        ) from None


def _check_step(step: object, where: str) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TypeError(f"{where}: step must be an int >= 0 (the step the checkpoint is of), got {step!r}")


def _read(path: str, step: int | None, run: str | None) -> dict[str, Any]:
    """The record in ``path``, checked field by field (and to be of ``step`` and ``run`` when given)."""
    record = read_record(
        path,
        missing="the checkpoint holds no loader state, so the loader would start its epoch again and train on "
        "samples twice. Save it with shardkit.integrations.ray.save_loader_state() on every rank before "
        "ray.train.report(..., checkpoint=...)",
        writer="save_loader_state()",
    )
    _check_record(path, record)
    wanted = {STEP_KEY: step, RUN_KEY: run}
    wrong = {key: record[key] for key, value in wanted.items() if value is not None and record[key] != value}
    if wrong:
        found = ", ".join(f"{key} {record[key]!r}" for key in wrong)
        asked = ", ".join(f"{key} {wanted[key]!r}" for key in wrong)
        raise StateError(
            f"{path} is the loader state of {found}, but {asked} is resumed: it was copied from another "
            "checkpoint or run. Fix: resume from the checkpoint folder as it was saved"
        )
    return record


def _check_record(path: str, record: Any) -> None:
    """Every field of a record is there and of its type, and the world size is the number of states it holds."""
    if not isinstance(record, dict) or record.get(FORMAT_KEY) != FORMAT or STATE_KEY not in record:
        raise StateError(f"{path} is not a loader state written by save_loader_state() (no {FORMAT!r} record)")
    if record.get(VERSION_KEY) != VERSION or type(record.get(VERSION_KEY)) is not int:
        raise StateError(f"{path} has version {record.get(VERSION_KEY)!r}; this shardkit reads version {VERSION}")
    for key in (RUN_KEY, SAVE_KEY):
        if not isinstance(record.get(key), str) or not record[key]:
            raise StateError(f"{path}: field {key!r} must be a non-empty str, got {record.get(key)!r}")
    for key in (STEP_KEY, WORLD_KEY):
        value = record.get(key)
        if type(value) is not int or value < (0 if key == STEP_KEY else 1):
            raise StateError(f"{path}: field {key!r} must be an int >= {0 if key == STEP_KEY else 1}, got {value!r}")
    saved_world = len(check_ranks(record[STATE_KEY], path)) if is_ranks(record[STATE_KEY]) else 1
    if saved_world != record[WORLD_KEY]:
        raise StateError(
            f"{path} says world size {record[WORLD_KEY]} but holds the states of {saved_world} ranks: "
            "the file was edited or is corrupt"
        )


def _check_one_save(gathered: Any) -> None:
    """What every rank loaded (``gathered`` through the job's store; one rank's without a process group)
    is one save; else a StateError on every rank naming what each loaded."""
    entries = gathered["states"] if is_ranks(gathered) else [gathered]
    if all(entry == entries[0] for entry in entries):
        return
    described = "; ".join(
        f"rank {rank}: run {entry['run']!r} step {entry['step']} (save {entry['save']})"
        for rank, entry in enumerate(entries)
    )
    raise StateError(
        f"{_WHERE}: the ranks loaded different checkpoints ({described}), so they would resume from "
        "different positions, training some records twice and others never. Fix: give every rank the "
        "same checkpoint (ray.train.get_checkpoint() does)"
    )
