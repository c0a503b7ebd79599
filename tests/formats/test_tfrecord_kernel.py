"""The TFRecord framing kernel: the compiled one (``_tfrecord.c``) and the Python one agree, byte for byte and error for error.

Both are run side by side on hypothesis-generated valid files, on mutated
bytes (flipped, inserted, deleted and duplicated bytes, forged lengths with
valid CRCs), and on every cut of a small file, through the kernel's own
operations and through ``read_tfrecord`` / ``read_tfrecord_batches`` with the
one or the other swapped in. The C kernel also runs over thousands of mutated
files and nonsense arguments in a subprocess, so that a memory error fails a
test instead of killing the runner.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pytest
from crc32c import crc32c as crc32c_package
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit
from shardkit import CorruptRecordError
from shardkit.formats.crc import masked_crc32c
from shardkit.formats.tfrecord import TFRecordWriter, build_index, kernel, read_tfrecord, read_tfrecord_batches
from shardkit.formats.tfrecord import arrays as arrays_module
from shardkit.formats.tfrecord import buffers as buffers_module
from shardkit.formats.tfrecord import framing as tfr
from shardkit.formats.tfrecord.buffers import BlockBuffers, shared_buffers
from shardkit.io import files as skio
from tests.helpers.examples import examples
from tests.helpers.load import hang_bound

try:
    from shardkit.formats import _tfrecord as compiled  # pyright: ignore[reportAttributeAccessIssue]
except ImportError:  # not built: its tests skip, except test_ci_runs_with_the_c_kernel_built under CI
    compiled = None

NOT_BUILT = "C kernel not built (pip install -e .)"
KERNELS = [
    pytest.param(kernel.PYTHON, id="python"),
    pytest.param(
        kernel._c_kernel(compiled) if compiled is not None else None,
        id="c",
        marks=pytest.mark.skipif(compiled is None, reason=NOT_BUILT),
    ),
]
needs_c = pytest.mark.skipif(compiled is None, reason=NOT_BUILT)


def framed(record: bytes, *, length: int | None = None) -> bytes:
    """A record framed by hand from the format description; ``length`` forges the length field (with a valid CRC)."""
    head = struct.pack("<Q", len(record) if length is None else length)
    return head + struct.pack("<I", masked_crc32c(head)) + record + struct.pack("<I", masked_crc32c(record))


def c_kernel() -> kernel.Kernel:
    assert compiled is not None
    return kernel._c_kernel(compiled)


# --------------------------------------------------------------------------- backend


def test_the_compiled_kernel_is_used_when_built() -> None:
    expected = "c" if compiled is not None and os.environ.get("SHARDKIT_PURE_PYTHON", "") in ("", "0") else "python"
    assert kernel.BACKEND == expected
    assert kernel.KERNEL.name == expected


def test_ci_runs_with_the_c_kernel_built() -> None:
    """CI must exercise both kernels: there a missing extension is a failure, not a skip."""
    if compiled is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but shardkit.formats._tfrecord is not built: `pip install -e .` must compile it")
        pytest.skip(NOT_BUILT)
    assert compiled.crc32c(b"123456789") == 0xE3069283


def test_shardkit_pure_python_forces_the_python_kernel() -> None:
    code = "from shardkit.formats.tfrecord import kernel; print(kernel.BACKEND)"
    env = {**os.environ, "SHARDKIT_PURE_PYTHON": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "python"


# --------------------------------------------------------------------------- CRC-32C


@needs_c
@settings(max_examples=examples(300), deadline=None)
@given(data=st.binary(max_size=3 * 8192 * 2 + 40), skip=st.integers(0, 7))
def test_the_c_crc32c_matches_the_crc32c_package_in_hardware_and_in_tables(data: bytes, skip: int) -> None:
    view = memoryview(data)[skip:]
    assert compiled is not None
    assert compiled.crc32c(view) == compiled.crc32c_software(view) == crc32c_package(view)


@needs_c
def test_the_c_crc32c_matches_on_every_length_around_its_interleaved_blocks() -> None:
    assert compiled is not None
    data = random.Random(3).randbytes(3 * 8192 * 2 + 64)
    for n in [*range(0, 80), *range(3 * 256 - 9, 3 * 256 + 9), *range(3 * 8192 - 9, 3 * 8192 + 9), len(data)]:
        assert compiled.crc32c(data[:n]) == compiled.crc32c_software(data[:n]) == crc32c_package(data[:n]), n


@needs_c
def test_the_c_crc32c_matches_on_every_length_around_its_folding_steps_with_and_without_avx512() -> None:
    """Lengths around the carry-less folding's 256-, 64- and 32-byte steps, in this process (AVX-512, or AVX2 with
    VPCLMULQDQ, when the CPU has it) and in one with ``SHARDKIT_NO_AVX512`` set (four crc32 streams), against the
    crc32c package."""
    data = random.Random(5).randbytes(4096 + 64)
    lengths = [*range(240, 400), *range(1000, 1040), 2048, 4095, 4096, len(data)]
    assert [compiled.crc32c(data[:n]) for n in lengths] == [crc32c_package(data[:n]) for n in lengths]  # type: ignore[union-attr]
    records = [data[i % 7 : i % 7 + n] for i, n in enumerate(lengths)]  # four at a time: AVX-512 or AVX2 folding
    assert compiled.crc32c_records(records) == [crc32c_package(r) for r in records]  # type: ignore[union-attr]
    probe = (
        "import json, random, sys; from shardkit.formats import _tfrecord as k; data = random.Random(5).randbytes(4160);"
        f"lengths = {lengths!r}; records = [data[i % 7 : i % 7 + n] for i, n in enumerate(lengths)];"
        "print(json.dumps([k.VECTOR_CRC, [k.crc32c(data[:n]) for n in lengths], k.crc32c_records(records)]))"
    )
    vector, crcs, grouped = json.loads(run_python(probe, SHARDKIT_NO_AVX512="1"))  # three crc32 streams at once
    assert vector == 0 and crcs == [crc32c_package(data[:n]) for n in lengths]
    assert grouped == [crc32c_package(data[i % 7 : i % 7 + n]) for i, n in enumerate(lengths)]


@needs_c
@settings(max_examples=examples(200), deadline=None)
@given(
    sizes=st.lists(st.one_of(st.integers(0, 80), st.integers(0, 1200)), max_size=11),
    skip=st.integers(0, 63),
)
def test_the_c_kernel_checks_four_records_at_once_as_the_crc32c_package_checks_one(sizes: list[int], skip: int) -> None:
    """The interleaved CRCs (four folding registers, three crc32 streams) on records of any mix of lengths, at any
    alignment, are each record's own CRC."""
    data = random.Random(sum(sizes) + skip).randbytes(sum(sizes) + skip)
    records, at = [], skip
    for n in sizes:
        records.append(data[at : at + n])
        at += n
    assert compiled.crc32c_records(records) == [crc32c_package(r) for r in records]  # type: ignore[union-attr]


