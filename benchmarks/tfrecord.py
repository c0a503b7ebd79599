"""TFRecord read throughput: shardkit vs the ``tfrecord`` package vs reading the bytes.

Targets, on 100k records of about 1 KB (about 105 MB):
- shardkit raw with CRC checks >= 2x the tfrecord package's raw iteration
  (which skips CRCs) and >= 0.7x the throughput of reading the file's bytes;
- shardkit decoding to numpy >= 5x the tfrecord package's parsed loader.

Decoding runs with the decoder ``shardkit.formats.example.BACKEND`` picked
(the compiled one where built), with the pure-Python one beside it, and as
columns (``decode_columns`` over blocks of ``--block`` records, the four
fixed-shape features of the benchmark's records).

Cases run round-robin, ``--repeat`` times, and the best time of each is kept,
so that load from other processes hurts every case alike. Ratios use CPU time
(``time.process_time``): every case is single-threaded, so on an idle machine
it equals wall time, and on a shared one it swings far less; wall time is
printed beside it. Two more lines back
the implementation choices: the two CRC-32C packages, and protobuf's C runtime
(upb) with conversion to numpy as an alternative Example decoder.

The raw path against the disk (``--kernel``, or alone with ``--kernel-only``):
per-record ``read_tfrecord`` and ``read_tfrecord_batches`` (Arrow arrays of
``--batch-records`` records), both CRCs checked, each with the compiled framing
kernel and with the pure-Python one, as ratios of the fastest plain read of the
file's bytes in the same process (the fastest of ``f.read()`` of the whole file,
``f.read`` of :data:`BLOCK_SIZE` blocks, ``readinto`` a reused buffer and
``os.preadv`` into one: none of them shaped by the readers' own buffer pools):
CPU-time medians of interleaved rounds. The batches run
in both layouts, ``large_binary`` (the default) and ``binary_view`` (no copy);
with the compiled kernel they read the file in C, a batch per call
(``read_pack``/``read_views``; ``read_tfrecord``: ``read_cut``, a list of ``bytes``
per call, shown beside the block reader it replaced), with the Python one block by block.
Targets: per-record >= 0.5x and batches >= 0.8x of that fastest plain read.
What bounds them is printed as the floor: the fastest plain read plus what
checking every record's data CRC adds to it (``os.preadv`` of 256 KiB, the
records framed and checked by the kernel, against the same with the checks
off: :func:`read_and_check`), with each target's ratio to that floor, and the
CRC-32C packages' cost for the same records beside the kernel's.
The load average is printed with the table: on a shared machine the cases
that work on cache-resident blocks lose more to neighbours than plain reads.

A last table (``--sources``, or alone with ``--sources-only``) measures how a
local file's blocks are read: a memory map (what the reader used to do; a file
truncated under it kills the process with SIGBUS), ``os.pread`` into a fresh
``bytes`` per block (what it does now), and ``readinto`` a reused buffer with
records copied out of a memoryview. All three share the framing and CRC code;
CPU-time medians of interleaved rounds, as ratios to the memory map.

    python benchmarks/tfrecord.py [--records 100000] [--repeat 5] [--block 256] [--path FILE]
        [--sources | --sources-only] [--kernel | --kernel-only] [--batch-records 1024]
"""

from __future__ import annotations

import argparse
import itertools
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np

from shardkit import (
    TFRecordWriter,
    decode_columns,
    decode_example,
    encode_example,
    read_tfrecord,
    read_tfrecord_batches,
)
from shardkit.formats import example as example_module
from shardkit.formats.example.backend import COMPILED
from shardkit.formats.example.columns import _decode_columns
from shardkit.formats.tfrecord import framing as tfr
from shardkit.formats.tfrecord import kernel
from shardkit.io.files import BLOCK_SIZE

# This script's name would shadow the ``tfrecord`` package it compares against.
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]


def make_file(path: str, records: int) -> None:
    """Examples of about 1 KB: a 900-byte image, a label, 16 scores, 8 ids."""
    rng = np.random.default_rng(0)
    with TFRecordWriter(path) as writer:
        for i in range(records):
            writer.write(
                encode_example(
                    {
                        "image": rng.bytes(900),
                        "label": i % 1000,
                        "score": rng.random(16, dtype=np.float32),
                        "ids": np.arange(i % 7, i % 7 + 8),
                    }
                )
            )


