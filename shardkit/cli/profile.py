"""``shardkit profile``: run a pipeline for a while and say where its time goes.

PIPELINE is a ``module:function`` (imported from the working directory or
``PYTHONPATH``) that returns a :class:`~shardkit.MixedLoader` or a dataset, or a
quoted glob of shard files read with the defaults of their format's dataset. A
dataset is read through ``MixedLoader(dataset, batch_size, num_workers)``. The
loop does nothing with the batches, so the loader runs as fast as it can: the
report is what bounds it (:func:`diagnose`), from the loader's stall accounting
(:mod:`shardkit.loader.stalls`), with every micro-batch's stages timed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import time
from typing import Any

from shardkit.cli.exits import EXIT_OK, fail, one_line
from shardkit.cli.files import GLOB_CHARS, shard_indices
from shardkit.cli.outputs import check_trace_path
from shardkit.cli.picture_profile import profile_picture
from shardkit.cli.svg import PictureError, check_writable, write_atomic
from shardkit.errors import ShardkitError

#: A ``module:function`` spec (a url or a Windows drive has "://" or a single letter before its colon).
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
#: Workers busier than this are what the loader waits for.
BUSY = 0.75


class ProfileError(ShardkitError, ValueError):
    """PIPELINE cannot be loaded or run."""


def cmd_profile(args: argparse.Namespace) -> int:
    if args.trace:  # an input shard, or a path that cannot be written, is refused before the run
        try:
            check_trace_path(args.trace, _inputs(args.pipeline))
        except Exception as error:  # noqa: BLE001 - one line naming the trace, exit 2
            return fail(args, error, args.trace)
    try:
        if args.picture:
            check_writable(args.picture)  # before the run: a wrong path should not cost the run
        loader = _loader(args.pipeline, args.batch_size, args.num_workers)
    except PictureError as error:
        return fail(args, error)
    except Exception as error:  # noqa: BLE001 - one line naming PIPELINE, then main's exit code
        return fail(args, error, None if isinstance(error, ProfileError) else args.pipeline)
    loader.record_timeline()
    run = _run(loader, args.seconds, args.batches)
    stats = loader.stats()
    text = report(stats, *run)
    print(text)
    timeline = loader.timeline()
    if args.trace:
        _write_json(args.trace, timeline)
        print(f"timeline: {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if args.picture:
        try:
            write_atomic(args.picture, profile_picture(timeline, stats, text.splitlines()[0], diagnose(stats)[0]))
        except PictureError as error:
            return fail(args, error)
        print(f"picture: {args.picture}")
    return EXIT_OK


def _inputs(spec: str) -> list[str]:
    """The shard files a glob PIPELINE reads (none known for a module:function, nor for a bad glob,
    which the loader reports)."""
    if _SPEC.match(spec) or not (GLOB_CHARS.search(spec) or os.path.isfile(spec)):
        return []
    import shardkit

    try:
        urls = shardkit.ShardList.from_glob(spec).urls()
    except ShardkitError:
        return []
    if not GLOB_CHARS.search(spec):
        return urls
    return [urls[i] for i in shard_indices(urls, spec, report=False)]  # _glob_dataset reports them


def _loader(spec: str, batch_size: int, num_workers: int) -> Any:
    """The MixedLoader that PIPELINE names (see the module docstring)."""
    import shardkit

    made = _call(spec) if _SPEC.match(spec) else _glob_dataset(spec)
    if isinstance(made, shardkit.MixedLoader):
        return made
    from torch.utils.data import IterableDataset

    if not isinstance(made, IterableDataset):
        raise ProfileError(
            f"{spec} returned a {type(made).__name__}; return a shardkit.MixedLoader or an IterableDataset "
            "(a shardkit pipeline): a plain DataLoader's workers cannot be timed"
        )
    return shardkit.MixedLoader(made, batch_size=batch_size, num_workers=num_workers, persistent_workers=True)


def _call(spec: str) -> Any:
    module_name, name = spec.split(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ProfileError(
            f"cannot import {module_name!r} ({error}); PIPELINE is module:function, the module importable "
            "from the working directory or PYTHONPATH"
        ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ProfileError(f"{module_name} has no function {name!r}; PIPELINE is module:function")
    return function()


def _glob_dataset(spec: str) -> Any:
    """The dataset of its format over the files ``spec`` matches, read with its defaults."""
    import shardkit
    from shardkit.formats.registry import format_for
    from shardkit.formats.sniff import SNIFF_BYTES
    from shardkit.io.files import open_raw

    if not GLOB_CHARS.search(spec) and not os.path.isfile(spec):
        raise ProfileError(f"{spec}: not module:function, nor a glob or a file of shards")
    shards = shardkit.ShardList.from_glob(spec)
    kept = shard_indices(shards.urls(), spec) if GLOB_CHARS.search(spec) else list(range(len(shards)))
    if not kept:
        raise ProfileError(f"{spec}: matches only index and manifest files; give the shards")
    shards = shards if len(kept) == len(shards) else shards.select(kept)
    first = shards.urls()[0]
    with open_raw(first, "rb") as file:
        fmt = format_for(first, file.read(SNIFF_BYTES))
    datasets = {
        "tfrecord": shardkit.TFRecordDataset,
        "tar": shardkit.TarDataset,
        "parquet": shardkit.ParquetDataset,
        "jsonl": shardkit.JsonlDataset,
    }
    if fmt.name not in datasets:
        raise ProfileError(f"{first}: profile reads tfrecord, tar, parquet and jsonl globs, not {fmt.name}")
    return datasets[fmt.name](shards, balance="none")


def _run(loader: Any, seconds: float | None, batches: int | None) -> tuple[float, int, int]:
    """Iterate ``loader`` (epoch after epoch) for ``seconds`` or ``batches``; a progress bar on stderr.
    Returns the wall time, the samples and the bytes of the batches' arrays."""
    from tqdm import tqdm

    if seconds is None and batches is None:
        seconds = 10.0
    total = batches if batches is not None else seconds
    unit = "batch" if batches is not None else "s"
    samples = nbytes = count = 0
    start = time.perf_counter()
    with tqdm(total=total, unit=unit, file=sys.stderr, desc="shardkit profile", leave=False, disable=None) as bar:
        while True:
            produced = False
            for batch in loader:
                produced = True
                count += 1
                size, data = _measure(batch)
                samples, nbytes = samples + size, nbytes + data
                elapsed = time.perf_counter() - start
                bar.update(1 if batches is not None else round(elapsed - bar.n, 2))
                if (batches is not None and count >= batches) or (seconds is not None and elapsed >= seconds):
                    return time.perf_counter() - start, samples, nbytes
            if not produced:
                return time.perf_counter() - start, samples, nbytes