@needs_c
def test_the_c_kernel_checks_records_of_every_length_up_to_4096_at_any_alignment_as_the_crc32c_package() -> None:
    """Every length 0..4096, in groups of twelve of nearby lengths at random offsets (on a CPU with AVX2 folding and
    not AVX-512, six at once by three crc32 streams and three folding chains; a group with a record under 32 bytes
    falls back to four at a time), each record's CRC the crc32c package's."""
    rng = random.Random(11)
    data = rng.randbytes(4096 + 64 + 16)
    assert compiled is not None
    for n in range(4097):
        records = [data[(at := rng.randrange(64)) : at + max(0, n + rng.randrange(-3, 4))] for _ in range(12)]
        assert compiled.crc32c_records(records) == [crc32c_package(r) for r in records], n


@needs_c
@settings(max_examples=examples(300), deadline=None)
@given(
    sizes=st.lists(st.one_of(st.integers(0, 64), st.integers(0, 4096)), min_size=6, max_size=30),
    skips=st.lists(st.integers(0, 63), min_size=30, max_size=30),
)
def test_the_c_kernel_checks_six_and_twelve_records_at_once_as_the_crc32c_package_checks_one(
    sizes: list[int], skips: list[int]
) -> None:
    """Groups of records of any mix of lengths, each at its own alignment: whichever interleaved path a group takes,
    each record's CRC is its own."""
    data = random.Random(sum(sizes)).randbytes(4096 + 64)
    records = [data[skip : skip + n] for n, skip in zip(sizes, skips)]
    assert compiled.crc32c_records(records) == [crc32c_package(r) for r in records]  # type: ignore[union-attr]


def run_python(code: str, **env: str) -> str:
    """``code``'s output in a child interpreter with this checkout importable and ``env`` set."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    full_env = {**os.environ, **env, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=full_env, capture_output=True, text=True, timeout=hang_bound(120)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


# --------------------------------------------------------------------------- the kernel's operations


def outcome(kern: kernel.Kernel, buf: bytes, pos: int = 0) -> dict[str, object]:
    """Everything a kernel says about a buffer: ends, a bad length, the records cut and packed, a bad data CRC."""
    ends, bad_length = kern.frame(buf, pos, len(buf), True)
    unchecked, _ = kern.frame(buf, pos, len(buf), False)
    records, bad = kern.cut(buf, pos, ends, 0, len(ends), True)
    values = np.zeros(len(buf) + 3, np.uint8)
    offsets = np.zeros(len(ends) + 1, np.int64)
    bad_packed = kern.pack(buf, pos, ends, 0, len(ends), True, values, offsets, 3)
    done = len(records)
    packed = [values[offsets[i] : offsets[i + 1]].tobytes() for i in range(done)]
    views = np.full(kernel.VIEW_BYTES * len(ends), 0xAB, np.uint8)
    bad_views = kern.views(buf, pos, ends, 0, len(ends), True, views, 1)
    good = bad_views if bad_views >= 0 else len(ends)
    return {
        "ends": ends.tolist(),
        "bad_length": bad_length,
        "unchecked": unchecked.tolist(),
        "records": records,
        "bad": bad,
        "packed": packed,
        "bad_packed": bad_packed,
        "unverified": kern.cut(buf, pos, ends, 0, len(ends), False)[0],
        "views": views[: kernel.VIEW_BYTES * good].tobytes(),
        "viewed": view_array(views, good, buf).to_pylist(),
        "bad_views": bad_views,
    }


def view_array(views: np.ndarray, count: int, buf: bytes) -> pa.BinaryViewArray:
    """The views as an Arrow array over ``buf`` (data buffer 1; 0 is empty), validated in full."""
    buffers = [None, pa.py_buffer(views[: kernel.VIEW_BYTES * count]), pa.py_buffer(b""), pa.py_buffer(buf)]
    array = pa.Array.from_buffers(pa.binary_view(), count, buffers)
    array.validate(full=True)
    return array


record_lists = st.lists(st.binary(max_size=300), max_size=20)


@needs_c
@settings(max_examples=examples(200), deadline=None)
@given(records=record_lists, lead=st.binary(max_size=20))
def test_both_kernels_frame_cut_and_pack_valid_files_alike(records: list[bytes], lead: bytes) -> None:
    buf = lead + b"".join(map(framed, records))
    python, c = outcome(kernel.PYTHON, buf, len(lead)), outcome(c_kernel(), buf, len(lead))
    assert python == c
    assert c["records"] == c["packed"] == c["unverified"] == c["viewed"] == records
    assert c["bad_length"] is False and c["bad"] == c["bad_packed"] == c["bad_views"] == -1


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One byte-wise mutation: a flipped bit, an inserted, deleted or duplicated run, a cut."""
    if not data:
        return bytes([rng.randrange(256)])
    i = rng.randrange(len(data))
    kind = rng.randrange(5)
    if kind == 0:
        return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1 :]
    if kind == 1:
        return data[:i] + rng.randbytes(rng.randrange(1, 9)) + data[i:]
    if kind == 2:
        return data[:i] + data[i + rng.randrange(1, 9) :]
    if kind == 3:
        j = min(len(data), i + rng.randrange(1, 30))
        return data[:j] + data[i:j] + data[j:]
    return data[:i]


