"""Converting shards in one process against converting on Ray: records/s of each way on the same input.

The same input for every case: ``--records`` tf.Examples of a 1 KB payload (and an id) in ``--files``
TFRecord files, and as many JSON lines documents (``{"input_ids": [...]}``, 256 tokens each) in as many
files. Outputs are shards of at most ``--max-records`` records plus what a loader needs to plan.

TFRecord cases, records/s of wall time:

- ``convert``: one-process ``shardkit convert SRC DST --format tfrecord`` (records copied as bytes,
  reframed, manifest with counts);
- ``convert --ray, 1 / 2 workers``: the same conversion as ``shardkit convert --ray`` does it
  (``write_shards`` over one row per source file, each task reading its file), at most 1 or 2 write tasks
  at a time on one local Ray of 2 CPUs;
- ``rows -> write_shards``: the files' rows (id, payload) as a Ray dataset, each row encoded as a
  tf.Example by ``write_shards`` (2 workers);
- ``rows -> write_tfrecords + count``: the same rows through Ray Data's own ``write_tfrecords`` (it needs
  TensorFlow; the row is left out and says so without it), then the counting pass a loader needs before it
  can plan (Ray writes no counts and no index: each file scanned, ``shardkit``'s CRC-checked scan);
- ``rows -> write_parquet + count``: Ray Data's ``write_parquet``, then the counts from the footers.

Megatron cases: JSON lines -> Megatron ``.bin``/``.idx`` pairs, one process (a ``ShardWriter`` loop: the
CLI's ``convert`` has no Megatron target) against ``write_shards`` with 1 and 2 workers.

Ray starts once (its start-up is not in any case); every case writes a fresh folder. Cases run
interleaved, ``--rounds`` times, and the median of each is kept; ratios are over the one-process case of
the same round set, with the load average printed beside them. The per-task overhead is the time of a
``write_shards`` run over one-record files, per task; the ratio per added core is the 2-worker case over
the 1-worker one, minus one.

    python benchmarks/convert.py [--records 200000] [--files 8] [--rounds 5] [--quick]

``SHARDKIT_BENCH_RECORDS`` sets ``--records``' default (to scale a run to a slow machine).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np


def write_inputs(root: str, records: int, files: int) -> tuple[list[str], list[str]]:
    import shardkit

    rng = np.random.default_rng(0)
    per_file = -(-records // files)
    with shardkit.ShardWriter(f"{root}/src/train-%05d.tfrecord", max_records=per_file) as writer:
        for i in range(records):
            writer.write(shardkit.encode_example({"id": [i], "payload": [rng.bytes(1024)]}))
    os.makedirs(f"{root}/jsonl")
    jsonl = []
    for f in range(files):
        path = f"{root}/jsonl/docs-{f:05d}.jsonl"
        with open(path, "w") as out:
            for i in range(f * per_file, min(records, (f + 1) * per_file)):
                out.write(json.dumps({"input_ids": rng.integers(0, 50_000, 256).tolist()}) + "\n")
        jsonl.append(path)
    return writer.shards.urls(), jsonl


class FileRows:
    """A source file's tf.Examples as Ray rows ``{"id", "payload"}`` (flat_map)."""

    def __call__(self, row: dict) -> list[dict]:
        import shardkit

        return [
            {"id": int(e["id"][0]), "payload": e["payload"][0]}
            for e in map(shardkit.decode_example, shardkit.read_tfrecord(row["url"]))
        ]


class JsonlDocs:
    """``to_records`` for a row ``{"url"}``: the file's JSON lines documents."""

    def __call__(self, row: dict):
        from shardkit.formats.registry import formats

        yield from formats()["jsonl"].read(row["url"])


def cases(
    root: str, src: list[str], jsonl: list[str], records: int, max_records: int, have_tf: bool
) -> dict[str, Callable]:
    import ray

    from shardkit.cli import main
    from shardkit.cli.convert import FileRecords, _record_converter, _source_format
    from shardkit.formats.registry import formats
    from shardkit.ray import write_shards
    from shardkit.writer import ShardWriter

    convert = _record_converter(None, [(u, _source_format(u)) for u in src], "tfrecord")
    files = [{"url": u, "first": 0} for u in src]

    def one_process(out: str) -> None:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = main(["convert", f"{root}/src/*.tfrecord", f"{out}/part-%05d.tfrecord", "--format", "tfrecord",
                         "--max-records", str(max_records)])  # fmt: skip
        assert code == 0

    def on_ray(workers: int) -> Callable[[str], None]:
        def run(out: str) -> None:
            ds = ray.data.from_items(files, override_num_blocks=len(files))
            write_shards(ds, out, max_records=max_records, to_records=FileRecords(convert), index=False,
                         concurrency=workers)  # fmt: skip

        return run

    def rows():
        return ray.data.from_items(files, override_num_blocks=len(files)).flat_map(FileRows())

    def rows_write_shards(out: str) -> None:
        write_shards(rows(), out, max_records=max_records, concurrency=2)

    def rows_write_tfrecords(out: str) -> None:
        from shardkit.formats.tfrecord.framing import scan_count

        rows().write_tfrecords(out, concurrency=2)
        counts = [scan_count(os.path.join(out, name)) for name in sorted(os.listdir(out))]
        assert sum(counts) == records, counts

    def rows_write_parquet(out: str) -> None:
        import pyarrow.parquet as pq

        rows().write_parquet(out, concurrency=2)
        counts = [pq.ParquetFile(os.path.join(out, name)).metadata.num_rows for name in sorted(os.listdir(out))]
        assert sum(counts) == records, counts

    def megatron_one(out: str) -> None:
        jsonl_format = formats()["jsonl"]
        with ShardWriter(f"{out}/part-%05d.bin", max_records=max_records) as writer:
            for url in jsonl:
                for doc in jsonl_format.read(url):
                    writer.write(doc)

    def megatron_ray(workers: int) -> Callable[[str], None]:
        def run(out: str) -> None:
            ds = ray.data.from_items([{"url": u} for u in jsonl], override_num_blocks=len(jsonl))
            write_shards(ds, out, format="megatron", max_records=max_records, to_records=JsonlDocs(),
                         concurrency=workers)  # fmt: skip

        return run

    found = {
        "convert (one process)": one_process,
        "convert --ray, 1 worker": on_ray(1),
        "convert --ray, 2 workers": on_ray(2),
        "rows -> write_shards, 2 workers": rows_write_shards,
        "rows -> Ray write_parquet + count, 2 workers": rows_write_parquet,
        "megatron: one process": megatron_one,
        "megatron: write_shards, 1 worker": megatron_ray(1),
        "megatron: write_shards, 2 workers": megatron_ray(2),
    }
    if have_tf:
        found["rows -> Ray write_tfrecords + count, 2 workers"] = rows_write_tfrecords
    return found