# The benchmark records' features as fixed-shape columns (see make_file).
FEATURES = {"image": ("bytes", ()), "label": ("int64", ()), "score": ("float32", (16,)), "ids": ("int64", (8,))}


def cases(path: str, block: int) -> dict[str, Callable[[], int]]:
    from tfrecord.reader import tfrecord_iterator, tfrecord_loader

    def raw_read() -> int:
        n = 0
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(BLOCK_SIZE):
                n += len(chunk)
        return n

    def shardkit_raw(verify: bool) -> Callable[[], int]:
        def run() -> int:
            n = 0
            for _ in read_tfrecord(path, verify=verify):
                n += 1
            return n

        return run

    def shardkit_decoded(decode: Callable[[bytes], object]) -> Callable[[], int]:
        def run() -> int:
            n = 0
            for record in read_tfrecord(path):
                decode(record)
                n += 1
            return n

        return run

    def shardkit_columns() -> int:
        n = 0
        records = read_tfrecord(path)
        while chunk := list(itertools.islice(records, block)):
            decode_columns(chunk, FEATURES)
            n += len(chunk)
        return n

    def tfrecord_raw() -> int:
        n = 0
        for _ in tfrecord_iterator(path):
            n += 1
        return n

    def tfrecord_parsed() -> int:
        n = 0
        for _ in tfrecord_loader(path, None):
            n += 1
        return n

    return {
        "read the file's bytes": raw_read,
        "shardkit raw, CRC on": shardkit_raw(True),
        "shardkit raw, CRC off": shardkit_raw(False),
        "shardkit decoded (CRC on)": shardkit_decoded(decode_example),
        "  same, pure Python": shardkit_decoded(example_module.decode_example_python),
        "shardkit columns (CRC on)": shardkit_columns,
        "tfrecord raw (no CRC)": tfrecord_raw,
        "tfrecord parsed": tfrecord_parsed,
    }


def protobuf_decoder(records: list[bytes]) -> Callable[[], None]:
    """The alternative decoder: protobuf's C runtime (upb), values to numpy."""
    from tfrecord import example_pb2

    def run() -> None:
        parse = example_pb2.Example.FromString
        for record in records:
            out = {}
            for key, feature in parse(record).features.feature.items():
                kind = feature.WhichOneof("kind")
                if kind == "int64_list":
                    out[key] = np.array(feature.int64_list.value, dtype=np.int64)
                elif kind == "float_list":
                    out[key] = np.array(feature.float_list.value, dtype=np.float32)
                else:
                    out[key] = list(feature.bytes_list.value) if kind else []

    return run