@needs_c
@settings(max_examples=examples(300), deadline=None)
@given(records=record_lists.filter(bool), seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 3))
def test_both_kernels_agree_on_mutated_bytes(records: list[bytes], seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    buf = b"".join(map(framed, records))
    for _ in range(rounds):
        buf = mutate(buf, rng)
    python, c = outcome(kernel.PYTHON, buf), outcome(c_kernel(), buf)
    assert python == c
    assert c["viewed"] == c["records"] and c["bad_views"] == c["bad"]


@pytest.mark.parametrize("kern", KERNELS)
def test_impossible_lengths_zero_lengths_and_cut_headers_stay_in_bounds(kern: kernel.Kernel) -> None:
    good = framed(b"abc")
    for forged in (2**64 - 1, 2**64 - 16, 2**64 - 17, 2**63, 2**63 - 1, 2**32, len(good) + 1):
        buf = good + framed(b"xyz", length=forged)  # the length's CRC is valid: only the bounds stop it
        ends, bad = kern.frame(buf, 0, len(buf), True)
        assert ends.tolist() == [len(good)] and bad is False, forged
    empty = framed(b"") * 5
    assert kern.frame(empty, 0, len(empty), True)[0].tolist() == [16, 32, 48, 64, 80]
    assert kern.cut(empty, 0, kern.frame(empty, 0, len(empty), True)[0], 0, 5, True) == ([b""] * 5, -1)
    for cut in range(len(good)):  # a buffer ending mid-header or mid-record: no record, no error, no read past it
        assert kern.frame(good[:cut], 0, cut, True)[0].tolist() == []
    assert kern.frame(good + good[:11], 0, len(good) + 11, True)[0].tolist() == [len(good)]


@needs_c
def test_the_c_kernel_refuses_ends_that_are_not_records_of_the_buffer() -> None:
    assert compiled is not None
    buf = framed(b"abc") * 3
    values, offsets = np.empty(100, np.uint8), np.empty(10, np.int64)
    for ends, lo, hi in [
        ([19, 38, 100], 0, 3),  # past the buffer
        ([19, 30, 57], 0, 3),  # a record shorter than its framing
        ([19, 38, 57], 2, 4),  # past the ends
        ([19, 38, 57], 2, 1),  # backwards
        ([57, 38, 19], 0, 3),  # decreasing
    ]:
        array = np.array(ends, np.int64)
        with pytest.raises(ValueError, match="record|range"):
            compiled.cut(buf, 0, array, lo, hi, True)
        with pytest.raises(ValueError, match="record|range"):
            compiled.pack(buf, 0, array, lo, hi, True, values, offsets, 0)
        with pytest.raises(ValueError, match="record|range"):
            compiled.views(buf, 0, array, lo, hi, True, np.empty(160, np.uint8), 0)
    with pytest.raises(ValueError, match="too small"):
        compiled.pack(buf, 0, np.array([19, 38, 57], np.int64), 0, 3, True, np.empty(8, np.uint8), offsets, 0)
    with pytest.raises(ValueError, match="too small"):
        compiled.views(buf, 0, np.array([19, 38, 57], np.int64), 0, 3, True, np.empty(47, np.uint8), 0)
    with pytest.raises(ValueError, match="index -1"):
        compiled.views(buf, 0, np.array([19, 38, 57], np.int64), 0, 3, True, np.empty(48, np.uint8), -1)
    with pytest.raises(ValueError, match="pos"):
        compiled.frame(buf, 10, 5, np.empty(4, np.int64), True)
    with pytest.raises(TypeError, match="writable"):
        compiled.frame(buf, 0, len(buf), b"\0" * 32, True)


CRASH_PROBE = r"""
import json, os, random, struct, sys
import numpy as np
from shardkit.formats import _tfrecord as k
from shardkit.formats.crc import masked_crc32c

def framed(record, length=None):
    head = struct.pack("<Q", len(record) if length is None else length)
    return head + struct.pack("<I", masked_crc32c(head)) + record + struct.pack("<I", masked_crc32c(record))

rng = random.Random(int(sys.argv[1]))
seen = {"records": 0, "bad_length": 0, "bad_data": 0, "refused": 0}
made = 0
for _ in range(int(sys.argv[2])):
    records = [rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(1, 8))]
    buf = bytearray(b"".join(framed(r, rng.choice([None, None, None, 2**64 - 1 - rng.randrange(64)])) for r in records))
    for _ in range(rng.randrange(1, 4)):
        i = rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8)
    buf = bytes(buf[: rng.randrange(len(buf) + 1)])
    out = np.empty(len(buf) // 16 + 1, np.int64)
    count, bad = k.frame(buf, 0, len(buf), out, rng.random() < 0.5)
    ends = out[:count]
    recs, bad_data = k.cut(buf, 0, ends, 0, count, True)
    values, offsets = np.empty(len(buf), np.uint8), np.empty(count + 1, np.int64)
    k.pack(buf, 0, ends, 0, count, True, values, offsets, 0)
    assert k.views(buf, 0, ends, 0, count, True, np.empty(16 * count, np.uint8), 0) == bad_data
    seen["records"] += len(recs)
    seen["bad_length"] += bad
    seen["bad_data"] += bad_data >= 0
    nonsense = np.array([rng.randrange(-2**40, 2**40) for _ in range(rng.randrange(0, 5))], np.int64)
    try:
        k.cut(buf, rng.randrange(-5, 50), nonsense, rng.randrange(-1, 4), rng.randrange(-1, 6), True)
    except ValueError:
        seen["refused"] += 1
    try:
        k.views(buf, rng.randrange(-5, 50), nonsense, rng.randrange(-1, 4), rng.randrange(-1, 6), True,
                np.empty(16 * rng.randrange(0, 6), np.uint8), rng.randrange(-1, 3))
    except ValueError:
        seen["refused"] += 1
    made += 1
    path = f"{sys.argv[3]}.{made}"  # a new file each time: ext4 flushes a file rewritten over its old bytes on close
    with open(path, "wb") as f:
        f.write(buf)
    fd = os.open(path, os.O_RDONLY)
    os.unlink(path)  # read through the open descriptor; unlinked unwritten, it costs no disk write
    try:
        size = rng.randrange(1, 300)
        state = np.array([0, 0, 0, rng.randrange(1, 64), 0, rng.randrange(0, 3), rng.choice([-1, rng.randrange(400)]),
                          rng.randrange(1, 300)], np.int64)
        if rng.random() < 0.3:  # nonsense: refused, never read
            state[rng.randrange(8)] = rng.randrange(-2**62, 2**62)
        take = rng.randrange(0, 9)
        try:
            which = rng.random()
            if which < 0.33:
                k.read_views(fd, np.empty(size, np.uint8), state, take, rng.random() < 0.5, np.empty(16 * take, np.uint8), 0)
            elif which < 0.67:
                got, status = k.read_cut(fd, np.empty(size, np.uint8), state, take, rng.random() < 0.5)
                assert len(got) <= take and all(type(r) is bytes for r in got), (len(got), take)
            else:
                offsets = np.zeros(take + 1, np.int64)
                k.read_pack(fd, np.empty(size, np.uint8), state, take, rng.random() < 0.5, offsets)
        except ValueError:
            seen["refused"] += 1
    finally:
        os.close(fd)
print(json.dumps(seen))
"""


@needs_c
@pytest.mark.slow
def test_the_c_kernel_survives_mutated_files_and_nonsense_ends_in_a_subprocess(tmp_path) -> None:
    """A memory error in C would kill the process: run it in a child and check it exited cleanly (its readers of a
    file too, over small buffers and random or nonsense states)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    probe = str(tmp_path / "probe.tfrecord")
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", CRASH_PROBE, "20261201", "20000", probe],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_bound(240),
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    seen = json.loads(done.stdout)
    assert all(seen[key] > 100 for key in ("records", "bad_length", "bad_data", "refused")), seen


# --------------------------------------------------------------------------- the readers over either kernel


def write(path: str, records: list[bytes]) -> str:
    with TFRecordWriter(path) as writer:
        for record in records:
            writer.write(record)
    return path


def read_all(read: Callable[[], Iterator[object]]) -> tuple[list[bytes], tuple[object, ...] | None]:
    """The records a reader hands out before it stops, and its error (index, offset, message), if any."""
    records: list[bytes] = []
    try:
        for item in read():
            if isinstance(item, bytes):
                records.append(item)
            else:
                assert isinstance(item, (pa.LargeBinaryArray, pa.BinaryViewArray)) and len(item) > 0
                item.validate(full=True)
                records.extend(item.to_pylist())
    except CorruptRecordError as error:
        return records, (error.record_index, error.offset, error.framing_intact, str(error))
    return records, None


def both_readers(path: str, **options: object) -> list[tuple[list[bytes], tuple[object, ...] | None]]:
    return [
        read_all(lambda: read_tfrecord(path, **options)),  # type: ignore[arg-type]
        read_all(lambda: read_tfrecord_batches(path, batch_records=3, **options)),  # type: ignore[arg-type]
        read_all(lambda: read_tfrecord_batches(path, batch_records=3, arrow_type="binary_view", **options)),  # type: ignore[arg-type]
    ]


def under_each_kernel(monkeypatch: pytest.MonkeyPatch, run: Callable[[], object]) -> list[object]:
    results = []
    for kern in (kernel.PYTHON, c_kernel()):
        monkeypatch.setattr(kernel, "KERNEL", kern)
        results.append(run())
    return results


SMALL = [b"", b"a", b"hello world", bytes(range(256)), b"xyz" * 40, b""]


@needs_c
def test_every_cut_of_a_small_file_reads_alike_under_both_kernels_and_both_readers(tmp_path, monkeypatch) -> None:
    whole = b"".join(map(framed, SMALL))
    path = str(tmp_path / "cut.tfrecord")
    for cut in range(len(whole) + 1):
        with open(path, "wb") as f:
            f.write(whole[:cut])
        python, c = under_each_kernel(monkeypatch, lambda: both_readers(path, compression=None))
        assert python == c, cut
        per_record, batched, viewed = c
        assert per_record == batched == viewed, cut
        records, error = per_record
        assert records == SMALL[: len(records)]
        assert (error is None) == (cut in np.cumsum([0, *map(len, map(framed, SMALL))]).tolist()), cut


@needs_c
@settings(max_examples=examples(60), deadline=None)
@given(records=record_lists.filter(bool), seed=st.integers(0, 2**32 - 1), block=st.sampled_from([7, 64, 4 << 20]))
def test_mutated_files_read_alike_under_both_kernels_with_the_same_located_error(
    tmp_path_factory, records, seed, block
) -> None:
    rng = random.Random(seed)
    data = mutate(b"".join(map(framed, records)), rng)
    path = str(tmp_path_factory.mktemp("mutated") / "m.tfrecord")
    with open(path, "wb") as f:
        f.write(data)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(tfr, "BLOCK_SIZE", block)
        monkeypatch.setattr(skio, "BLOCK_SIZE", block)
        python, c = under_each_kernel(monkeypatch, lambda: both_readers(path, compression=None))
    assert python == c
    assert c[0] == c[1] == c[2]  # read_tfrecord and read_tfrecord_batches (both layouts): the same records and error


def long_records(seed: int, count: int) -> list[bytes]:
    """Records of 64 to 127 bytes: long enough for the compiled kernel's folding CRC of four records at once."""
    rng = random.Random(seed)
    return [rng.randbytes(rng.randrange(64, 128)) for _ in range(count)]


def in_large_batches(path: str) -> list[tuple[list[bytes], tuple[object, ...] | None]]:
    """``read_tfrecord`` beside ``large_binary`` batches of 1,000: the compiled ``read_pack`` checks four records at
    a time and moves each down over the framing of those before it (batches of 3 never check four at once)."""
    return [
        read_all(lambda: read_tfrecord(path)),
        read_all(lambda: read_tfrecord_batches(path, batch_records=1000)),
    ]


@needs_c
def test_a_bad_data_crc_at_each_record_of_a_file_of_long_records_is_found_alike_by_both_kernels(
    tmp_path, monkeypatch
) -> None:
    records = long_records(0, 80)
    starts = np.cumsum([0, *map(len, map(framed, records))]).tolist()
    path = str(tmp_path / "bad.tfrecord")
    for bad in range(len(records)):  # every place in a group of four checked at once
        data = bytearray(b"".join(map(framed, records)))
        data[starts[bad] + 12 + bad % 64] ^= 0x10
        with open(path, "wb") as f:
            f.write(data)
        python, c = under_each_kernel(monkeypatch, lambda: in_large_batches(path))
        assert python == c, bad
        assert c[0] == c[1], bad
        got, error = c[1]
        assert got == records[:bad] and error is not None and error[:2] == (bad, starts[bad]), bad


@needs_c
def test_a_flipped_bit_in_any_record_of_mixed_lengths_is_named_with_url_index_and_offset_by_every_reader(
    tmp_path,
) -> None:
    """Records of 0 to 1,200 bytes, checked twelve at a time (six at once where the CPU folds with AVX2): a bit
    flipped anywhere in any record's data stops ``read_tfrecord`` and both layouts of ``read_tfrecord_batches`` at
    that record, after the good ones before it, with the file, the record's index and its byte offset."""
    rng = random.Random(7)
    records = [rng.randbytes(rng.choice([rng.randrange(0, 40), rng.randrange(900, 1200)])) for _ in range(60)]
    starts = np.cumsum([0, *map(len, map(framed, records))]).tolist()
    path = str(tmp_path / "flipped.tfrecord")
    for bad in (i for i, r in enumerate(records) if r):
        data = bytearray(b"".join(map(framed, records)))
        data[starts[bad] + 12 + rng.randrange(len(records[bad]))] ^= 1 << rng.randrange(8)
        with open(path, "wb") as f:
            f.write(data)
        for got, error in (
            read_all(lambda: read_tfrecord(path)),
            read_all(lambda: read_tfrecord_batches(path, batch_records=1000)),
            read_all(lambda: read_tfrecord_batches(path, batch_records=1000, arrow_type="binary_view")),
        ):
            assert got == records[:bad], bad
            assert error is not None and error[:2] == (bad, starts[bad]), bad
            assert path in str(error[3]) and "data CRC mismatch" in str(error[3]), error


@needs_c
@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 150))
def test_mutated_files_of_long_records_read_alike_in_large_batches_under_both_kernels(
    tmp_path_factory, seed, count
) -> None:
    records = long_records(seed, count)
    data = mutate(b"".join(map(framed, records)), random.Random(seed))
    path = str(tmp_path_factory.mktemp("mutated") / "m.tfrecord")
    with open(path, "wb") as f:
        f.write(data)
    with pytest.MonkeyPatch.context() as monkeypatch:
        python, c = under_each_kernel(monkeypatch, lambda: in_large_batches(path))
    assert python == c
    assert c[0] == c[1]


