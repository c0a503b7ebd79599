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
  previous file or none, never half of one. The file names the run, the
  global step, the rank and the world size it belongs to. The run is one
  identity per ``train()`` call, the same on every rank (rank 0's, taken
  through the job's store when training begins), so the files of one save
  can be told from those another run wrote into the same folder.
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
* **Every file loaded is of one save.** Two runs saving into the same
  ``checkpoint-N/`` (a 4-rank run, then a 2-rank run) leave files of both:
  loaded as they are, some ranks would take one run's position and the rest
  the other's, training some records twice and others never. So the files
  every rank loads (its own, or all of them on another number of ranks) must
  agree on run, world size and step: each rank checks the files it reads, and
  the ranks compare what they loaded through the job's store before any
  rank loads it; a disagreement is a ``StateError`` on every rank naming the
  files and both runs. A folder saved by one run whole (its files of ranks
  beyond the world size that saved it, left by another run, are never read)
  loads.
* **Older files** (version 1, written before the run was saved) load as
  before when every file loaded is of version 1 and they agree on world size
  and step; which run wrote them cannot be checked. A version-1 file loaded
  beside a version-2 one is two runs' and refused.

Each rank saves its own state (``state_dict(gather=False)`` for a shardkit
loader, which would otherwise gather every rank's into each file).

The Trainer then calls ``set_epoch`` with the checkpoint's epoch and iterates
the loader, which yields exactly the batches an uninterrupted run would have
made after the checkpoint. This module imports ``transformers``; ``import
shardkit`` does not import this module.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any

# From the defining modules, not the package: the same classes, but a type checker that
# resolves ``transformers/__init__.py`` binds all of its models (40 s of basedpyright's run).
from transformers.trainer_callback import TrainerCallback, TrainerControl, TrainerState
from transformers.training_args import TrainingArguments

from shardkit.errors import StateError
from shardkit.integrations.state_files import read_record, write_record
from shardkit.ranks import gather, is_ranks, ranks_node
from shardkit.trainers import TrainerError

__all__ = ["STATE_FILE", "ResumeCallback", "read_loader_state", "write_loader_state"]

logger = logging.getLogger("shardkit")

#: Each rank's loader state in a checkpoint folder, by rank.
STATE_FILE = "shardkit_loader_rank{rank}.json"
FORMAT, VERSION = "shardkit.integrations.hf.loader_state", 2
OLD_VERSION = 1  # before the run was saved: still read (module docstring)
FORMAT_KEY, VERSION_KEY, RUN_KEY, STEP_KEY, RANK_KEY, WORLD_KEY, STATE_KEY = (
    "format", "version", "run", "global_step", "rank", "world_size", "state",
)  # fmt: skip
_WHERE = "ResumeCallback.on_train_begin()"
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
        self.run: str | None = None  # this train() call's identity, rank 0's on every rank (on_train_begin)

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if not args.ignore_data_skip:
            logger.info("shardkit: ResumeCallback sets ignore_data_skip=True (the loader resumes by position)")
        args.ignore_data_skip = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.run is None:  # saved without on_train_begin (called by hand): agree on a run now
            self.run = _agreed_run([])
        folder = _checkpoint_folder(args, state.global_step)
        state_dict = _own_state(self.loader)
        write_loader_state(folder, state_dict, state.global_step, args.process_index, args.world_size, run=self.run)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        resuming = state.global_step > 0  # else a fresh run: nothing to resume
        if resuming and not args.ignore_data_skip:
            raise TrainerError(
                "the Trainer resumes at global step "
                f"{state.global_step} by skipping batches (ignore_data_skip=False), which would re-read them and "
                "then drop the loader's position: ResumeCallback was added after the Trainer was built, too late "
                "to set it. Fix: pass it in Trainer(callbacks=[ResumeCallback(loader)]), or set "
                "TrainingArguments(ignore_data_skip=True)"
            )
        folder = _resumed_folder(args, state) if resuming else None
        loaded: list[Any] = []

        def load_own() -> dict[str, Any] | None:  # inside the gather: an error here reaches every rank
            if folder is None:
                return None
            saved, header = _load(folder, state.global_step, args.process_index, args.world_size)
            loaded.append(saved)
            return header

        headers: list[dict[str, Any] | None] = []
        self.run = _agreed_run(headers, load_own)
        if folder is not None:
            _check_one_save(folder, headers)
            self.loader.load_state_dict(loaded[0])


def _agreed_run(headers: list[dict[str, Any] | None], load: Callable[[], dict[str, Any] | None] | None = None) -> str:
    """A new run identity, rank 0's on every rank (through the job's store; without a process group,
    this process's). ``load()`` runs on every rank inside the same gather: what each rank loaded
    (None: nothing) is appended to ``headers`` in rank order."""

    def post() -> dict[str, Any]:
        return {RUN_KEY: uuid.uuid4().hex, "loaded": None if load is None else load()}

    gathered = gather(post, _WHERE)
    entries = gathered["states"] if is_ranks(gathered) else [gathered]
    headers += [entry["loaded"] for entry in entries]
    return entries[0][RUN_KEY]


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


def write_loader_state(folder: str, state: Any, global_step: int, rank: int, world_size: int, *, run: str) -> str:
    """Write ``state`` as rank ``rank``'s loader state of the checkpoint in ``folder``, saved by the
    run ``run`` (the same string on every rank of one run), atomically: a temporary name, then a
    rename. Returns the file's path.

    Raises:
        StateError: the state is not plain JSON data (it would not load back as saved).
    """
    if not isinstance(run, str) or not run:
        raise TypeError(f"run must be a non-empty str naming the run (the same on every rank), got {run!r}")
    record = {
        FORMAT_KEY: FORMAT, VERSION_KEY: VERSION, RUN_KEY: run, STEP_KEY: global_step, RANK_KEY: rank,
        WORLD_KEY: world_size, STATE_KEY: state,
    }  # fmt: skip
    return write_record(
        folder, STATE_FILE.format(rank=rank), record, when=f"global step {global_step}", saver="ResumeCallback"
    )


def read_loader_state(folder: str, global_step: int, rank: int, world_size: int) -> Any:
    """Rank ``rank``'s loader state in the checkpoint ``folder`` of ``global_step``, checked to
    belong to that step and rank. Saved by another number of ranks, every rank's file is read
    and checked to be of one run, and the states come as one ``"ranks"`` node for the loader to merge.

    Raises:
        StateError: a file is missing, not this format, of another checkpoint or rank, or the
            files read are of two runs.
    """
    return _load(folder, global_step, rank, world_size)[0]


def _load(folder: str, global_step: int, rank: int, world_size: int) -> tuple[Any, dict[str, Any]]:
    """:func:`read_loader_state`, and what was loaded: the save's run, version, world size and step,
    and the files read (for :func:`_check_one_save` to compare over the ranks)."""
    record = _read_record(folder, global_step, rank)
    saved_world = record[WORLD_KEY]
    if saved_world == world_size:
        return record[STATE_KEY], _header(record, [rank])
    if not isinstance(saved_world, int) or saved_world < 1:
        raise StateError(f"{_path(folder, rank)} gives world size {saved_world!r}, not a number of ranks")
    records = [_read_record(folder, global_step, r, saved_world) for r in range(saved_world)]
    headers = [_header(r, [r[RANK_KEY]]) for r in records]
    _check_one_save(folder, headers, across_ranks=False)
    return ranks_node([r[STATE_KEY] for r in records]), _header(record, list(range(saved_world)))


def _header(record: dict[str, Any], ranks: list[int]) -> dict[str, Any]:
    """Which save a record is of (an older file has no run: None), and the ranks whose files were read."""
    return {
        RUN_KEY: record.get(RUN_KEY), VERSION_KEY: record[VERSION_KEY], WORLD_KEY: record[WORLD_KEY],
        STEP_KEY: record[STEP_KEY], "files": ranks,
    }  # fmt: skip


def _check_one_save(folder: str, headers: Sequence[dict[str, Any] | None], *, across_ranks: bool = True) -> None:
    """Every file in ``headers`` (what each rank loaded, by rank; or, ``across_ranks`` False, each file
    one rank read) is of one save: the same run, version, world size and step; else a StateError
    naming each save's files."""
    saves: dict[tuple[Any, ...], list[int]] = {}
    for index, header in enumerate(headers):
        if header is not None:
            key = (header[RUN_KEY], header[VERSION_KEY], header[WORLD_KEY], header[STEP_KEY])
            saves.setdefault(key, []).append(index)
    if len(saves) < 2:
        return
    described = []
    for (run, version, world, step), indexes in saves.items():
        files = sorted({r for i in indexes for r in headers[i]["files"]})  # type: ignore[index]
        names = ", ".join(STATE_FILE.format(rank=r) for r in files)
        who = f" (loaded by rank {', '.join(map(str, indexes))})" if across_ranks else ""
        run_name = f"run {run}" if run is not None else f"an older shardkit's run (version {version}, no run saved)"
        described.append(f"{names}{who} of {run_name}, {world} ranks, step {step}")
    raise StateError(
        f"checkpoint {folder} holds the loader states of {len(saves)} saves, not one: "
        + "; ".join(described)
        + ". Another run saved into the same folder (e.g. on another number of ranks), so loading them would "
        "resume some ranks from one run's position and others from the other's, training some records twice "
        "and others never. Fix: resume from a checkpoint folder one run saved whole (or remove the files of "
        "the run it does not hold the model of)"
    )


def _path(folder: str, rank: int) -> str:
    return os.path.join(folder, STATE_FILE.format(rank=rank))


def _read_record(folder: str, global_step: int, rank: int, world_size: int | None = None) -> dict[str, Any]:
    path = _path(folder, rank)
    record = read_record(
        path,
        missing=f"checkpoint {folder} holds no loader state for rank {rank}, so the loader would start its epoch "
        "again and train on samples twice. It was saved without ResumeCallback (or by fewer ranks). Fix: resume "
        "from a checkpoint saved with callbacks=[ResumeCallback(loader)], or to restart the data on purpose, leave "
        "ResumeCallback out",
        writer="ResumeCallback",
    )
    _check_record(path, record, global_step, rank, world_size)
    return record


def _check_record(path: str, record: Any, global_step: int, rank: int, world_size: int | None) -> None:
    """``record`` is a ResumeCallback file of ``global_step`` and ``rank`` (and ``world_size``, if given)."""
    if not isinstance(record, dict) or record.get(FORMAT_KEY) != FORMAT or STATE_KEY not in record:
        raise StateError(f"{path} is not a loader state written by ResumeCallback (no {FORMAT!r} record)")
    version = record.get(VERSION_KEY)
    if version not in (OLD_VERSION, VERSION) or type(version) is not int:
        raise StateError(f"{path} has version {version!r}; this shardkit reads versions {OLD_VERSION} and {VERSION}")
    run = record.get(RUN_KEY)
    if version == VERSION and (not isinstance(run, str) or not run):
        raise StateError(f"{path}: field {RUN_KEY!r} must be a non-empty str naming the run that saved it, got {run!r}")
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