def _measure(batch: Any) -> tuple[int, int]:
    """(samples, bytes) of a batch: its first dimension and the bytes of its arrays and byte strings."""
    leaves = list(_leaves(batch))
    sizes = [len(leaf) for leaf in leaves if hasattr(leaf, "__len__") and not isinstance(leaf, (bytes, str))]
    data = 0
    for leaf in leaves:
        if hasattr(leaf, "nelement"):  # a tensor
            data += leaf.element_size() * leaf.nelement()
        elif isinstance(leaf, (bytes, bytearray)):
            data += len(leaf)
        else:  # numpy, Arrow arrays
            data += int(getattr(leaf, "nbytes", 0) or 0)
    return (sizes[0] if sizes else 1), data


def _leaves(batch: Any) -> Any:
    if isinstance(batch, dict):
        for value in batch.values():
            yield from _leaves(value)
    elif isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (dict, list, tuple)):
        for value in batch:
            yield from _leaves(value)
    else:
        yield batch


def diagnose(stats: Any) -> tuple[str, str]:
    """What bounds the loader, and what to try: from its :class:`~shardkit.loader.stalls.LoaderStats`."""
    workers = stats.workers
    if not workers:
        return "the main process", "read with DataLoader workers: num_workers >= 1 (no worker figures without them)"
    utilisation = sum(worker.utilisation for worker in workers) / len(workers)
    # Workers that never wait for the main process are the bound, busy or not: on a loaded
    # machine the time they are not busy may be time the scheduler gave to other processes.
    waiting = sum(w.idle_seconds / w.elapsed_seconds if w.elapsed_seconds else 0 for w in workers) / len(workers)
    if (utilisation >= BUSY or waiting <= 1 - BUSY) and stats.slowest_stage is not None:
        return _stage_bound(stats.slowest_stage[0], len(workers))
    if stats.assemble_seconds > stats.receive_seconds:
        return "the main process", (
            "it assembles batches slower than the workers make them: keep collate_fn=None (collation then "
            "happens in the workers), or read column batches (TFRecordDataset(features=..., batch_size=1024))"
        )
    if stats.slowest_stage is not None and stats.slowest_stage[0] == "state":
        return "transport of the dataset states the workers send", _STATE_ADVICE
    return "transport", (
        f"the workers are busy {utilisation:.0%} of the time, the main process waits to receive their "
        "micro-batches: make them larger (micro_batch_size), keep collate_fn=None (shared-memory slabs), or "
        "read column batches (features=)"
    )