# --------------------------------------------------------------------------- read_tfrecord_batches


ARRAY_CLASSES = {"large_binary": pa.LargeBinaryArray, "binary_view": pa.BinaryViewArray}


@pytest.mark.parametrize("arrow_type", list(ARRAY_CLASSES))
@pytest.mark.parametrize("compression", [None, "gzip"])
@pytest.mark.parametrize("batch_records", [1, 3, 7, 1000])
def test_batches_hold_read_tfrecords_records_byte_for_byte(
    tmp_path, monkeypatch, compression, batch_records, arrow_type
) -> None:
    monkeypatch.setattr(tfr, "BLOCK_SIZE", 500)  # batches span blocks
    monkeypatch.setattr(skio, "BLOCK_SIZE", 500)
    rng = np.random.default_rng(1)
    records = [rng.bytes(int(n)) for n in rng.integers(0, 120, 200)]
    path = str(tmp_path / "a.tfrecord")
    with TFRecordWriter(path, compression=compression) as writer:
        for record in records:
            writer.write(record)
    arrays = list(read_tfrecord_batches(path, batch_records=batch_records, arrow_type=arrow_type))
    assert all(isinstance(a, ARRAY_CLASSES[arrow_type]) for a in arrays)
    assert [len(a) for a in arrays[:-1]] == [batch_records] * (len(arrays) - 1) and 0 < len(arrays[-1]) <= batch_records
    assert [r for a in arrays for r in a.to_pylist()] == list(read_tfrecord(path)) == records
    for a in arrays:
        a.validate(full=True)