def best(fn: Callable[[], object], repeat: int) -> float:
    """Best CPU time of ``repeat`` runs."""
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--block", type=int, default=256, help="records per decode_columns call")
    parser.add_argument("--path", default=None, help="benchmark file (default: in the temp dir, made once)")
    parser.add_argument("--sources", action="store_true", help="also compare mmap, pread and readinto block reads")
    parser.add_argument("--sources-only", action="store_true", help="only compare the block reads")
    parser.add_argument("--kernel", action="store_true", help="also compare the raw readers with reading the bytes")
    parser.add_argument("--kernel-only", action="store_true", help="only compare the raw readers with the bytes")
    parser.add_argument("--batch-records", type=int, default=1024, help="records per read_tfrecord_batches array")
    args = parser.parse_args()
    path = args.path or os.path.join(tempfile.gettempdir(), f"shardkit-bench-{args.records}.tfrecord")
    if not os.path.exists(path):
        make_file(path, args.records)
    if args.sources_only:
        block_sources(path, max(args.repeat, 5))
        return
    if args.kernel_only:
        kernel_ratios(path, max(args.repeat, 5), args.batch_records)
        return
    size = os.path.getsize(path)
    print(f"{path}: {args.records:,} records, {size / 1e6:.1f} MB, best of {args.repeat} runs")
    print(f"decoder backend: {example_module.BACKEND}")

    runs = cases(path, args.block)
    times = {name: float("inf") for name in runs}
    walls = dict(times)
    for _ in range(args.repeat):  # round-robin: background load hits every case alike
        for name, fn in runs.items():
            start, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name] = min(times[name], time.process_time() - cpu)
            walls[name] = min(walls[name], time.perf_counter() - start)

    raw_read, tf_raw, tf_parsed = (
        times["read the file's bytes"],
        times["tfrecord raw (no CRC)"],
        times["tfrecord parsed"],
    )
    print(
        f"{'case':<28}{'CPU s':>8}{'wall s':>8}{'MB/s':>7}{'vs tfrecord raw':>17}{'vs read':>9}{'vs tfrecord parsed':>20}"
    )
    for name, seconds in times.items():
        print(
            f"{name:<28}{seconds:>8.3f}{walls[name]:>8.3f}{size / seconds / 1e6:>7.0f}"
            f"{tf_raw / seconds:>16.2f}x{raw_read / seconds:>8.2f}x{tf_parsed / seconds:>19.2f}x"
        )
    crc_on, decoded = times["shardkit raw, CRC on"], times["shardkit decoded (CRC on)"]
    print("targets:")
    print(
        f"  raw with CRC >= 2x tfrecord raw:        {tf_raw / crc_on:5.2f}x  {'met' if tf_raw / crc_on >= 2 else 'NOT met'}"
    )
    print(
        f"  raw with CRC >= 0.7x reading the bytes: {raw_read / crc_on:5.2f}x  {'met' if raw_read / crc_on >= 0.7 else 'NOT met'}"
    )
    print(
        f"  decoded >= 5x tfrecord parsed:          {tf_parsed / decoded:5.2f}x  {'met' if tf_parsed / decoded >= 5 else 'NOT met'}"
    )

    records = list(read_tfrecord(path, stop=20_000, verify=False))
    scale = args.records / len(records)
    print(f"choices (CPU s per {args.records:,} records, scaled from {len(records):,}; best of {args.repeat * 3}):")
    crcs = crc_functions()
    big = [os.urandom(1 << 20) for _ in range(64)]
    best_of = {name: [float("inf"), float("inf")] for name in crcs}
    for _ in range(args.repeat * 3):  # round-robin again: the two packages are close
        for name, crc in crcs.items():
            best_of[name][0] = min(best_of[name][0], best(lambda crc=crc: list(map(crc, records)), 1))
            best_of[name][1] = min(best_of[name][1], best(lambda crc=crc: list(map(crc, big)), 1))
    for name, (small, large) in best_of.items():
        print(f"  data CRCs with {name:<22}{small * scale:>7.3f} s   (64 MB in 1 MB buffers: {large:.4f} s)")

    def decoder(decode: Callable[[bytes], object]) -> Callable[[], None]:
        return lambda: [decode(record) for record in records]

    def columns(compiled: object) -> Callable[[], None]:
        blocks = [records[i : i + args.block] for i in range(0, len(records), args.block)]
        return lambda: [_decode_columns(b, FEATURES, compiled) for b in blocks]

    compiled = COMPILED
    per_record = 1e6 / len(records)
    choices = {
        f"decode with shardkit ({example_module.BACKEND})": decoder(decode_example),
        "decode with shardkit (pure Python)": decoder(example_module.decode_example_python),
        f"decode_columns ({'c' if compiled is not None else 'python'}), {args.block}/call": columns(compiled),
        f"decode_columns (pure Python), {args.block}/call": columns(None),
        "decode with protobuf upb + numpy": protobuf_decoder(records),
    }
    for name, fn in choices.items():
        seconds = best(fn, args.repeat)
        print(f"  {name:<40}{seconds * scale:>7.3f} s  ({seconds * per_record:.2f} us/record)")
    if args.sources:
        block_sources(path, max(args.repeat, 5))
    if args.kernel:
        kernel_ratios(path, max(args.repeat, 5), args.batch_records)