def per_task_overhead(root: str, tasks: int = 8) -> float:
    """Seconds per write task of ``write_shards`` over one-record sources (the task, not the records)."""
    import ray

    from shardkit.ray import write_shards

    ds = ray.data.from_items([{"id": i, "text": "x"} for i in range(tasks)], override_num_blocks=tasks)
    start = time.perf_counter()
    write_shards(ds, f"{root}/overhead", max_records=1, concurrency=2)
    elapsed = time.perf_counter() - start
    shutil.rmtree(f"{root}/overhead")
    return elapsed / tasks * 2  # two at a time


def start_ray(tries: int = 4) -> None:
    """A new local Ray of 2 CPUs; tried again when its node does not register within Ray's fixed 30 s (a
    loaded machine)."""
    import ray

    for attempt in range(tries):
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
            return
        except Exception:
            if attempt == tries - 1:
                raise
            time.sleep(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=int(os.environ.get("SHARDKIT_BENCH_RECORDS", 200_000)))
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--max-records", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2,000 records, 2 rounds: does it run")
    args = parser.parse_args()
    records, rounds = (2_000, 2) if args.quick else (args.records, args.rounds)
    try:
        import ray
    except ImportError:
        print("Ray is not installed (pip install 'shardkit[ray]'): nothing to compare")
        return
    try:
        import tensorflow  # noqa: F401 - Ray Data's write_tfrecords builds its tf.Examples with it

        have_tf = True
    except ImportError:
        have_tf = False
    root = tempfile.mkdtemp(prefix="shardkit-convert-bench-")
    try:
        src, jsonl = write_inputs(root, records, args.files)
        start_ray()
        ray.data.DataContext.get_current().enable_progress_bars = False
        run(root, src, jsonl, records, rounds, max(1, min(args.max_records, records // 4)), have_tf)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        ray.shutdown()


def run(root: str, src: list[str], jsonl: list[str], records: int, rounds: int, max_records: int, have_tf: bool):
    todo = cases(root, src, jsonl, records, max_records, have_tf)
    for name, case in todo.items():  # warm: Ray's workers started and importing shardkit
        case(f"{root}/warm-{len(name)}")
        shutil.rmtree(f"{root}/warm-{len(name)}")
    times: dict[str, list[float]] = {name: [] for name in todo}
    loads = []
    for r in range(rounds):
        for name, case in todo.items():
            out = f"{root}/out-{r}"
            start = time.perf_counter()
            case(out)
            times[name].append(time.perf_counter() - start)
            shutil.rmtree(out)
        loads.append(os.getloadavg()[0])
    overhead = per_task_overhead(root)
    report(times, records, rounds, loads, overhead, have_tf)


def report(times: dict[str, list[float]], records: int, rounds: int, loads: list[float], overhead: float,
           have_tf: bool) -> None:  # fmt: skip
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{records} records of 1 KB, median of {rounds} interleaved rounds, load average "
          f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs\n")  # fmt: skip
    print("| case | records/s | over one process |")
    print("|---|---:|---:|")
    for name, seconds in median.items():
        base = median["megatron: one process" if name.startswith("megatron") else "convert (one process)"]
        print(f"| {name} | {records / seconds:,.0f} | {base / seconds:.2f}x |")
    if not have_tf:
        print("\nRay Data's write_tfrecords needs TensorFlow, which is not installed: its row is left out "
              "(pip install tensorflow-cpu to add it); write_parquet + footer counts stands for Ray's own writers.")  # fmt: skip
    one, two = median["convert --ray, 1 worker"], median["convert --ray, 2 workers"]
    print(f"\nper write task overhead: {overhead * 1000:.0f} ms")
    print(f"ratio per added core (convert --ray, 2 workers over 1, minus 1): {one / two - 1:+.2f}")
    mone, mtwo = median["megatron: write_shards, 1 worker"], median["megatron: write_shards, 2 workers"]
    print(f"ratio per added core (megatron, 2 workers over 1, minus 1): {mone / mtwo - 1:+.2f}")


if __name__ == "__main__":
    main()