@pytest.mark.parametrize("arrow_type", list(ARRAY_CLASSES))
def test_batches_honour_start_stop_and_an_index(tmp_path, arrow_type) -> None:
    records = [bytes([i]) * i for i in range(50)]
    path = write(str(tmp_path / "a.tfrecord"), records)
    index = build_index(path)
    for start, stop in [(0, None), (5, 17), (49, 50), (50, None), (10, 10)]:
        for idx in (None, index):
            arrays = read_tfrecord_batches(
                path, start=start, stop=stop, index=idx, batch_records=4, arrow_type=arrow_type
            )
            got = [r for a in arrays for r in a.to_pylist()]
            assert got == records[start:stop], (start, stop, idx)


@pytest.mark.parametrize("arrow_type", list(ARRAY_CLASSES))
def test_batches_hand_out_the_good_records_before_a_bad_data_crc_then_name_it(tmp_path, arrow_type) -> None:
    records = [b"r%d" % i * 20 for i in range(10)]
    data = bytearray(b"".join(map(framed, records)))
    offset = sum(len(framed(r)) for r in records[:6])
    data[offset + 12 + 3] ^= 0xFF  # record 6's data
    path = str(tmp_path / "bad.tfrecord")
    with open(path, "wb") as f:
        f.write(data)
    got: list[bytes] = []
    with pytest.raises(CorruptRecordError, match="data CRC mismatch") as caught:
        for array in read_tfrecord_batches(path, batch_records=4, arrow_type=arrow_type):
            got.extend(array.to_pylist())
    assert got == records[:6]
    assert (caught.value.record_index, caught.value.offset) == (6, offset)


# --------------------------------------------------------------------------- the compiled reader of a local file