_STATE_ADVICE = (
    "a .shuffle(n) buffer is encoded into every message's state: shuffle before decoding or use a smaller "
    "buffer, larger micro-batches, or MixedLoader(resumable=False) when you do not resume"
)


def _stage_bound(stage: str, workers: int) -> tuple[str, str]:
    more = f"more workers (now {workers}) if CPU cores are free"
    if stage.startswith("read "):
        return f"storage ({stage}: read, fetch and decode at the source)", (
            f"{more}; cache_dir= for remote shards read more than once; for TFRecord, column batches "
            "(features=..., batch_size=1024) skip the per-record decode"
        )
    if stage.startswith(("map(", "filter(")):
        return f"a map: {stage}", f"{more}; make the function cheaper, or fuse consecutive .map calls into one"
    if stage == "collate":
        return "collate", f"{more}; column batches (features=) collate no samples"
    if stage == "state":
        return "state (the dataset states the workers send with their micro-batches)", _STATE_ADVICE
    return stage, more


def report(stats: Any, wall: float, samples: int, nbytes: int) -> str:
    """The text ``shardkit profile`` prints."""
    lines = [
        f"{samples:,} samples in {stats.steps:,} batches, {wall:.2f} s: {samples / max(wall, 1e-9):,.0f} samples/s"
    ]
    if nbytes:
        lines[0] += f", {nbytes / max(wall, 1e-9) / 1e6:,.1f} MB/s of batch data"
    busy = sum(worker.busy_seconds for worker in stats.workers)
    if stats.stages:
        lines += ["", f"{'stage (summed over workers)':<40} {'seconds':>9} {'of busy':>8}"]
        for name, seconds in sorted(stats.stages.items(), key=lambda item: -item[1]):
            lines.append(f"{name:<40} {seconds:>9.3f} {seconds / busy if busy else 0:>8.0%}")
    lines += ["", f"{'worker':<8} {'busy':>6} {'idle':>6} {'samples':>9}"]
    for worker in stats.workers:
        lines.append(
            f"{worker.worker:<8} {worker.utilisation:>6.0%} "
            f"{worker.idle_seconds / worker.elapsed_seconds if worker.elapsed_seconds else 0:>6.0%} {worker.samples:>9,}"
        )
    lines.append(
        f"main process: waited {stats.wait_ratio:.0%} of the loop; receiving {stats.receive_seconds:.3f} s, "
        f"assembling {stats.assemble_seconds:.3f} s"
    )
    bound, suggestion = diagnose(stats)
    lines += ["", f"bound: {bound}", f"try: {suggestion}"]
    return "\n".join(lines)


def _write_json(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically: a temporary file beside it, renamed."""
    partial = f"{path}.partial-{os.getpid()}"
    try:
        with open(partial, "w") as file:
            json.dump(data, file)
        os.replace(partial, path)
    except OSError as error:
        if os.path.exists(partial):
            os.remove(partial)
        raise ProfileError(one_line(f"cannot write the trace to {path}: {error.strerror or error}")) from None
