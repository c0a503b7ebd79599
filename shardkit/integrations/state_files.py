"""A loader state as one plain-JSON file in a trainer's checkpoint folder.

Every integration saves the same way: the state and the fields that bind it to
one save (run, step, rank or world size) as one JSON record, written
atomically (a temporary name, then a rename: a kill mid-save leaves the
previous file or none). Never pickle: loading a checkpoint must not run code.
A state that is not plain JSON data fails at save, naming the step, not at
the resume that would need it. Reading gives the record or a ``StateError``
naming the file; checking the fields is the integration's own.
"""

from __future__ import annotations

import json
import os
from typing import Any

from shardkit.errors import StateError
from shardkit.tempfiles import write_text_atomic


def write_record(folder: str | os.PathLike[str], name: str, record: dict[str, Any], *, when: str, saver: str) -> str:
    """Write ``record`` as JSON to ``folder/name`` atomically and return the path; ``when`` names
    the save (e.g. ``"global step 10"``) and ``saver`` the function or class that saves it.

    Raises:
        StateError: the record is not plain JSON data (it would not load back as saved).
    """
    try:
        text = json.dumps(record, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise StateError(
            f"the loader's state_dict() at {when} is not plain JSON data ({error}); {saver} saves states as JSON, "
            "never pickle: give a loader whose state is plain data (every shardkit loader's is)"
        ) from error
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(os.fspath(folder), name)
    write_text_atomic(path, text)
    return path


def read_record(path: str, *, missing: str, writer: str) -> Any:
    """The JSON in ``path``; a missing file is a ``StateError`` ``"{path} is missing: {missing}"``,
    a file that is not JSON one naming ``writer`` (what writes such files)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise StateError(f"{path} is missing: {missing}") from None
    except ValueError as error:
        raise StateError(f"{path} is not a loader state written by {writer}: {error}") from error