def kernel_ratios(path: str, rounds: int, batch_records: int) -> None:
    """Print the raw readers' CPU-time medians of interleaved rounds as ratios of the fastest plain read of the
    file's bytes (:func:`plain_reads`), all in this process."""

    def per_record(kern: kernel.Kernel, verify: bool = True) -> Callable[[], int]:
        def run() -> int:
            kernel.KERNEL = kern  # the framing module looks it up per block
            try:
                for _ in read_tfrecord(path, verify=verify):  # the plainest loop a caller writes
                    pass
                return 0
            finally:
                kernel.KERNEL = chosen

        return run

    def batches(kern: kernel.Kernel, arrow_type: str, verify: bool = True) -> Callable[[], int]:
        def run() -> int:
            kernel.KERNEL = kern
            try:
                arrays = read_tfrecord_batches(path, batch_records=batch_records, arrow_type=arrow_type, verify=verify)
                return sum(len(array) for array in arrays)
            finally:
                kernel.KERNEL = chosen

        return run

    chosen = kernel.KERNEL
    runs = plain_reads(path)
    if chosen.read_views is not None:  # the floor: a plain read plus the data CRCs (see read_and_check)
        runs[CHECKED] = read_and_check(path, chosen, verify=True)
        runs[FRAMED] = read_and_check(path, chosen, verify=False)
    for kern in dict.fromkeys([chosen, kernel.PYTHON]):
        runs[f"read_tfrecord, {kern.name} kernel"] = per_record(kern)
        runs[f"read_tfrecord_batches, {kern.name} kernel"] = batches(kern, "large_binary")
        runs[f"  same, binary_view, {kern.name} kernel"] = batches(kern, "binary_view")
        if kern is chosen:  # what bounds the targets: the readers with no CRC checked
            runs[f"  read_tfrecord, CRC off, {kern.name} kernel"] = per_record(kern, verify=False)
            if kern.read_cut is not None:  # the block reader read_cut replaced (a Python call per 256 KB block)
                runs[f"  read_tfrecord, block reader, {kern.name} kernel"] = per_record(kern._replace(read_cut=None))
            runs[f"  binary_view batches, CRC off, {kern.name} kernel"] = batches(kern, "binary_view", verify=False)
    for fn in runs.values():  # warms the page cache
        fn()
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):  # interleaved: background load hits every case alike
        for name, fn in runs.items():
            start = time.process_time()
            fn()
            cpu[name].append(time.process_time() - start)
    median = {name: statistics.median(times) for name, times in cpu.items()}
    size = os.path.getsize(path)
    plain = [name for name in runs if name.startswith(PLAIN)]
    fastest = min(plain, key=median.__getitem__)
    base = median[fastest]
    vector = getattr(kernel.COMPILED, "VECTOR_CRC", 0)
    crc = {1: "AVX-512 folding", 2: "AVX2 VPCLMULQDQ folding"}.get(vector, "crc32 instruction or tables")
    print(
        f"raw path vs the bytes: {size / 1e6:.1f} MB, CPU s (median of {rounds} interleaved rounds), "
        f"batches of {batch_records}; kernel backend: {kernel.BACKEND} (data CRCs: {crc}); load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'case':<46}{'CPU s':>8}{'MB/s':>7}{'vs fastest plain read':>23}")
    for name, seconds in median.items():
        print(f"{name:<46}{seconds:>8.3f}{size / seconds / 1e6:>7.0f}{base / seconds:>22.2f}x")
    floor = None
    if CHECKED in median:  # the plain read plus what checking every record's data CRC adds to it
        crcs = max(0.0, median[CHECKED] - median[FRAMED])
        floor = base + crcs
        print(
            f"floor: the fastest plain read + the data CRCs ({crcs:.4f} s, {size / max(crcs, 1e-9) / 1e9:.0f} GB/s):"
            f"{floor:>8.3f}{size / floor / 1e6:>7.0f}{base / floor:>22.2f}x"
        )
        crc_packages(path, rounds, crcs)
    print(f"targets, against the fastest plain read of the same bytes ({fastest.removeprefix(PLAIN)}):")
    for name, target in (
        (f"read_tfrecord, {chosen.name} kernel", 0.5),
        (f"read_tfrecord_batches, {chosen.name} kernel", 0.8),
        (f"  same, binary_view, {chosen.name} kernel", 0.8),
    ):
        ratio = base / median[name]
        of_floor = f"  ({floor / median[name]:.2f}x of the floor)" if floor is not None else ""
        print(f"  {name} >= {target}x: {ratio:.2f}x  {'met' if ratio >= target else 'NOT met'}{of_floor}")


PLAIN = "plain read: "
CHECKED = "read + data CRCs: preadv 256 KiB, frame, check"
FRAMED = "  same, CRCs off: preadv, frame"