@needs_c
def test_the_compiled_readers_refuse_a_state_that_does_not_fit_their_buffer(tmp_path) -> None:
    assert compiled is not None
    path = write(str(tmp_path / "a.tfrecord"), [b"abc"] * 3)
    fd = os.open(path, os.O_RDONLY)
    try:
        good = [0, 0, 0, 64, 0, 0, -1, 64]
        for at, value in [(0, 5), (0, -1), (1, 200), (2, -1), (3, 0), (4, -1), (7, 0), (3, 2**61)]:
            state = np.array(good, np.int64)
            state[at] = value  # start past filled, filled past the buffer, a negative offset or index, no read size
            with pytest.raises(ValueError, match="does not fit a buffer of 100 bytes"):
                compiled.read_views(fd, np.empty(100, np.uint8), state, 3, True, np.empty(48, np.uint8), 0)
            with pytest.raises(ValueError, match="does not fit a buffer of 100 bytes"):
                compiled.read_pack(fd, np.empty(100, np.uint8), state, 3, True, np.zeros(4, np.int64))
            with pytest.raises(ValueError, match="does not fit a buffer of 100 bytes"):
                compiled.read_cut(fd, np.empty(100, np.uint8), state, 3, True)
        with pytest.raises(ValueError, match="too small for 3 views"):
            compiled.read_views(
                fd, np.empty(100, np.uint8), np.array(good, np.int64), 3, True, np.empty(47, np.uint8), 0
            )
        with pytest.raises(ValueError, match=r"offsets\[0\] \(1\) not in 0..start \(0\)"):
            compiled.read_pack(fd, np.empty(100, np.uint8), np.array(good, np.int64), 3, True, np.ones(4, np.int64))
        with pytest.raises(OSError):
            compiled.read_pack(-1, np.empty(100, np.uint8), np.array(good, np.int64), 3, True, np.zeros(4, np.int64))
        with pytest.raises(OSError):
            compiled.read_cut(-1, np.empty(100, np.uint8), np.array(good, np.int64), 3, True)
        with pytest.raises(ValueError, match="max_records -1"):
            compiled.read_cut(fd, np.empty(100, np.uint8), np.array(good, np.int64), -1, True)
    finally:
        os.close(fd)


@needs_c
def test_read_pack_reads_about_what_a_batch_needs_not_a_whole_read_past_it(tmp_path) -> None:
    """What it reads past a batch's last record moves to the next values buffer: a copy it keeps small."""
    assert compiled is not None
    records = [bytes([i % 256]) * 100 for i in range(1000)]
    path = write(str(tmp_path / "a.tfrecord"), records)
    fd = os.open(path, os.O_RDONLY)
    try:
        values, offsets = np.empty(1 << 20, np.uint8), np.zeros(301, np.int64)
        state = np.array([0, 0, 0, 4096, 0, 0, -1, 256 * 1024], np.int64)  # reads from 4 KB, doubling up to 256 KB
        assert compiled.read_pack(fd, values, state, 300, True, offsets) == (300, kernel.READ_FULL)
    finally:
        os.close(fd)
    assert values[: offsets[300]].tobytes() == b"".join(records[:300])
    start, filled, pos = state[:3]
    assert pos - (filled - start) == 300 * 116  # the next record's offset
    assert filled - start <= 4096 + 2 * 116, filled - start  # not the rest of a 256 KB read


