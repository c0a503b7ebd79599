"""Where a command will write, checked against what it reads before anything is written.

``convert`` reads the files SRC names and writes shards ``pattern % 0``,
``pattern % 1``, ... with companions (a Megatron ``.bin``'s ``.idx``) and a
manifest; ``profile --trace`` writes one file. Written blindly over an input,
an output destroys records not yet read and is then read back as input
(``convert 'd/part-*' 'd/part-%05d.tfrecord'`` once reported success with 10
source records gone and 3 read twice). So before the first byte is written:

- no input may be a name the outputs can take (:func:`check_outputs`): each
  input's path, and the file it resolves to (symlinks, ``..``), is compared
  with every name the pattern can produce, any shard number, not only the
  numbers this run will reach, in the output folder (also resolved);
- the SRC glob may not match a name the outputs can take either: the next
  run of the same command would read this run's outputs as its inputs. The
  glob is matched against the names of shards 0 to 9,999 and of every
  ``d * 10**k`` (k up to 15), the manifest and the companions;
- a trace file may not be an input shard, nor any existing shard file, and
  its folder must take a new file (:func:`check_trace_path`), found before
  the run rather than after it.

Local paths are compared resolved; urls as written.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterable, Iterator

from shardkit.cli.paths import is_url, shown
from shardkit.errors import ShardkitError
from shardkit.tempfiles import probe_writable

_FIELD = re.compile(r"%[-+ #0]*\d*[diu]")  # the integer field of a ShardWriter pattern
_SAMPLED = 10_000  # shard numbers tried against a glob, plus the round numbers beyond


class OutputError(ShardkitError):
    """An output the command would write can be one of its inputs, or cannot be written at all
    (exit 2, nothing written)."""


def _resolved(path: str) -> set[str]:
    """The spellings of one local file to compare: as written (absolute, normalised) and resolved."""
    if is_url(path):
        return {path}
    return {os.path.normpath(os.path.abspath(path)), os.path.realpath(path)}


def _companions(name: str) -> list[str]:
    """Files written beside shard ``name``: a Megatron ``.bin`` has its ``.idx``."""
    return [name[: -len(".bin")] + ".idx"] if name.endswith(".bin") else []


def _produces(base: str, name: str) -> bool:
    """Whether the file name ``name`` is ``base % n`` for some n >= 0, or the companion of one."""
    field = _FIELD.search(base)
    if field is None:
        return False
    if base.endswith(".bin") and name.endswith(".idx"):
        name = name[: -len(".idx")] + ".bin"
    prefix, suffix = base[: field.start()], base[field.end() :]
    middle = name[len(prefix) : len(name) - len(suffix)]
    if not (name.startswith(prefix) and name.endswith(suffix) and middle.strip(" +").isdigit()):
        return False
    return base % int(middle) == name


def _sampled_names(base: str, manifest: str) -> Iterator[str]:
    """Output file names to try against a glob: shards 0 to 9,999, the round numbers beyond, their
    companions, and the manifest."""
    yield manifest
    numbers = [*range(_SAMPLED), *(d * 10**k for k in range(4, 16) for d in range(1, 10))]
    for n in numbers:
        name = base % n
        yield name
        yield from _companions(name)


def _folder_and_name(path: str) -> tuple[set[str], str]:
    folder, _, name = path.rpartition("/")
    return _resolved(folder or "."), name


def _writes_over(inputs: Iterable[str], pattern: str, manifest: str) -> str | None:
    """The first input that is a name the outputs can take, None when there is none."""
    out_folders, base = _folder_and_name(pattern)
    manifests = _resolved(manifest)
    for url in inputs:
        for spelling in _resolved(url):
            folder, name = _folder_and_name(spelling)
            if spelling in manifests or (folder & out_folders and _produces(base, name)):
                return url
    return None


def _glob_parts(glob: str) -> list[str]:
    """``glob`` as absolute path components, its literal leading folder resolved; urls split as written."""
    if is_url(glob):
        return glob.split("/")
    parts = os.path.normpath(os.path.abspath(glob)).split("/")
    literal = next((i for i, part in enumerate(parts) if re.search(r"[*?\[{]", part)), len(parts))
    folder = os.path.realpath("/".join(parts[:literal]) or "/")
    return [*folder.split("/"), *parts[literal:]] if folder != "/" else ["", *parts[literal:]]


def _glob_matches(glob: str, pattern: str, manifest: str) -> str | None:
    """The first output (a sampled shard name, a companion, the manifest) that ``glob`` matches, component
    by component (brace groups expanded), None when there is none."""
    from shardkit.io.glob import expand_braces

    folders, base = _folder_and_name(pattern)
    manifest_folders, manifest_name = _folder_and_name(manifest)
    for part in expand_braces(glob):
        *glob_folder, glob_name = _glob_parts(part)
        if "**" in part:  # any depth: match whole paths (rare; the sampled names only)
            whole = "/".join([*glob_folder, glob_name])
            candidates = [f"{folder}/{name}" for folder in folders for name in _sampled_names(base, "") if name]
            candidates += [f"{folder}/{manifest_name}" for folder in manifest_folders]
            hit = next((c for c in candidates if fnmatch.fnmatchcase(c, whole)), None)
        else:
            hit = _name_match(glob_folder, glob_name, folders, _sampled_names(base, ""))
            hit = hit or _name_match(glob_folder, glob_name, manifest_folders, iter([manifest_name]))
        if hit is not None:
            return hit
    return None


def _name_match(glob_folder: list[str], glob_name: str, folders: set[str], names: Iterator[str]) -> str | None:
    """``folder/name`` for the first name ``glob_name`` matches in a folder ``glob_folder`` matches."""
    matching = [f for f in folders if _components_match(f.split("/"), glob_folder)]
    if not matching:
        return None
    name = next((n for n in names if n and fnmatch.fnmatchcase(n, glob_name)), None)
    return None if name is None else f"{matching[0]}/{name}"


def _components_match(parts: list[str], globs: list[str]) -> bool:
    return len(parts) == len(globs) and all(map(fnmatch.fnmatchcase, parts, globs))


def check_outputs(source: str, inputs: list[str], pattern: str, manifest: str) -> None:
    """Refuse (before anything is written) outputs ``pattern`` and ``manifest`` that can be an input:
    one of ``inputs`` (SRC expanded), or a file the glob ``source`` would pick up on the next run.

    Raises:
        OutputError: naming the input or output and the fix.
    """
    hit = _writes_over(inputs, pattern, manifest)
    if hit is not None:
        raise OutputError(
            f"the output {pattern!r} would write over the input {hit} before reading it (or read its own "
            "output back); write to another folder or name"
        )
    if re.search(r"[*?\[{]", source):
        output = _glob_matches(source, pattern, manifest)
        if output is not None:
            output = shown(output, pattern)
            raise OutputError(
                f"the source glob {source!r} matches the output {output}, so the outputs would be read as "
                "inputs on the next run; write to another folder or name, or narrow the glob"
            )


def check_trace_path(path: str, inputs: list[str]) -> None:
    """Refuse a trace file that is an input shard or any existing shard file, or that cannot be written
    (no folder, not a folder, a directory at ``path``, no permission), before the run.

    Raises:
        OutputError: ``path`` is a shard, or cannot be written (no folder, not a folder, a directory,
            no permission).
    """
    from shardkit.formats.base import FormatError
    from shardkit.formats.registry import format_for

    targets = _resolved(path)
    hit = next((url for url in inputs if _resolved(url) & targets), None)
    if hit is None and os.path.isfile(path):
        with open(path, "rb") as file:
            head = file.read(512)
        try:
            shard = not head.startswith(b'{"traceEvents"') and format_for(path, head) is not None
        except FormatError:
            shard = False
        hit = path if shard else None
    if hit is not None:
        raise OutputError(f"--trace {path} is a shard file ({hit}); give a new name such as trace.json")
    _probe_writable(path)


def _probe_writable(path: str) -> None:
    """Create and remove a file beside ``path``: the rename at the end then has a folder that takes it.

    Raises:
        OutputError: ``path`` is a directory, or cannot be written (the OS's reason).
    """
    if os.path.isdir(path):
        raise OutputError(f"--trace {path} is a directory; give a file name such as {path}/trace.json")
    try:
        probe_writable(path)
    except OSError as error:
        reason = (error.strerror or type(error).__name__).lower()
        raise OutputError(f"cannot write the trace to {path}: {reason}") from None