def read_and_check(path: str, kern: kernel.Kernel, verify: bool) -> Callable[[], int]:
    """The floor's measurement: ``os.preadv`` into a reused buffer of
    :data:`~shardkit.formats.tfrecord.framing.LOCAL_BLOCK_SIZE` (the plain read), the records of each read framed
    (length CRCs not checked) and, with ``verify``, their data CRCs checked by the kernel's ``views`` (views written
    to a reused scratch, 16 bytes a record), a record cut off at a read's end read again with the next. Without
    ``verify`` it is the same minus the data CRCs: the difference is what checking them costs in this process (the
    fastest CRC-32C here: the kernel's, twelve records at a time; see :func:`crc_packages`)."""

    def run() -> int:
        block = tfr.LOCAL_BLOCK_SIZE
        buf = bytearray(block)
        view = memoryview(buf)
        scratch = np.empty(kernel.VIEW_BYTES * block // 16, dtype=np.uint8)  # a view per 16 bytes at most
        fd, pos, count = os.open(path, os.O_RDONLY), 0, 0
        try:
            while got := os.preadv(fd, [buf], pos):
                ends, _ = kern.frame(view, 0, got, False)
                if not len(ends):
                    break  # (the benchmark's records are far shorter than a read)
                if kern.views(view, 0, ends, 0, len(ends), verify, scratch, 0) >= 0:
                    raise AssertionError(f"{path}: a bad data CRC in the benchmark's file")
                count += len(ends)
                pos += int(ends[-1])
        finally:
            os.close(fd)
        return count

    return run


def crc_packages(path: str, rounds: int, ours: float) -> None:
    """Print the data CRCs' cost by the CRC-32C packages installed (a call per record, on records already in
    memory), beside the kernel's (``ours``: what checking them added to a read, above)."""
    with open(path, "rb") as f:
        data = f.read()
    ends, _ = kernel.KERNEL.frame(data, 0, len(data), False)
    starts = np.concatenate([[0], ends[:-1]]) + 12  # each record's data, after its 12-byte header
    view = memoryview(data)
    records = [view[a:b] for a, b in zip(starts.tolist(), (ends - 4).tolist())]
    found = crc_functions()
    line = f"  data CRCs alone: the kernel's {ours:.4f} s (measured above)"
    for name, crc in found.items():
        wants_bytes = name.startswith("google")  # google_crc32c.value takes bytes only
        items = [bytes(r) for r in records] if wants_bytes else records
        times = []
        for _ in range(rounds):
            start = time.process_time()
            for record in items:
                crc(record)
            times.append(time.process_time() - start)
        line += f"; {name}, a call per record: {statistics.median(times):.4f} s"
    print(line)


def plain_reads(path: str) -> dict[str, Callable[[], int]]:
    """The plain ways of reading a file's bytes, none shaped by the readers' buffer pools; the fastest
    of them in this process is the baseline (which wins depends on the machine and the allocator: a
    whole-file ``f.read`` maps and faults in a fresh buffer each time, a reused one does not)."""

    def read_in(block: int) -> Callable[[], int]:
        def run() -> int:
            n = 0
            with open(path, "rb", buffering=0) as f:
                while chunk := f.read(block):
                    n += len(chunk)
            return n

        return run

    def read_whole() -> int:
        with open(path, "rb", buffering=0) as f:
            return len(f.read())

    def readinto(block: int) -> Callable[[], int]:
        def run() -> int:
            n, buf = 0, bytearray(block)
            with open(path, "rb", buffering=0) as f:
                while got := f.readinto(buf):
                    n += got
            return n

        return run

    def preadv(block: int) -> Callable[[], int]:
        def run() -> int:
            n, buf = 0, bytearray(block)
            fd = os.open(path, os.O_RDONLY)
            try:
                while got := os.preadv(fd, [buf], n):
                    n += got
            finally:
                os.close(fd)
            return n

        return run

    kib = tfr.LOCAL_BLOCK_SIZE >> 10
    return {
        f"{PLAIN}f.read() whole file": read_whole,
        f"{PLAIN}f.read({BLOCK_SIZE >> 20} MiB) blocks": read_in(BLOCK_SIZE),
        f"{PLAIN}readinto a reused {kib} KiB buffer": readinto(tfr.LOCAL_BLOCK_SIZE),
        f"{PLAIN}readinto a reused 1 MiB buffer": readinto(1 << 20),
        f"{PLAIN}os.preadv, a reused {kib} KiB buffer": preadv(tfr.LOCAL_BLOCK_SIZE),
    }


def mapped_batches(path: str, verify: bool) -> Iterator[list[bytes]]:
    """The reader as it was: blocks framed in a read-only memory map of the file."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    src = tfr._Origin(path, None)
    pos, index = 0, 0
    while pos < len(mapped):
        ends, bad = kernel.KERNEL.frame(mapped, pos, min(len(mapped), pos + BLOCK_SIZE), verify)
        if not len(ends) and not bad:  # a record longer than a block
            ends, bad = kernel.KERNEL.frame(mapped, pos, len(mapped), verify)
        for block in tfr._checked(tfr._Block(mapped, pos, ends, index, 0), bad, src):  # type: ignore[arg-type]
            yield from tfr._batches(block, 0, len(block.ends), src, verify)
        index += len(ends)
        pos = int(ends[-1])


def pread_batches(path: str, verify: bool) -> Iterator[list[bytes]]:
    """The reader as it is: one ``os.preadv`` into a fresh buffer per block."""
    fd = os.open(path, os.O_RDONLY)
    try:
        src = tfr._Origin(path, None)
        for block in tfr._file_blocks(fd, src, 0, 0, verify):
            yield from tfr._batches(block, 0, len(block.ends), src, verify)
    finally:
        os.close(fd)


def readinto_batches(path: str, verify: bool) -> Iterator[list[bytes]]:
    """The alternative: ``readinto`` one reused buffer, records copied out of it (no error paths)."""
    buf = bytearray(BLOCK_SIZE)
    view = memoryview(buf)
    src = tfr._Origin(path, None)
    with open(path, "rb", buffering=0) as f:
        pos = index = 0
        while n := f.readinto(buf):
            ends, bad = kernel.KERNEL.frame(view, 0, n, verify)
            for block in tfr._checked(tfr._Block(view, 0, ends, index, pos), bad, src):
                yield from tfr._batches(block, 0, len(block.ends), src, verify)
            index += len(ends)
            pos += int(ends[-1])
            f.seek(pos)


def block_sources(path: str, rounds: int) -> None:
    """Print CPU-time medians of interleaved rounds for the three ways of reading a local file's blocks."""
    sources = {
        "mmap (before)": mapped_batches,
        "preadv, reused buffers (now)": pread_batches,
        "readinto + memoryview": readinto_batches,
    }
    runs = {
        (name, verify): (lambda fn=fn, verify=verify: sum(1 for _ in itertools.chain.from_iterable(fn(path, verify))))
        for name, fn in sources.items()
        for verify in (True, False)
    }
    runs[("read_tfrecord (now)", True)] = lambda: sum(1 for _ in read_tfrecord(path))
    runs[("read_tfrecord (now)", False)] = lambda: sum(1 for _ in read_tfrecord(path, verify=False))
    counts = {fn() for fn in runs.values()}  # also warms the page cache
    assert len(counts) == 1, counts
    cpu: dict[tuple[str, bool], list[float]] = {key: [] for key in runs}
    for _ in range(rounds):  # interleaved: background load hits every case alike
        for key, fn in runs.items():
            start = time.process_time()
            fn()
            cpu[key].append(time.process_time() - start)
    median = {key: statistics.median(times) for key, times in cpu.items()}
    print(f"local block sources, {counts.pop():,} raw records, CPU s (median of {rounds} interleaved rounds):")
    print(f"{'source':<28}{'CRC on':>9}{'vs mmap':>9}{'CRC off':>9}{'vs mmap':>9}")
    for name in [*sources, "read_tfrecord (now)"]:
        on, off = median[(name, True)], median[(name, False)]
        base_on, base_off = median[("mmap (before)", True)], median[("mmap (before)", False)]
        print(f"{name:<28}{on:>9.3f}{on / base_on:>8.2f}x{off:>9.3f}{off / base_off:>8.2f}x")


def crc_functions() -> dict[str, Callable[[bytes], int]]:
    """The CRC-32C packages installed, by the name of their function."""
    import importlib

    found = {}
    for module, function in (("crc32c", "crc32c"), ("google_crc32c", "value")):
        try:
            found[f"{module}.{function}"] = getattr(importlib.import_module(module), function)
        except ImportError:
            print(f"  ({module} is not installed)")
    return found


if __name__ == "__main__":
    main()