@needs_c
def test_read_cut_hands_out_the_records_of_each_read_before_reading_on_and_stops_at_a_bad_data_crc(tmp_path) -> None:
    """As lazy as the block reader (a file cut behind it is still seen), and a bad record is never handed out."""
    assert compiled is not None
    records = [bytes([i]) * 100 for i in range(50)]
    data = bytearray(b"".join(map(framed, records)))
    data[30 * 116 + 12 + 7] ^= 0x04  # record 30's data
    path = str(tmp_path / "a.tfrecord")
    with open(path, "wb") as f:
        f.write(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        state = np.array([0, 0, 0, 1000, 0, 0, -1, 1000], np.int64)  # reads of 1,000 bytes: 8 records and a part
        buf = np.empty(2000, np.uint8)
        got, status = compiled.read_cut(fd, buf, state, 128, True)
        assert (got, status) == (records[:8], kernel.READ_PAUSED)
        assert state[2] == 1000  # one read so far
        seen = got
        while status == kernel.READ_PAUSED:
            got, status = compiled.read_cut(fd, buf, state, 128, True)
            seen += got
        assert (seen, status) == (records[:30], kernel.READ_BAD_DATA)
        start, filled, pos, _, index = state[:5].tolist()
        assert (index, pos - (filled - start)) == (30, 30 * 116)  # the bad record: where the error names it
        assert compiled.read_cut(fd, buf, state, 128, False)[0][0] == bytes(data[30 * 116 + 12 : 30 * 116 + 112])
    finally:
        os.close(fd)


@needs_c
def test_read_tfrecord_reads_a_local_file_with_read_cut_and_hands_long_records_to_the_block_reader(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(tfr, "BLOCK_SIZE", 4096)  # read_cut's reads: 4 KB, its buffer 8 KB
    rng = np.random.default_rng(4)
    records = [rng.bytes(int(n)) for n in rng.choice([10, 300, 5000, 20000], 400, p=[0.4, 0.5, 0.07, 0.03])]
    path = write(str(tmp_path / "a.tfrecord"), records)
    results: list[int] = []  # the status of each call

    def counted(*args: object) -> tuple[list[bytes], int]:
        got, status = compiled.read_cut(*args)  # type: ignore[union-attr]
        results.append(status)
        return got, status

    monkeypatch.setattr(kernel, "KERNEL", c_kernel()._replace(read_cut=counted))
    assert list(read_tfrecord(path)) == records
    assert list(read_tfrecord(path, start=7, stop=391)) == records[7:391]
    assert kernel.READ_HAND_OVER in results and kernel.READ_PAUSED in results and kernel.READ_END in results
    handed = len(results) - 1 - results[::-1].index(kernel.READ_HAND_OVER)
    assert handed < len(results) - 1  # the compiled reader read on after the last long record


@needs_c
@pytest.mark.parametrize("arrow_type", list(ARRAY_CLASSES))
def test_records_longer_than_the_compiled_readers_buffer_go_to_the_block_reader_and_it_reads_on_after_them(
    tmp_path, monkeypatch, arrow_type
) -> None:
    monkeypatch.setattr(tfr, "BLOCK_SIZE", 4096)  # the compiled reader's buffers and reads: 4 KB
    monkeypatch.setattr(arrays_module, "_FIRST_VALUES", 4096)  # and read_pack's first values buffers
    rng = np.random.default_rng(3)
    records = [rng.bytes(int(n)) for n in rng.choice([10, 300, 5000, 20000], 400, p=[0.4, 0.5, 0.07, 0.03])]
    path = write(str(tmp_path / "a.tfrecord"), records)
    results: list[tuple[int, int]] = []  # (records, status) of each call

    def counted(name: str) -> Callable[..., tuple[int, int]]:
        def call(*args: object) -> tuple[int, int]:
            results.append(getattr(compiled, name)(*args))
            return results[-1]

        return call

    c = c_kernel()
    monkeypatch.setattr(kernel, "KERNEL", c._replace(read_views=counted("read_views"), read_pack=counted("read_pack")))
    arrays = list(read_tfrecord_batches(path, batch_records=16, arrow_type=arrow_type))
    assert [r for a in arrays for r in a.to_pylist()] == records
    assert [len(a) for a in arrays] == [16] * 25
    for a in arrays:
        a.validate(full=True)
    handed = [i for i, (_, status) in enumerate(results) if status == kernel.READ_HAND_OVER]
    assert handed  # (read_pack grows its values buffer for a long record after others, and hands over less)
    after = [count for count, _ in results[handed[-1] + 1 :]]
    assert sum(after) > 0  # the compiled reader read on after the last one


@needs_c
@pytest.mark.parametrize("arrow_type", list(ARRAY_CLASSES))
def test_a_file_truncated_under_read_tfrecord_batches_at_a_record_boundary_is_reported_by_both_kernels(
    tmp_path, monkeypatch, arrow_type
) -> None:
    monkeypatch.setattr(tfr, "BLOCK_SIZE", 256)
    records = [os.urandom(50) for _ in range(40)]
    path = write(str(tmp_path / "a.tfrecord"), records)
    whole = open(path, "rb").read()
    for kern in (kernel.PYTHON, c_kernel()):
        with open(path, "wb") as f:
            f.write(whole)
        monkeypatch.setattr(kernel, "KERNEL", kern)
        arrays = read_tfrecord_batches(path, batch_records=2, arrow_type=arrow_type)
        assert next(arrays).to_pylist() == records[:2]  # the first read (records 0..2, 3 x 66 bytes) is in memory
        os.truncate(path, 2 * 66)  # cut between records 1 and 2, behind the reader
        rest: list[bytes] = []
        with pytest.raises(CorruptRecordError, match="file shrank from 2640 to 132 bytes while being read") as info:
            for array in arrays:
                rest.extend(array.to_pylist())
        assert rest == records[2:3], kern.name
        assert (info.value.record_index, info.value.offset) == (3, 3 * 66), kern.name


CUTS_PROBE = r"""
import json
from shardkit import CorruptRecordError
from shardkit.formats.tfrecord import framing, kernel, read_tfrecord, read_tfrecord_batches
framing.BLOCK_SIZE = 512  # the compiled reader's buffers: switched, and records handed over, often
path = PATH
whole = open(path, "rb").read()
seen = []
for cut in range(0, len(whole) + 1, 4):
    with open(path, "wb") as f:
        f.write(whole[:cut])
    for arrow_type in ("large_binary", "binary_view", None):  # None: read_tfrecord (read_cut)
        records = []
        try:
            if arrow_type is None:
                records.extend(r.hex() for r in read_tfrecord(path, compression=None))
            else:
                for array in read_tfrecord_batches(path, batch_records=2, arrow_type=arrow_type, compression=None):
                    records.extend(r.hex() for r in array.to_pylist())
            error = None
        except CorruptRecordError as e:
            error = [e.record_index, e.offset, str(e)]
        seen.append([records, error])
print(json.dumps([kernel.BACKEND, kernel.COMPILED.VECTOR_CRC, seen]))
"""


@needs_c
def test_every_cut_of_a_damaged_file_reads_alike_with_the_c_reader_without_avx512_and_the_python_kernel(
    tmp_path, monkeypatch
) -> None:
    """The compiled readers (``read_pack``, ``read_views``, ``read_cut``) in a process with ``SHARDKIT_NO_AVX512`` set
    (crc32 streams, not folding), against the Python kernel's block reader, on every fourth cut of a file with a
    damaged record."""
    records = [bytes([n % 251]) * n for n in (0, 5, 70, 300, 1000, 64, 257, 700, 3)]
    data = bytearray(b"".join(map(framed, records)))
    data[sum(map(len, map(framed, records[:3]))) + 12 + 100] ^= 1  # record 3's data
    path = str(tmp_path / "cut.tfrecord")
    with open(path, "wb") as f:
        f.write(data)
    backend, vector, seen = json.loads(run_python(CUTS_PROBE.replace("PATH", repr(path)), SHARDKIT_NO_AVX512="1"))
    assert backend == "c" and vector == 0
    monkeypatch.setattr(kernel, "KERNEL", kernel.PYTHON)
    monkeypatch.setattr(tfr, "BLOCK_SIZE", 512)
    expected = []
    for cut in range(0, len(data) + 1, 4):
        with open(path, "wb") as f:
            f.write(data[:cut])
        for arrow_type in ("large_binary", "binary_view", None):
            if arrow_type is None:
                got, error = read_all(lambda: read_tfrecord(path))
            else:
                got, error = read_all(lambda: read_tfrecord_batches(path, batch_records=2, arrow_type=arrow_type))
            expected.append([[r.hex() for r in got], None if error is None else [error[0], error[1], error[3]]])
    assert seen == expected
    assert sum(error is not None and "data CRC" in error[2] for _, error in seen) > 100


def test_batches_refuse_a_batch_of_no_records(tmp_path) -> None:
    path = write(str(tmp_path / "a.tfrecord"), [b"x"])
    with pytest.raises(ValueError, match="batch_records must be at least 1, got 0"):
        read_tfrecord_batches(path, batch_records=0)


def test_batches_refuse_an_arrow_type_they_do_not_build(tmp_path) -> None:
    path = write(str(tmp_path / "a.tfrecord"), [b"x"])
    with pytest.raises(ValueError, match="arrow_type must be one of 'large_binary', 'binary_view', got 'binary'"):
        read_tfrecord_batches(path, arrow_type="binary")


def test_binary_view_batches_share_the_blocks_and_convert_cast_and_write_to_parquet(tmp_path) -> None:
    """No record is copied (the data buffers are the blocks as read, framing and all), and what a consumer does
    with the arrays works: Python objects, a cast to large_binary, a Parquet round trip, decode_columns."""
    import pyarrow.parquet as pq

    records = [shardkit.encode_example({"label": i, "blob": bytes([i % 256]) * (i % 40)}) for i in range(300)]
    path = write(str(tmp_path / "a.tfrecord"), records)
    (array,) = read_tfrecord_batches(path, batch_records=1000, arrow_type="binary_view")
    with open(path, "rb") as f:
        whole = f.read()
    blocks = [bytes(buffer) for buffer in array.buffers()[2:]]  # the blocks as read (each from a record's start)
    assert blocks[0] == whole[: len(blocks[0])] and all(block in whole for block in blocks)
    assert array.buffers()[1].size == 16 * len(records)  # views, 16 bytes each, are all the array adds
    assert array.to_pylist() == records
    assert array.cast(pa.large_binary()).to_pylist() == records
    pq.write_table(pa.table({"record": array}), tmp_path / "a.parquet")
    assert pq.read_table(tmp_path / "a.parquet").column("record").to_pylist() == records
    columns = shardkit.decode_columns(array.to_pylist(), {"label": ("int64", ())})
    assert columns["label"].tolist() == list(range(300))


def test_read_tfrecord_batches_is_exported_from_shardkit() -> None:
    assert shardkit.read_tfrecord_batches is read_tfrecord_batches


@pytest.mark.parametrize("arrow_type", list(ARRAY_CLASSES))
def test_arrays_kept_by_the_caller_stay_intact_while_later_blocks_reuse_the_buffers_of_dropped_ones(
    tmp_path, monkeypatch, arrow_type
) -> None:
    monkeypatch.setattr(tfr, "BLOCK_SIZE", 2048)  # many blocks, each a few arrays: buffers are reused
    rng = np.random.default_rng(2)
    records = [rng.bytes(int(n)) for n in rng.integers(0, 200, 3000)]
    path = write(str(tmp_path / "a.tfrecord"), records)
    kept: list[tuple[int, pa.Array]] = []
    seen = 0
    for i, array in enumerate(read_tfrecord_batches(path, batch_records=5, arrow_type=arrow_type)):
        assert array.to_pylist() == records[seen : seen + len(array)]
        if i % 7 == 0:
            kept.append((seen, array))
        seen += len(array)
    assert seen == len(records)
    for start, array in kept:  # read again after every later block was read into whatever buffer was free
        assert array.to_pylist() == records[start : start + len(array)]


def test_large_binary_batches_larger_than_any_before_grow_their_values_and_leave_earlier_arrays_intact(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(arrays_module, "_FIRST_VALUES", 256)  # values buffers start at 256 bytes
    records = [bytes([i % 256]) * (i % 50) for i in range(400)]
    path = write(str(tmp_path / "a.tfrecord"), records)
    got = list(read_tfrecord_batches(path, batch_records=37))
    for a in got:
        a.validate(full=True)
    assert [r for a in got for r in a.to_pylist()] == records


def test_small_large_binary_batches_hold_buffers_of_their_own_size_not_a_pooled_megabyte(tmp_path) -> None:
    import tracemalloc  # numpy reports its buffers to it

    records = [bytes([i]) * 100 for i in range(40)]
    path = write(str(tmp_path / "a.tfrecord"), records)
    list(read_tfrecord_batches(path, batch_records=3))  # the process's pool has its buffer before the count starts
    tracemalloc.start()
    try:
        kept = list(read_tfrecord_batches(path, batch_records=3))  # 14 arrays; the reader is gone
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert [r for a in kept for r in a.to_pylist()] == records
    assert held < 256 * 1024, held  # not 14 pooled buffers of 1 MB


def test_a_block_buffer_is_taken_again_only_when_nothing_holds_it() -> None:
    buffers = BlockBuffers()
    first = buffers.take(100)
    assert buffers.take(100) is not first  # `first` still holds it
    pooled = [id(buf) for buf in buffers._pool]
    del first
    again = buffers.take(100)
    assert id(again) in pooled  # free again: taken from the pool, not allocated
    view = memoryview(again)
    del again
    assert buffers.take(100) is not view.obj  # a view of it holds it too


def test_the_block_buffer_taken_last_is_taken_again_first_while_it_is_in_the_cache() -> None:
    buffers = BlockBuffers(4096)
    a, b, c = buffers.take(4096), buffers.take(4096), buffers.take(4096)
    ids = [id(a), id(b), id(c)]
    del a, b, c
    assert [id(buffers.take(4096)) for _ in range(3)] == [ids[2]] * 3  # free each time: the same one
    assert len(BlockBuffers(256 * 1024)._pool) == 0 and BlockBuffers(256 * 1024)._keep == 4 * skio.BLOCK_SIZE // (
        256 * 1024
    )


def test_a_second_file_is_read_into_the_buffers_the_reader_of_the_first_left(tmp_path) -> None:
    records = [bytes([i % 256]) * 1100 for i in range(2048)]  # batches of 1,024 grow the values to 2 MiB
    paths = [write(str(tmp_path / f"{i}.tfrecord"), records) for i in range(2)]
    first = list(read_tfrecord_batches(paths[0], batch_records=1024))
    assert len(first[0].buffers()[2]) > 1 << 20
    del first  # its buffers free again
    pooled = {buf.ctypes.data for buf in shared_buffers(2 << 20)._pool}
    kept = list(read_tfrecord_batches(paths[1], batch_records=1024))
    assert [r for a in kept for r in a.to_pylist()] == records
    assert {a.buffers()[2].address for a in kept} <= pooled  # no buffer mapped afresh for the second file


def test_the_process_keeps_pools_of_the_buffer_sizes_used_last() -> None:
    first = shared_buffers(12_345)
    assert shared_buffers(12_345) is first
    for size in range(1, buffers_module._SHARED_SIZES + 1):
        shared_buffers(size)
    assert shared_buffers(12_345) is not first  # used longest ago: dropped, with its buffers
